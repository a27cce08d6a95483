"""Prefill speed on the embedded model: one prompt of --tokens tokens, one new token, batch 1, the
kernels' matmul routes side by side in one process (interleaved): 4-bit matmuls on 8-bit activations
(the default where dspark's kernels run), on bf16 activations (DSPARK_INT8_ACTIVATIONS=0) and on AMX
tiles where the CPU has them (DSPARK_AMX=1).

    .venv/bin/python bench/prefill_speed.py [--tokens 512] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import time

from dspark import LLM, SamplingParams
from dspark.models import native

TEXT = "The lighthouse keeper climbed the spiral stairs, lit the lamp and wrote the weather in his logbook. "


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    engines = {}
    for name in native.ROUTES:
        with native.route(name) as runs:
            if runs:
                engines[name] = LLM(profile_progress=False)
    if not engines:
        raise SystemExit(f"dspark's kernels do not run here: {native.why()}")
    tok = next(iter(engines.values())).tokenizer
    ids = (tok.encode(TEXT) * (args.tokens // 8 + 1))[:args.tokens]
    params = SamplingParams(max_tokens=1)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for rep in range(args.repeats + 1):  # round 0 warms up
        for name, llm in engines.items():
            with native.route(name):
                t = time.perf_counter()
                llm.generate([ids], params)
                if rep:
                    seconds[name].append(time.perf_counter() - t)
    for name, ts in seconds.items():
        m = statistics.median(ts)
        print(f"{name:>17}: {args.tokens}-token prefill {1e3 * m:.0f} ms median of {args.repeats}, "
              f"{1e3 * m / args.tokens:.2f} ms/token")


if __name__ == "__main__":
    main()
