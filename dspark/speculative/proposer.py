"""The proposer contract: every method (plain, n-gram, DFlash, DSpark) drafts through it, so the
engine runs one loop for all of them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence as Seq

import torch

if TYPE_CHECKING:  # type hints only: speculative/ never imports engine/ at run time
    from dspark.engine.sequence import Sequence


@dataclass(frozen=True)
class Proposal:
    """Drafts for the decoding requests of one step, in request order."""

    tokens: list[list[int]]  # per request, up to gamma draft tokens
    probs: list[torch.Tensor | None]  # per request [n, V] draft distribution sampled from (None: greedy/point mass)
    confidences: list[list[float]] | None  # per request, c_k (conditional survival), if the drafter has a head


class Proposer(Protocol):
    """Drafts tokens for decoding requests and observes what the target committed."""

    max_drafts: int  # gamma: the widest proposal
    hidden_layers: tuple[int, ...]  # target layers whose outputs it needs (empty for none / n-gram)

    def propose(self, seqs: Seq[Sequence], num_drafts: int | None = None) -> Proposal:
        """Up to num_drafts (default max_drafts) drafts per request."""

    def observe(self, seq: Sequence, hidden: torch.Tensor | None, start: int) -> None:
        """Target hidden states [n, m*d] of newly committed positions start..start+n-1."""

    def release(self, seq: Sequence) -> None:
        """Forget a finished or preempted request."""


class NoProposer:
    """Plain autoregressive decoding: zero drafts."""

    max_drafts = 0
    hidden_layers: tuple[int, ...] = ()

    def propose(self, seqs: Seq[Sequence], num_drafts: int | None = None) -> Proposal:
        return Proposal(tokens=[[] for _ in seqs], probs=[None] * len(seqs), confidences=None)

    def observe(self, seq: Sequence, hidden: torch.Tensor | None, start: int) -> None:
        pass

    def release(self, seq: Sequence) -> None:
        pass
