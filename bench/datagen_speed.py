"""Training-data generation speed: the same prompts answered by each generator of `dspark train-data`
(the trainer's dense target pass, the serving engine, the serving engine with DSpark speculation), in
alternating rounds in one process so host drift hits all alike. Greedy answers must be the same
tokens for the two engine rows (speculation is lossless); the dense pass differs from the served
4-bit target in a few percent of tokens.

    .venv/bin/python bench/datagen_speed.py [--prompts 64] [--max-tokens 320] [--rounds 2] [--json OUT]

Generators: dense, dense:sdpa (the dense pass with its decode attention on PyTorch's SDPA instead of
dspark's kernel), engine, engine:QUANT (engine with --quantization QUANT), engine+ALGO (speculative).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from dspark.train.datagen import load_dense_target, read_prompt_file
from dspark.train.engine_gen import EngineTarget

PROMPTS = Path(__file__).resolve().parent / "data" / "eval" / "gsm8k.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="prompts per round (one shard)")
    ap.add_argument("--prompt-file", default=str(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--generators", default="dense,engine,engine+dspark")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    names = args.generators.split(",")
    targets = {}
    for name in names:
        if name in ("dense", "dense:sdpa"):
            targets[name] = load_dense_target(None)[0]
            if name == "dense:sdpa":
                targets[name]._decode_kernel = lambda kv: None
        else:
            base, _, spec = name.partition("+")
            quant = base.partition(":")[2] or "auto"
            targets[name] = EngineTarget(max_num_seqs=args.max_num_seqs, speculative_algorithm=spec or "none",
                                         quantization=quant)
    tok = next(t.llm.tokenizer for t in targets.values() if isinstance(t, EngineTarget)) if any(
        isinstance(t, EngineTarget) for t in targets.values()) else load_dense_target(None)[1]
    prompts = read_prompt_file(args.prompt_file)[:args.prompts]
    ids = [list(getattr(x, "input_ids", x)) for x in (tok.apply_chat_template(
        [{"role": "user", "content": p.text}], tokenize=True, add_generation_prompt=True) for p in prompts)]
    rates: dict[str, list[float]] = {n: [] for n in names}
    answers: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name in names:
            t0 = time.perf_counter()
            outs = targets[name].generate(ids, max_tokens=args.max_tokens, batch=args.max_num_seqs)
            dt = time.perf_counter() - t0
            n = sum(len(o.tokens) for o in outs)
            rates[name].append(n / dt)
            answers[name] = [o.tokens for o in outs]
            print(f"round {r}: {name:14s} {n} tokens in {dt:.1f} s = {n / dt:.1f} tokens/s", flush=True)
    report = {"prompts": len(ids), "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
              "tokens_per_s": {n: round(statistics.median(v), 1) for n, v in rates.items()}}
    engines = [n for n in names if n.startswith("engine") and ":" not in n]
    if len(engines) > 1:
        report["engine_answers_equal"] = all(answers[n] == answers[engines[0]] for n in engines)
    if "dense" in answers and "dense:sdpa" in answers:
        a, b = answers["dense"], answers["dense:sdpa"]
        report["dense_equal_to_dense_sdpa"] = sum(x == y for x, y in zip(a, b)) / len(a)
    if "dense" in answers and engines:
        a, b = answers["dense"], answers[engines[0]]
        report["dense_equal_to_engine"] = sum(x == y for x, y in zip(a, b)) / len(a)
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
