"""Seeded sampling that speculation cannot change: counter-based randomness per (seed, output position).

A seeded request's token at output position j is the exponential race argmax_i p_i / E_i, where the
E_i ~ Exp(1) are drawn from a generator keyed by (seed, j) alone -- an exact sample of p (the
Gumbel-max trick). Verification then accepts a draft only when it equals that token and otherwise
commits that token, so the text is a function of the target's distributions and the seed: the same
alone or in any batch, with any drafter, planner or window, and the same as plain decoding.

Drafts are chosen from their own distribution q with the same noise (coupled), so a draft matches the
target's token whenever both races pick the same winner, which is likely when q is close to p."""
from __future__ import annotations

import hashlib
from typing import Sequence

import torch

from dspark.sampling.rejection import Acceptance


def position_noise(seed: int, positions: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise [len(positions), vocab] (fp32): row r depends on (seed, positions[r]) only.
    Drawn on the CPU, so it is the same whatever device the model runs on."""
    rows = []
    for pos in positions:
        key = int.from_bytes(hashlib.blake2b(f"{seed}/{pos}".encode(), digest_size=8).digest(), "little")
        g = torch.Generator().manual_seed(key)
        rows.append(torch.empty(vocab).exponential_(generator=g))
    return torch.stack(rows).to(device)


def race(probs: torch.Tensor, noise: torch.Tensor) -> list[int]:
    """The exponential race per row: argmax p / E, an exact sample of each row of probs [N, V]."""
    return (probs.float() / noise).argmax(-1).tolist()


def sample_keyed(probs: torch.Tensor, seed: int, position: int) -> list[int]:
    """Tokens for rows of probs [N, V] at consecutive output positions position, position + 1, ..."""
    return race(probs, position_noise(seed, range(position, position + probs.shape[0]), probs.shape[1],
                                      probs.device))


def accept_keyed(draft_tokens: Sequence[int], target_probs: torch.Tensor, seed: int, position: int) -> Acceptance:
    """Keep drafts while each equals the target's keyed token; then append the target's token.

    target_probs [l+1, V] are the target's warped distributions for output positions position ..
    position + l. The committed tokens are the target's keyed samples whatever the drafts were."""
    l = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != l + 1:
        raise ValueError(f"target_probs must be [{l + 1}, V], got {tuple(target_probs.shape)}")
    want = sample_keyed(target_probs, seed, position)
    tokens: list[int] = []
    for k, tok in enumerate(draft_tokens):
        if int(tok) != want[k]:
            break
        tokens.append(int(tok))
    num_accepted = len(tokens)
    tokens.append(want[num_accepted])  # the target's own token at the first mismatch, or the bonus
    return Acceptance(tokens=tokens, num_accepted=num_accepted)


def couple_drafts(draft_probs: torch.Tensor, seed: int, position: int) -> list[int]:
    """Drafts [l] re-chosen from their distributions q [l, V] with the target's noise for the same
    positions, so each matches the target's keyed token whenever the two races agree."""
    return sample_keyed(draft_probs, seed, position)
