"""Per-request drafter context cache: projected context K/V of every committed position."""
from __future__ import annotations

import torch


class DrafterCache:
    """Context keys (after k-norm and RoPE) and values of positions 0..length-1, every drafter layer in
    one tensor [layers, 2 (k, v), kv_heads, capacity, hd]: a head's positions are rows of one matrix,
    so a drafting round multiplies by them where they lie (drafters/runner.py), and a feed of n
    positions is one strided write."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 64):
        self.kv = torch.empty(num_layers, 2, kv_heads, max(capacity, 1), head_dim, dtype=dtype, device=device)
        self.length = 0  # positions 0..length-1 are filled

    @property
    def capacity(self) -> int:
        """Positions storable before the next reallocation."""
        return self.kv.shape[3]

    def append(self, kv: torch.Tensor) -> None:
        """Append kv [n, layers, 2, kv_heads, hd] at positions length..length+n-1."""
        n = kv.shape[0]
        self.reserve(self.length + n)
        self.kv[:, :, :, self.length:self.length + n] = kv.permute(1, 2, 3, 0, 4)
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rolled-back or re-extended context)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a drafter cache of length {self.length} to {length}")
        self.length = length

    def filled(self) -> torch.Tensor:
        """The filled positions of every layer: [layers, 2, kv_heads, length, hd] (a view)."""
        return self.kv[:, :, :, :self.length]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Filled keys and values of one layer, each [length, kv_heads, hd] (views)."""
        k, v = self.kv[index, :, :, :self.length].transpose(1, 2)
        return k, v

    def reserve(self, need: int) -> None:
        """Room for `need` positions (a drafting round also writes its block's keys and values after the context)."""
        if need <= self.capacity:
            return
        grown = self.kv.new_empty((*self.kv.shape[:3], max(need, 2 * self.capacity), self.kv.shape[4]))
        grown[:, :, :, :self.length] = self.filled()
        self.kv = grown
