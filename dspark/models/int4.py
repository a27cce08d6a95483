"""4-bit weights, 32 per group, run with dspark's own CPU kernels (bf16 activations: native.py, csrc/int4_mm.c;
fp32 activations on AVX2 CPUs: native_avx2.py, csrc/avx2_mm.c) or PyTorch's (bf16 activations).

Why: at batch 1 a decode step reads every weight once, so its cost is the bytes read. The embedded
target ships as a Q4_1 GGUF: its linear weights are 4-bit codes with a scale and a minimum per group of
32 (w = d * q + m, q in 0..15). Kept in that form, a step reads a quarter of the bytes of bf16; the
kernel decodes them on the fly. dspark's kernel (AVX-512 BF16 CPUs) decodes a tile once per call for
all its rows, ~2x PyTorch's at any row count; PyTorch's (everywhere else) dequantizes once per few rows,
so it is faster than packed bf16 only up to about 8 rows per call. On CPUs without AVX-512-bf16 the
model runs in fp32 (bf16 arithmetic is slow there), and the AVX2 kernel takes its fp32 rows, rounded to
8-bit groups as llama.cpp does, against the same codes (int4_kernel picks).

`native_int4` recognises weights that already are 4-bit groups (as a GGUF Q4_1 file's are, after any
conversion to fp32), so re-packing them loses nothing but the rounding of scales to bf16 (less than
rounding the weights themselves to bf16 does). Forcing int4 on other weights is round-to-nearest
quantization: it changes the model, so dspark never does it unless asked.

Every row gets the same result whatever the number of rows in a call (tests/test_int4.py), so
speculative verification stays token-identical to plain decoding on this path too.
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.models import native, native_avx2

GROUP = 32  # GGUF Q4_0 / Q4_1 block size
_LEVELS = 15
_TOLERANCE = 1e-3  # of a group's step: what "already 4-bit" allows for fp32 rounding of d * q + m


def int4_supported(device: torch.device | str) -> bool:
    """True where the CPU int4 kernel exists (PyTorch >= 2.6 on a CPU)."""
    return torch.device(device).type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def _shape_ok(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return n % 16 == 0 and k % GROUP == 0  # the kernel's layout constraints


def fit_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Asymmetric 4-bit fit per group of 32 along the input axis: codes [N, K] int32, step and minimum
    [N, K/32] fp32, and the largest reconstruction error as a fraction of its group's step."""
    n, k = weight.shape
    g = weight.detach().float().reshape(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    step = (hi - lo) / _LEVELS
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = ((g - lo[..., None]) / safe[..., None]).round().clamp(0, _LEVELS)
    err = ((codes * step[..., None] + lo[..., None] - g).abs().amax(-1) / safe).max().item()
    return codes.to(torch.int32).reshape(n, k), step, lo, err


def native_int4(weight: torch.Tensor) -> bool:
    """True when `weight` already is 4-bit groups of 32 (e.g. dequantized from GGUF Q4_1)."""
    return weight.dim() == 2 and _shape_ok(weight) and _is_native(fit_int4(weight))


def _is_native(fit: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]) -> bool:
    return fit[3] <= _TOLERANCE


def _bf16_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).contiguous().view(torch.uint8)


def pack_for_kernel(codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor, quads: bool | None = None) -> torch.Tensor:
    """dspark's kernel layout (csrc/int4_mm.c) of codes [N, K] (0..15), step and minimum [N, K / 32]: per
    16 output columns and group, 256 bytes of codes, then 16 bf16 steps and 16 bf16 centres lo + 8 step.
    The codes are interleaved by k-pairs for bf16 activations, by k-quads for 8-bit ones (`quads`; by
    default what the AVX-512 kernels run now, native.act8(); the AVX2 kernel always takes quads)."""
    n, k = codes.shape
    nb, g = n // 16, k // GROUP
    if native.act8() if quads is None else quads:  # chunk c: q[col, 8c + i] low nibble, q[col, 8c + 4 + i] high, byte 4 col + i
        q = codes.to(torch.uint8).view(nb, 16, g, 4, 2, 4).permute(0, 2, 3, 4, 1, 5).reshape(nb, g, 4, 2, 64)
    else:  # chunk c: pair-vectors 2c (low nibbles) and 2c + 1 (high), element j = q[j / 2, 2p + j % 2]
        q = codes.to(torch.uint8).view(nb, 16, g, 16, 2).permute(0, 2, 3, 1, 4).reshape(nb, g, 8, 2, 32)
    packed_codes = q[:, :, :, 0] | (q[:, :, :, 1] << 4)
    d = _bf16_bytes(step.view(nb, 16, g).permute(0, 2, 1))  # [nb, g, 32 bytes]
    z = _bf16_bytes((lo + 8 * step).view(nb, 16, g).permute(0, 2, 1))
    return torch.cat([packed_codes.reshape(nb, g, 256), d, z], dim=-1).contiguous().view(-1)


