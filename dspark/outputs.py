"""RequestOutput: what generate() returns per prompt (and what the engine streams per step)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """The state of one request: text and token ids generated so far, and why it finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per round
    verify_lengths: list[int] = field(default_factory=list)  # drafts verified per round
    # per round, the drafter's calibrated confidence of each draft it made (c_k: draft k survives given
    # 1..k-1 did); empty for a proposer without a confidence head
    draft_confidences: list[list[float]] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # finish_reason "error": what failed (the step's other requests went on)

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0
