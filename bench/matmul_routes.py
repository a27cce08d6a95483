"""The target's 4-bit matmul routes side by side on the four matmuls of one layer of the embedded target
(shapes only: random weights), 1-16 rows, interleaved in one process, all threads: bf16 activations on
VDPBF16PS (DSPARK_INT8_ACTIVATIONS=0), AMX tiles where the CPU has them (DSPARK_AMX=1), and activations
rounded to 8 bits on VPDPBUSD (the default). What a verify window of n rows costs against one row is the
question: speculation pays only if it is close to one.

    .venv/bin/python bench/matmul_routes.py [--repeats 200] [--rows 1,2,4,8,16]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from dspark.models import native
from dspark.models.int4 import fit_int4, pack_for_kernel

LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (outputs, inputs)


def median_ms(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1e3 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--rows", default="1,2,4,8,16")
    args = ap.parse_args()
    lib = native.library()
    if lib is None:
        raise SystemExit(f"dspark's kernels do not run here: {native.why()}")
    packed = {}  # route -> layer matmul -> weights in that route's layout
    for route in native.ROUTES:
        with native.route(route) as runs:
            gen = torch.Generator().manual_seed(0)
            if runs:
                packed[route] = {name: pack_for_kernel(*fit_int4(torch.randn(n, k, generator=gen) * 0.02)[:3])
                                 for name, (n, k) in LAYER.items()}
    routes = list(packed)
    print(f"one layer's four 4-bit matmuls, median ms of {args.repeats}, {torch.get_num_threads()} threads")
    print(f"{'rows':>4} " + " ".join(f"{r:>18}" for r in routes))
    one = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        totals = dict.fromkeys(routes, 0.0)
        for name, (n, k) in LAYER.items():
            for route in routes:
                with native.route(route):
                    totals[route] += median_ms(lambda: native.int4_mm(lib, xs[k], packed[route][name], n),
                                               args.repeats)
        one = one or totals
        print(f"{rows:>4} " + " ".join(f"{totals[r]:>10.3f} ({totals[r] / one[r]:.2f}x)" for r in routes))


if __name__ == "__main__":
    main()
