"""Command-line options shared by `dspark generate`, `dspark serve` and `dspark bench`
(names mirror SGLang's server flags)."""
from __future__ import annotations

import argparse
import os

from dspark.models.loader import DTYPE_CHOICES, QUANTIZATION_CHOICES
from dspark.speculative.config import ALGORITHMS, PLANNERS, SPS_PROFILES, VERIFY_MODES


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--model-path", dest="model", default=None,
                   help="local Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: bfloat16 on CUDA and on CPUs with AMX / AVX-512-bf16, else float32")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATION_CHOICES,
                   help="auto: keep weights that already are 4-bit groups (the embedded GGUF Q4_1 model) in 4 bits "
                        "on a bf16 CPU, the fastest batch-1 decoding; none: packed bf16, more throughput above "
                        "about 8 tokens per step; int4: quantize any model's layers (changes its outputs)")
    p.add_argument("--device", default="cpu")


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding")
    g.add_argument("--speculative-algorithm", type=str.upper, default="NONE", choices=ALGORITHMS)
    g.add_argument("--speculative-draft-model-path", dest="draft_model", default=None,
                   help="drafter directory (default for DSPARK / DFLASH: the shipped drafter)")
    g.add_argument("--speculative-dspark-block-size", dest="block_size", type=int, default=None,
                   help="drafts per round (gamma); default: the drafter's")
    g.add_argument("--speculative-num-draft-tokens", dest="num_draft_tokens", type=int, default=None,
                   help="SGLang's name: must equal block size + 1 (anchor + drafts)")
    g.add_argument("--speculative-dspark-planner", dest="planner", default="throughput", choices=PLANNERS)
    g.add_argument("--speculative-dspark-threshold", dest="threshold", type=float, default=0.5)
    g.add_argument("--speculative-dspark-no-skip-drafting", dest="skip_drafting", action="store_false",
                   help="throughput planner: draft every round, even where drafting cannot pay")
    g.add_argument("--speculative-dspark-min-gain", dest="min_gain", type=float, default=0.05,
                   help="throughput planner: draft and verify only where the SPS table says speculation beats "
                        "plain decoding by at least this fraction of tokens/s (a margin for measurement error)")
    g.add_argument("--speculative-dspark-sps-table-path", dest="sps_table", default=None)
    g.add_argument("--speculative-dspark-sps-profile", dest="sps_profile", default=None, choices=SPS_PROFILES,
                   help="without an SPS table, what to profile when none is cached: full, or quick (a coarse "
                        "grid measured in seconds; default for dspark serve, full elsewhere). A cached full "
                        "table is always used first")
    g.add_argument("--speculative-dspark-confidence-sts-path", dest="sts_path", default=None)
    g.add_argument("--ragged-verify-mode", dest="verify_mode", default=None, choices=VERIFY_MODES,
                   help="default: $SGLANG_RAGGED_VERIFY_MODE or compact")


def speculative_kwargs(args: argparse.Namespace) -> dict:
    """LLM(...) keyword arguments from the parsed flags; ValueError for inconsistent ones."""
    block = args.block_size
    if args.num_draft_tokens is not None:
        if block is None:
            block = args.num_draft_tokens - 1
        elif args.num_draft_tokens != block + 1:
            raise ValueError(f"--speculative-num-draft-tokens ({args.num_draft_tokens}) must equal "
                             f"--speculative-dspark-block-size + 1 ({block + 1})")
    mode = args.verify_mode or os.environ.get("SGLANG_RAGGED_VERIFY_MODE") or "compact"
    if mode not in VERIFY_MODES:
        raise ValueError(f"SGLANG_RAGGED_VERIFY_MODE must be one of {', '.join(VERIFY_MODES)}, got {mode!r}")
    return dict(speculative_algorithm=args.speculative_algorithm, draft_model=args.draft_model,
                num_draft_tokens=block, planner=args.planner, threshold=args.threshold, sps_table=args.sps_table,
                sts_path=args.sts_path, verify_mode=mode, skip_drafting=args.skip_drafting,
                min_gain=args.min_gain, sps_profile=args.sps_profile or "full")
