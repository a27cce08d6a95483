"""dspark's AVX-512 kernels as they are against the kernels of another git revision, in one process: the
embedded model is loaded once (the packed weights are the same for both builds) and every repeat times
a verify step of each window size, with --batch a step of several sequences, and with --draft, a whole
drafting round of the shipped drafter (for 1 request, or each batch size listed), on one build and then
the other (in turn first). Interleaved so that a noisy host moves both alike; medians per build.

    .venv/bin/python bench/kernels_ab.py [--against HEAD] [--tokens 1,2,4,8,16] [--repeats 30] [--batch 8,32] [--draft [1,8]]

Only the C sources differ between the two builds; both take this process's routes (DSPARK_AMX,
DSPARK_INT8_ACTIVATIONS). For kernel changes whose layouts or signatures differ, compare separate runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from dspark import LLM
from dspark.cache import blocks_for
from dspark.models import native
from dspark.models.attention import KV_ALIGN
from dspark.speculative.profile import _time_step

REPO = Path(__file__).resolve().parent.parent


def build_at(rev: str, out_dir: Path):
    """The kernels' sources at git revision `rev`, built and loaded with this process's routes."""
    src = out_dir / "csrc"
    src.mkdir(parents=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:dspark/models/csrc"], cwd=REPO, check=True,
                           capture_output=True, text=True).stdout.split()
    for name in names:
        blob = subprocess.run(["git", "show", f"{rev}:dspark/models/csrc/{name}"], cwd=REPO, check=True,
                              capture_output=True).stdout
        (src / name).write_bytes(blob)
    lib_path = out_dir / "kernels.so"
    native._build(lib_path, sources=[src / p.name for p in native.SOURCES])
    lib = native.open_library(lib_path)
    lib.dspark_amx_init(int(native.amx()))
    lib.dspark_act8_init(int(native.act8()))
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", default="HEAD", help="git revision whose kernels to compare with")
    ap.add_argument("--tokens", default="1,2,4,8,16", help="verify window sizes (one sequence, 256 cached)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--batch", default="", help="also steps of B sequences, one new token each (e.g. 8,32)")
    ap.add_argument("--draft", nargs="?", const="1", default="",
                    help="also time a whole drafting round, for each of these batch sizes (default 1)")
    ap.add_argument("--json", help="write the medians here")
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    batches = [int(b) for b in args.batch.split(",") if b]
    drafts = [int(b) for b in args.draft.split(",") if b]
    llm = LLM(speculative_algorithm="DSPARK", planner="fixed") if args.draft else LLM()
    dec = llm.engine.model
    if native.loaded() is None:
        raise SystemExit(f"dspark's kernels do not run here: {native.why()}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"this tree": native.loaded(), args.against: build_at(args.against, Path(tmp))}
        gen = torch.Generator().manual_seed(0)
        cache = dec.new_cache(max([1] + batches) * (blocks_for(256 + max(sizes) + KV_ALIGN) + 1))
        rounds = {b: _round(llm, b) for b in drafts}
        times: dict[tuple[str, str], list[float]] = {}
        with torch.inference_mode():
            for rep in range(args.repeats + 2):  # two warm-up passes
                order = list(libs.items())
                for name, lib in (order if rep % 2 else order[::-1]):  # A B B A ...: neither build always goes first
                    native._lib = lib
                    for n in sizes:
                        sec = _time_step(dec, cache, [n], 256, gen)
                        if rep >= 2:
                            times.setdefault((name, f"step {n}"), []).append(sec)
                    for b in batches:
                        sec = _time_step(dec, cache, [1] * b, 256, gen)
                        if rep >= 2:
                            times.setdefault((name, f"batch {b}"), []).append(sec)
                    for b, round_fn in rounds.items():
                        t = time.perf_counter()
                        round_fn()
                        if rep >= 2:
                            times.setdefault((name, f"draft round x{b}"), []).append(time.perf_counter() - t)
        native._lib = libs["this tree"]
    med = {f"{name} | {what}": statistics.median(v) * 1e3 for (name, what), v in times.items()}
    for name in libs:
        whats = [f"step {n}" for n in sizes] + [f"batch {b}" for b in batches] + [f"draft round x{b}" for b in drafts]
        row = {what: med[f"{name} | {what}"] for what in whats}
        ratio = f", {sizes[-1]}-token step / 1-token step {row[f'step {sizes[-1]}'] / row['step 1']:.2f}" if 1 in sizes else ""
        print(f"{name:>12}: " + "  ".join(f"{w} {ms:.2f} ms" for w, ms in row.items()) + ratio)
    if args.json:
        Path(args.json).write_text(json.dumps({"against": args.against, "repeats": args.repeats, "ms": med}, indent=1))


def _round(llm, batch: int):
    """One drafting round of the engine's drafter for `batch` requests, each after 256 positions of context
    (random features)."""
    drafter = llm.engine.proposer.drafter
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    hidden = torch.randn(256, width, generator=torch.Generator().manual_seed(1)).to(drafter.fc.weight.dtype)
    caches = [drafter.new_cache(256 + 10) for _ in range(batch)]
    drafter.extend_many(caches, [hidden] * batch, [0] * batch)

    def run() -> None:
        drafter.extend_many(caches, [hidden[254:]] * batch, [254] * batch)
        drafter.draft(caches, list(range(1, batch + 1)), [256] * batch, return_logits=False)
    return run


if __name__ == "__main__":
    main()
