"""BlockDrafterProposer: the DSpark / DFlash drafter behind the proposer contract. Its context K/V
is fed from the target's hidden states of committed positions only (prefill and accepted verify rows)."""
from __future__ import annotations

from typing import Sequence as Seq

import torch

from dspark.drafters import DSparkDrafter
from dspark.engine.sequence import Sequence
from dspark.spec.proposer import Proposal


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

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence]) -> Proposal:
        if not seqs:
            return Proposal(tokens=[], probs=[], confidences=[])
        out = self.drafter.draft(
            [self._caches[s.request_id] for s in seqs],
            [s.last_token for s in seqs],
            [s.num_tokens - 1 for s in seqs],
            temperature=[s.params.temperature for s in seqs],
            top_k=[s.params.top_k for s in seqs],
            top_p=[s.params.top_p for s in seqs],
            generators=[s.generator for s in seqs],
        )
        n = self.max_drafts
        tokens = out.tokens[:, :n].tolist()
        probs = [None] * len(seqs) if out.probs is None else list(out.probs[:, :n].float())
        conf = None
        if out.conf_logits is not None:
            z = out.conf_logits.float().cpu()
            conf = torch.sigmoid(z / self.sts if self.sts is not None else z)[:, :n].tolist()
        return Proposal(tokens=tokens, probs=probs, confidences=conf)

    @torch.inference_mode()
    def observe(self, seq: Sequence, hidden: torch.Tensor | None, start: int) -> None:
        cache = self._caches.get(seq.request_id)
        if cache is None:
            cache = self._caches[seq.request_id] = self.drafter.new_cache()
        if hidden is not None and hidden.shape[0]:
            self.drafter.extend(cache, hidden.to(self.drafter.fc.weight.dtype), start)

    def release(self, seq: Sequence) -> None:
        self._caches.pop(seq.request_id, None)
