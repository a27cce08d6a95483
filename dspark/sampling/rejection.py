"""Lossless acceptance of one request's verify window (docs/method.md#losslessness).

The target has scored [x0, x1..x_l] (l + 1 rows). Acceptance keeps the longest surviving prefix of
the drafts x1..x_l and appends one target token: the correction at the first rejection, or the bonus
after the last accepted draft. Both rules reproduce the target's own distribution exactly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dspark.sampling.sampler import sample


@dataclass(frozen=True)
class Acceptance:
    """Outcome of one verify window: committed tokens (accepted drafts + one target token)."""

    tokens: list[int]  # len == num_accepted + 1; tokens[-1] is the correction / bonus (next anchor)
    num_accepted: int  # drafts kept, 0..l


def _check_window(draft_tokens: Sequence[int], rows: int, vocab: int, what: str) -> None:
    """Raise ValueError unless `what` has len(draft_tokens) + 1 rows and the drafts are in-vocab."""
    if rows != len(draft_tokens) + 1:
        raise ValueError(f"{what} has {rows} rows; expected len(draft_tokens) + 1 = {len(draft_tokens) + 1}")
    for tok in draft_tokens:
        if not 0 <= int(tok) < vocab:
            raise ValueError(f"draft token {tok} outside vocabulary of size {vocab}")


def accept_greedy(draft_tokens: Sequence[int], target_logits: torch.Tensor) -> Acceptance:
    """Temperature-0 acceptance: keep drafts while they equal the target argmax; append the argmax."""
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [l+1, V], got shape {tuple(target_logits.shape)}")
    _check_window(draft_tokens, target_logits.shape[0], target_logits.shape[1], "target_logits")
    best: list[int] = target_logits.argmax(dim=-1).tolist()  # [l+1]
    tokens: list[int] = []
    for k, tok in enumerate(draft_tokens):
        if int(tok) != best[k]:
            break
        tokens.append(int(tok))
    num_accepted = len(tokens)
    tokens.append(best[num_accepted])  # correction at the first mismatch, or bonus after the last draft
    return Acceptance(tokens=tokens, num_accepted=num_accepted)


def residual_probs(p_target: torch.Tensor, p_draft: torch.Tensor) -> torch.Tensor:
    """Distribution after a rejection: normalize(max(p_t - p_d, 0)) [V], falling back to p_t if all-zero."""
    resid = (p_target.double() - p_draft.double()).clamp_min_(0.0)  # [V]
    total = float(resid.sum())
    if total <= 0.0:  # p_t == p_d (up to rounding): a rejection is then (almost) impossible anyway
        return p_target.double() / p_target.double().sum()
    return resid / total


def accept_sampled(
    draft_tokens: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Acceptance:
    """Speculative sampling: accept x_k w.p. min(1, p_t/p_d); resample the residual or draw the bonus.

    draft_probs [l, V] are the distributions x1..x_l were actually sampled from (Markov-corrected,
    warped like the target); target_probs [l+1, V] are the target's warped distributions. With l = 0
    this is plain sampling from target_probs[0].
    """
    l = len(draft_tokens)
    if target_probs.dim() != 2 or draft_probs.dim() != 2:
        raise ValueError("draft_probs must be [l, V] and target_probs [l+1, V]")
    vocab = target_probs.shape[1]
    _check_window(draft_tokens, target_probs.shape[0], vocab, "target_probs")
    if draft_probs.shape[0] != l or (l > 0 and draft_probs.shape[1] != vocab):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}; expected ({l}, {vocab})"
        )
    tokens: list[int] = []
    if l > 0:
        rows = torch.arange(l, device=target_probs.device)  # [l]
        idx = torch.as_tensor([int(t) for t in draft_tokens], dtype=torch.long, device=target_probs.device)  # [l]
        p_t = target_probs[rows, idx].double().tolist()  # [l] target prob of each draft
        p_d = draft_probs[rows, idx].double().tolist()  # [l] draft prob of each draft
        dev = generator.device if generator is not None else target_probs.device
        u = torch.rand(l, generator=generator, device=dev, dtype=torch.float64).tolist()  # [l] in [0, 1)
        for k in range(l):
            # u < p_t / p_d without dividing: p_t = 0 never accepts, p_d = 0 < p_t always accepts.
            if u[k] * p_d[k] < p_t[k]:
                tokens.append(int(draft_tokens[k]))
                continue
            resid = residual_probs(target_probs[k], draft_probs[k])  # [V]
            tokens.append(int(sample(resid.unsqueeze(0), generator)[0]))
            return Acceptance(tokens=tokens, num_accepted=k)
    bonus = target_probs[l : l + 1].double()  # [1, V]
    tokens.append(int(sample(bonus, generator)[0]))
    return Acceptance(tokens=tokens, num_accepted=l)
