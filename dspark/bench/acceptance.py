"""Per-round bookkeeping for tau and per-position conditional acceptance, from each RequestOutput's
accept_lengths (tokens committed per round) and verify_lengths (drafts verified per round)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AcceptanceCounter:
    """Accumulates rounds into tau and per-position conditional acceptance P(draft j kept | 1..j-1 kept)."""

    rounds: int = 0
    committed: int = 0
    attempts: list[int] = field(default_factory=list)  # [gamma] rounds that verified draft j with 1..j-1 kept
    accepts: list[int] = field(default_factory=list)  # [gamma] ... and kept draft j
    drafts_verified: int = 0  # over every round, the last included
    drafts_kept: int = 0

    def add(self, accept_lengths: list[int], windows: list[int] | None) -> None:
        """One request's rounds. Its last round may be cut by a stop or max_tokens, so acceptance skips it."""
        self.rounds += len(accept_lengths)
        self.committed += sum(accept_lengths)
        if not windows or len(windows) != len(accept_lengths):
            return
        self.add_drafts(sum(windows), sum(min(c - 1, w) for c, w in zip(accept_lengths, windows)))
        for committed, window in list(zip(accept_lengths, windows))[:-1]:
            kept = min(committed - 1, window)
            if window > len(self.attempts):
                grow = window - len(self.attempts)
                self.attempts += [0] * grow
                self.accepts += [0] * grow
            for j in range(min(kept + 1, window)):  # draft j+1 was verified after j kept drafts
                self.attempts[j] += 1
                if j < kept:
                    self.accepts[j] += 1

    def add_drafts(self, verified: int, kept: int) -> None:
        """Draft totals alone, for a method that reports no rounds (llama-server)."""
        self.drafts_verified += verified
        self.drafts_kept += kept

    @property
    def draft_acceptance(self) -> float | None:
        """Drafts kept / drafts verified; None before any draft."""
        return self.drafts_kept / self.drafts_verified if self.drafts_verified else None

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per round (bonus included); None before any round."""
        return self.committed / self.rounds if self.rounds else None

    def conditional(self) -> list[float | None]:
        """Per-position conditional acceptance rates, position 1 first."""
        return [a / n if n else None for a, n in zip(self.accepts, self.attempts)]
