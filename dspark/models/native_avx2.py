"""dspark's AVX2 kernels, for CPUs with AVX2 and FMA (the ones where the AVX-512 kernels, native.py, cannot run
among them), on fp32 rows: 4-bit and 8-bit grouped-weight matmuls (csrc/avx2_mm.c), attention one query row
at a time (csrc/avx2_attention.c), RMSNorm + residual, SiLU gating and RoPE + cache write
(csrc/avx2_layer_ops.c), a decoder layer as one call (csrc/avx2_layer.c), a whole target step of one sequence
or of several sequences' windows as one call (csrc/avx2_step.c), and a drafter's block-pass layer, context
projection and greedy Markov picks as one call each (csrc/avx2_drafter.c).

There the model runs in fp32 (bf16 arithmetic is slow without AVX-512-bf16), and its linears would be fp32
matmuls: the embedded model's decode step read ~540 MB of weights, and its matmuls took ~80% of the step.
With these, its 4-bit layers and 8-bit LM head stay in their own form (~100 MB a step), each row rounded to
8-bit groups as in llama.cpp's CPU path; a row's result never depends on the other rows of a call, so
speculative verification stays token-identical to plain decoding.

A library of its own (AVX2 flags only), built on first use into $DSPARK_HOME/kernels like the AVX-512 one,
keyed by a hash of its source and flags. DSPARK_KERNELS=torch turns it off as well.
"""
from __future__ import annotations

import ctypes
import hashlib
import os

import torch

from dspark.models import native

SOURCES = [native.CSRC / name for name in ("avx2_mm.c", "avx2_attention.c", "avx2_layer_ops.c", "avx2_layer.c",
                                           "avx2_step.c", "avx2_drafter.c")]
FLAGS = ["-O3", "-std=gnu11", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-lm"]
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_MM_ARGS = [_P, _I64, _I64, _P, _I64, _P, _INT]

_lib: ctypes.CDLL | None = None
_tried = False
_why = ""
_key = ""


def library() -> ctypes.CDLL | None:
    """The AVX2 kernels, building them on first use; None where they cannot run here (why()) or with
    DSPARK_KERNELS=torch."""
    global _lib, _tried, _why, _key
    if os.environ.get(native.ENV, "auto") == "torch":
        return None
    if _tried:
        return _lib
    _tried = True
    files = SOURCES + [native.CSRC / "avx2.h"]
    key = hashlib.sha256(b"".join(p.read_bytes() for p in files) + " ".join(FLAGS).encode()).hexdigest()[:12]
    path = native._cache_dir() / f"dspark-avx2-{key}.so"
    try:
        if not path.exists():
            native._build(path, SOURCES, FLAGS)
        lib = ctypes.CDLL(str(path))
        if not lib.dspark_avx2_supported():
            _why = "this CPU lacks AVX2 and FMA"
            return None
    except (OSError, RuntimeError) as e:
        _why = str(e)
        return None
    for name in ("dspark_avx2_int4_mm", "dspark_avx2_q8_mm"):
        getattr(lib, name).argtypes = _MM_ARGS
        getattr(lib, name).restype = None
    lib.dspark_avx2_attention.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _I64, _P, _P] + [_I64] * 9 + [_INT]
    lib.dspark_avx2_attention.restype = None
    lib.dspark_avx2_attention_paged.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _P] + [_I64] * 9 + [_INT]
    lib.dspark_avx2_attention_paged.restype = None
    lib.dspark_avx2_add_rmsnorm.argtypes = [_P, _P, _P, _P, ctypes.c_float, _P, _I64, _I64, _INT]
    lib.dspark_avx2_silu_mul.argtypes = [_P, _P, _I64, _I64, _INT]
    lib.dspark_avx2_rope_store.argtypes = [_P, _P, _P, _P, ctypes.c_float, _I64, _I64, _I64, _I64, _P, _P, _I64, _P,
                                           _INT]
    lib.dspark_avx2_layer.argtypes = [_P, _P, _I64, _I64, _P, _P, ctypes.c_float, _P, _P, _P, _P, _I64, _I64, _I64, _I64,
                                      _P, _P, _P, ctypes.c_float, _P, _I64, _P, _I64, _P, _I64, _P, _P, _INT]
    lib.dspark_avx2_step.argtypes = ([_P, _P, _I64, _I64, _I64, _P, _I64, ctypes.c_float, _I64, _I64, _I64, _I64, _P, _P,
                                      _P, ctypes.c_float, _P, _I64, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _P, _I64, _P,
                                      _P, _I64, _P, _P, ctypes.c_float, _P, _I64, _P, _I64, _P, _INT])
    lib.dspark_avx2_step.restype = _INT
    _F = ctypes.c_float
    lib.dspark_avx2_drafter_layer.argtypes = ([_P, _P, _P, _P, _I64, _I64, _I64, _P, _P, _F, _P, _P, _P, _P, _P, _P, _F]
                                              + [_I64] * 4 + [_P, _P, _P, _F, _P, _I64, _I64, _P, _P, _P, _P, _INT])
    lib.dspark_avx2_drafter_context.argtypes = [_P, _I64, _I64, _I64, _P, _P, _F, _P, _I64, _I64, _I64, _P, _F, _P, _P,
                                                _P, _P, _P, _INT]
    lib.dspark_avx2_markov_greedy.argtypes = [_P, _P, _I64, _I64, _I64, _I64, _I64, _P, _I64, _P, _I64, _P, _P, _P, _P,
                                              _P, _INT]
    for name in ("dspark_avx2_add_rmsnorm", "dspark_avx2_silu_mul", "dspark_avx2_rope_store", "dspark_avx2_layer",
                 "dspark_avx2_drafter_layer", "dspark_avx2_drafter_context", "dspark_avx2_markov_greedy"):
        getattr(lib, name).restype = None
    _lib, _key = lib, key
    return _lib


