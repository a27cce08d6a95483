"""Build the (proposer, planner) pair for a SpeculativeConfig."""
from __future__ import annotations

from pathlib import Path

import torch

from dspark.models.decoder import Decoder
from dspark.models.packing import packing_supported
from dspark.speculative.config import Algorithm, DraftQuantization, PlannerKind, SpeculativeConfig, VerifyMode
from dspark.speculative.cost_table import SPSTable
from dspark.speculative.planners import Planner, make_planner
from dspark.speculative.proposer import NoProposer, Proposer


def build_proposer(cfg: SpeculativeConfig, decoder: Decoder, model_path: Path) -> Proposer:
    """NONE -> plain decoding; NGRAM -> prompt lookup; DSPARK / DFLASH -> the block drafter."""
    if cfg.algorithm == Algorithm.NONE:
        return NoProposer()
    if cfg.algorithm == Algorithm.NGRAM:
        from dspark.speculative.ngram import NgramProposer

        return NgramProposer(cfg.num_speculative_tokens or 7)
    from dspark.drafters.io import read_sts
    from dspark.interop import load_any_drafter
    from dspark.speculative.block_drafter import BlockDrafterProposer

    path = cfg.drafter_path(model_path)
    drafter = load_any_drafter(path, decoder.embed_tokens.weight, decoder.lm_head.weight)  # dspark / speculators / DeepSpec
    _check_compatible(drafter, decoder, path)
    if cfg.algorithm == Algorithm.DFLASH:
        if drafter.markov_head is not None or drafter.confidence_head is not None:
            raise ValueError(f"{path} is a DSpark drafter; DFLASH needs markov_rank=0 and no confidence head")
    n = cfg.num_speculative_tokens
    if n is not None and n > drafter.config.block_size:
        raise ValueError(f"num_speculative_tokens {n} exceeds the drafter's trained block size "
                         f"{drafter.config.block_size}")
    drafter = drafter.to(dtype=decoder.dtype, device=decoder.device).eval()
    if cfg.draft_quantization != DraftQuantization.AUTO:
        drafter.pack(weight_bits=_draft_weight_bits(cfg.draft_quantization, decoder))
    elif packing_supported(decoder.dtype, decoder.device) or _avx2_fp32(decoder):
        drafter.pack()
    sts = read_sts(Path(cfg.sts_path)) if cfg.sts_path else None
    if cfg.sts_path and sts is None:
        raise FileNotFoundError(f"STS file {cfg.sts_path!r} not found")
    if cfg.sts_path:  # its logit offset replaces the one folded in from the checkpoint's own sts.json
        from dspark.drafters.io import refold_sts_offset

        refold_sts_offset(drafter, Path(cfg.sts_path))
    return BlockDrafterProposer(drafter, sts, max_drafts=n)


def _draft_weight_bits(quantization: DraftQuantization, decoder: Decoder) -> int:
    """4 or 8 for an explicit draft_quantization; ValueError where no kernel of dspark's takes it here."""
    from dspark.models import native

    on_avx512 = decoder.dtype == torch.bfloat16 and decoder.device.type == "cpu" and native.library() is not None
    if on_avx512 or (quantization == DraftQuantization.INT8 and _avx2_fp32(decoder)):
        return 4 if quantization == DraftQuantization.INT4 else 8
    why = native.why() or f"the target runs in {str(decoder.dtype).removeprefix('torch.')} on {decoder.device}"
    needs = "dspark's AVX-512 kernels and a bf16 target" if quantization == DraftQuantization.INT4 else \
        "dspark's kernels (AVX-512 with a bf16 target, or AVX2 with an fp32 one)"
    raise ValueError(f"draft_quantization {quantization} needs {needs} on the CPU; here: {why}")


def build_planner(cfg: SpeculativeConfig, proposer: Proposer, decoder: Decoder, model_path: Path,
                  max_num_seqs: int, progress: bool = True) -> Planner | None:
    """Planner for drafters with a confidence head; everything else verifies all its drafts.
    progress: show the progress bar of a first-time SPS profile."""
    if cfg.algorithm != Algorithm.DSPARK or cfg.verify_mode == VerifyMode.STATIC or cfg.planner == PlannerKind.FIXED:
        return None
    if cfg.planner == PlannerKind.THRESHOLD:
        return make_planner("threshold", threshold=cfg.threshold)
    from dspark.speculative.profile import drafting_grid, load_or_profile, profile_drafting

    window = 1 + proposer.max_drafts
    table = SPSTable.load(cfg.sps_table) if cfg.sps_table else load_or_profile(
        model_path, decoder, max_num_seqs * window, max_seqs=max_num_seqs, window=window, progress=progress,
        profile=cfg.sps_profile)
    draft_seconds = draft_one = None
    if cfg.skip_drafting and hasattr(proposer, "drafter"):
        sizes, repeats = drafting_grid(max_num_seqs, cfg.sps_profile)
        draft_seconds = profile_drafting(proposer.drafter, sizes, decoder=decoder, table=table, repeats=repeats,
                                         num_drafts=proposer.max_drafts)
        if proposer.max_drafts > 1:  # rounds that draft less than the block (the lagged budget) cost less
            draft_one = profile_drafting(proposer.drafter, sizes, decoder=decoder, table=table, repeats=repeats,
                                         num_drafts=1)
    prior = getattr(getattr(proposer, "drafter", None), "survival_prior", None)
    if cfg.sts_path:
        from dspark.drafters.io import read_survival_prior

        prior = read_survival_prior(Path(cfg.sts_path)) or prior
    return make_planner("throughput", table, variant=cfg.throughput_variant, draft_seconds=draft_seconds,
                        draft_seconds_one=draft_one, block_size=proposer.max_drafts, prior=prior,
                        min_gain=cfg.min_gain)


def _check_compatible(drafter, decoder: Decoder, path: Path) -> None:
    c, t = drafter.config, decoder.config
    if c.hidden_size != t.hidden_size or c.vocab_size != t.vocab_size:
        raise ValueError(f"drafter {path} (hidden {c.hidden_size}, vocab {c.vocab_size}) does not fit the target "
                         f"(hidden {t.hidden_size}, vocab {t.vocab_size})")
    trained = (getattr(drafter, "metadata", None) or {}).get("trained_for", {}).get("num_hidden_layers")
    if trained is not None and trained != t.num_layers:
        raise ValueError(f"drafter {path} was trained for a {trained}-layer target; this target has {t.num_layers}")
    bad = [i for i in c.target_layer_ids if not 0 <= i < t.num_layers]
    if bad:
        raise ValueError(f"drafter {path} reads target layers {bad}; the target has {t.num_layers}")


def _avx2_fp32(decoder: Decoder) -> bool:
    """An fp32 CPU model where dspark's AVX2 kernels run: its drafter's projections go on their 8-bit matmuls
    (F.linear in fp32 took ~6x as long for the drafter's head on a 2-core Zen 1)."""
    from dspark.models import native_avx2

    return decoder.dtype == torch.float32 and decoder.device.type == "cpu" and native_avx2.library() is not None
