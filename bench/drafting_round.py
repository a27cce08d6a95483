"""The shipped DSpark drafter's drafting round as a fraction of a plain one-token target step, the way the
throughput planner prices it (speculative/profile.py: each round timed right after a target step, median
of --repeats), for a whole block (7 drafts) and for one draft, at several batch sizes; the default engine
settings. With --compare, also the same drafter on the per-op route (the kernels' layers and context
projection switched off); with --draft-model DIR (repeatable), other drafters beside the shipped one (a
deeper one, a wider Markov head); with --4bit, the shipped one again with its matrices on the 4-bit kernel
(`--speculative-draft-model-quantization int4`); all interleaved round by round in one process. With --hot,
also each round again right after itself, with no target step in between: the drafter's weights are then still in
cache, and the difference is what bringing them back from memory costs. With --phases, where a batch-1 round
of the shipped drafter goes, after a target step and hot: feeding the context, copying it for attention,
the layers, the heads, the greedy picks, and the Python between them.

    .venv/bin/python bench/drafting_round.py [--sizes 1,8] [--repeats 15] [--compare] [--hot] [--4bit]
        [--draft-model DIR ...] [--phases]
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import time

import torch

from dspark import LLM
from dspark.cache import blocks_for
from dspark.models.attention import KV_ALIGN
from dspark.speculative.factory import build_proposer
from dspark.speculative.profile import _time_step


def _fed_caches(drafter, n: int, context: int, fed: int, gen: torch.Generator):
    """(n drafter caches holding `context` positions of random target features, those features)."""
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    hidden = torch.randn(context, width, generator=gen).to(drafter.fc.weight.dtype)
    caches = [drafter.new_cache(context + fed + 8) for _ in range(n)]
    drafter.extend_many(caches, [hidden] * n, [0] * n)
    return caches, hidden


def fused_flags(runner) -> tuple[bool, bool]:
    """(layers fused, context fused) of a drafter's runner, on whichever kernels it drafts: dspark's AVX-512 ones
    (bf16) or the AVX2 ones (fp32)."""
    if runner._native:
        return runner._fused_layers, runner._fused_context
    return runner._avx2_layers, runner._avx2_context


def set_fused(runner, flags: tuple[bool, bool]) -> None:
    """fused_flags()' inverse: switch a runner's fused layers and context projection on or off."""
    if runner._native:
        runner._fused_layers, runner._fused_context = flags
    else:
        runner._avx2_layers, runner._avx2_context = flags


def round_seconds(routes: dict, dec, sizes: list[int], repeats: int, num_drafts: int | None,
                  context: int = 256, fed: int = 2, hot: bool = False) -> tuple[float, dict]:
    """(median step seconds, {(route, size): median round seconds}), routes interleaved round by round.
    routes: name -> (drafter, (fused layers, fused context)). hot: also {(route + " hot", size): ...}, the
    same round timed again straight after itself."""
    gen = torch.Generator().manual_seed(0)
    widest = max(sizes)
    target = dec.new_cache(blocks_for(context + 1 + KV_ALIGN) + 1)  # keys as one view: the engine's batch-1 path
    state = {}  # drafter -> (its caches, its context features)
    for drafter, _ in routes.values():
        if drafter not in state:
            state[drafter] = _fed_caches(drafter, widest, context, fed, gen)
    steps, times = [], {}
    with torch.inference_mode():
        for p in range(repeats + 1):  # pass 0 warms up
            for name, (drafter, flags) in routes.items():
                caches, hidden = state[drafter]
                runner = drafter.runner()
                set_fused(runner, flags)
                for r in sizes:
                    step = _time_step(dec, target, [1], context, gen)
                    for label in (name, f"{name} hot") if hot else (name,):
                        t = time.perf_counter()
                        drafter.extend_many(caches[:r], [hidden[context - fed:]] * r, [context - fed] * r)
                        drafter.draft(caches[:r], [1] * r, [context] * r, num_drafts=num_drafts,
                                      return_logits=False)
                        if p:
                            times.setdefault((label, r), []).append(time.perf_counter() - t)
                    if p:
                        steps.append(step)
    return statistics.median(steps), {k: statistics.median(v) for k, v in times.items()}


PHASES = {"context_kv": "context feed", "_context": "context copy", "_backbone_on_kernels": "layers",
          "heads": "heads", "greedy_picks": "greedy picks"}  # DraftRunner methods timed by --phases


def phase_seconds(drafter, dec, repeats: int, context: int = 256, fed: int = 2) -> dict[str, dict[str, float]]:
    """{"after a step" / "hot": {phase: median seconds, "rest": the round's other time, "round": all of it}}
    for batch-1 rounds of a whole block (PHASES' methods of the drafter's runner, timed in place)."""
    runner, spent = drafter.runner(), {}
    for method in PHASES:
        def timed(*a, _f=getattr(runner, method), _m=method, **k):
            t = time.perf_counter()
            out = _f(*a, **k)
            spent[_m] = spent.get(_m, 0.0) + time.perf_counter() - t
            return out
        setattr(runner, method, timed)
    gen = torch.Generator().manual_seed(0)
    target = dec.new_cache(blocks_for(context + 1 + KV_ALIGN) + 1)
    (cache,), hidden = _fed_caches(drafter, 1, context, fed, gen)
    samples: dict[str, dict[str, list[float]]] = {}
    try:
        with torch.inference_mode():
            for p in range(repeats + 1):  # pass 0 warms up
                _time_step(dec, target, [1], context, gen)
                for label in ("after a step", "hot"):
                    spent.clear()
                    t = time.perf_counter()
                    drafter.extend_many([cache], [hidden[context - fed:]], [context - fed])
                    drafter.draft([cache], [1], [context], return_logits=False)
                    total = time.perf_counter() - t
                    if p:
                        row = samples.setdefault(label, {})
                        for method in PHASES:
                            row.setdefault(PHASES[method], []).append(spent.get(method, 0.0))
                        row.setdefault("rest", []).append(total - sum(spent.values()))
                        row.setdefault("round", []).append(total)
    finally:
        for method in PHASES:
            delattr(runner, method)
    return {label: {k: statistics.median(v) for k, v in row.items()} for label, row in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,8", help="batch sizes (requests drafting together)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--compare", action="store_true", help="also the per-op route, interleaved")
    ap.add_argument("--hot", action="store_true",
                    help="also each round repeated straight after itself (no target step between: weights in cache)")
    ap.add_argument("--4bit", dest="four_bit", action="store_true",
                    help="also the shipped drafter with 4-bit matrices, interleaved")
    ap.add_argument("--phases", action="store_true",
                    help="also where a batch-1 round goes (context feed and copy, layers, heads, picks, the rest)")
    ap.add_argument("--draft-model", action="append", default=[], metavar="DIR",
                    help="another DSpark drafter to time beside the shipped one (repeat for more)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    llm = LLM(speculative_algorithm="DSPARK", planner="fixed")
    drafter, dec = llm.engine.proposer.drafter, llm.engine.model
    runner = drafter.runner()
    routes = {"kernels": (drafter, fused_flags(runner))}
    if args.compare:
        routes["per-op"] = (drafter, (False, False))
    if args.four_bit:
        w4 = copy.deepcopy(drafter).pack(weight_bits=4)
        routes["4-bit"] = (w4, fused_flags(w4.runner()))
    for path in args.draft_model:  # built as the engine builds its drafter, on the same target
        spec = dataclasses.replace(llm.config.speculative, draft_model=path)
        other = build_proposer(spec, llm.decoder, llm.model_path).drafter
        c = other.config
        name = f"{path} ({c.num_layers} layers, Markov rank {c.markov_rank})"
        routes[name] = (other, fused_flags(other.runner()))
    layers, context = fused_flags(runner)
    print(f"weights: {dec.weight_format}; drafter layers fused: {layers}, context fused: {context}")
    for n in (None, 1):
        step, rounds = round_seconds(routes, dec, sizes, args.repeats, n, hot=args.hot)
        label = "whole block" if n is None else "one draft"
        for (name, r), sec in sorted(rounds.items()):
            print(f"{label:11s} {name:8s} batch {r:2d}: {sec * 1e3:6.2f} ms = {sec / step:.3f} of a "
                  f"{step * 1e3:.2f} ms step")
    if args.phases:
        for label, row in phase_seconds(drafter, dec, args.repeats).items():
            print(f"phases, batch 1, {label}: " + ", ".join(f"{k} {v * 1e3:.3f}" for k, v in row.items()) + " ms")


if __name__ == "__main__":
    main()