def loaded() -> ctypes.CDLL | None:
    """The library if library() has loaded it: modules decide at construction and fetch it here at each call."""
    return _lib


def why() -> str:
    """Why library() is None ("" when it is not, or not yet asked)."""
    if os.environ.get(native.ENV, "auto") == "torch":
        return f"{native.ENV}=torch"
    return _why


def build_key() -> str:
    """The loaded library's hash of source and flags ("" when none is loaded): what a cached timing of it is
    valid for."""
    return _key if _lib is not None else ""


def matmul(x: torch.Tensor, packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """x [rows, K] fp32 times weights packed for 8-bit rows (int4.pack_for_kernel with quads, or
    q8.pack_for_vnni), n outputs (a multiple of 16): [rows, n] fp32."""
    rows, k = x.shape
    x = x.contiguous()
    y = torch.empty(rows, n, dtype=torch.float32)
    if rows:
        (_lib.dspark_avx2_int4_mm if bits == 4 else _lib.dspark_avx2_q8_mm)(
            x.data_ptr(), rows, k, packed.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    return y


def attention_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether attention() takes these shapes and layouts."""
    hd = q.shape[-1]
    return (q.dtype == k.dtype == torch.float32 and hd % 8 == 0 and hd <= 256 and k.stride(-1) == 1
            and k.stride(-2) == hd and q.device.type == "cpu")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """native.attention's contract on the AVX2 kernel (csrc/avx2_attention.c), fp32 out: q [B, H, Q, hd] fp32
    (unit last stride), k / v [Hkv, B, S, hd] fp32 with rows of hd consecutive floats, mask [B, 1, Q, S] bool
    -> [B, H, Q, hd], laid out [B, Q, H, hd] in memory."""
    b, h, nq, hd = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    mask = mask.contiguous()
    out = torch.empty(b, nq, h, hd, dtype=torch.float32)
    _lib.dspark_avx2_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(),
                               k.stride(0), k.stride(1), mask.data_ptr(), out.data_ptr(), out.stride(0), out.stride(2),
                               out.stride(1), b, h, k.shape[0], nq, k.shape[2], hd, torch.get_num_threads())
    return out.transpose(1, 2)


def attention_paged(q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """attention() over a layer's cache as it is: pool [2 Hkv, pool rows, hd] fp32 (keys, then values), rows [B, S]
    int64: the pool row of each sequence's key s (padding: any row, masked). The same arithmetic per row as
    attention() on the rows gathered into [Hkv, B, S, hd], so the same bits, without the copy."""
    b, h, nq, hd = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    mask, rows = mask.contiguous(), rows.contiguous()
    hkv = pool.shape[0] // 2
    out = torch.empty(b, nq, h, hd, dtype=torch.float32)
    _lib.dspark_avx2_attention_paged(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), pool.data_ptr(),
                                     pool[hkv].data_ptr(), pool.stride(0), rows.data_ptr(), None, None, mask.data_ptr(),
                                     out.data_ptr(), out.stride(0), out.stride(2), out.stride(1), b, h, hkv, nq,
                                     rows.shape[1], hd, torch.get_num_threads())
    return out.transpose(1, 2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """native.rms_norm on fp32 rows: (x + residual, its RMSNorm) for x [rows, d] fp32 contiguous (d a multiple
    of 8), weight [d] fp32; without residual the first is x itself."""
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    _lib.dspark_avx2_add_rmsnorm(x.data_ptr(), None if residual is None else residual.data_ptr(), total.data_ptr(),
                                 weight.data_ptr(), eps, out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2n] fp32 contiguous -> [rows, n] fp32."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    _lib.dspark_avx2_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, torch.get_num_threads())
    return out


def rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_scale: float,
               heads: int, kv_heads: int, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """native.rope_store on fp32 rows: RoPE on the fused qkv rows [T, H + 2 Hkv, hd] fp32 contiguous; keys and
    values written to the layer's pool [2 Hkv, rows, hd] fp32 at `slots` [T] int64; returns q [T, H, hd] fp32
    (scaled by q_scale). cos and signed sin: fp32 tables [positions, hd] covering `positions` [T] int64."""
    t, _, hd = qkv.shape
    q = torch.empty(t, heads, hd, dtype=torch.float32)
    _lib.dspark_avx2_rope_store(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_scale, t, heads,
                                kv_heads, hd, q.data_ptr(), pool.data_ptr(), pool.shape[1], slots.data_ptr(),
                                torch.get_num_threads())
    return q
