"""Sampled generation speed: requests at T 0.7, top-p 0.8, top-k 20 (or --top-k) through the engine, seeded (keyed draws,
sampling/keyed.py) or not (rejection sampling), plain or with DSpark speculation verifying every draft, and
the engine's counters. Run it under two trees (PYTHONPATH=<tree>) on idle cores to compare sampling code.

    .venv/bin/python bench/sampled_speed.py [--seeded] [--speculative] [--prompts 16] [--max-tokens 128] [--top-k 20]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dspark.llm import LLM
from dspark.sampling_params import SamplingParams
from dspark.train.datagen import prompt_ids, read_prompt_file

PROMPTS = Path(__file__).resolve().parent / "data" / "eval" / "mt-bench.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeded", action="store_true", help="request j has seed j (keyed draws)")
    ap.add_argument("--speculative", action="store_true",
                    help="the shipped DSpark drafter, gamma 7, every draft verified")
    ap.add_argument("--prompts", type=int, default=16, help="requests, all at once (max_num_seqs)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=20, help="-1: top-p alone")
    args = ap.parse_args()
    spec = dict(speculative_algorithm="DSPARK", verify_mode="static", num_speculative_tokens=7) \
        if args.speculative else {}
    llm = LLM(None, max_num_seqs=args.prompts, kv_cache_mb=512, profile_progress=False, **spec)
    ids = [prompt_ids(llm.tokenizer, p.text) for p in read_prompt_file(PROMPTS)[:args.prompts]]
    params = [SamplingParams(temperature=0.7, top_p=0.8, top_k=args.top_k, max_tokens=args.max_tokens, ignore_eos=True,
                             seed=j if args.seeded else None) for j in range(len(ids))]
    t0 = time.perf_counter()
    outs = llm.generate(ids, params)
    wall = time.perf_counter() - t0
    n = sum(len(o.token_ids) for o in outs)
    s = llm.engine.stats
    print(json.dumps({"top_k": args.top_k, "seeded": args.seeded, "speculative": args.speculative, "requests": len(ids), "tokens": n,
                      "seconds": round(wall, 1), "tokens_per_s": round(n / wall, 1), "rounds": s.rounds,
                      "accepted": s.accepted, "time_draft": round(s.time_draft, 1),
                      "time_verify": round(s.time_verify, 1)}))


if __name__ == "__main__":
    main()
