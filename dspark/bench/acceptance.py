"""Per-round bookkeeping for tau and per-position conditional acceptance, from each RequestOutput's
accept_lengths (tokens committed per round) and verify_lengths (drafts verified per round); and, from its
draft_confidences, how well the drafter's confidences forecast those rounds (calibration on this traffic)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dspark.train.sts import ece


@dataclass
class AcceptanceCounter:
    """Accumulates rounds into tau and per-position conditional acceptance P(draft j kept | 1..j-1 kept)."""

    rounds: int = 0
    committed: int = 0
    attempts: list[int] = field(default_factory=list)  # [gamma] rounds that verified draft j with 1..j-1 kept
    accepts: list[int] = field(default_factory=list)  # [gamma] ... and kept draft j
    drafts_verified: int = 0  # over every round, the last included
    drafts_kept: int = 0
    # per position k: (forecast prefix survival a_k, 1 if drafts 1..k were all kept) of each round that verified draft k
    forecasts: list[list[tuple[float, int]]] = field(default_factory=list)

    def add(self, accept_lengths: list[int], windows: list[int] | None,
            confidences: list[list[float]] | None = None) -> None:
        """One request's rounds. Its last round may be cut by a stop or max_tokens, so acceptance skips it.
        confidences: the drafter's row per round (c_k, draft k survives given 1..k-1 did), where it has one."""
        self.rounds += len(accept_lengths)
        self.committed += sum(accept_lengths)
        if not windows or len(windows) != len(accept_lengths):
            return
        self.add_drafts(sum(windows), sum(min(c - 1, w) for c, w in zip(accept_lengths, windows)))
        rows = confidences if confidences and len(confidences) == len(accept_lengths) else None
        for r, (committed, window) in enumerate(list(zip(accept_lengths, windows))[:-1]):
            kept = min(committed - 1, window)
            if rows is not None:
                self._forecast(kept, rows[r][:window])
            if window > len(self.attempts):
                grow = window - len(self.attempts)
                self.attempts += [0] * grow
                self.accepts += [0] * grow
            for j in range(min(kept + 1, window)):  # draft j+1 was verified after j kept drafts
                self.attempts[j] += 1
                if j < kept:
                    self.accepts[j] += 1

    def _forecast(self, kept: int, row: list[float]) -> None:
        """A round that verified len(row) drafts and kept the first `kept`: each verified position's forecast."""
        if len(row) > len(self.forecasts):
            self.forecasts += [[] for _ in range(len(row) - len(self.forecasts))]
        a = 1.0
        for k, c in enumerate(row):
            a *= c
            self.forecasts[k].append((a, int(k < kept)))

    def calibration(self) -> dict | None:
        """Per position: rounds that verified it, mean forecast prefix survival, the share that survived,
        and the ECE of the forecasts (15 equal-width bins); None without confidences. With every draft
        verified (fixed block) this is the drafter's calibration on this traffic; under a planner, only
        the positions it chose to verify count, so high forecasts are over-represented."""
        if not self.forecasts:
            return None
        out: dict[str, list] = {"count": [], "forecast": [], "survived": [], "ece": []}
        for pairs in self.forecasts:
            a, y = np.array(pairs, dtype=np.float64).T
            out["count"].append(len(pairs))
            out["forecast"].append(float(a.mean()))
            out["survived"].append(float(y.mean()))
            out["ece"].append(ece(a, y))  # 15 bins, as `dspark calibrate` scores its held-out logs
        return out

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
