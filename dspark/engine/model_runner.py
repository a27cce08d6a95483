"""ModelRunner: packs a step's token windows into one ragged target forward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from dspark.cache import KVCache
from dspark.models.decoder import Decoder


@dataclass(frozen=True)
class Window:
    """Tokens one request appends this step, and whether it needs logits for all of them or the last."""

    request_id: str
    tokens: list[int]
    start: int  # position of tokens[0]
    logits: str  # "all" | "last" | "none"


@dataclass(frozen=True)
class StepResult:
    """Per-window logits ([n_i, V] or None) and tapped hidden states ([len_i, m*d] or None)."""

    logits: list[torch.Tensor | None]
    hidden: list[torch.Tensor | None]


class ModelRunner:
    """Runs the target decoder over packed windows."""

    def __init__(self, model: Decoder, cache: KVCache, hidden_layers: Seq[int] = ()):
        self.model = model
        self.cache = cache
        self.hidden_layers = tuple(hidden_layers)

    @torch.inference_mode()
    def run(self, windows: list[Window]) -> StepResult:
        """One forward over all windows (room already reserved in the cache)."""
        ids, pos, rows, spans = [], [], [], []
        offset = 0
        for w in windows:
            n = len(w.tokens)
            ids.extend(w.tokens)
            pos.extend(range(w.start, w.start + n))
            first = len(rows)
            if w.logits == "all":
                rows.extend(range(offset, offset + n))
            elif w.logits == "last":
                rows.append(offset + n - 1)
            spans.append((offset, n, first, len(rows) - first))
            offset += n
        device = self.model.device
        meta = self.cache.prepare([w.request_id for w in windows], [len(w.tokens) for w in windows])
        out = self.model(
            torch.tensor(ids, device=device),
            torch.tensor(pos, device=device),
            self.cache,
            meta,
            logits_rows=torch.tensor(rows, device=device) if rows else None,
            hidden_layers=self.hidden_layers,
        )
        logits = [out.logits[r0 : r0 + nr] if nr else None for _, _, r0, nr in spans]
        hidden = [out.hidden[o : o + n] if out.hidden is not None else None for o, n, _, _ in spans]
        return StepResult(logits=logits, hidden=hidden)
