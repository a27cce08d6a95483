"""The learning curve of a drafter: held-out greedy tau and per-position acceptance against training
tokens, from the run logs (metrics.jsonl) of the run and of the runs it was started from."""
from __future__ import annotations

import json
from pathlib import Path


LOG = "run_log.jsonl"  # the validation records of every run behind a checkpoint, shipped with it


def curve_points(logs: list[str | Path], set_name: str | None = None) -> list[dict]:
    """Validation records {"tokens", "tau", "accept"} of run logs (metrics.jsonl / run_log.jsonl), ordered
    by tokens: all held-out sets together, or only the records that measured data directory `set_name` on
    its own (a record of a run without that directory, or with one directory only, is left out)."""
    points: dict[int, dict] = {}
    for path in map(Path, logs):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            val = rec.get("val")
            if not val or "tokens" not in rec:
                continue
            if set_name:
                val = val.get("sets", {}).get(set_name)
                if val is None:
                    continue
            points[int(rec["tokens"])] = {"tokens": int(rec["tokens"]), "tau": val["greedy_tau"],
                                          "accept": val.get("greedy_accept", val["greedy_match"]),
                                          "wall_s": rec.get("wall_s")}
    return [points[k] for k in sorted(points)]


def write_run_log(directory: str | Path, run_metrics: str | Path, init_from: str | Path | None) -> Path:
    """DIR/run_log.jsonl: the --init-from checkpoint's run log, then this run's validation records."""
    lines = []
    if init_from and (Path(init_from) / LOG).exists():
        lines += (Path(init_from) / LOG).read_text().splitlines()
    if Path(run_metrics).exists():
        lines += [ln for ln in Path(run_metrics).read_text().splitlines() if '"val"' in ln]
    out = Path(directory) / LOG
    out.write_text("\n".join(lines) + "\n")
    return out


def write_curves(directory: str | Path, log: str | Path, set_names: list[str]) -> None:
    """DIR/learning_curve.png and learning_curve.md from a run log: all held-out sets together, then each
    data directory in `set_names` on its own (learning_curve-NAME.png)."""
    lines = []
    for name in [None, *set_names]:
        points = curve_points([log], name)
        if len(points) > 1:
            suffix = f"-{name}" if name else ""
            curve_png(points, Path(directory) / f"learning_curve{suffix}.png", name or "all held-out sets")
            note = [] if name else ["Each run's held-out sets together: a run with another mix of data "
                                    "directories moves this figure by the mix alone.", ""]
            lines += [f"### {name or 'all held-out sets'}", "", *note, curve_table(points), ""]
    if lines:
        (Path(directory) / "learning_curve.md").write_text("\n".join(lines))


def curve_table(points: list[dict]) -> str:
    """Markdown: tokens, greedy tau, acceptance at positions 1..gamma."""
    if not points:
        return ""
    g = len(points[0]["accept"])
    head = "| training tokens | greedy tau | " + " | ".join(f"pos {k + 1}" for k in range(g)) + " |"
    rows = [head, "|" + "---|" * (g + 2)]
    for p in points:
        rows.append(f"| {p['tokens']:,} | {p['tau']:.2f} | " + " | ".join(f"{a:.2f}" for a in p["accept"]) + " |")
    return "\n".join(rows)


def curve_png(points: list[dict], path: str | Path, title: str = "") -> None:
    """Two panels against training tokens (log scale): greedy tau; acceptance per position."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["tokens"] for p in points]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    ax1.plot(x, [p["tau"] for p in points], marker="o")
    ax1.set_ylabel("held-out greedy tau (gamma 7, bonus included)")
    for k in range(len(points[0]["accept"])):
        ax2.plot(x, [p["accept"][k] for p in points], marker="o", ms=3, label=f"pos {k + 1}")
    ax2.set_ylabel("P(draft k survives | drafts 1..k-1 did)")
    ax2.legend(fontsize=7)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.set_xlabel("training tokens seen")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
