"""Per-request drafter context cache: projected context K/V of every committed position."""
from __future__ import annotations

import torch


class DrafterCache:
    """Per drafter layer, the context keys (after k-norm and RoPE) and values of positions 0..length-1."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, capacity: int = 64):
        shape = (max(capacity, 1), kv_heads, head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0  # positions 0..length-1 are filled

    @property
    def capacity(self) -> int:
        """Positions storable before the next reallocation."""
        return self.keys[0].shape[0]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append one (k, v) pair [n, kv_heads, hd] per layer at positions length..length+n-1."""
        n = kv[0][0].shape[0]
        self._reserve(self.length + n)
        for layer, (k, v) in enumerate(kv):
            self.keys[layer][self.length:self.length + n] = k
            self.values[layer][self.length:self.length + n] = v
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget positions >= length (rolled-back or re-extended context)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a drafter cache of length {self.length} to {length}")
        self.length = length

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Filled keys and values of one layer, each [length, kv_heads, hd] (views)."""
        return self.keys[index][:self.length], self.values[index][:self.length]

    def _reserve(self, need: int) -> None:
        if need <= self.capacity:
            return
        new_cap = max(need, 2 * self.capacity)
        for store in (self.keys, self.values):
            for i, old in enumerate(store):
                grown = old.new_empty((new_cap, *old.shape[1:]))
                grown[:self.length] = old[:self.length]
                store[i] = grown
