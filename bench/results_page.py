"""Regenerate the results page (docs/results.md) for the embedded default target in one command:

    .venv/bin/python bench/results_page.py --eval-dir bench/data/eval [--quick]

Steps, all into --out (default bench/results/): the roofline and SPS curve (the SPS table it measures is
the one the throughput planner reads in every later step); the offline suite (every method, the first
--num-prompts prompts of each eval set, greedy, batch 1, interleaved repeats); closed-loop serving runs
against `dspark serve` for plain decoding, DFlash and DSpark (when dspark's server is installed); then
docs/results.md = a fixed header + the generated tables + the figures.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from dspark.cli import main as dspark
from dspark.drafters.registry import SHIPPED, shipped_path
from dspark.train.curve import LOG, curve_points

ROOT = Path(__file__).resolve().parent.parent
HEADER = """# Results: the embedded default (SmolLM2-135M-Instruct)

Regenerate this page (and the figures under `bench/results/`) with one command:

    .venv/bin/python bench/results_page.py --eval-dir bench/data/eval

Everything below comes from one run of it; `--quick` gives a one-minute smoke version. Methods: `ar`
(this engine's plain decoding), `ngram` (prompt lookup), `dflash`, `dspark-{fixed,threshold,throughput}`
(the planners), `hf` / `hf-pld` (transformers' `generate()`, plain and prompt lookup) and `llama.cpp`
(when llama-cpp-python is installed). "matches ar" says whether every greedy output equals plain
decoding token for token.

"""


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    """Block until GET /health answers 200; RuntimeError if the server died or never came up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2.0, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the server at {url} was not ready after {timeout:.0f} s")


def serve_runs(args, out: Path, sps: Path, datasets: list[str]) -> None:
    """One closed-loop serving run per method against a freshly started `dspark serve`."""
    if importlib.util.find_spec("dspark.server") is None:  # (an import here would shadow dspark())
        print("results_page: dspark.server is not installed; skipping the serving runs", file=sys.stderr)
        return
    levels = "1,2" if args.quick else "1,2,4,8,16,32"
    for algo in ("NONE", "DFLASH", "DSPARK"):
        port = args.port
        cmd = [sys.executable, "-m", "dspark.serve", "--port", str(port), "--speculative-algorithm", algo,
               "--log-level", "warning"]
        if algo == "DSPARK":
            cmd += ["--speculative-dspark-sps-table-path", str(sps)]
        proc = subprocess.Popen(cmd, cwd=ROOT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, proc)
            dspark(["bench", "serve", "--url", url, "--label", {"NONE": "ar"}.get(algo, algo.lower()),
                    "--concurrency", levels, "--num-requests", "8" if args.quick else "64",
                    "--max-tokens", "32" if args.quick else str(args.max_tokens), "--num-prompts", "5",
                    *sum((["--dataset", d] for d in datasets), []), "--out", str(out)])
        except RuntimeError as e:
            print(f"results_page: serving run {algo} failed: {e}", file=sys.stderr)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def drafters_line(checkpoints: dict[str, Path] | None = None) -> str:
    """Which shipped drafters the run used: training tokens (the run log's last validation) and a weights
    hash, so a page older than the checkpoints it describes shows it."""
    checkpoints = checkpoints or {algo: shipped_path(algo) for algo in SHIPPED}
    parts = []
    for algo, path in checkpoints.items():
        weights = path / "model.safetensors"
        if not weights.is_file():
            parts.append(f"{algo} not installed")
            continue
        digest = hashlib.sha256(weights.read_bytes()).hexdigest()[:12]
        points = curve_points([path / LOG])
        tokens = f"{points[-1]['tokens'] / 1e6:.2f}M training tokens, " if points else ""
        parts.append(f"{algo} `{path.name}` ({tokens}weights sha256 {digest})")
    return "Drafters: " + "; ".join(parts) + ".\n\n"


def write_page(out: Path, page: Path, argv: list[str], checkpoints: dict[str, Path] | None = None) -> None:
    """docs/results.md: the header, the command of this run and the drafters it used, then results.md
    with figure links made relative to the page."""
    body = (out / "results.md").read_text().split("\n", 1)[1]  # drop its own title
    run = "This page: `.venv/bin/python bench/results_page.py " + " ".join(argv) + "`.\n\n"
    run += drafters_line(checkpoints)
    here = Path(page).resolve().parent
    rel = Path(os.path.relpath(out.resolve(), here)).as_posix()
    body = re.sub(r"!\[([^\]]*)\]\(([^)/]+)\)", lambda m: f"![{m.group(1)}]({rel}/{m.group(2)})", body)
    page.write_text(HEADER + run + body.lstrip("\n"))
    print(f"wrote {page}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eval-dir", required=True, help="folder with gsm8k.jsonl, humaneval.jsonl, mt-bench.jsonl")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--page", default=str(ROOT / "docs" / "results.md"))
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=30123)
    ap.add_argument("--no-serve", action="store_true", help="skip the serving runs")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").unlink(missing_ok=True)  # one run, one page
    datasets = [str(Path(args.eval_dir) / f"{n}.jsonl") for n in ("gsm8k", "humaneval", "mt-bench")]
    quick = ["--quick"] if args.quick else []
    sps = out / "sps.json"
    # the SPS table every later step reads, loaded steps up to the serving runs' 32 requests included
    rc = dspark(["bench", "roofline", "--out", str(out), "--max-tokens", "32" if args.quick else "256",
                 "--max-seqs", "2" if args.quick else "32", "--save-sps", str(sps), *quick])
    offline = ["bench", "offline", "--out", str(out), "--sps-table", str(sps), *quick,
               *sum((["--dataset", d] for d in datasets), [])]
    if not args.quick:
        offline += ["--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
                    "--repeats", str(args.repeats)]
    rc |= dspark(offline)
    if not args.no_serve:
        serve_runs(args, out, sps, datasets)
    write_page(out, Path(args.page), sys.argv[1:])
    return rc


if __name__ == "__main__":
    sys.exit(main())
