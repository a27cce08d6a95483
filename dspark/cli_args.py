"""Command-line options shared by `dspark generate`, `dspark serve` and `dspark bench`
(names mirror SGLang's server flags)."""
from __future__ import annotations

import argparse
import os

from dspark.config import EngineConfig
from dspark.errors import ConfigError
from dspark.models.loader import DTYPE_CHOICES, QUANTIZATION_CHOICES
from dspark.speculative.config import (Algorithm, DraftQuantization, PlannerKind, SpsProfile, ThroughputVariant,
                                       VerifyMode, choices)


def count(text: str) -> int:
    """argparse type: an integer >= 0 (a number of prompts, a shard index)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive(text: str) -> int:
    """argparse type: an integer >= 1 (a size, a length, a number of repeats)."""
    value = count(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: bfloat16 on CUDA and on CPUs with AMX / AVX-512-bf16, else float32")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="auto: keep weights that already are 4-bit groups (the embedded GGUF Q4_1 model) in 4 bits "
                        "on a CPU (bf16 rows, or fp32 rows on the AVX2 kernels), the fastest batch-1 decoding; "
                        "none: full-precision weights (packed bf16: more throughput above "
                        "about 8 tokens per step); int4: quantize any model's layers (changes its outputs)")
    p.add_argument("--device", default="cpu")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-algorithm", type=str.upper, default="NONE", choices=choices(Algorithm))
    g.add_argument("--speculative-draft-model-path", dest="draft_model", default=None,
                   help="drafter directory (default for DSPARK / DFLASH: the shipped drafter)")
    g.add_argument("--speculative-draft-model-quantization", dest="draft_quantization", default="auto",
                   choices=choices(DraftQuantization),
                   help="the drafter's matrices: auto (int8 where dspark's kernels run), int8, or int4 (4-bit "
                        "groups, round to nearest: fewer bytes a round; needs dspark's AVX-512 kernels)")
    g.add_argument("--speculative-dspark-block-size", dest="block_size", type=positive, default=None,
                   help="drafts per round (gamma); default: the drafter's")
    g.add_argument("--speculative-num-draft-tokens", dest="num_draft_tokens", type=positive, default=None,
                   help="SGLang's name: must equal block size + 1 (anchor + drafts)")
    g.add_argument("--speculative-dspark-planner", dest="planner", default="throughput", choices=choices(PlannerKind))
    g.add_argument("--speculative-dspark-threshold", dest="threshold", type=float, default=0.5)
    g.add_argument("--speculative-dspark-throughput-variant", dest="throughput_variant", default="auto",
                   choices=choices(ThroughputVariant),
                   help="throughput planner: auto (the default: algorithm1 for a lone request, lagged for a batch), "
                        "lagged (a verify budget from confidences two rounds back, searched globally over the SPS "
                        "curve), or algorithm1 (this round's confidences, admitted while each draft raises "
                        "expected tokens/s)")
    g.add_argument("--speculative-dspark-no-skip-drafting", dest="skip_drafting", action="store_false",
                   help="throughput planner: draft every round, even where drafting cannot pay")
    g.add_argument("--speculative-dspark-min-gain", dest="min_gain", type=float, default=0.05,
                   help="throughput planner: draft and verify only where the SPS table says speculation beats "
                        "plain decoding by at least this fraction of tokens/s (a margin for measurement error)")
    g.add_argument("--speculative-dspark-sps-table-path", dest="sps_table", default=None)
    g.add_argument("--speculative-dspark-sps-profile", dest="sps_profile", default=None, choices=choices(SpsProfile),
                   help="without an SPS table, what to profile when none is cached: full, or quick (a coarse "
                        "grid measured in seconds; default for dspark serve, full elsewhere). A cached full "
                        "table is always used first")
    g.add_argument("--speculative-dspark-confidence-sts-path", dest="sts_path", default=None)
    g.add_argument("--ragged-verify-mode", dest="verify_mode", default=None, choices=choices(VerifyMode),
                   help="default: $SGLANG_RAGGED_VERIFY_MODE or compact")


MODEL_FLAGS = {"model": "--model", "dtype": "--dtype", "quantization": "--quantization", "device": "--device"}
SPECULATIVE_FLAGS = {
    "speculative_algorithm": "--speculative-algorithm", "draft_model": "--speculative-draft-model-path",
    "num_speculative_tokens": "--speculative-dspark-block-size / --speculative-num-draft-tokens",
    "planner": "--speculative-dspark-planner", "threshold": "--speculative-dspark-threshold",
    "throughput_variant": "--speculative-dspark-throughput-variant",
    "skip_drafting": "--speculative-dspark-no-skip-drafting", "min_gain": "--speculative-dspark-min-gain",
    "sps_table": "--speculative-dspark-sps-table-path", "sps_profile": "--speculative-dspark-sps-profile",
    "sts_path": "--speculative-dspark-confidence-sts-path", "verify_mode": "--ragged-verify-mode",
    "draft_quantization": "--speculative-draft-model-quantization"}


def model_options(args: argparse.Namespace) -> dict:
    """EngineConfig keywords of add_model_args' flags."""
    return {key: getattr(args, key) for key in MODEL_FLAGS}


def speculative_options(args: argparse.Namespace, sps_profile: str = "full") -> dict:
    """EngineConfig keywords of add_speculative_args' flags (sps_profile: the command's default).
    SGLang's --speculative-num-draft-tokens counts the anchor: it is the drafts per round + 1."""
    drafts = args.block_size
    if args.num_draft_tokens is not None:
        if drafts is None:
            drafts = args.num_draft_tokens - 1
        elif args.num_draft_tokens != drafts + 1:
            raise ValueError(f"--speculative-num-draft-tokens ({args.num_draft_tokens}) must equal "
                             f"--speculative-dspark-block-size + 1 ({drafts + 1})")
    mode = args.verify_mode or os.environ.get("SGLANG_RAGGED_VERIFY_MODE") or "compact"
    if mode not in choices(VerifyMode):
        raise ValueError(f"SGLANG_RAGGED_VERIFY_MODE must be one of {', '.join(choices(VerifyMode))}, got {mode!r}")
    return dict(speculative_algorithm=args.speculative_algorithm, draft_model=args.draft_model,
                num_speculative_tokens=drafts, planner=args.planner, threshold=args.threshold,
                throughput_variant=args.throughput_variant, sps_table=args.sps_table, sts_path=args.sts_path, verify_mode=mode, skip_drafting=args.skip_drafting,
                min_gain=args.min_gain, sps_profile=args.sps_profile or sps_profile,
                draft_quantization=args.draft_quantization)


def engine_config(options: dict, flags: dict[str, str] | None = None, check_files: bool = False) -> EngineConfig:
    """EngineConfig.from_kwargs(**options); a bad value comes back as a ValueError that names its flag
    (flags: keyword -> flag, beyond the model and speculative ones). check_files: also check that the
    files the settings name exist (ValueError / FileNotFoundError), before anything loads."""
    names = {**MODEL_FLAGS, **SPECULATIVE_FLAGS, **(flags or {})}
    try:
        config = EngineConfig.from_kwargs(**options)
        if check_files:
            from dspark.models.embedded import resolve_model_path

            config.check_files(resolve_model_path(config.target.model))
        return config
    except ConfigError as e:
        if e.key not in names:
            raise
        raise ValueError(f"{names[e.key]}: {e}") from None
