"""SpeculativeConfig: which method drafts, how many drafts get verified, and how they are verified."""
from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS = ("NONE", "NGRAM", "DFLASH", "DSPARK")
PLANNERS = ("fixed", "threshold", "throughput")
VERIFY_MODES = ("static", "compact", "cap-accept")
SPS_PROFILES = ("full", "quick")  # what a start with no SPS table measures (speculative/profile.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Options of the speculative engine (names follow SGLang's flags where they exist)."""

    algorithm: str = "NONE"
    draft_model: str | None = None  # None with DSPARK / DFLASH: the drafter shipped for the embedded target
    block_size: int | None = None  # drafts per round; None = the drafter's gamma (7 for n-gram)
    planner: str = "throughput"
    threshold: float = 0.5  # for planner="threshold"
    throughput_variant: str = "lagged"  # "lagged" (production) or "algorithm1"
    skip_drafting: bool = True  # throughput planner: skip the drafter in rounds where it cannot pay
    min_gain: float = 0.05  # throughput planner: speculate only where it beats plain decoding by this fraction
    sps_table: str | None = None  # JSON from `dspark profile`; None = profile once and cache
    sts_path: str | None = None  # STS temperatures; None = those shipped with the drafter
    verify_mode: str = "compact"
    sps_profile: str = "full"  # with no SPS table: "full" profile, or "quick" (a coarse grid in seconds)

    def __post_init__(self) -> None:
        algo = str(self.algorithm or "NONE").upper()
        object.__setattr__(self, "algorithm", algo)
        if algo not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.planner not in PLANNERS:
            raise ValueError(f"planner must be one of {', '.join(PLANNERS)}, got {self.planner!r}")
        if self.sps_profile not in SPS_PROFILES:
            raise ValueError(f"sps_profile must be one of {', '.join(SPS_PROFILES)}, got {self.sps_profile!r}")
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {', '.join(VERIFY_MODES)}, got {self.verify_mode!r}")
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or not 1 <= self.block_size <= 64):
            raise ValueError(f"block_size must be an integer in [1, 64], got {self.block_size!r}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {self.threshold!r}")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) \
                or not 0.0 <= self.min_gain < 1.0:
            raise ValueError(f"min_gain must be a number in [0, 1), got {self.min_gain!r}")
        if algo in ("NONE", "NGRAM") and self.draft_model is not None:
            raise ValueError(f"draft_model is only used by DSPARK and DFLASH, not {algo}")

    @property
    def uses_drafter(self) -> bool:
        return self.algorithm in ("DSPARK", "DFLASH")
