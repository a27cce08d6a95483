"""Prompt-lookup (n-gram) drafting: propose the continuation of the latest earlier match of the suffix."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest matching suffix.

    Tries suffix lengths n = max_n down to min_n; the suffix itself is not a match. Returns [] when
    no suffix of length min_n..max_n occurs earlier in `tokens` (prompt + output so far).
    """
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k <= 0:
        return []
    seq = np.asarray(tokens, dtype=np.int64)  # [L]
    length = seq.shape[0]
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = seq[length - n :]  # [n]
        # Candidate starts i in [0, L - n - 1]: windows ending before the final token, so the
        # suffix itself is excluded and at least one token follows every match.
        hits = seq[: length - n] == suffix[0]  # [L - n]
        for offset in range(1, n):
            hits &= seq[offset : length - n + offset] == suffix[offset]
        found = np.flatnonzero(hits)
        if found.size:
            start = int(found[-1]) + n
            return seq[start : start + k].tolist()
    return []


class NgramProposer:
    """Prompt lookup over prompt + generated text: no model, no confidences (verify all drafts)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(self, num_drafts: int = 7, max_n: int = 3, min_n: int = 1):
        if num_drafts < 1 or min_n < 1 or max_n < min_n:
            raise ValueError(f"ngram needs num_drafts >= 1 and 1 <= min_n <= max_n, got "
                             f"{num_drafts}, {min_n}, {max_n}")
        self.max_drafts, self.max_n, self.min_n = num_drafts, max_n, min_n

    def propose(self, seqs, num_drafts: int | None = None):
        from dspark.speculative.proposer import Proposal

        k = min(self.max_drafts, num_drafts or self.max_drafts)
        tokens = [propose_ngram(s.tokens, k, self.max_n, self.min_n) for s in seqs]
        return Proposal(tokens=tokens, probs=[None] * len(seqs), confidences=None)

    def observe(self, seq, hidden, start) -> None:
        pass

    def release(self, seq) -> None:
        pass
