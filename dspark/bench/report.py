"""results.json (the data), results.md (the tables) and the PNGs of one output directory.

Each bench command merges its section into DIR/results.json (offline, roofline, race replace theirs;
serving runs replace the run with the same label and mode), then redraws the whole report, so an
offline run, a roofline and serving runs against several servers end up side by side.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from dspark.bench.plots import headline_cells, make_plots
from dspark.bench.roofline import method_fractions
from dspark.host import cpu_name


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    cpu = cpu_name()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(), "gpu": gpu,
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform()}


def load_results(out: Path) -> dict:
    path = Path(out) / "results.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); move it away or pick another --out") from None


def merge(results: dict, section: str, data) -> dict:
    """Put one command's output into the results (serving runs accumulate by label and mode)."""
    if section == "serve":
        runs = [r for r in results.get("serve") or [] if (r["label"], r["mode"]) != (data["label"], data["mode"])]
        results["serve"] = runs + [data]
    else:
        results[section] = data
    results["meta"] = {**machine(), "updated": time.strftime("%Y-%m-%d %H:%M:%S"),
                       "command": " ".join(["dspark", *sys.argv[1:]]) if sys.argv else ""}
    return results


def write_report(out: Path, results: dict) -> list[str]:
    """Write results.json, the figures and results.md into `out`; return the written file names."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1) + "\n")
    os.replace(tmp, out / "results.json")
    figures = make_plots(results, out)
    diagram = (results.get("calibration") or {}).get("diagram")
    if diagram and Path(diagram).is_file():
        shutil.copyfile(diagram, out / "reliability.png")
        figures.append("reliability.png")
    (out / "results.md").write_text(render_markdown(results, figures))
    return ["results.json", "results.md", *figures]


# ---- markdown --------------------------------------------------------------------------------------
def _f(x, fmt: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, fmt)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows)]


def _match(c: dict) -> str:
    if c.get("matches_ar") is None:
        return "n/a"
    return "yes" if c["matches_ar"] else f"NO ({len(c['mismatched_prompts'])}/{c['prompts']})"


def _offline(off: dict) -> list[str]:
    cfg, cells = off.get("config", {}), off.get("cells", [])
    sets = ", ".join(f"{k} {v['prompts']}" for k, v in cfg.get("datasets", {}).items())
    lines = ["## Offline", "",
             f"Prompts per dataset: {sets}; "
             f"max tokens {cfg.get('max_tokens')}; repeats {cfg.get('repeats')} (tokens/s: median [min, max]); "
             "methods interleaved per prompt group. Speedup is over `ar` (this engine's plain decoding); "
             "tau = tokens committed per round; draft acc. = drafts accepted / drafts verified; the time split "
             "is the share of wall time in draft / plan / verify (prefill included) / other.", ""]
    groups = sorted({(c["temperature"], c["concurrency"]) for c in cells})
    for t, conc in groups:
        lines += [f"### T = {t:g}, concurrency {conc}", ""]
        rows = []
        for c in cells:
            if (c["temperature"], c["concurrency"]) != (t, conc):
                continue
            s, sp = c["tokens_per_s"], c.get("time_split") or {}
            split = "/".join(f"{100 * sp[k]:.0f}" for k in ("draft", "plan", "verify", "other")) if sp else "-"
            rows.append([c["dataset"], c["label"], f"{_f(s['median'], '.1f')} [{_f(s['min'], '.1f')}, {_f(s['max'], '.1f')}]",
                         _f(c.get("speedup"), ".2f") + ("x" if c.get("speedup") else ""), _f(c.get("tau")),
                         _f(c.get("draft_acceptance")), _match(c), split,
                         _f(c.get("tpot_s", {}).get("p50") and 1000 * c["tpot_s"]["p50"], ".1f")])
        lines += _table(["dataset", "method", "tokens/s", "speedup", "tau", "draft acc.", "matches ar",
                         "draft/plan/verify/other %", "per-token p50 ms"], rows) + [""]
    acc = [c for c in headline_cells({"offline": off}) if any(v is not None for v in c.get("accept_by_position") or [])]
    if acc:
        width = max(len(c["accept_by_position"]) for c in acc)
        lines += ["### Per-position conditional acceptance", "",
                  "P(draft j accepted | drafts 1..j-1 accepted), over every verified window.", ""]
        lines += _table(["dataset", "method", *(f"j={j + 1}" for j in range(width)), "outside draft vocab %"],
                        [[c["dataset"], c["label"], *(_f(v) for v in c["accept_by_position"]),
                          *(["-"] * (width - len(c["accept_by_position"]))),
                          _f(100 * c["outside_draft_vocab"], ".1f") if c.get("outside_draft_vocab") is not None
                          else "-"] for c in acc]) + [""]
    cal = [c for c in headline_cells({"offline": off}) if c.get("confidence_calibration")]
    if cal:
        width = max(len(c["confidence_calibration"]["ece"]) for c in cal)
        lines += ["### Confidence calibration on these rounds", "",
                  "Per draft position j: the drafter's mean forecast prefix survival (the product of its calibrated "
                  "confidences c_1..c_j) / the share of rounds whose drafts 1..j all survived (ECE %, 15 bins), "
                  "over the rounds that verified position j.", ""]
        cell = lambda k, j: (f"{_f(k['forecast'][j])} / {_f(k['survived'][j])} ({_f(100 * k['ece'][j], '.1f')})"  # noqa: E731
                             if j < len(k["ece"]) else "-")
        lines += _table(["dataset", "method", *(f"j={j + 1}" for j in range(width))],
                        [[c["dataset"], c["label"], *(cell(c["confidence_calibration"], j) for j in range(width))]
                         for c in cal]) + [""]
    for s in off.get("skipped", []):
        lines.append(f"- skipped `{s['method']}`: {s['reason']}")
    return lines + [""]


def _roofline(roof: dict, results: dict) -> list[str]:
    lines = ["## Roofline", "",
             f"Read bandwidth {roof['bandwidth_gb_s']:.1f} GB/s; weights {roof['weight_bytes'] / 1e6:.0f} MB "
             f"({roof['dtype']}); plain-decode ceiling {roof['ceiling_tokens_per_s']:.1f} tokens/s "
             f"({roof['threads']} threads, {roof['device']}). A fraction above 1 means more than one token per "
             "weight read: only speculation gets there.", ""]
    cells = headline_cells(results)
    if cells:
        lines += _table(["dataset", "method", "tokens/s", "fraction of ceiling"],
                        [[f["dataset"], f["label"], _f(f["tokens_per_s"], ".1f"), _f(f["fraction"])]
                         for f in method_fractions(roof, cells)]) + [""]
    pts = sorted((int(k), v) for k, v in roof["sps"].items())
    lines += [f"SPS curve ({roof['sps_source']}): " + ", ".join(f"{b}: {v:.1f}" for b, v in pts[:16])
              + (" ..." if len(pts) > 16 else "") + " (tokens: target steps/s)", ""]
    return lines


def _serve(runs: list[dict]) -> list[str]:
    lines = ["## Serving", "", "Closed loop: level = concurrent clients; open loop: level = Poisson rate "
             "(requests/s). Per-token latency = (last token - first token) / (tokens - 1); per-user tokens/s = a "
             "request's tokens / its end-to-end time (median over requests); tokens/s = all output tokens / wall "
             "time of the level.", ""]
    rows = []
    for run in runs:
        for lv in run["levels"]:
            ms = lambda s, q: _f(s.get(q) and 1000 * s[q], ".0f")  # noqa: E731
            errors = ", ".join(f"{k}: {v}" for k, v in lv["errors"].items()) or "0"
            rows.append([run["label"], run["mode"], f"{lv['level']:g}", f"{lv['ok']}/{lv['requests']}", errors,
                         _f(lv["throughput_tokens_per_s"], ".1f"), _f(lv["per_user_tokens_per_s"]["p50"], ".1f"),
                         "/".join(ms(lv["ttft_s"], q) for q in ("p50", "p90", "p99")),
                         "/".join(ms(lv["tpot_s"], q) for q in ("p50", "p90", "p99"))])
    return lines + _table(["server", "mode", "level", "ok", "errors", "tokens/s", "per-user tokens/s",
                           "TTFT p50/p90/p99 ms", "per-token p50/p90/p99 ms"], rows) + [""]


def _race(race: dict) -> list[str]:
    same = sum(r["identical"] for r in race["prompts"])
    lines = ["## Race", "", f"`{race['method']}` vs plain decoding: **{'lossless' if race['identical'] else 'NOT lossless'}** "
             f"({same}/{len(race['prompts'])} prompts identical); speedup {_f(race.get('speedup'))}x, "
             f"tau {_f(race.get('tau'))}.", ""]
    for r in race["prompts"]:
        if not r["identical"]:
            d = r["divergence"]
            lines.append(f"- {r['prompt']}: first divergence at token {d['token']} after `{d['before']!r}`: "
                         f"plain `{d['plain']!r}` vs `{d['method']!r}`")
    return lines + [""]


def _calibration(cal: dict) -> list[str]:
    where = " (ECE on the held-out logs the fit never saw)" if cal.get("held_out") else ""
    lines = ["## Calibration", "", f"From `{cal['source']}`{where}.", ""]
    n = max(len(cal.get("ece_before") or []), len(cal.get("ece_after") or []))
    if n:
        pct = lambda xs, j: _f(xs[j] * 100 if xs and j < len(xs) else None, ".1f")  # noqa: E731
        lines += _table(["position", "ECE before STS %", "ECE after STS %"],
                        [[str(j + 1), pct(cal.get("ece_before"), j), pct(cal.get("ece_after"), j)] for j in range(n)])
    return lines + [""]


def render_markdown(results: dict, figures: list[str]) -> str:
    """The whole results page body."""
    meta = results.get("meta", {})
    lines = ["# dspark benchmark results", "",
             f"Machine: {meta.get('cpu', '?')}, {meta.get('cores', '?')} cores, {meta.get('threads', '?')} torch threads"
             + (f", GPU {meta['gpu']}" if meta.get("gpu") else "") + f"; torch {meta.get('torch', '?')}; "
             f"updated {meta.get('updated', '?')}.", ""]
    if results.get("offline"):
        lines += _offline(results["offline"])
    if results.get("roofline"):
        lines += _roofline(results["roofline"], results)
    if results.get("serve"):
        lines += _serve(results["serve"])
    if results.get("race"):
        lines += _race(results["race"])
    if results.get("calibration"):
        lines += _calibration(results["calibration"])
    if figures:
        lines += ["## Figures", ""] + [f"![{f[:-4].replace('_', ' ')}]({f})" for f in figures] + [""]
    return "\n".join(lines)
