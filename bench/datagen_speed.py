"""Training-data generation speed: the same prompts answered by each generator of `dspark train-data`
(the trainer's dense target pass, the serving engine, the serving engine with DSpark speculation), in
alternating rounds in one process so host drift hits all alike. Greedy answers must be the same
tokens for the two engine rows (speculation is lossless); the dense pass differs from the served
4-bit target in a few percent of tokens.

    .venv/bin/python bench/datagen_speed.py [--prompts 64] [--max-tokens 320] [--rounds 2] [--sampled] [--json OUT]

Generators: dense (the trainer's default pass, `--target-quantization auto`), dense:served (the dense pass on the
served 4-bit layers, `--target-quantization served`), dense:plain (the dense pass on plain weights, `--target-quantization none`: the 4-bit
layers dequantised to packed bf16), dense:sdpa (the dense pass with its decode attention on PyTorch's SDPA
instead of dspark's kernel), dense:full-vocab (with --sampled: the dense pass sampling from warp_probs over the whole
vocabulary, as it did before it sampled among the top-k candidates), engine, engine:QUANT (engine with
--quantization QUANT), engine+ALGO (speculative). --sampled answers at T 0.7, top-p 0.8, top-k 20.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import dspark.train.dense_target as dense_target
from dspark.sampling.sampler import sample, warp_probs
from dspark.train.datagen import load_dense_target, read_prompt_file
from dspark.train.engine_gen import EngineTarget

PROMPTS = Path(__file__).resolve().parent / "data" / "eval" / "gsm8k.jsonl"
SAMPLED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}


def _full_vocab_pick(logits, temperature, top_p, top_k, gen):
    """The dense generator's token pick with a sample drawn over the whole warped vocabulary."""
    if temperature <= 0:
        return logits.argmax(-1)
    return sample(warp_probs(logits, temperature, top_k, top_p), gen)


@contextlib.contextmanager
def _picking(pick):
    """dense_target's token pick swapped for `pick` (None: as it is) inside the block."""
    kept = dense_target._pick
    dense_target._pick = pick or kept
    try:
        yield
    finally:
        dense_target._pick = kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64, help="prompts per round (one shard)")
    ap.add_argument("--prompt-file", default=str(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--generators", default="dense,engine,engine+dspark")
    ap.add_argument("--sampled", action="store_true", help="sample (T 0.7, top-p 0.8, top-k 20) instead of greedy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    names = args.generators.split(",")
    targets = {}
    for name in names:
        if name in ("dense", "dense:plain", "dense:served", "dense:sdpa", "dense:full-vocab"):
            quantization = {"dense:plain": "none", "dense:served": "served"}.get(name, "auto")
            targets[name] = load_dense_target(None, quantization=quantization)[0]
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
            with _picking(_full_vocab_pick if name == "dense:full-vocab" else None):
                outs = targets[name].generate(ids, max_tokens=args.max_tokens, batch=args.max_num_seqs,
                                              **(SAMPLED if args.sampled else {}), seed=r)
            dt = time.perf_counter() - t0
            n = sum(len(o.tokens) for o in outs)
            rates[name].append(n / dt)
            answers[name] = [o.tokens for o in outs]
            print(f"round {r}: {name:14s} {n} tokens in {dt:.1f} s = {n / dt:.1f} tokens/s", flush=True)
    report = {"prompts": len(ids), "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
              "sampling": SAMPLED if args.sampled else "greedy",
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
