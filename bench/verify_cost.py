"""What a verify window of 1 + n tokens costs at batch 1, against a one-token step, timed three ways in one
process, interleaved: as the SPS profile times it (target steps back to back), right after a DSpark
drafting round (as the engine runs it), and that again with the drafter's hidden layers tapped (the
engine's DSpark verify). Also the engine's own verify passes (`ModelRunner.run`) by window size, from
batch-1 runs of the throughput planner over eval prompts, and what the SPS table says.

    .venv/bin/python bench/verify_cost.py [--repeats 20] [--context 256] [--prompts 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark import LLM, SamplingParams
from dspark.cache import blocks_for
from dspark.models.attention import KV_ALIGN
from dspark.speculative.profile import _time_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--prompts", type=int, default=5, help="eval prompts per set for the engine's own passes")
    args = p.parse_args()
    llm = LLM(speculative_algorithm="DSPARK", max_num_seqs=1, profile_progress=False)
    dec, proposer = llm.decoder, llm.engine.proposer
    drafter, layers = proposer.drafter, proposer.hidden_layers
    gen = torch.Generator().manual_seed(0)
    ctx, widest = args.context, proposer.max_drafts + 1
    cache = dec.new_cache(blocks_for(ctx + widest + KV_ALIGN) + 1)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    feats = torch.randn(ctx, width, generator=gen).to(drafter.fc.weight.dtype)
    dcache = drafter.new_cache(ctx + 16)
    drafter.extend_many([dcache], [feats], [0])

    def draft_round() -> None:
        drafter.extend_many([dcache], [feats[ctx - 2:]], [ctx - 2])
        drafter.draft([dcache], [1], [ctx], return_logits=False)

    times: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):  # pass 0 warms up
            for n in range(1, widest + 1):
                _time_step(dec, cache, [1], ctx, gen)
                hot = _time_step(dec, cache, [n], ctx, gen)
                draft_round()
                cold = _time_step(dec, cache, [n], ctx, gen)
                draft_round()
                tapped = _time_step(dec, cache, [n], ctx, gen, layers)
                if rep:
                    for name, t in (("back to back", hot), ("after drafting", cold), ("after drafting, tapped", tapped)):
                        times.setdefault((name, n), []).append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    one = med[("back to back", 1)]

    runs: dict[int, list[float]] = {}
    run = llm.engine.runner.run

    def timed_run(windows):
        t = time.perf_counter()
        out = run(windows)
        runs.setdefault(sum(len(w.tokens) for w in windows), []).append(time.perf_counter() - t)
        return out

    llm.engine.runner.run = timed_run
    from dspark.bench.datasets import load_datasets
    from dspark.bench.offline import encode_prompts

    for ds in load_datasets(["bench/data/eval"], limit=args.prompts):
        for ids in encode_prompts(llm.tokenizer, ds.prompts, raw=False):
            llm.generate([ids], SamplingParams(max_tokens=128, temperature=0.0))
    table = llm.engine.planner.table
    print(f"one-token step back to back: {one * 1e3:.2f} ms; in steps of that:")
    print("| tokens | back to back | after drafting | after drafting, tapped | engine verify (rounds) | SPS table |")
    print("|---|---|---|---|---|---|")
    for n in range(1, widest + 1):
        eng = runs.get(n, [])
        e = f"{statistics.median(eng) / one:.3f} ({len(eng)})" if eng else "-"
        print(f"| {n} | {med[('back to back', n)] / one:.3f} | {med[('after drafting', n)] / one:.3f} "
              f"| {med[('after drafting, tapped', n)] / one:.3f} | {e} | {table.sps(1, 1) / table.sps(n, 1):.3f} |")


if __name__ == "__main__":
    main()
