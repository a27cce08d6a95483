"""Target step times by shape: sequences x tokens each (decodes, verify windows, mixed windows) after --context
cached tokens, on the default load of the embedded model (or --model / --dtype), medians of --repeats. Run the
same command on two trees in turn (PYTHONPATH=<tree>) to compare code side by side.

    .venv/bin/python bench/step_shapes.py [--shapes '1;8;8x1;32x1;1,3,8,2,1,5,8,1;8x8'] [--context 256] [--repeats 15]

A shape is a comma list of window lengths, one per sequence, or NxK for N sequences of K tokens."""
from __future__ import annotations

import argparse
import statistics

import torch

from dspark import LLM
from dspark.cache import blocks_for
from dspark.models.attention import KV_ALIGN
from dspark.speculative.profile import _time_step


def parse_shape(text: str) -> list[int]:
    """'8x1' -> [1] * 8 (N sequences of K tokens), '1,3,8' -> [1, 3, 8], '8' -> [8] (one sequence)."""
    if "x" in text:
        n, k = text.split("x")
        return [int(k)] * int(n)
    return [int(v) for v in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="1;8;8x1;32x1;1,3,8,2,1,5,8,1;8x8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    try:
        shapes = {s: parse_shape(s) for s in args.shapes.split(";")}
    except ValueError:
        ap.error(f"--shapes {args.shapes!r}: each shape is a comma list of token counts or NxK")
    if any(not lens or min(lens) < 1 or len(lens) > 256 for lens in shapes.values()) or args.repeats < 1:
        ap.error("every shape needs 1 to 256 sequences of at least one token, and --repeats at least 1")
    llm = LLM(model=args.model, dtype=args.dtype, speculative_algorithm="NONE", profile_progress=False)
    dec, ctx = llm.decoder, args.context
    most = max(len(lens) for lens in shapes.values())
    cache = dec.new_cache(most * (blocks_for(ctx + max(max(v) for v in shapes.values()) + KV_ALIGN) + 1))
    gen = torch.Generator().manual_seed(0)
    print(f"{dec.weight_format}, {dec.kv_dtype} cache, {ctx} cached tokens, {torch.get_num_threads()} threads, "
          f"median ms of {args.repeats}")
    with torch.inference_mode():
        for name, lens in shapes.items():
            _time_step(dec, cache, lens, ctx, gen)  # warm-up
            times = [_time_step(dec, cache, lens, ctx, gen) for _ in range(args.repeats)]
            print(f"{name:<24} {1e3 * statistics.median(times):9.2f} ms")


if __name__ == "__main__":
    main()
