"""Building blocks shared by the target decoder and the drafter: RMSNorm, RoPE, SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, computed in fp32 like the reference implementations."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel (fp32 inside); equal to the reference in fp32, within an ulp in bf16
        w = self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)


class SwiGLU(nn.Module):
    """gate/up projections fused into one matmul, SiLU-gated, then down."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.intermediate, dim=-1)
        return self.down(F.silu(gate) * up)


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

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (first half negated) for `positions` [T] -> each [T, 1, hd], ready to
        broadcast over heads; apply_rotary takes them as they are."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self._cos.shape[0]:
            self._build(max(need, 2 * self._cos.shape[0]))
        if self._cos.device != positions.device:
            self._cos, self._sin = self._cos.to(positions.device), self._sin.to(positions.device)
            self._typed = {}
        if dtype not in self._typed:  # the tables in the model's dtype, cast once
            self._typed[dtype] = (self._cos.to(dtype), self._sin.to(dtype))
        cos, sin = self._typed[dtype]
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [T, heads, hd]; cos and signed sin from Rotary.cos_sin: [T, 1, hd]."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return torch.addcmul(x * cos, swapped, sin)
