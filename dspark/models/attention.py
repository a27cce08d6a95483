"""Attention over the paged cache, and a window-invariant variant for CPU models whose rows must not depend on
the window: bf16 models, and fp32 ones with 4-bit layers (Decoder.invariant).

`F.scaled_dot_product_attention` is exact enough in fp32, but its result for one query row depends
slightly (1e-7) on how many other rows and keys share the call. Under bf16 weights the next layer
rounds that to bf16, so a position verified inside a draft window would sometimes differ by an ulp
from the same position decoded alone, and greedy speculative output would drift from plain decoding.
`invariant_attention` computes every row with the same reductions whatever the window: fp32 matmuls
whose reduction axes (head_dim, then the key axis padded to a fixed multiple by the cache) do not
change with the number of query rows, a masked softmax over that padded axis, masked keys contributing
exact zeros, and at least MIN_ROWS rows per matmul. The probs @ values reduction runs over chunks of
exactly KV_CHUNK keys (one batched matmul), summed in key order: a BLAS kernel blocks a reduction by
its length (Intel's MKL past ~384 keys, on AVX2-only AMD CPUs at any length), so a row whose window
pads the key axis 64 further would otherwise round differently.
tests/test_packing.py checks the bit-identity, on the embedded model and on long contexts.
Where dspark's kernels run (models/native.py), `invariant_attention` is one call of csrc/attention.c
instead, which computes each row on its own and needs none of that padding; on CPUs with AVX2 but not those,
one call of csrc/avx2_attention.c (models/native_avx2.py), which does the same in 8-lane vectors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark.models import native, native_avx2

KV_ALIGN = 64  # key-axis padding the invariant path relies on (KVCache.kv_align)
KV_CHUNK = KV_ALIGN  # keys per probs @ values product: every chunk the same length, whatever S is
# Fewest rows per (sequence, kv head) matmul. BLAS libraries reduce a row differently when the matrix
# has very few rows (Intel's MKL on AMX CPUs: 1 row; on AVX2-only AMD CPUs: up to 3 rows) and the same
# for every row count above that, so a decode's rows are padded up to this many.
MIN_ROWS = 4
_NEG_INF = torch.tensor(float("-inf"))  # made once: a Python scalar in torch.where becomes a new tensor per call


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, Q, hd] already scaled by 1/sqrt(hd), k/v [Hkv, B, S, hd] (the cache's head-major layout),
    mask [B, 1, Q, S] bool -> [B, H, Q, hd]."""
    return F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=1.0,
                                          enable_gqa=q.shape[1] != k.shape[0])


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *,
                        kernels: bool | str | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Same contract as sdpa_attention; fp32 inputs, S a multiple of KV_ALIGN. kernels: use dspark's
    kernel where it fits (None: where it is loaded now; "avx2": the AVX2 library's even where the AVX-512
    one runs, as a model on 4-bit AVX2 layers must: its fused layers attend on it, and a row's bits must
    not depend on which path computed it); out_dtype: the result's dtype."""
    b, h, nq, hd = q.shape
    hkv = k.shape[0]
    if kernels == "avx2":
        if native_avx2.library() is not None and native_avx2.attention_fits(q, k):
            return native_avx2.attention(q, k, v, mask).to(out_dtype)
        return _invariant_attention_torch(q, k, v, mask).to(out_dtype)
    lib = native.library() if kernels is None else native.loaded() if kernels else None
    if lib is not None and native.attention_fits(q, k):
        return native.attention(lib, q, k, v, mask, out_dtype)
    if (kernels is not False and lib is None and native_avx2.library() is not None
            and native_avx2.attention_fits(q, k)):
        return native_avx2.attention(q, k, v, mask).to(out_dtype)
    return _invariant_attention_torch(q, k, v, mask).to(out_dtype)


def _invariant_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    b, h, nq, hd = q.shape
    hkv = k.shape[0]
    g = h // hkv
    if g * nq < MIN_ROWS:  # few-row matmuls take other kernels (GEMV, small-M), which round differently
        pad = -(-MIN_ROWS // g)  # query rows so that the group's matmul has at least MIN_ROWS rows
        qp = torch.cat([q, q[:, :, -1:].expand(b, h, pad - nq, hd)], dim=2)
        mp = torch.cat([mask, mask[:, :, -1:].expand(b, 1, pad - nq, mask.shape[-1])], dim=2)
        return _invariant_attention_torch(qp, k, v, mp)[:, :, :nq]
    # one matmul per (kv head, sequence): the g query heads of a group share its keys, which are read
    # where the cache's gather put them (k [Hkv, B, S, hd]: K^T is a transposed view, not a copy)
    qg = q.reshape(b, hkv, g * nq, hd).transpose(0, 1)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(hkv, b, g, nq, -1)
    scores = torch.where(mask.view(1, b, 1, nq, -1), scores, _NEG_INF)
    probs = torch.softmax(scores, dim=-1).view(hkv, b, g * nq, -1)
    c = probs.shape[-1] // KV_CHUNK
    chunks = probs.view(hkv, b, g * nq, c, KV_CHUNK).transpose(2, 3)  # [Hkv, B, C, rows, KV_CHUNK]
    parts = torch.matmul(chunks, v.reshape(hkv, b, c, KV_CHUNK, hd))  # [Hkv, B, C, rows, hd], same shape per chunk
    out = parts.cumsum(dim=2)[:, :, -1]  # summed in key order: chunks past a row's keys add exact zeros
    return out.transpose(0, 1).reshape(b, h, nq, hd)

