"""Building blocks shared by the target decoder and the drafter: RMSNorm, RoPE, SwiGLU MLP."""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models import native, native_avx2


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 like the reference implementations.

    Outside autograd it runs as one `layer_norm` over [x, -x]: that row has mean 0 and variance
    mean(x^2), so its first half is x / sqrt(mean(x^2) + eps) times the weight, from the fused
    LayerNorm kernel (fp32 inside). On a CPU that is about 3x faster than `F.rms_norm`, whose bf16
    path is a chain of small ops, and a decode step makes 2 * layers + 1 of these calls. Rows stay
    independent, and the result equals the reference to fp32 rounding (tests/test_layers.py).
    Where dspark's kernels run (models/native.py), bf16 rows take one kernel call instead, which can also
    add the residual first (`add_forward`); where the AVX2 ones do (models/native_avx2.py), fp32 rows."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._padded: tuple[tuple, torch.Tensor] | None = None  # (weight version key, [w, 0] or fp32 w)
        self._kernels = native.library() is not None
        self._avx2 = native_avx2.library() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
            return F.rms_norm(x, (x.shape[-1],), w if w.dtype == x.dtype else w.to(x.dtype), self.eps)
        kernel = self._kernel(x)
        if kernel is not None:
            return kernel(x, self._cached_weight(None), self.eps)[1]
        d = x.shape[-1]
        return F.layer_norm(torch.cat([x, x.neg()], dim=-1), (2 * d,), self._cached_weight(x.dtype),
                            None, self.eps)[..., :d]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, norm(x + residual)): one kernel call where it fits (inference, bf16 on a CPU)."""
        grad = torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad or self.weight.requires_grad)
        kernel = None if grad or not residual.is_contiguous() or residual.dtype != x.dtype else self._kernel(x)
        if kernel is not None:
            return kernel(x, self._cached_weight(None), self.eps, residual)
        x = x + residual
        return x, self.forward(x)

    def _kernel(self, x: torch.Tensor):
        """The kernel call that takes these rows here (bf16: native.rms_norm, fp32: native_avx2.rms_norm), or None."""
        if x.dim() != 2 or x.device.type != "cpu" or not x.is_contiguous() or x.shape[-1] % 16:
            return None
        if self._kernels and x.dtype == torch.bfloat16:
            return partial(native.rms_norm, native.loaded())
        if self._avx2 and x.dtype == torch.float32:
            return native_avx2.rms_norm
        return None

    def _cached_weight(self, dtype: torch.dtype | None) -> torch.Tensor:
        """[w, 0] in `dtype` for the layer_norm route, or w in fp32 for the kernel (dtype None), rebuilt
        whenever the weight changes (optimizer steps, loads bump _version)."""
        w = self.weight
        version = None if w.is_inference() else w._version  # inference tensors cannot change in place
        key = (w.data_ptr(), version, w.dtype, w.device, dtype)
        if self._padded is None or self._padded[0] != key:
            value = (w.detach().float().contiguous() if dtype is None
                     else torch.cat([w.detach(), torch.zeros_like(w.detach())]).to(dtype))
            self._padded = (key, value)
        return self._padded[1]


class SwiGLU(nn.Module):
    """gate/up projections fused into one matmul, SiLU-gated, then down."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)
        self._kernels = native.library() is not None or native_avx2.library() is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down.forward(silu_gate(self.gate_up.forward(x), self._kernels))


def silu_gate(gu: torch.Tensor, kernels: bool) -> torch.Tensor:
    """silu(gate) * up of gu [..., 2n] (gate first): one kernel call for rows [N, 2n] outside autograd where
    dspark's kernels run (`kernels`, decided by the caller at construction; bf16 rows on the AVX-512 library,
    fp32 ones on the AVX2 library), else two PyTorch ops."""
    n = gu.shape[-1] // 2
    if (kernels and not gu.requires_grad and gu.dim() == 2 and gu.device.type == "cpu" and gu.is_contiguous()
            and n % 16 == 0):
        if gu.dtype == torch.bfloat16 and native.loaded() is not None:
            return native.silu_mul(native.loaded(), gu)
        if gu.dtype == torch.float32 and native_avx2.loaded() is not None:
            return native_avx2.silu_mul(gu)
    gate, up = gu.split(n, dim=-1)
    return F.silu(gate) * up


class Rotary(nn.Module):
    """Rotary position embedding: a cos/sin table indexed by absolute position.

    `inv_freq` and `scale` come from the model's rope settings (see models/config.py), so
    every HF scaling type transformers knows is honoured.
    """

    def __init__(self, inv_freq: torch.Tensor, scale: float = 1.0, max_positions: int = 4096):
        super().__init__()
        self.inv_freq = inv_freq.float()  # a plain attribute: module.to(bf16) must not round it
        self.scale = scale
        self._build(max_positions)

    def _build(self, n: int) -> None:
        t = torch.arange(n, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # [n, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, hd]
        self._cos = emb.cos() * self.scale
        sin = emb.sin() * self.scale
        self._sin = torch.cat([-sin[:, : sin.shape[1] // 2], sin[:, sin.shape[1] // 2:]], dim=-1)  # signed
        self._typed: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp32 cos and signed sin tables [n, hd], n covering every one of `positions`."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            self._build(max(need, 2 * self._cos.shape[0]))
        return self._cos, self._sin

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (first half negated) for `positions` [T] -> each [T, 1, hd], ready to
        broadcast over heads; apply_rotary takes them as they are."""
        self.tables(positions)
        if self._cos.device != positions.device:
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
            self._typed = {}
        if dtype not in self._typed:  # the tables in the model's dtype, cast once
            self._typed[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        cos, sin = self._typed[dtype]
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, hd]; cos and signed sin from Rotary.cos_sin: [T, 1, hd].
    roll swaps the halves in one op (the sign lives in the table)."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin)
