"""DeepSpec checkpoints (`Qwen3DSparkModel`, e.g. deepseek-ai/dspark_qwen3_4b_block7), which SGLang loads.

Layout: the HF `save_pretrained` of DeepSpec's Qwen3DSparkModel. config.json is the target's Qwen3
config with the draft's `num_hidden_layers` and the DSpark keys `num_target_layers`, `block_size`,
`mask_token_id`, `target_layer_ids`, `num_anchors`, `markov_rank`, `markov_head_type`,
`enable_confidence_head`, `confidence_head_with_markov`; `architectures` = ["Qwen3DSparkModel"].
model.safetensors holds unprefixed names: frozen copies of the target's `embed_tokens.weight` and
`lm_head.weight`, the body (`fc`, `hidden_norm`, `layers.N.*` with gate/up/down_proj, `norm`),
`markov_head.markov_w1/markov_w2` (+ `gate_proj` / `joint_proj`) and `confidence_head.proj`.
DFlash is the same class with markov_rank=0 and no confidence head.
Conventions shared with dspark: `target_layer_ids` are 0-based decoder layers whose output is
hooked (-1 = the embedding output, which dspark does not support); the block is
[anchor, mask, ..., mask] at positions anchor..anchor+B-1 and slot k predicts x_{k+1}; full vocabulary.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from dspark.drafters.config import DrafterConfig
from dspark.drafters.io import CONFIG
from dspark.drafters.model import DSparkDrafter
from dspark.interop.layout import (Tensors, join_mlp, prepare_output, read_json, read_weights, split_mlp,
                                   strip_prefix, target_embedding, target_lm_head, write_checkpoint)
from dspark.interop.parts import DrafterParts, read_dspark, sts_parts, with_target, write_dspark, write_sts
from dspark.interop.speculators import rope_theta

ARCHITECTURE = "Qwen3DSparkModel"
SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's, frozen; dspark uses the live ones
DEFAULT_NUM_ANCHORS = 512


def is_deepspec(raw: dict[str, Any]) -> bool:
    """Whether a config.json dict is a DeepSpec DSpark / DFlash checkpoint."""
    archs = raw.get("architectures") or []
    return any(a.endswith("DSparkModel") for a in archs) or \
        {"target_layer_ids", "mask_token_id", "block_size", "markov_rank", "num_anchors"} <= raw.keys()


# ---- import ----------------------------------------------------------------------------------------
def load_deepspec(directory: str | Path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> DSparkDrafter:
    """A DeepSpec checkpoint dir as a DSparkDrafter around the target's embedding and LM head."""
    src = Path(directory)
    weights = strip_prefix(read_weights(src))
    _check_shared(weights, embed_weight, lm_head_weight, src)
    return read_deepspec(src, weights).build(embed_weight, lm_head_weight)


def from_deepspec(src: str | Path, dst: str | Path, *, force: bool = False) -> Path:
    """Convert a DeepSpec checkpoint in src into a dspark drafter dir in dst (no target needed)."""
    dst = Path(dst)
    parts = read_deepspec(Path(src))
    prepare_output(dst, force)
    write_dspark(dst, parts)
    return dst


def read_deepspec(src: Path, weights: Tensors | None = None) -> DrafterParts:
    """A DeepSpec checkpoint dir as validated dspark DrafterParts."""
    config, metadata = drafter_config(read_json(src / CONFIG), str(src / CONFIG))
    weights = strip_prefix(read_weights(src)) if weights is None else weights
    tensors = join_mlp({k: v for k, v in weights.items() if k not in SHARED})
    return sts_parts(src, config, tensors, metadata).validate(str(src))


