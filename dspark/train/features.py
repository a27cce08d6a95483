"""Target features and soft labels for training, computed online by the dense target pass.

Nothing is cached on disk: at ~6 KB a token, features for millions of tokens would not fit, while the
dense bf16 pass recomputes them at over a thousand tokens a second on two cores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class TargetBatch:
    """One padded micro-batch with everything the losses need from the target."""

    ids: torch.Tensor  # int64 [B, S] data tokens (right-padded with 0)
    loss_mask: torch.Tensor  # bool [B, S], True on assistant tokens
    hidden: torch.Tensor  # [B, S, m*d] outputs of the chosen target layers (bf16 on a CPU)
    final: torch.Tensor  # [B, S, d] the target's final-normed hidden state (its LM head gives p_t)


@torch.no_grad()
def target_batch(target, seqs: Sequence[tuple[torch.Tensor, torch.Tensor]], layers: Sequence[int]) -> TargetBatch:
    """Teacher-forced dense pass over (ids [L], loss_mask [L]) pairs, right-padded into one batch."""
    s = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.bool)
    for i, (x, m) in enumerate(seqs):
        ids[i, :len(x)], mask[i, :len(x)] = x, m
    ids, mask = ids.to(target.device), mask.to(target.device)
    hidden, final = target.forward(ids, hidden_layers=tuple(layers))
    return TargetBatch(ids, mask, hidden, final)


@torch.no_grad()
def soft_labels(target, final: torch.Tensor, d2t: torch.Tensor | None,
                chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution at rows final [N, d] -> (p_t on the draft vocabulary
    [N, Vd] fp32, exact: normalised over the FULL vocabulary, so 1 - its sum is the mass outside the
    draft vocabulary; the target's greedy token [N], a target id)."""
    probs, greedy = [], []
    for rows in final.split(chunk):
        logits = target.logits(rows).float()  # [n, V]: the served LM head's values (its dtype), in fp32
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        inside = logits if d2t is None else logits.index_select(-1, d2t)
        probs.append(inside.sub_(lse).exp_())
        greedy.append(logits.argmax(-1))
    return torch.cat(probs), torch.cat(greedy)
