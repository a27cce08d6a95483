"""bf16 linear layers with weights pre-packed for oneDNN (AMX / AVX-512-bf16 CPUs).

Why: on this kind of CPU, a bf16 matmul through `F.linear` re-packs the weight on every call, so
a 1-row decode is no faster than fp32 and every extra row costs little only in principle. With the
weight packed once, the cost of a forward is almost flat from 1 to 16 rows, which is what makes
verifying a block of drafts nearly as cheap as decoding one token. The packed kernel gives every
row the same result whatever the number of rows (checked in tests/test_packing.py), so
speculative and plain decoding stay token-identical.
"""
from __future__ import annotations

import torch
from torch import nn


def packing_supported(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where packed bf16 linears run natively: a CPU with oneDNN bf16 support."""
    if dtype != torch.bfloat16 or torch.device(device).type != "cpu":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


class PackedLinear(nn.Module):
    """Inference-only stand-in for an `nn.Linear` whose weight lives in oneDNN's packed layout.

    `weight` keeps the original tensor only when `keep_weight` (other modules read it, e.g. a tied
    LM head the drafter shares); otherwise the plain copy is dropped to save memory.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, keep_weight: bool = False,
                 row_chunk: int | None = None):
        """row_chunk: run at most this many rows per kernel call (see pack_linears)."""
        super().__init__()
        self.row_chunk = row_chunk
        w = weight.detach()
        self.out_features, self.in_features = w.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w)
        self.bias = None if bias is None else bias.detach()
        self.weight = w if keep_weight else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, keep_weight: bool = False, row_chunk: int | None = None) -> "PackedLinear":
        return cls(linear.weight, linear.bias, keep_weight, row_chunk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        rows = rows.contiguous()
        if self.row_chunk is not None and rows.shape[0] > self.row_chunk:
            y = torch.cat([self._mm(c) for c in rows.split(self.row_chunk)])
        else:
            y = self._mm(rows)
        return y.view(*lead, self.out_features)

    def _mm(self, rows: torch.Tensor) -> torch.Tensor:
        n = rows.shape[0]
        if self.row_chunk is not None and n < MIN_ROWS:  # zero rows up to the kernel every call uses
            rows = torch.cat([rows, rows.new_zeros(MIN_ROWS - n, rows.shape[1])])
        return torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")[:n]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=bf16"


# Above 32 rows oneDNN switches kernels for some shapes (an LM head, a square o_proj), and a row's
# result then changes by an ulp; at most 32 rows per call keeps every row's result the same at any
# batch size (tests/test_packing.py).
ROW_CHUNK = 32
# Below 8 rows oneDNN picks another bf16 kernel for some shapes on AVX-512-bf16 CPUs without AMX (a
# 1536-wide down projection on a Zen 5 EPYC), whose rows differ by an ulp from the same rows in a
# bigger call; a call of fewer rows is padded to 8 with zero rows, so every row goes through the
# kernel of 8-32 rows. The weight read dominates such small calls, so the padding costs little.
MIN_ROWS = 8


def pack_linears(module: nn.Module, keep: tuple[str, ...] | bool = ()) -> int:
    """Swap every `nn.Linear` under `module` for a PackedLinear; attribute names in `keep` (e.g.
    "lm_head"), or all when `keep` is True, keep their plain weight readable. Returns the count."""
    count = 0
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear):
                setattr(child, attr, PackedLinear.from_linear(sub, keep_weight=keep is True or attr in keep,
                                                              row_chunk=ROW_CHUNK))
                count += 1
    return count
