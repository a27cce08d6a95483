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


@torch.no_grad()
def time_draft(drafter, context: int = 200, repeats: int = 10) -> dict[str, float]:
    """Mean ms of one greedy draft() block (R=1, `context` cached positions) with this drafter's
    vocabulary and with an otherwise identical full-vocabulary twin."""
    import dataclasses

    from dspark.drafters import DSparkDrafter

    cfg = drafter.config
    full_cfg = dataclasses.replace(cfg, draft_vocab_size=None)
    twin = DSparkDrafter(full_cfg, drafter.embed_weight, drafter.embed_weight if drafter.d2t is None else
                         _full_head(drafter), dtype=drafter.fc.weight.dtype)
    out = {}
    feats = torch.randn(context, cfg.num_context_layers * cfg.hidden_size, dtype=drafter.fc.weight.dtype)
    for name, model in (("full_vocab_ms", twin), ("draft_vocab_ms", drafter)):
        model.eval()
        cache = model.new_cache(context + 16)
        model.extend(cache, feats, 0)
        for _ in range(2):
            model.draft([cache], [17], [context])
        t0 = time.perf_counter()
        for _ in range(repeats):
            model.draft([cache], [17], [context])
        out[name] = round((time.perf_counter() - t0) / repeats * 1000, 2)
    out["vocab"] = [cfg.vocab_size, cfg.draft_vocab]
    return out


def _full_head(drafter) -> torch.Tensor:
    """A [V, d] head for the full-vocabulary twin (timing only: the values do not matter)."""
    return torch.zeros(drafter.config.vocab_size, drafter.config.hidden_size, dtype=drafter.lm_head.dtype)
