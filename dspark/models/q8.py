"""8-bit grouped weights (GGUF Q8_0's form, w = d * q, q in -128..127, 32 per group) for the LM head, run
with dspark's kernel (native.py, csrc/q8_mm.c): bf16 rows in, fp32 logits out.

Why: the embedded model's LM head (tied to its embeddings) is Q8_0 in its GGUF file. As bf16 it was 57 MB
of the ~80 MB a batch-1 decode step reads; in its own 8-bit form it is 30 MB, and since the kernel
computes with the file's own codes and fp32 scales, its logits are closer to the file's model than the
bf16-rounded head was. Like the 4-bit layers (models/int4.py), only weights that already are 8-bit
groups are taken (`native_q8`), and a row's logits never depend on the other rows of the call.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.models import native, native_avx2

GROUP = 32
_LEVELS = 127
_TOLERANCE = 1e-3  # of a group's step: what "already 8-bit" allows for the rounding of d * q


def fit_q8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Symmetric 8-bit fit per group of 32 along the input axis: codes [N, K] int8, step [N, K/32] fp32,
    and the largest reconstruction error as a fraction of its group's step."""
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    step = g.abs().amax(-1) / _LEVELS
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = (g / safe[..., None]).round().clamp(-128, 127)
    err = ((codes * step[..., None] - g).abs().amax(-1) / safe).max().item()
    return codes.to(torch.int8).reshape(n, k), step, err


def shape_ok(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % GROUP == 0


def native_q8(weight: torch.Tensor) -> bool:
    """True when `weight` already is 8-bit groups of 32 (e.g. dequantized from GGUF Q8_0)."""
    return shape_ok(weight) and fit_q8(weight)[2] <= _TOLERANCE


def pack_for_kernel(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The kernel's layout (csrc/q8_mm.c): per 16 output columns and group, 512 bytes of codes in
    (column, k-pair) order, then the 16 columns' steps as fp32."""
    n, k = codes.shape
    nb, g = n // 16, k // GROUP
    q = codes.view(nb, 16, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 512).view(torch.uint8)
    d = step.float().view(nb, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [nb, g, 64]
    return torch.cat([q, d], dim=-1).contiguous().view(-1)


def pack_for_vnni(codes: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The VNNI kernel's layout (csrc/q8_vnni_mm.c): per 16 output columns and group, 512 bytes of codes
    plus 128 in (k-quad, column, 4) order, then the 16 columns' steps as fp32."""
    n, k = codes.shape
    nb, g = n // 16, k // GROUP
    unsigned = (codes.to(torch.int16) + 128).to(torch.uint8)
    q = unsigned.view(nb, 16, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(nb, g, 512)
    d = step.float().view(nb, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)  # [nb, g, 64]
    return torch.cat([q, d], dim=-1).contiguous().view(-1)


class Q8Linear(nn.Module):
    """Inference-only y = x @ W^T (+ bias) for 8-bit grouped weights: bf16 rows in, fp32 out (or
    `out_dtype`). Any out_features: the kernel's rows are padded to a multiple of 16, the output is not.
    With `vnni`, the rows are rounded to 8-bit groups as well and multiplied on VNNI (q8_vnni_mm.c):
    about twice as fast, for callers that can take the rounding (the drafter; the target where its 4-bit
    matmuls round their rows too, native.act8()). With `avx2`, fp32 rows rounded to 8-bit groups on the AVX2
    kernel (native_avx2), fp32 out: where the AVX-512 kernels cannot run."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype = torch.float32, vnni: bool = False, avx2: bool = False):
        super().__init__()
        if weight.dim() != 2 or weight.shape[1] % GROUP:
            raise ValueError(f"q8 needs in_features % {GROUP} == 0, got {tuple(weight.shape)}")
        if avx2 and native_avx2.library() is None:
            raise RuntimeError(f"the AVX2 q8 kernel does not run here: {native_avx2.why()}")
        if not avx2 and native.library() is None:
            raise RuntimeError(f"the q8 kernel does not run here: {native.why()}")
        self.out_features, self.in_features = weight.shape
        self.out_dtype = out_dtype
        self._rows = -(-self.out_features // 16) * 16
        padded = torch.cat([weight.detach().float(), weight.new_zeros(self._rows - self.out_features,
                                                                      self.in_features).float()])
        codes, step, _ = fit_q8(padded)
        self.vnni, self.avx2 = vnni, avx2  # the kernel: VNNI (bf16 rows), AVX2 (fp32 rows), or q8_mm.c
        self.register_buffer("packed", (pack_for_vnni if vnni or avx2 else pack_for_kernel)(codes, step))
        self.bias = None if bias is None else bias.detach().to(out_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.avx2:
            y = native_avx2.matmul(x.reshape(-1, self.in_features).float(), self.packed, self._rows, 8)
            return self._finish(y, x)
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.empty(rows.shape[0], self._rows, dtype=self.out_dtype)
        n, bf16_out = rows.shape[0], int(self.out_dtype == torch.bfloat16)
        if n and self.vnni:
            xq = torch.empty(n, self.in_features, dtype=torch.int8)  # the kernel's scratch: the rows in 8 bits,
            scales = torch.empty(n, self.in_features // GROUP, dtype=torch.float32)  # their groups' scales
            sums = torch.empty(n, self.in_features // GROUP, dtype=torch.int32)  # and code sums
            native.loaded().dspark_q8_vnni_mm(rows.data_ptr(), n, self.in_features, self.packed.data_ptr(), self._rows,
                                              y.data_ptr(), bf16_out, xq.data_ptr(), scales.data_ptr(),
                                              sums.data_ptr(), torch.get_num_threads())
        elif n:
            native.loaded().dspark_q8_mm(rows.data_ptr(), n, self.in_features, self.packed.data_ptr(), self._rows,
                                         y.data_ptr(), bf16_out, torch.get_num_threads())
        return self._finish(y, x)

    def _finish(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The kernel's [rows, padded outputs] -> x's leading shape, out_features, out_dtype, with the bias."""
        y = y.to(self.out_dtype)
        if self._rows != self.out_features:
            y = y[:, :self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, 8-bit groups of {GROUP}"
                + (", 8-bit rows (AVX2)" if self.avx2 else ", 8-bit rows (VNNI)" if self.vnni else ""))
