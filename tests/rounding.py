"""What the kernels' 8-bit activation route does to a row before its 4-bit matmuls (csrc/int4_mm.c):
each group of 32 values becomes e * u, e = max|x| / 127, u = round(x / e) in -127..127."""
from __future__ import annotations

import torch

GROUP = 32


def rows_rounded_to_8bit(x: torch.Tensor) -> torch.Tensor:
    """x [rows, k] (k a multiple of 32) -> fp32 rows as the 8-bit route sees them."""
    g = x.float().view(x.shape[0], -1, GROUP)
    mx = g.abs().amax(-1, keepdim=True)
    u = torch.round(g * torch.where(mx > 0, 127 / mx, 0))
    return (u * (mx / 127)).view(x.shape[0], -1)
