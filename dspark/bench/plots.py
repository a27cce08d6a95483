"""PNG figures of a results.json: one function per figure, each returning its file name (None: no data)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator, ScalarFormatter  # noqa: E402


def headline_cells(results: dict) -> list[dict]:
    """Offline cells at the lowest temperature and concurrency: the side-by-side comparison."""
    cells = (results.get("offline") or {}).get("cells") or []
    if not cells:
        return []
    t = min(c["temperature"] for c in cells)
    conc = min(c["concurrency"] for c in cells)
    return [c for c in cells if c["temperature"] == t and c["concurrency"] == conc]


def _grouped_bars(ax, cells: list[dict], value, err=None) -> None:
    datasets = list(dict.fromkeys(c["dataset"] for c in cells))
    labels = list(dict.fromkeys(c["label"] for c in cells))
    width = 0.8 / max(1, len(labels))
    for k, label in enumerate(labels):
        xs, ys, lo, hi = [], [], [], []
        for i, d in enumerate(datasets):
            for c in cells:
                if c["label"] == label and c["dataset"] == d and value(c) is not None:
                    xs.append(i + (k - (len(labels) - 1) / 2) * width)
                    ys.append(value(c))
                    if err:
                        a, b = err(c)
                        lo.append(max(0.0, ys[-1] - a))
                        hi.append(max(0.0, b - ys[-1]))
        if xs:
            ax.bar(xs, ys, width, label=label, yerr=[lo, hi] if err else None, capsize=2)
    ax.set_xticks(range(len(datasets)), datasets)
    _legend_right(ax)


def _legend_right(ax) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _log2_axis(ax) -> None:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(ScalarFormatter())


def _save(fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def tau_by_dataset(results: dict, out: Path) -> str | None:
    cells = [c for c in headline_cells(results) if c.get("tau")]
    if not cells:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    _grouped_bars(ax, cells, lambda c: c["tau"])
    ax.set_ylabel("mean accept length tau (tokens / round)")
    ax.set_title("tau by dataset and method")
    return _save(fig, out, "tau_by_dataset.png")


def acceptance_by_position(results: dict, out: Path) -> str | None:
    cells = [c for c in headline_cells(results) if any(v is not None for v in c.get("accept_by_position") or [])]
    if not cells:
        return None
    datasets = list(dict.fromkeys(c["dataset"] for c in cells))
    fig, axes = plt.subplots(1, len(datasets), figsize=(4 * len(datasets), 3.6), squeeze=False, sharey=True)
    for ax, d in zip(axes[0], datasets):
        for c in cells:
            if c["dataset"] == d:
                pts = [(j + 1, v) for j, v in enumerate(c["accept_by_position"]) if v is not None]
                ax.plot(*zip(*pts), marker="o", label=c["label"])
        ax.set_title(d)
        ax.set_xlabel("draft position j")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(0, 1.02)
    axes[0][0].set_ylabel("P(accept j | 1..j-1 accepted)")
    axes[0][-1].legend(fontsize=7)
    return _save(fig, out, "acceptance_by_position.png")


def tokens_per_s(results: dict, out: Path) -> str | None:
    cells = headline_cells(results)
    if not cells:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    _grouped_bars(ax, cells, lambda c: c["tokens_per_s"]["median"],
                  err=lambda c: (c["tokens_per_s"]["min"], c["tokens_per_s"]["max"]))
    roof = results.get("roofline")
    if roof:
        ax.axhline(roof["ceiling_tokens_per_s"], color="k", ls="--", lw=1, label="plain-decode roofline")
        _legend_right(ax)
    ax.set_ylabel("tokens/s (median, min-max over repeats)")
    ax.set_title(f"decode speed, concurrency {cells[0]['concurrency']}, T={cells[0]['temperature']:g}")
    return _save(fig, out, "tokens_per_s.png")


def _concurrency_series(results: dict) -> list[tuple[str, list[tuple[float, dict]]]]:
    """(name, [(concurrency, level summary)]) for closed-loop serving runs and multi-concurrency offline cells."""
    series = []
    for run in results.get("serve") or []:
        if run["mode"] == "closed":
            series.append((f"serve {run['label']}", [(lv["level"], lv) for lv in run["levels"]]))
    cells = (results.get("offline") or {}).get("cells") or []
    t0 = min((c["temperature"] for c in cells), default=0)
    for label in dict.fromkeys(c["label"] for c in cells):
        pts = {}
        for c in cells:
            if c["label"] == label and c["temperature"] == t0:
                x = pts.setdefault(c["concurrency"], {"throughput": [], "tpot_s": c["tpot_s"], "ttft_s": c["ttft_s"]})
                x["throughput"].append(c["tokens_per_s"]["median"])
        if len(pts) > 1:
            series.append((f"offline {label}", [(k, {"throughput_tokens_per_s": sum(v["throughput"]) / len(v["throughput"]),
                                                     "tpot_s": v["tpot_s"], "ttft_s": v["ttft_s"]})
                                                for k, v in sorted(pts.items())]))
    return series


def throughput_vs_concurrency(results: dict, out: Path) -> str | None:
    series = _concurrency_series(results)
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in series:
        ax.plot([p[0] for p in pts], [p[1]["throughput_tokens_per_s"] for p in pts], marker="o", label=name,
                ls="-" if name.startswith("serve") else "--")
    _log2_axis(ax)
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("total output tokens/s")
    _legend_right(ax)
    return _save(fig, out, "throughput_vs_concurrency.png")


def latency_vs_concurrency(results: dict, out: Path) -> str | None:
    series = _concurrency_series(results)
    if not series:
        return None
    from matplotlib.lines import Line2D

    styles = (("p50", "-"), ("p90", "--"), ("p99", ":"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, title in ((axes[0], "ttft_s", "time to first token"), (axes[1], "tpot_s", "time per output token")):
        for k, (name, pts) in enumerate(series):
            for q, ls in styles:
                xy = [(p[0], (p[1].get(key) or {}).get(q)) for p in pts]
                xy = [(x, y) for x, y in xy if y is not None]
                if xy:
                    ax.plot(*zip(*xy), ls=ls, color=f"C{k % 10}", marker=".")
        _log2_axis(ax)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("seconds")
        ax.set_title(title)
    handles = [Line2D([], [], color=f"C{k % 10}", label=name) for k, (name, _) in enumerate(series)]
    handles += [Line2D([], [], color="gray", ls=ls, label=q) for q, ls in styles]
    fig.legend(handles=handles, loc="center right", fontsize=7)
    fig.tight_layout(rect=(0, 0, 0.82, 1))
    fig.savefig(out / "latency_vs_concurrency.png", dpi=110)
    plt.close(fig)
    return "latency_vs_concurrency.png"


def sps_curve(results: dict, out: Path) -> str | None:
    roof = results.get("roofline") or {}
    sps = roof.get("sps")
    if not sps:
        return None
    pts = sorted((int(k), v) for k, v in sps.items())
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color="C0", label="steps/s")
    ax.set_xlabel("verify batch size (tokens)")
    ax.set_ylabel("target forward passes / s", color="C0")
    ax2 = ax.twinx()
    ax2.plot([p[0] for p in pts], [p[0] * p[1] for p in pts], marker=".", color="C1", label="tokens scored / s")
    ax2.set_ylabel("tokens scored / s", color="C1")
    ax.set_title(f"SPS curve ({roof.get('model', '')}, {roof.get('threads', '?')} threads)")
    return _save(fig, out, "sps_curve.png")


def calibration(results: dict, out: Path) -> str | None:
    cal = results.get("calibration")
    if not cal:
        return None
    rel = cal.get("reliability_after") or cal.get("reliability_before")
    fig, axes = plt.subplots(1, 2 if rel else 1, figsize=(11 if rel else 6, 4), squeeze=False)
    ax = axes[0][0]
    for key, name in (("ece_before", "before STS"), ("ece_after", "after STS")):
        if cal.get(key):
            ax.plot(range(1, len(cal[key]) + 1), [100 * v for v in cal[key]], marker="o", label=name)
    ax.axhline(3.0, color="k", ls=":", lw=1, label="3% target")
    ax.set_xlabel("draft position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("ECE of prefix survival (%)")
    ax.legend(fontsize=7)
    if rel:
        ax = axes[0][1]
        ax.plot([0, 1], [0, 1], color="k", lw=0.8, ls="--")
        for j, pos in enumerate(rel):
            ax.plot(pos["confidence"], pos["accuracy"], marker=".", label=f"position {j + 1}")
        ax.set_xlabel("predicted survival probability")
        ax.set_ylabel("observed survival rate")
        ax.set_title("reliability" + (" (after STS)" if cal.get("reliability_after") else ""))
        ax.legend(fontsize=6)
    return _save(fig, out, "calibration.png")


FIGURES = (tau_by_dataset, acceptance_by_position, tokens_per_s, throughput_vs_concurrency,
           latency_vs_concurrency, sps_curve, calibration)


def make_plots(results: dict, out: Path) -> list[str]:
    """Draw every figure the data supports into `out`; return their file names."""
    return [name for fig in FIGURES if (name := fig(results, out))]