def drafter_config(raw: dict[str, Any], source: str) -> tuple[DrafterConfig, dict[str, Any]]:
    """A DeepSpec config.json dict -> (DrafterConfig, dspark metadata)."""
    archs = raw.get("architectures") or []
    _refuse(any(a.endswith("DSparkModel") and a != ARCHITECTURE for a in archs), source,
            f"architecture {archs} (dspark reads the Qwen3 layout {ARCHITECTURE})")
    _refuse(raw.get("model_type", "qwen3") != "qwen3", source, f"model_type {raw.get('model_type')!r}")
    for key in ("target_layer_ids", "mask_token_id", "block_size"):
        _refuse(raw.get(key) is None, source, f"missing {key}")
    ids = tuple(int(i) for i in raw["target_layer_ids"])
    _refuse(-1 in ids, source, "target_layer_ids contains -1 (the embedding output)")
    n_target = raw.get("num_target_layers")
    _refuse(n_target is not None and max(ids) >= int(n_target), source,
            f"target_layer_ids {list(ids)} outside the {n_target}-layer target")
    _refuse(any(t != "full_attention" for t in raw.get("layer_types") or []), source, "sliding-window layers")
    markov = int(raw.get("markov_rank", 0))
    conf = bool(raw.get("enable_confidence_head", False))
    with_markov = bool(raw.get("confidence_head_with_markov", False)) if conf else False
    _refuse(conf and (markov > 0) != with_markov, source,
            "confidence_head_with_markov must be true exactly when there is a Markov head")
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    config = DrafterConfig(
        hidden_size=hidden, intermediate_size=int(raw["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads), vocab_size=int(raw["vocab_size"]),
        target_layer_ids=ids, mask_token_id=int(raw["mask_token_id"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta(raw, source),
        num_layers=int(raw.get("num_hidden_layers", 1)), block_size=int(raw["block_size"]),
        markov_rank=markov, markov_head_type=str(raw.get("markov_head_type") or "vanilla").lower(),
        confidence_head=conf, draft_vocab_size=None, qk_norm=True,
        attention_bias=bool(raw.get("attention_bias", False)),
    )
    metadata = raw.get("dspark")
    if not isinstance(metadata, dict):
        metadata = {"imported_from": {"format": "deepspec", "architectures": archs, "num_target_layers": n_target,
                                      "num_anchors": raw.get("num_anchors"), "name_or_path": raw.get("_name_or_path")}}
    return config, metadata


def _check_shared(weights: Tensors, embed: torch.Tensor, head: torch.Tensor, src: Path) -> None:
    """The checkpoint's frozen embedding / LM head must fit the target; differing values only warn."""
    for name, live in (("embed_tokens.weight", embed), ("lm_head.weight", head)):
        saved = weights.get(name)
        if saved is None or saved.device.type == "meta":
            continue
        if tuple(saved.shape) != tuple(live.shape):
            raise ValueError(f"{src}: {name} is {list(saved.shape)} but the target's is {list(live.shape)}: "
                             "this drafter was trained for another target")
        if not torch.equal(saved.to(live.device, live.dtype), live):
            warnings.warn(f"{src}: {name} differs from the target's; dspark drafts with the target's weights",
                          stacklevel=3)


# ---- export ----------------------------------------------------------------------------------------
def to_deepspec(src: str | Path, dst: str | Path, *, target: str | Path, force: bool = False) -> Path:
    """Write the dspark drafter in src as a DeepSpec checkpoint in dst (see write_deepspec)."""
    return write_deepspec(read_dspark(Path(src)).validate(str(src)), Path(dst), target=target, force=force)


def write_deepspec(parts: DrafterParts, dst: Path, *, target: str | Path, force: bool = False) -> Path:
    """Write parts as a DeepSpec checkpoint (what SGLang's DSPARK loads) in dst.

    target: the Qwen3 target model dir; its config is the base of config.json and its embedding
    and LM head are stored as the frozen `embed_tokens` / `lm_head`, as DeepSpec does.
    """
    target = Path(target)
    config = deepspec_config(parts, read_json(target / CONFIG), str(target))
    dtype = parts.tensors["fc.weight"].dtype
    tensors = split_mlp(dict(parts.tensors))
    tensors["embed_tokens.weight"] = target_embedding(target).to(dtype)
    tensors["lm_head.weight"] = target_lm_head(target).to(dtype)
    prepare_output(dst, force)
    write_checkpoint(dst, config, tensors)
    write_sts(dst, parts)
    return dst


def deepspec_config(parts: DrafterParts, target_cfg: dict[str, Any], target: str) -> dict[str, Any]:
    """DeepSpec's config.json: the target's config plus the draft shape and DSpark keys."""
    c = parts.config
    if target_cfg.get("model_type") != "qwen3":
        raise ValueError(f"DeepSpec / SGLang DSpark drafters are Qwen3 models; target {target} is "
                         f"{target_cfg.get('model_type')!r}")
    if c.draft_vocab_size is not None:
        raise ValueError("DeepSpec checkpoints have no reduced draft vocabulary; this drafter has "
                         f"draft_vocab_size={c.draft_vocab_size}")
    if not c.qk_norm:
        raise ValueError("DeepSpec's Qwen3 DSpark layers always carry q_norm/k_norm; this drafter has qk_norm=False")
    n_target = int(target_cfg["num_hidden_layers"])
    for key, want in (("hidden_size", c.hidden_size), ("vocab_size", c.vocab_size)):
        if int(target_cfg[key]) != want:
            raise ValueError(f"target {target} has {key}={target_cfg[key]}, the drafter {want}")
    if max(c.target_layer_ids) >= n_target:
        raise ValueError(f"drafter reads target layers {list(c.target_layer_ids)}; {target} has {n_target}")
    train = parts.metadata.get("train", {}) if isinstance(parts.metadata, dict) else {}
    out = {k: v for k, v in target_cfg.items() if k not in ("auto_map", "quantization_config")}
    out.update(
        architectures=[ARCHITECTURE], num_target_layers=n_target, num_hidden_layers=c.num_layers,
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, attention_bias=c.attention_bias,
        block_size=c.block_size, tie_word_embeddings=False, layer_types=["full_attention"] * c.num_layers,
        mask_token_id=c.mask_token_id, target_layer_ids=list(c.target_layer_ids),
        num_anchors=int(train.get("anchors", DEFAULT_NUM_ANCHORS)), markov_rank=c.markov_rank,
        enable_confidence_head=c.confidence_head, dtype=str(parts.tensors["fc.weight"].dtype).removeprefix("torch."),
        dspark=with_target(parts.metadata, Path(target)),
    )
    if c.markov_rank > 0:
        out["markov_head_type"] = c.markov_head_type
    if c.confidence_head:
        out["confidence_head_with_markov"] = c.markov_rank > 0
    out.pop("torch_dtype", None)
    return out


def _refuse(bad: bool, source: str, what: str) -> None:
    if bad:
        raise ValueError(f"{source}: unsupported DeepSpec checkpoint: {what}")


__all__ = ["from_deepspec", "is_deepspec", "load_deepspec", "read_deepspec", "to_deepspec", "write_deepspec"]
