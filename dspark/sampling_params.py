"""SamplingParams: how one request is decoded (temperature 0 = greedy)."""
from __future__ import annotations

from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # temperatures under this decode greedily (as vLLM does): logits / 1e-300 overflow to inf
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass
class SamplingParams:
    """Per-request decoding settings, validated on construction (ValueError names the parameter).

    Every accepted value is numerically safe: a temperature under GREEDY_BELOW becomes 0 (greedy), and
    the sampler keeps at least the most likely token whatever top_p (1e-46 is 0 in float32)."""

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
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # one meaning of greedy everywhere (engine, drafter, benchmarks)
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
        _check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)
                                     and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
               "seed", f"must be an integer in [-2**63, 2**64 - 1] or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} {why}")
