"""Logits -> probabilities -> tokens. The same processing serves plain and speculative decoding,
so target and draft distributions are warped identically (temperature, top-k, top-p)."""
from __future__ import annotations

import torch


def warp_probs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """Sampling distribution for rows of logits [N, V] -> probs [N, V] (fp32).

    temperature must be > 0 here (greedy never needs probabilities).
    """
    logits = logits.float() / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = (cum - sorted_p) >= top_p  # keep the smallest prefix whose mass reaches top_p
        drop[..., 0] = False  # ...never empty: a tiny top_p is 0 in float32, and then every token would drop
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of probs [N, V] -> [N] (int64)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
