"""A prototype 4-bit matmul with 8-bit activations (kernel.c) timed beside dspark's shipped 4-bit kernels on
the four matmuls of one layer of the embedded target (shapes only: random codes), 1-16 rows, interleaved in
one process, both threads. The question it answers: would rounding the activations to 8 bits (as llama.cpp
does) make a verify window cheap on plain AVX-512 VNNI? Where the CPU has AMX, the shipped AMX route
(DSPARK_AMX=1) is timed too.

    .venv/bin/python bench/int8_activations/run.py [--repeats 200] [--rows 1,2,4,8,16]
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dspark.models import native
from dspark.models.int4 import fit_int4, pack_for_kernel

LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # (outputs, inputs)
FLAGS = ["-O3", "-std=gnu11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-fopenmp", "-shared", "-fPIC"]


def build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    out = Path(tempfile.mkdtemp()) / "int8_activations.so"
    subprocess.run([cc, *FLAGS, str(Path(__file__).with_name("kernel.c")), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    p, i = ctypes.c_void_p, ctypes.c_int64
    lib.quantize_rows.argtypes = [p, i, i, p, p, p]
    lib.int4_q8act_mm.argtypes = [p, p, p, i, i, p, i, p, ctypes.c_int]
    return lib


def pack(codes: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """codes [n, k] 0..15, d / m [n, k / 32] -> kernel.c's layout"""
    n, k = codes.shape
    g = k // 32
    q = codes.reshape(n // 16, 16, g, 4, 2, 4).transpose(0, 2, 3, 1, 5, 4)  # block, group, chunk, col, j, low/high
    nib = (q[..., 0] | (q[..., 1] << 4)).reshape(n // 16, g, 256).astype(np.uint8)
    scales = np.ascontiguousarray(np.concatenate([d.reshape(n // 16, 16, g).transpose(0, 2, 1), m.reshape(n // 16, 16, g).transpose(0, 2, 1)],
                            axis=2).astype(np.float32))
    return np.ascontiguousarray(np.concatenate([nib, scales.view(np.uint8)], axis=2))


class Prototype:
    def __init__(self, lib: ctypes.CDLL, n: int, k: int, rng: np.random.Generator):
        self.lib, self.n, self.k = lib, n, k
        self.codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
        self.d = (rng.random((n, k // 32)) * 0.01 + 1e-3).astype(np.float32)
        self.m = (-8 * self.d).astype(np.float32)
        self.packed = pack(self.codes, self.d, self.m)

    def __call__(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows, k = x.shape
        q = np.empty((rows, k), np.int8)
        dx, sx = np.empty((rows, k // 32), np.float32), np.empty((rows, k // 32), np.float32)
        y = np.empty((rows, self.n), np.float32)
        self.lib.quantize_rows(x.data_ptr(), rows, k, q.ctypes.data, dx.ctypes.data, sx.ctypes.data)
        self.lib.int4_q8act_mm(q.ctypes.data, dx.ctypes.data, sx.ctypes.data, rows, k, self.packed.ctypes.data, self.n,
                               y.ctypes.data, torch.get_num_threads())
        return y, q, dx

    def weight(self) -> np.ndarray:
        g = self.k // 32
        return (self.codes.reshape(self.n, g, 32) * self.d[..., None] + self.m[..., None]).reshape(self.n, self.k)


def check(proto: Prototype) -> tuple[float, float]:
    """(max error against the exact product of the rounded rows, relative error against the bf16 rows)"""
    x = torch.randn(5, proto.k).bfloat16()
    y, q, dx = proto(x)
    w = proto.weight().astype(np.float64)
    xq = (q.reshape(5, -1, 32) * dx[..., None].astype(np.float64)).reshape(5, -1)
    exact = x.double().numpy() @ w.T
    return float(np.abs(y - xq @ w.T).max() / np.abs(exact).max()), float(np.abs(y - exact).max() / np.abs(exact).max())


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
    proto_lib, rng = build(), np.random.default_rng(0)
    amx = lib.dspark_amx_init(1) == 1
    lib.dspark_amx_init(int(native.amx()))
    mats = {}
    for name, (n, k) in LAYER.items():
        codes, step, lo, _ = fit_int4(torch.randn(n, k) * 0.02)
        mats[name] = (pack_for_kernel(codes, step, lo), Prototype(proto_lib, n, k, rng), n, k)
        err_exact, err_bf16 = check(mats[name][1])
        print(f"{name} {n}x{k}: prototype vs exact sums of the rounded rows {err_exact:.1e}, vs the bf16 rows {err_bf16:.1e}"
              " (relative to the largest output)")
    routes = ["avx512"] + (["amx"] if amx else []) + ["int8-activations"]
    print(f"\none layer's four matmuls, median ms of {args.repeats}, {torch.get_num_threads()} threads")
    print(f"{'rows':>4} " + " ".join(f"{r:>17}" for r in routes))
    one = {}
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
        totals = dict.fromkeys(routes, 0.0)
        for packed, proto, n, k in mats.values():
            for route in routes:
                if route == "int8-activations":
                    totals[route] += median_ms(lambda: proto(xs[k]), args.repeats)
                else:
                    lib.dspark_amx_init(int(route == "amx"))
                    totals[route] += median_ms(lambda: native.int4_mm(lib, xs[k], packed, n), args.repeats)
        lib.dspark_amx_init(int(native.amx()))
        one = one or totals
        print(f"{rows:>4} " + " ".join(f"{totals[r]:>9.3f} ({totals[r] / one[r]:.2f}x)" for r in routes))


if __name__ == "__main__":
    main()
