"""Seeded sampling that speculation cannot change: counter-based randomness per (seed, output position).

A seeded request's token at output position j is the exponential race argmax_i p_i / E_i, where
E_i ~ Exp(1) is a function of (seed, j, i) alone (a keyed hash of the token id, `token_noise`) -- an exact
sample of p (the Gumbel-max trick). Verification then accepts a draft only when it equals that token and
otherwise commits that token, so the text is a function of the target's distributions and the seed: the
same alone or in any batch, with any drafter, planner or window, and the same as plain decoding.

Because each token's noise depends on its own id, a race can run over a row's candidates alone (the
top-k, `sampler.warp_top_k`): tokens outside them have probability 0 and never win, so the result is the
one the whole vocabulary would give, without drawing noise for 49k entries a token.

Drafts are chosen from their own distribution q with the same noise (coupled), so a draft matches the
target's token whenever both races pick the same winner, which is likely when q is close to p."""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import torch

from dspark.sampling.rejection import Acceptance

_MIX1, _MIX2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)


def _fmix32(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's finaliser: a bijection of uint32 whose output bits each depend on every input bit."""
    h = h ^ (h >> np.uint32(16))
    h = h * _MIX1
    h = h ^ (h >> np.uint32(13))
    h = h * _MIX2
    return h ^ (h >> np.uint32(16))


def _position_keys(seed: int, positions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Two 32-bit keys per output position, [N, 1] each, from a hash of (seed, position)."""
    digests = [hashlib.blake2b(f"{seed}/{pos}".encode(), digest_size=8).digest() for pos in positions]
    keys = np.frombuffer(b"".join(digests), dtype="<u4").reshape(len(digests), 2)
    return keys[:, :1], keys[:, 1:]


def token_noise(seed: int, positions: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise (fp32) for token ids [m] (the same ids at every position) or [N, m] (row r's ids at
    positions[r]) -> [N, m]: entry (r, c) depends on (seed, positions[r], ids[r, c]) only. Computed on the
    CPU (the result goes to ids' device), so it is the same whatever device the model runs on."""
    k1, k2 = _position_keys(seed, positions)
    x = ids.detach().to("cpu", torch.int64).numpy().astype(np.uint32)
    with np.errstate(over="ignore"):
        h = _fmix32(_fmix32(x ^ k1) + k2)
    u = ((h >> np.uint32(8)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)  # in (0, 1)
    return torch.from_numpy(-np.log(u)).to(ids.device)


def position_noise(seed: int, positions: Sequence[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exp(1) noise [len(positions), vocab] (fp32) for every token id: token_noise over the vocabulary."""
    return token_noise(seed, positions, torch.arange(vocab)).to(device)


def race(probs: torch.Tensor, noise: torch.Tensor, ids: torch.Tensor | None = None) -> list[int]:
    """The exponential race per row: argmax p / E, an exact sample of each row of probs [N, m]; the
    winning column's token id (ids [N, m], or the column itself where ids is None)."""
    col = (probs.float() / noise).argmax(-1)
    return (col if ids is None else ids.gather(-1, col.unsqueeze(-1)).squeeze(-1)).tolist()


def sample_keyed(probs: torch.Tensor, seed: int, position: int, ids: torch.Tensor | None = None) -> list[int]:
    """Tokens for rows of probs [N, m] at consecutive output positions position, position + 1, ...;
    probs over the token ids ids [N, m] (a row's candidates), or over the whole vocabulary (ids None)."""
    positions = range(position, position + probs.shape[0])
    cols = torch.arange(probs.shape[1], device=probs.device) if ids is None else ids
    return race(probs, token_noise(seed, positions, cols), ids)


def accept_keyed(draft_tokens: Sequence[int], target_probs: torch.Tensor, seed: int, position: int,
                 ids: torch.Tensor | None = None) -> Acceptance:
    """Keep drafts while each equals the target's keyed token; then append the target's token.

    target_probs [l+1, m] are the target's warped distributions for output positions position ..
    position + l, over the token ids ids [l+1, m] (None: the whole vocabulary). The committed tokens are
    the target's keyed samples whatever the drafts were."""
    l = len(draft_tokens)
    if target_probs.dim() != 2 or target_probs.shape[0] != l + 1:
        raise ValueError(f"target_probs must be [{l + 1}, V], got {tuple(target_probs.shape)}")
    want = sample_keyed(target_probs, seed, position, ids)
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
    positions, so each matches the target's keyed token whenever the two races agree. The race runs among
    the rows' nonzero entries alone (a top-k warped q has a few dozen), which picks what the whole row would."""
    support = int((draft_probs > 0).sum(-1).max()) if draft_probs.numel() else 0
    if 0 < support < draft_probs.shape[-1]:
        probs, ids = draft_probs.topk(support, dim=-1)
        return sample_keyed(probs, seed, position, ids)
    return sample_keyed(draft_probs, seed, position)
