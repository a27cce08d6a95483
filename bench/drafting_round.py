"""The shipped DSpark drafter's drafting round as a fraction of a plain one-token target step, the way the
throughput planner prices it (speculative/profile.py: each round timed right after a target step, median
of --repeats), for a whole block (7 drafts) and for one draft, at several batch sizes; the default engine
settings. With --compare, also the same drafter on the per-op route (the kernels' layers and context
projection switched off), interleaved in one process.

    .venv/bin/python bench/drafting_round.py [--sizes 1,8] [--repeats 15] [--compare]
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


def round_seconds(drafter, dec, sizes: list[int], repeats: int, routes: dict, num_drafts: int | None,
                  context: int = 256, fed: int = 2) -> tuple[float, dict]:
    """(median step seconds, {(route, size): median round seconds}), routes interleaved round by round."""
    gen = torch.Generator().manual_seed(0)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    hidden = torch.randn(context, width, generator=gen).to(drafter.fc.weight.dtype)
    widest = max(sizes)
    caches = [drafter.new_cache(context + fed + 8) for _ in range(widest)]
    drafter.extend_many(caches, [hidden] * widest, [0] * widest)
    target = dec.new_cache(blocks_for(context + 1 + KV_ALIGN) + 1)  # keys as one view: the engine's batch-1 path
    runner = drafter.runner()
    steps, times = [], {}
    with torch.inference_mode():
        for p in range(repeats + 1):  # pass 0 warms up
            for name, flags in routes.items():
                runner._fused_layers, runner._fused_context = flags
                for r in sizes:
                    step = _time_step(dec, target, [1], context, gen)
                    t = time.perf_counter()
                    drafter.extend_many(caches[:r], [hidden[context - fed:]] * r, [context - fed] * r)
                    drafter.draft(caches[:r], [1] * r, [context] * r, num_drafts=num_drafts, return_logits=False)
                    if p:
                        steps.append(step)
                        times.setdefault((name, r), []).append(time.perf_counter() - t)
    return statistics.median(steps), {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,8", help="batch sizes (requests drafting together)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compare", action="store_true", help="also the per-op route, interleaved")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(speculative_algorithm="DSPARK", planner="fixed")
    drafter, dec = llm.engine.proposer.drafter, llm.engine.model
    runner = drafter.runner()
    routes = {"kernels": (runner._fused_layers, runner._fused_context)}
    if args.compare:
        routes["per-op"] = (False, False)
    print(f"weights: {dec.weight_format}; drafter layers fused: {runner._fused_layers}, "
          f"context fused: {runner._fused_context}")
    for n in (None, 1):
        step, rounds = round_seconds(drafter, dec, sizes, args.repeats, routes, n)
        label = "whole block" if n is None else "one draft"
        for (name, r), sec in sorted(rounds.items()):
            print(f"{label:11s} {name:8s} batch {r:2d}: {sec * 1e3:6.2f} ms = {sec / step:.3f} of a "
                  f"{step * 1e3:.2f} ms step")


if __name__ == "__main__":
    main()
