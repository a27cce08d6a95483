"""BlockDrafterProposer: the DSpark / DFlash drafter behind the proposer contract. Its context K/V
is fed from the target's hidden states of committed positions only (prefill and accepted verify rows).

Feeding is lazy: committed hidden states wait (copied, per request) until the request next drafts, and
then go through the drafter's context projections in one call. Under load the planner often declines
to draft, and a prompt's worth of context would otherwise be projected for nothing."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence as Seq

import torch

from dspark.drafters import DSparkDrafter
from dspark.speculative.proposer import Proposal

if TYPE_CHECKING:  # type hints only: speculative/ never imports engine/ at run time
    from dspark.engine.sequence import Sequence


class BlockDrafterProposer:
    """Drafts gamma tokens per request in one batched drafter pass; confidences are STS-calibrated."""

    def __init__(self, drafter: DSparkDrafter, sts_temperatures: Seq[float] | None = None,
                 max_drafts: int | None = None):
        self.drafter = drafter
        self.max_drafts = min(max_drafts or drafter.config.block_size, drafter.config.block_size)
        self.hidden_layers = tuple(drafter.config.target_layer_ids)
        temps = list(sts_temperatures or drafter.sts_temperatures or [])
        if temps and len(temps) < self.max_drafts:
            temps += [temps[-1]] * (self.max_drafts - len(temps))
        self.sts = torch.tensor(temps[: self.max_drafts]) if temps else None  # [gamma]
        self._caches: dict[str, object] = {}
        self._pending: dict[str, list[tuple[int, torch.Tensor]]] = {}  # request -> (start, hidden) not yet fed

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], num_drafts: int | None = None) -> Proposal:
        if not seqs:
            return Proposal(tokens=[], probs=[], confidences=[])
        self._feed([s.request_id for s in seqs])
        out = self.drafter.draft(
            [self._caches[s.request_id] for s in seqs],
            [s.last_token for s in seqs],
            [s.num_tokens - 1 for s in seqs],
            temperature=[s.params.temperature for s in seqs],
            top_k=[s.params.top_k for s in seqs],
            top_p=[s.params.top_p for s in seqs],
            generators=[s.generator for s in seqs],
            num_drafts=min(self.max_drafts, num_drafts or self.max_drafts),
            return_logits=False,
        )
        tokens = out.tokens.tolist()
        probs = [None] * len(seqs) if out.probs is None else list(out.probs.float())
        conf = None if out.conf_logits is None else self.confidences(out.conf_logits)
        return Proposal(tokens=tokens, probs=probs, confidences=conf)

    def confidences(self, conf_logits: torch.Tensor) -> list[list[float]]:
        """The drafter's confidence logits [n, k] as STS-calibrated conditional survival c_1..c_k per row."""
        z = conf_logits.float().cpu()
        return torch.sigmoid(z / self.sts[: z.shape[1]] if self.sts is not None else z).tolist()

    @torch.inference_mode()
    def observe(self, seq: Sequence, hidden: torch.Tensor | None, start: int) -> None:
        rid = seq.request_id
        if rid not in self._caches:
            self._caches[rid] = self.drafter.new_cache()
        if hidden is None or not hidden.shape[0]:
            return
        pending = self._pending.get(rid, [])
        if pending and start > pending[-1][0] + pending[-1][1].shape[0]:
            raise ValueError(f"request {rid!r}: hidden states from position {start} leave a gap")
        # a re-observed tail (positions from `start` on) replaces what was waiting there
        pending = [(s, h[: start - s]) for s, h in pending if s < start]
        pending.append((start, hidden.to(self.drafter.fc.weight.dtype, copy=True)))
        self._pending[rid] = pending

    @torch.inference_mode()
    def _feed(self, rids: list[str]) -> None:
        """Project the requests' waiting hidden states into their drafter caches (one packed extend)."""
        caches, hidden, starts = [], [], []
        for rid in rids:
            pending = self._pending.pop(rid, None)
            if pending:
                caches.append(self._caches[rid])
                hidden.append(torch.cat([h for _, h in pending]))
                starts.append(pending[0][0])
        if caches:
            self.drafter.extend_many(caches, hidden, starts)

    def release(self, seq: Sequence) -> None:
        self._caches.pop(seq.request_id, None)
        self._pending.pop(seq.request_id, None)
