"""SpeculativeConfig: which method drafts, how many drafts get verified, and how they are verified.
The modes are enums, parsed from strings once, here; the rest of the code compares members."""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from dspark.errors import ConfigError


class Algorithm(StrEnum):
    NONE = "NONE"
    NGRAM = "NGRAM"
    DFLASH = "DFLASH"
    DSPARK = "DSPARK"


class PlannerKind(StrEnum):
    FIXED = "fixed"  # verify every draft
    THRESHOLD = "threshold"  # verify while the confidence stays above a threshold
    THROUGHPUT = "throughput"  # verify the prefix that maximises expected tokens/s (speculative/planners.py)


class ThroughputVariant(StrEnum):
    LAGGED = "lagged"  # plan with the confidences of two rounds ago (speculative/planners.py)
    ALGORITHM1 = "algorithm1"  # the method's Algorithm 1 on this round's confidences
    AUTO = "auto"  # algorithm1 for a round of one request and no prefill, lagged for any other round


class VerifyMode(StrEnum):
    STATIC = "static"  # verify every draft
    COMPACT = "compact"  # verify the planned windows
    CAP_ACCEPT = "cap-accept"  # verify every draft, commit only the planned window (the acceptance ceiling)


class DraftQuantization(StrEnum):
    """The drafter's matrices at inference (drafters/runner.py); drafts need not be exact, verification keeps
    the output lossless whatever they are."""

    AUTO = "auto"  # int8 where dspark's kernels run, else packed in the drafter's dtype
    INT8 = "int8"  # 8-bit groups of 32 (where dspark's kernels run)
    INT4 = "int4"  # 4-bit groups of 32, round to nearest: about half int8's bytes; needs dspark's AVX-512 kernels


class SpsProfile(StrEnum):
    """What a start with no SPS table measures (speculative/profile.py)."""

    FULL = "full"
    QUICK = "quick"  # a coarse grid, measured in seconds


def choices(enum: type[StrEnum]) -> list[str]:
    """The values a flag of this mode accepts."""
    return [m.value for m in enum]


def parse(enum: type[StrEnum], key: str, value) -> StrEnum:
    try:
        return enum(value)
    except ValueError:
        raise ConfigError(key, f"{key} must be one of {', '.join(choices(enum))}, got {value!r}") from None


@dataclass(frozen=True)
class SpeculativeConfig:
    """Options of the speculative engine (names follow SGLang's and vLLM's where they exist)."""

    algorithm: Algorithm = Algorithm.NONE
    draft_model: str | None = None  # None with DSPARK / DFLASH: the drafter shipped for the embedded target
    num_speculative_tokens: int | None = None  # drafts per round (vLLM's name); None = the drafter's gamma
    planner: PlannerKind = PlannerKind.THROUGHPUT
    threshold: float = 0.5  # for planner="threshold"
    throughput_variant: ThroughputVariant = ThroughputVariant.AUTO
    skip_drafting: bool = True  # throughput planner: skip the drafter in rounds where it cannot pay
    min_gain: float = 0.05  # throughput planner: speculate only where it beats plain decoding by this fraction
    sps_table: str | None = None  # JSON from `dspark profile`; None = profile once and cache
    sts_path: str | None = None  # STS temperatures; None = those shipped with the drafter
    verify_mode: VerifyMode = VerifyMode.COMPACT
    sps_profile: SpsProfile = SpsProfile.FULL  # with no SPS table: what to profile
    draft_quantization: DraftQuantization = DraftQuantization.AUTO  # the drafter's matrices (SGLang's name)

    def __post_init__(self) -> None:
        algo = parse(Algorithm, "speculative_algorithm", str(self.algorithm or "NONE").upper())
        object.__setattr__(self, "algorithm", algo)
        for key, enum in (("planner", PlannerKind), ("verify_mode", VerifyMode), ("sps_profile", SpsProfile),
                          ("throughput_variant", ThroughputVariant), ("draft_quantization", DraftQuantization)):
            object.__setattr__(self, key, parse(enum, key, getattr(self, key)))
        n = self.num_speculative_tokens
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64):
            raise ConfigError("num_speculative_tokens", f"num_speculative_tokens (drafts per round) must be an "
                                                        f"integer in [1, 64], got {n!r}")
        if n is not None and algo == Algorithm.NONE:
            raise ConfigError("num_speculative_tokens", "num_speculative_tokens needs speculative_algorithm "
                                                        "NGRAM, DFLASH or DSPARK")
        if not 0.0 <= self.threshold <= 1.0:
            raise ConfigError("threshold", f"threshold must be in [0, 1], got {self.threshold!r}")
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) \
                or not 0.0 <= self.min_gain < 1.0:
            raise ConfigError("min_gain", f"min_gain must be a number in [0, 1), got {self.min_gain!r}")
        if not self.uses_drafter and self.draft_model is not None:
            raise ConfigError("draft_model", f"draft_model is only used by DSPARK and DFLASH, not {algo}")
        if not self.uses_drafter and self.draft_quantization != DraftQuantization.AUTO:
            raise ConfigError("draft_quantization", f"draft_quantization is only used by DSPARK and DFLASH, not {algo}")
        for key in ("sps_table", "sts_path"):
            if getattr(self, key) is not None and algo != Algorithm.DSPARK:
                raise ConfigError(key, f"{key} is only used with speculative_algorithm DSPARK, not {algo}")
        if self.sps_table is not None and not self.plans_throughput:
            raise ConfigError("sps_table", "sps_table is only read by the throughput planner "
                                           "(planner throughput, verify_mode compact or cap-accept)")

    @property
    def uses_drafter(self) -> bool:
        return self.algorithm in (Algorithm.DSPARK, Algorithm.DFLASH)

    @property
    def plans_throughput(self) -> bool:
        """Whether the throughput planner (and so an SPS table) sizes the verify windows."""
        return (self.algorithm == Algorithm.DSPARK and self.planner == PlannerKind.THROUGHPUT
                and self.verify_mode != VerifyMode.STATIC)

    def check_files(self, model_path: Path) -> None:
        """The files this configuration names exist (before anything loads); FileNotFoundError or ConfigError."""
        if self.uses_drafter:
            self.drafter_path(model_path)
        for key in ("sps_table", "sts_path"):
            value = getattr(self, key)
            if value is not None and not Path(value).expanduser().is_file():
                raise FileNotFoundError(f"{key} {value!r} is not a file")

    def drafter_path(self, model_path: Path) -> Path:
        """The drafter directory: draft_model, or the one shipped for the embedded target."""
        from dspark.models.embedded import embedded_model_dir

        if self.draft_model is None:
            if Path(model_path).resolve() != embedded_model_dir().resolve():
                raise ConfigError("draft_model", f"{self.algorithm} on {model_path} needs draft_model "
                                                 "(the shipped drafter is for the embedded SmolLM2 target)")
            from dspark.drafters.registry import shipped_drafter

            return shipped_drafter(self.algorithm)
        path = Path(self.draft_model).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"draft model {str(path)!r} is not a drafter directory (no config.json)")
        return path
