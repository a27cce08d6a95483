"""SamplingParams: how one request is decoded (temperature 0 = greedy)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """Per-request decoding settings, validated on construction (ValueError names the parameter)."""

    temperature: float = 0.0
    top_k: int = -1  # -1 or 0: disabled
    top_p: float = 1.0
    max_tokens: int = 128
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_number(self.temperature) and self.temperature >= 0 and self.temperature <= 100,
               "temperature", f"must be a number in [0, 100], got {self.temperature!r}")
        _check(isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
               "top_k", f"must be an integer >= -1 (-1 or 0 disables it), got {self.top_k!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool)
               and self.max_tokens >= 1, "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop", f"must be non-empty strings, got {self.stop!r}")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", f"must be non-negative integers, got {self.stop_token_ids!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
               "seed", f"must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # below this, warped logits overflow: treat as greedy (as vLLM does)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {why}")
