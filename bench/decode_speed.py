"""Decode speed on the embedded model, batch 1, greedy, one prompt, one thread count, side by side:
dspark's engine vs transformers' generate(), plus the memory roofline (weight bytes / bandwidth).

    .venv/bin/python bench/decode_speed.py [--tokens 128] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dspark import LLM, SamplingParams
from dspark.bench.roofline import ceiling_tokens_per_s, read_bandwidth_gbs, weight_bytes

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def time_dspark(llm: LLM, prompt_ids: list[int], n: int) -> float:
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    llm.generate([prompt_ids], params)  # warm-up
    t = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0]
    return len(out.token_ids) / (time.perf_counter() - t)


def time_transformers(model, prompt_ids: list[int], n: int) -> float:
    ids = torch.tensor([prompt_ids])
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        model.generate(ids, **kw)
        t = time.perf_counter()
        out = model.generate(ids, **kw)
    return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    llm = LLM()
    tok = AutoTokenizer.from_pretrained(str(llm.model_path))
    hf = AutoModelForCausalLM.from_pretrained(str(llm.model_path), dtype=torch.float32).eval()
    prompt_ids = tok.encode(llm.apply_chat_template([{"role": "user", "content": PROMPT}]))
    ours, theirs = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
        ours.append(time_dspark(llm, prompt_ids, args.tokens))
        theirs.append(time_transformers(hf, prompt_ids, args.tokens))
    bw = read_bandwidth_gbs()
    nbytes = weight_bytes(llm.decoder)
    roofline = ceiling_tokens_per_s(bw, nbytes)
    best_ours, best_theirs = max(ours), max(theirs)
    result = {
        "threads": torch.get_num_threads(), "tokens": args.tokens, "prompt_tokens": len(prompt_ids),
        "dspark_tokens_per_s": [round(x, 2) for x in ours],
        "transformers_tokens_per_s": [round(x, 2) for x in theirs],
        "speedup_best": round(best_ours / best_theirs, 2),
        "read_bandwidth_gb_s": round(bw, 2), "weight_bytes": nbytes,
        "roofline_tokens_per_s": round(roofline, 2),
        "dspark_fraction_of_roofline": round(best_ours / roofline, 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
