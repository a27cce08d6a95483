"""Reduced draft vocabulary: the top-N target tokens by frequency in the generated responses."""
from __future__ import annotations

import time
from typing import Iterable

import torch


def token_counts(seqs: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int) -> torch.Tensor:
    """Counts [V] of the loss (assistant) tokens over (ids, loss_mask) pairs."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, mask in seqs:
        counts += torch.bincount(ids[mask.bool()], minlength=vocab_size)[:vocab_size]
    return counts


def build_d2t(counts: torch.Tensor, size: int, always: Iterable[int] = ()) -> torch.Tensor:
    """Draft->target id map [size]: forced ids first, then the most frequent (ties by id), sorted ascending."""
    forced = sorted({int(i) for i in always})
    score = counts.double().clone()
    score[forced] = float("inf")
    order = torch.argsort(-score, stable=True)[:size]  # stable: ties keep the lower id
    return order.sort().values


def coverage(counts: torch.Tensor, d2t: torch.Tensor) -> float:
    """Fraction of counted tokens that the draft vocabulary contains."""
    total = int(counts.sum())
    return float(counts[d2t].sum()) / total if total else 1.0


@torch.no_grad()
def time_lm_head(hidden: int, vocab_sizes: Iterable[int], rows: int = 7, repeats: int = 50) -> dict[int, float]:
    """Mean milliseconds of one drafting LM-head product [rows, d] @ [d, V] for each vocabulary size."""
    out = {}
    x = torch.randn(rows, hidden)
    for v in vocab_sizes:
        w = torch.randn(v, hidden)
        for _ in range(3):
            (x @ w.T).argmax(-1)
        t0 = time.perf_counter()
        for _ in range(repeats):
            (x @ w.T).argmax(-1)
        out[int(v)] = round((time.perf_counter() - t0) / repeats * 1000, 3)
    return out
