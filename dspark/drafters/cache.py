"""Per-request drafter context cache: projected context K/V of every committed position."""
from __future__ import annotations

import torch


class DrafterCache:
    """Context keys (after k-norm and RoPE) and values of positions 0..length-1, every drafter layer in
    one tensor [capacity, layers, 2 (k, v), kv_heads, hd], so a feed writes one slice per request."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 64):
        self.kv = torch.empty(max(capacity, 1), num_layers, 2, kv_heads, head_dim, dtype=dtype, device=device)
        self.length = 0  # positions 0..length-1 are filled

    @property
    def capacity(self) -> int:
        """Positions storable before the next reallocation."""
        return self.kv.shape[0]

    def append(self, kv: torch.Tensor) -> None:
        """Append kv [n, layers, 2, kv_heads, hd] at positions length..length+n-1."""
        n = kv.shape[0]
        self._reserve(self.length + n)
        self.kv[self.length:self.length + n] = kv
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rolled-back or re-extended context)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a drafter cache of length {self.length} to {length}")
        self.length = length

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Filled keys and values of one layer, each [length, kv_heads, hd] (views)."""
        return self.kv[:self.length, index, 0], self.kv[:self.length, index, 1]

    def _reserve(self, need: int) -> None:
        if need <= self.capacity:
            return
        grown = self.kv.new_empty((max(need, 2 * self.capacity), *self.kv.shape[1:]))
        grown[:self.length] = self.kv[:self.length]
        self.kv = grown
