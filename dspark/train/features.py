"""Target features and soft labels for training, computed online by the dense target pass.

Nothing is cached on disk: at ~6 KB a token, features for millions of tokens would not fit, while the
dense bf16 pass recomputes them at over a thousand tokens a second on a CPU with AMX. Where the data
is small enough to be seen for several epochs, or the CPU is slow (an AVX2-only CPU runs the fp32 pass
at ~250 tokens a second, three times the drafter's own step), FeatureCache keeps each sequence's pass
in memory so that later epochs and validations skip it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from dspark.models import native


@dataclass
class TargetBatch:
    """One padded micro-batch with everything the losses need from the target."""

    ids: torch.Tensor  # int64 [B, S] data tokens (right-padded with 0)
    loss_mask: torch.Tensor  # bool [B, S], True on assistant tokens
    hidden: torch.Tensor  # [B, S, m*d] outputs of the chosen target layers (bf16 on a CPU)
    final: torch.Tensor  # [B, S, d] the target's final-normed hidden state (its LM head gives p_t)
    labels: tuple | None = None  # (rows, d2t, p_t, greedy) of the last labels_at(): a twin reuses them

    def labels_at(self, target, rows: torch.Tensor, d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """soft_labels() of flat positions `rows` (into [B * S]) on draft vocabulary d2t, kept for the next
        call with the same rows and vocabulary: drafters trained on the same batches (--twin) share one
        computation (~0.7 s of a 2-core step)."""
        if self.labels is not None:
            had, had_d2t, pt, greedy = self.labels
            if torch.equal(had, rows) and (had_d2t is d2t or (had_d2t is not None and d2t is not None
                                                              and torch.equal(had_d2t, d2t))):
                return pt, greedy
        pt, greedy = soft_labels(target, self.final.flatten(0, 1).index_select(0, rows), d2t)
        self.labels = (rows, d2t, pt, greedy)
        return pt, greedy


class FeatureCache:
    """Each sequence's target pass (chosen layers' outputs and final hidden state, [L, ...] in the pass's
    dtype) kept in memory by sequence key, up to a byte budget; sequences past it are recomputed."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.items: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, key: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.items.get(key)

    def put(self, key: int, hidden: torch.Tensor, final: torch.Tensor) -> None:
        size = hidden.numel() * hidden.element_size() + final.numel() * final.element_size()
        if key not in self.items and self.bytes + size <= self.max_bytes:
            self.items[key] = (hidden.clone(), final.clone())  # clone: a slice would pin the whole batch
            self.bytes += size


@torch.no_grad()
def target_batch(target, seqs: Sequence[tuple[torch.Tensor, torch.Tensor]], layers: Sequence[int],
                 cache: FeatureCache | None = None, keys: Sequence[int] | None = None) -> TargetBatch:
    """Teacher-forced target pass over (ids [L], loss_mask [L]) pairs, right-padded into one batch. The
    pass runs on the sequences packed end to end without padding (DenseTarget.forward_packed); with a
    cache (and one key per sequence), a batch whose sequences are all cached skips it. Positions past a
    sequence's length are zeros (nothing reads them: the drafter attends only to context before its
    anchors)."""
    s = max(len(ids) for ids, _ in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.bool)
    for i, (x, m) in enumerate(seqs):
        ids[i, :len(x)], mask[i, :len(x)] = x, m
    ids, mask = ids.to(target.device), mask.to(target.device)
    found = [cache.get(k) for k in keys] if cache is not None and keys is not None else [None]
    if all(f is not None for f in found):
        return TargetBatch(ids, mask, _padded([h for h, _ in found], s), _padded([f for _, f in found], s))
    lengths = [len(x) for x, _ in seqs]
    rows_h, rows_f = target.forward_packed([x for x, _ in seqs], hidden_layers=tuple(layers))  # no padding
    per_h, per_f = rows_h.split(lengths), rows_f.split(lengths)
    if cache is not None and keys is not None:
        for h, f, k in zip(per_h, per_f, keys):
            cache.put(k, h, f)
    return TargetBatch(ids, mask, _padded(per_h, s), _padded(per_f, s))


def _padded(rows: Sequence[torch.Tensor], s: int) -> torch.Tensor:
    """Per-sequence rows [L_i, D] -> [B, s, D], zeros past each sequence's length."""
    out = rows[0].new_zeros(len(rows), s, rows[0].shape[-1])
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


@torch.no_grad()
def soft_labels(target, final: torch.Tensor, d2t: torch.Tensor | None,
                chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's next-token distribution at rows final [N, d] -> (p_t on the draft vocabulary
    [N, Vd] fp32, exact: normalised over the FULL vocabulary, so 1 - its sum is the mass outside the
    draft vocabulary; the target's greedy token [N], a target id)."""
    probs, greedy = [], []
    for rows in final.split(chunk):
        logits = target.logits(rows)  # [n, V]: the served LM head's values (its dtype)
        if (logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.is_contiguous()
                and native.library() is not None):  # one pass a row on dspark's kernel (vocab_loss.c)
            p, g = native.soft_labels(native.loaded(), logits, None if d2t is None else d2t.contiguous())
            probs.append(p)
            greedy.append(g)
            continue
        logits = logits.float()
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        inside = logits if d2t is None else logits.index_select(-1, d2t)
        probs.append(inside.sub_(lse).exp_())
        greedy.append(logits.argmax(-1))
    return torch.cat(probs), torch.cat(greedy)
