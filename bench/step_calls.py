"""What the Python around dspark's kernels costs at batch 1, each pair interleaved step by step in one process:
- a target step in one kernel call (the default where dspark's AVX-512 kernels run, csrc/step.c: the
  embedding, every layer, the final norm and the LM head) against a call per layer (each layer fused, as
  before) with the embedding, norm and head from Python; windows of --tokens tokens after --context cached
  ones, the wider ones tapping the shipped drafter's five hidden layers as a DSpark verify pass does;
- a DSpark drafting round of the shipped drafter, timed right after a target step as the planner prices it
  (feeding 2 positions, then a whole block), with the block and its greedy picks in one kernel call
  (csrc/draft_block.c, the default) against the calls one by one, for --draft-sizes requests.
Each pair gives the same bits (tests/test_native.py); the difference is Python and call overhead, during
which the other core waits.

    .venv/bin/python bench/step_calls.py [--tokens 1,8] [--draft-sizes 1,8] [--repeats 60] [--context 256]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark import LLM
from dspark.cache import blocks_for
from dspark.models.attention import KV_ALIGN
from dspark.speculative.profile import _time_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--draft-sizes", default="1,8")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--context", type=int, default=256)
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    requests = [int(s) for s in args.draft_sizes.split(",")]
    llm = LLM(speculative_algorithm="DSPARK", planner="fixed", profile_progress=False)
    dec, drafter = llm.decoder, llm.engine.proposer.drafter
    taps, runner, ctx = tuple(drafter.config.target_layer_ids), drafter.runner(), args.context
    gen = torch.Generator().manual_seed(0)
    cache = dec.new_cache(blocks_for(ctx + max(sizes) + KV_ALIGN) + 1)
    width = len(taps) * drafter.config.hidden_size
    feats = torch.randn(ctx, width, generator=gen).to(drafter.fc.weight.dtype)
    caches = [drafter.new_cache(ctx + 16) for _ in range(max(requests))]
    drafter.extend_many(caches, [feats] * len(caches), [0] * len(caches))
    times: dict[tuple[str, int, str], list[float]] = {}
    with torch.inference_mode():
        _time_step(dec, cache, [1], ctx, gen)
        weights, plan = dec._layer_weights(), runner._plan
        if not dec._fused or weights is None or plan is None:
            raise SystemExit("the one-call paths do not run here (dspark's AVX-512 kernels, the shipped drafter)")
        for rep in range(args.repeats + 1):  # pass 0 warms up
            for one in (True, False) if rep % 2 else (False, True):
                mode = "one call" if one else "by calls"
                dec._weights = weights if one else False
                for n in sizes:
                    t = _time_step(dec, cache, [n], ctx, gen, taps if n > 1 else ())
                    if rep:
                        times.setdefault(("step", n, mode), []).append(t)
                dec._weights = weights
                runner._plan = plan if one else None
                for r in requests:
                    _time_step(dec, cache, [1], ctx, gen)
                    t = time.perf_counter()
                    drafter.extend_many(caches[:r], [feats[ctx - 2:]] * r, [ctx - 2] * r)
                    drafter.draft(caches[:r], [1] * r, [ctx] * r, return_logits=False)
                    if rep:
                        times.setdefault(("round", r, mode), []).append(time.perf_counter() - t)
                runner._plan = plan
    print(f"batch 1 unless said, {ctx} cached tokens, median ms of {args.repeats}, {torch.get_num_threads()} threads")
    for kind, ns, what in (("step", sizes, "target step of {} tokens"),
                           ("round", requests, "drafting round, {} requests")):
        for n in ns:
            one, calls = (1e3 * statistics.median(times[(kind, n, m)]) for m in ("one call", "by calls"))
            print(f"{what.format(n):<30} one call {one:7.3f} ms, calls one by one {calls:7.3f} ms ({calls / one:.2f}x)")


if __name__ == "__main__":
    main()
