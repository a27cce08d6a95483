"""Sequence: the per-request state the engine mutates only when it commits tokens."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from dspark.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqStats:
    """Speculation counters of one request."""

    rounds: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    verify_lengths: list[int] = field(default_factory=list)  # drafts verified per round
    confidences: list[list[float]] = field(default_factory=list)  # per round, the drafter's row for its drafts


@dataclass(eq=False)
class Sequence:
    """One request. The KV cache holds every token but the last (the next round's anchor)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_cached: int = 0  # tokens whose K/V are in the cache
    finish_reason: str | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    text: str = ""  # detokenized output so far (engine/detokenizer.py)
    prefix_offset: int = 0
    read_offset: int = 0
    stopped_by_string: bool = False
    checked_len: int = 0  # text length already searched for stop strings
    generator: torch.Generator | None = None
    stats: SeqStats = field(default_factory=SeqStats)
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token(self) -> int:
        """The next round's anchor, without copying the whole history as `tokens` does."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefill_target(self) -> int:
        """How many tokens must be cached before decoding: the prompt, or all but the anchor."""
        return self.num_tokens - 1 if self.output_token_ids else len(self.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
