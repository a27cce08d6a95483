"""Per-round bookkeeping for tau and per-position conditional acceptance.

RequestOutput gives the tokens committed per round (accept_lengths) but not how many drafts each round
verified. RoundRecorder observes the engine's proposer and planner (read-only wrappers, installed from
outside) to log the verify window of every round, per request, in the same order as accept_lengths.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class RoundRecorder:
    """Logs the verify window length of every decode round, per request id."""

    def __init__(self, engine):
        self.windows: dict[str, list[int]] = {}
        self._static = getattr(engine, "verify_mode", "compact") == "static"
        engine.proposer = _Proposer(engine.proposer, self)
        if engine.planner is not None:
            engine.planner = _Planner(engine.planner, self)

    def take(self, request_id: str) -> list[int]:
        """The windows of a finished request (forgotten afterwards)."""
        return self.windows.pop(request_id, [])

    def _drafted(self, request_ids: list[str], counts: list[int]) -> None:
        for rid, n in zip(request_ids, counts):
            self.windows.setdefault(rid, []).append(n)

    def _planned(self, request_ids: list[str], lengths: list[int]) -> None:
        if self._static:
            return
        for rid, l in zip(request_ids, lengths):
            log = self.windows[rid]
            log[-1] = min(log[-1], int(l))


class _Proposer:
    """Delegates to the engine's proposer; notes how many drafts each request got."""

    def __init__(self, inner, recorder: RoundRecorder):
        self._inner, self._rec = inner, recorder

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def propose(self, seqs):
        proposal = self._inner.propose(seqs)
        self._rec._drafted([s.request_id for s in seqs], [len(t) for t in proposal.tokens])
        return proposal


class _Planner:
    """Delegates to the engine's planner; notes the planned verify lengths."""

    def __init__(self, inner, recorder: RoundRecorder):
        self._inner, self._rec = inner, recorder

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def plan(self, request_ids, confidences, extra_tokens=0, context_tokens=None):
        lengths = self._inner.plan(request_ids, confidences, extra_tokens, context_tokens)
        self._rec._planned(list(request_ids), list(lengths))
        return lengths


@dataclass
class AcceptanceCounter:
    """Accumulates rounds into tau and per-position conditional acceptance P(draft j kept | 1..j-1 kept)."""

    rounds: int = 0
    committed: int = 0
    attempts: list[int] = field(default_factory=list)  # [gamma] rounds that verified draft j with 1..j-1 kept
    accepts: list[int] = field(default_factory=list)  # [gamma] ... and kept draft j

    def add(self, accept_lengths: list[int], windows: list[int] | None) -> None:
        """One request's rounds. Its last round may be cut by a stop or max_tokens, so acceptance skips it."""
        self.rounds += len(accept_lengths)
        self.committed += sum(accept_lengths)
        if not windows or len(windows) != len(accept_lengths):
            return
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

    @property
    def tau(self) -> float | None:
        """Mean tokens committed per round (bonus included); None before any round."""
        return self.committed / self.rounds if self.rounds else None

    def conditional(self) -> list[float | None]:
        """Per-position conditional acceptance rates, position 1 first."""
        return [a / n if n else None for a, n in zip(self.accepts, self.attempts)]