def int4_kernel(dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Which 4-bit kernel runs rows of `dtype` here: "dspark" (bf16 rows, the AVX-512 kernels), "avx2" (fp32
    rows, native_avx2), "torch" (bf16 rows, PyTorch's), or None."""
    if torch.device(device).type != "cpu":
        return None
    if dtype == torch.bfloat16:
        if native.library() is not None:
            return "dspark"
        return "torch" if int4_supported(device) else None
    if dtype == torch.float32 and native_avx2.library() is not None:
        return "avx2"
    return None


class Int4Linear(nn.Module):
    """Inference-only stand-in for an `nn.Linear` with 4-bit grouped weights: bf16 in and out, or fp32 in and
    out on the AVX2 kernel (dtype float32). On dspark's kernels any out_features (the rows are padded to a
    multiple of 16, the output is not)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 fit: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None,
                 dtype: torch.dtype = torch.bfloat16):
        """fit: fit_int4(weight) when the caller already has it. dtype: the rows' (see int4_kernel)."""
        super().__init__()
        kernel = int4_kernel(dtype, "cpu")
        if kernel is None:
            raise ValueError(f"no 4-bit kernel takes {str(dtype).removeprefix('torch.')} rows here")
        if not (_shape_ok(weight) or (kernel != "torch" and weight.dim() == 2 and weight.shape[1] % GROUP == 0)):
            raise ValueError(f"int4 needs in_features % {GROUP} == 0 (and out_features % 16 == 0 on PyTorch's "
                             f"kernel), got {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self._rows = -(-self.out_features // 16) * 16  # dspark's kernels: rows padded, the output is not
        if self._rows != self.out_features:
            fit = None
            weight = torch.cat([weight.detach().float(), weight.new_zeros(self._rows - self.out_features,
                                                                          self.in_features).float()])
        codes, step, lo, _ = fit or fit_int4(weight)
        self._kernel = kernel  # a str: modules stay deep-copyable
        self._native = kernel == "dspark"
        if kernel != "torch":  # codes, scales and centres in one buffer (csrc/int4_mm.c, csrc/avx2_mm.c)
            self.packed, self.scale_zero = pack_for_kernel(codes, step, lo, quads=True if kernel == "avx2" else None), None
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
            # PyTorch's kernel decodes w = (q - 8) * scale + zero
            zero = lo + 8 * step
            self.scale_zero = torch.stack([step, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        self.bias = None if bias is None else bias.detach().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.dim() == 2  # the decoder's case: no reshaping (a step makes ~120 of these calls)
        rows = x if flat else x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        if self._kernel != "torch":
            y = (native.int4_mm(native.loaded(), rows.contiguous(), self.packed, self._rows) if self._native
                 else native_avx2.matmul(rows, self.packed, self._rows, 4))
            if self._rows != self.out_features:
                y = y[:, :self.out_features]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows.contiguous(), self.packed, GROUP, self.scale_zero)
        if self.bias is not None:
            y = y + self.bias
        return y if flat else y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of {GROUP}, "
                f"{self._kernel} kernel")


def quantize_linears_int4(module: nn.Module, skip: tuple[str, ...] = (), native_only: bool = False,
                          dtype: torch.dtype = torch.bfloat16) -> int:
    """Swap every `nn.Linear` under `module` (attribute names in `skip` excepted, and any whose shape
    the kernel cannot take) for an Int4Linear taking `dtype` rows. Returns the count. `native_only`: all or nothing, and
    only if every such weight already is 4-bit groups (else everything is put back and 0 returned;
    the first weight that is not stops the scan, so a bf16 checkpoint costs one fit)."""
    swapped: list[tuple[nn.Module, str, nn.Linear]] = []
    for child in list(module.modules()):
        for attr, sub in list(child.named_children()):
            if isinstance(sub, nn.Linear) and attr not in skip and _shape_ok(sub.weight):
                fit = fit_int4(sub.weight)
                if native_only and not _is_native(fit):
                    for parent, name, linear in swapped:
                        setattr(parent, name, linear)
                    return 0
                setattr(child, attr, Int4Linear(sub.weight, sub.bias, fit=fit, dtype=dtype))
                swapped.append((child, attr, sub))
    return len(swapped)
