"""Attention over the paged cache, and a window-invariant variant for bf16 models on a CPU.

`F.scaled_dot_product_attention` is exact enough in fp32, but its result for one query row depends
slightly (1e-7) on how many other rows and keys share the call. Under bf16 weights the next layer
rounds that to bf16, so a position verified inside a draft window would sometimes differ by an ulp
from the same position decoded alone, and greedy speculative output would drift from plain decoding.
`invariant_attention` computes every row with the same reductions whatever the window: fp32 matmuls
whose reduction axes (head_dim, then the key axis padded to a fixed multiple by the cache) do not
change with the number of query rows, a masked softmax over that padded axis, masked keys contributing
exact zeros. The probs @ values reduction runs over fixed chunks of KV_CHUNK keys, summed in order:
past ~384 keys the BLAS kernel splits a long reduction at points that depend on its length, so a row
whose window pads the key axis 64 further would otherwise round differently.
tests/test_packing.py checks the bit-identity, on the embedded model and on long contexts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

KV_ALIGN = 64  # key-axis padding the invariant path relies on (KVCache.kv_align)
KV_CHUNK = 256  # keys per probs @ values matmul: a length the kernel reduces in one block
_NEG_INF = torch.tensor(float("-inf"))  # made once: a Python scalar in torch.where becomes a new tensor per call


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, Q, hd] already scaled by 1/sqrt(hd), k/v [B, Hkv, S, hd], mask [B, 1, Q, S] bool -> [B, H, Q, hd]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0, enable_gqa=q.shape[1] != k.shape[1])


def invariant_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Same contract as sdpa_attention; fp32 inputs, S a multiple of KV_ALIGN."""
    b, h, nq, hd = q.shape
    hkv = k.shape[1]
    g = h // hkv
    if g * nq == 1:  # a single-row matmul takes the GEMV path, which rounds differently: pad to 2 rows
        return invariant_attention(q.expand(b, h, 2, hd), k, v, mask.expand(b, 1, 2, -1))[:, :, :1]
    # one matmul per (sequence, kv head): the g query heads of a group share its keys
    qg = q.reshape(b, hkv, g * nq, hd)
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, hkv, g, nq, -1)
    scores = torch.where(mask.view(b, 1, 1, nq, -1), scores, _NEG_INF)
    probs = torch.softmax(scores, dim=-1).view(b, hkv, g * nq, -1)
    out = torch.matmul(probs[..., :KV_CHUNK], v[:, :, :KV_CHUNK])
    for s in range(KV_CHUNK, probs.shape[-1], KV_CHUNK):  # chunks past a row's keys add exact zeros
        out = out + torch.matmul(probs[..., s:s + KV_CHUNK], v[:, :, s:s + KV_CHUNK])
    return out.view(b, h, nq, hd)
