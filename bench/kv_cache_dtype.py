"""A target step of the embedded model on a bf16 KV cache (the default where dspark's AVX-512 kernels run: keys
rounded once to bf16 when written, values as the projection gives them) against an fp32 cache (the default
before), interleaved step by step in one process: windows of --tokens tokens after each of --contexts cached
tokens, batch 1. Attention reads every cached key and value each step; bf16 halves those bytes.

    .venv/bin/python bench/kv_cache_dtype.py [--tokens 1,8] [--contexts 256,1024] [--repeats 40]
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
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",")]
    contexts = [int(s) for s in args.contexts.split(",")]
    dec = LLM(max_num_seqs=1, profile_progress=False).decoder
    if dec.kv_dtype != torch.bfloat16:
        raise SystemExit(f"this model's cache is {dec.kv_dtype} here, not bf16 (dspark's AVX-512 kernels do not run)")
    c, gen = dec.config, torch.Generator().manual_seed(0)
    blocks = blocks_for(max(contexts) + max(sizes) + KV_ALIGN) + 1
    caches = {str(dt).removeprefix("torch."): KVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                                                      head_dim=c.head_dim, num_blocks=blocks, dtype=dt,
                                                      kv_align=KV_ALIGN) for dt in (torch.bfloat16, torch.float32)}
    times: dict[tuple[int, int, str], list[float]] = {}
    with torch.inference_mode():
        for rep in range(args.repeats + 1):  # pass 0 warms up
            for name in list(caches) if rep % 2 else list(caches)[::-1]:
                for ctx in contexts:
                    for n in sizes:
                        t = _time_step(dec, caches[name], [n], ctx, gen)
                        if rep:
                            times.setdefault((ctx, n, name), []).append(t)
    print(f"batch-1 target step, median ms of {args.repeats}, {torch.get_num_threads()} threads")
    for ctx in contexts:
        for n in sizes:
            b16, f32 = (1e3 * statistics.median(times[(ctx, n, k)]) for k in ("bfloat16", "float32"))
            print(f"{ctx:>5} cached, {n:>2} tokens: bf16 cache {b16:7.3f} ms, fp32 cache {f32:7.3f} ms ({f32 / b16:.2f}x)")


if __name__ == "__main__":
    main()
