"""A target step of the embedded model on a bf16 KV cache (the default where dspark's AVX-512 kernels run: keys
rounded once to bf16 when written, values as the projection gives them) against an fp32 cache (the default
before), interleaved step by step in one process: windows of --tokens tokens after each of --contexts cached
tokens, batch 1, and with --batch steps of B sequences of one new token each (their keys gathered from the
pool). Attention reads every cached key and value each step; bf16 halves those bytes.

    .venv/bin/python bench/kv_cache_dtype.py [--tokens 1,8] [--contexts 256,1024] [--batch 8,32] [--repeats 40]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from dspark import LLM
from dspark.cache import KVCache, blocks_for
from dspark.models.attention import KV_ALIGN
from dspark.speculative.profile import _time_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--batch", default="", help="also steps of B sequences, one new token each (e.g. 8,32)")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    contexts = [int(s) for s in args.contexts.split(",")]
    batches = [int(s) for s in args.batch.split(",") if s]
    shapes = [[n] for n in sizes] + [[1] * b for b in batches]  # tokens per sequence of each step
    dec = LLM(max_num_seqs=1, profile_progress=False).decoder
    if dec.kv_dtype != torch.bfloat16:
        raise SystemExit(f"this model's cache is {dec.kv_dtype} here, not bf16 (dspark's AVX-512 kernels do not run)")
    c, gen = dec.config, torch.Generator().manual_seed(0)
    per_seq = blocks_for(max(contexts) + max(sizes) + KV_ALIGN) + 1

    def pools(seqs: int) -> dict[str, KVCache]:
        return {str(dt).removeprefix("torch."): KVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                                        head_dim=c.head_dim, num_blocks=per_seq * seqs, dtype=dt,
                                                        kv_align=KV_ALIGN) for dt in (torch.bfloat16, torch.float32)}

    # a sequence alone in its pool keeps consecutive blocks (one view, the fused step), as the engine's batch 1 does
    caches = {len(lens): pools(len(lens)) for lens in shapes}
    times: dict[tuple[int, int, str], list[float]] = {}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):  # pass 0 warms up
            for name in ("bfloat16", "float32") if rep % 2 else ("float32", "bfloat16"):
                for ctx in contexts:
                    for lens in shapes:
                        t = _time_step(dec, caches[len(lens)][name], lens, ctx, gen)
                        if rep:
                            times.setdefault((ctx, tuple(lens), name), []).append(t)
    print(f"target step, median ms of {args.repeats}, {torch.get_num_threads()} threads")
    for ctx in contexts:
        for lens in shapes:
            b16, f32 = (1e3 * statistics.median(times[(ctx, tuple(lens), k)]) for k in ("bfloat16", "float32"))
            what = f"{lens[0]:>2} tokens" if len(lens) == 1 else f"{len(lens)} sequences x 1 token"
            print(f"{ctx:>5} cached, {what}: bf16 cache {b16:7.3f} ms, fp32 cache {f32:7.3f} ms ({f32 / b16:.2f}x)")


if __name__ == "__main__":
    main()
