"""vLLM `speculators` checkpoints (speculators 0.9.0, `speculators_model_type` "dspark" / "dflash").

Layout: config.json (a DSparkSpeculatorConfig / DFlashSpeculatorConfig) + model.safetensors holding
the drafter body without the verifier-owned `embed_tokens` / `verifier_lm_head` / `verifier_norm`.
Conventions that differ from dspark and are converted here:
  * `aux_hidden_state_layer_ids` are HF `hidden_states` indices (0 = embedding output), so the
    output of 0-based decoder layer i is id i + 1 (speculators' own z-lab DFlash converter adds 1).
  * the MLP is `gate_proj` / `up_proj` / `down_proj` (dspark fuses gate and up).
  * a reduced draft vocabulary stores `d2t` as offsets (target id = draft id + d2t[draft id]),
    `t2d` as a bool mask over the target vocabulary, and the pruned `lm_head.weight` [Vd, d].
  * `sample_from_anchor=True` is dspark's anchor-first block (slot k predicts x_{k+1}); a
    `sample_from_anchor=False` checkpoint (anchor = bonus token) has a different block layout.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from dspark.drafters.config import DrafterConfig
from dspark.drafters.io import CONFIG
from dspark.interop.layout import (Tensors, join_mlp, prepare_output, read_json, read_weights, split_mlp,
                                   target_lm_head, write_checkpoint)
from dspark.interop.parts import DrafterParts, read_dspark, sts_parts, with_target, write_dspark, write_sts

SPECULATORS_VERSION = "0.9.0"  # the schema these files follow (checked against that release)
MODEL_TYPES = ("dspark", "dflash")
# Filled from the verifier by speculators (or excluded from its saves); dspark uses the target's own.
VERIFIER_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight", "lm_head.weight", "t2d")
# DSparkSpeculatorConfig / DFlashSpeculatorConfig defaults in 0.9.0, applied when a key is absent.
DEFAULTS = {
    "dspark": dict(markov_rank=256, markov_head_type="vanilla", enable_confidence_head=True,
                   confidence_head_with_markov=True, sample_from_anchor=True),
    "dflash": dict(markov_rank=0, markov_head_type="vanilla", enable_confidence_head=False,
                   confidence_head_with_markov=False, sample_from_anchor=False),
}


def is_speculators(raw: dict[str, Any]) -> bool:
    """Whether a config.json dict is a speculators checkpoint."""
    return "speculators_model_type" in raw


# ---- export ----------------------------------------------------------------------------------------
def to_speculators(src: str | Path, dst: str | Path, *, target: str | Path | None = None,
                   verifier: str | None = None, model_type: str | None = None, force: bool = False) -> Path:
    """Write the dspark drafter in src as a speculators checkpoint in dst (see write_speculators)."""
    return write_speculators(read_dspark(Path(src)).validate(str(src)), Path(dst), target=target,
                             verifier=verifier, model_type=model_type, force=force)


def write_speculators(parts: DrafterParts, dst: Path, *, target: str | Path | None = None,
                      verifier: str | None = None, model_type: str | None = None, force: bool = False) -> Path:
    """Write parts as a speculators checkpoint in dst.

    target: the target model dir (needed for a reduced draft vocabulary: its LM head rows become
    `lm_head.weight`; also supplies the verifier's architectures). verifier: the name recorded in
    `speculators_config.verifier.name_or_path` (default: target, else the drafter's training record).
    model_type: "dspark" or "dflash" (default: "dflash" for a drafter without heads, else "dspark").
    """
    target_dir = Path(target) if target is not None else None
    config = speculators_config(parts, model_type=model_type, target=target_dir, verifier=verifier)
    tensors = speculators_tensors(parts, target_dir)
    prepare_output(dst, force)
    write_checkpoint(dst, config, tensors)
    write_sts(dst, parts)
    return dst


def speculators_config(parts: DrafterParts, *, model_type: str | None = None, target: Path | None = None,
                       verifier: str | None = None) -> dict[str, Any]:
    """The config.json of a speculators checkpoint for these parts."""
    c = parts.config
    has_heads = c.markov_rank > 0 or c.confidence_head
    kind = model_type or ("dspark" if has_heads else "dflash")
    if kind not in MODEL_TYPES:
        raise ValueError(f"speculators model type must be one of {MODEL_TYPES}, got {kind!r}")
    if kind == "dflash" and has_heads:
        raise ValueError("a drafter with a Markov or confidence head exports as speculators type 'dspark', "
                         "not 'dflash'")
    if not c.qk_norm:
        raise ValueError("speculators' DFlash/DSpark layers always carry q_norm/k_norm; this drafter has qk_norm=False")
    n_target = _target_layers(parts, target)
    if n_target and max(c.target_layer_ids) >= n_target - 1:
        warnings.warn("the drafter reads the target's last layer; speculators id num_layers is the final "
                      "(normed) hidden state in HF, not the raw layer output dspark uses", stacklevel=2)
    target_cfg = read_json(target / CONFIG) if target is not None else {}
    layer = {
        "model_type": "qwen3", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "attention_bias": c.attention_bias,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "tie_word_embeddings": False,
    }
    if "max_position_embeddings" in target_cfg:
        layer["max_position_embeddings"] = target_cfg["max_position_embeddings"]
    trained_for = parts.metadata.get("trained_for", {}) if isinstance(parts.metadata, dict) else {}
    name = verifier or (str(target) if target is not None else None) or trained_for.get("model")
    return {
        "architectures": ["DSparkSpeculator" if kind == "dspark" else "DFlashSpeculator"],
        "speculators_model_type": kind,
        "speculators_version": SPECULATORS_VERSION,
        "speculators_config": {
            "algorithm": kind,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": name, "architectures": list(target_cfg.get("architectures") or [])},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab,
        "block_size": c.block_size,
        "target_hidden_size": c.hidden_size,
        "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": False,
        "sample_from_anchor": True,
        **({"markov_rank": c.markov_rank, "markov_head_type": c.markov_head_type,
            "enable_confidence_head": c.confidence_head,
            "confidence_head_with_markov": c.confidence_head and c.markov_rank > 0} if kind == "dspark" else {}),
        "dtype": _dtype_name(parts.tensors["fc.weight"].dtype),
        # passthrough (pydantic extra="allow"): the recipe, and the target dir, survive a round trip
        "dspark": with_target(parts.metadata, target),
    }


def speculators_tensors(parts: DrafterParts, target: Path | None) -> Tensors:
    """dspark tensors -> speculators names; a reduced vocabulary adds d2t offsets, t2d and lm_head."""
    tensors = split_mlp({k: v for k, v in parts.tensors.items() if k != "d2t"})
    d2t = parts.tensors.get("d2t")
    if d2t is None:
        return tensors
    order = torch.argsort(d2t)
    if not torch.equal(order, torch.arange(len(d2t))):  # speculators' t2d mask implies ascending draft ids
        d2t = d2t[order]
        w2 = "markov_head.markov_w2.weight"
        if w2 in tensors:
            tensors[w2] = tensors[w2][order].contiguous()
    if target is None:
        raise ValueError("a reduced-vocabulary drafter needs the target (--target DIR): speculators stores "
                         "the pruned LM head rows as lm_head.weight")
    head = target_lm_head(target)
    if head.shape[0] != parts.config.vocab_size or head.shape[1] != parts.config.hidden_size:
        raise ValueError(f"target {target} LM head is {list(head.shape)}, the drafter expects "
                         f"[{parts.config.vocab_size}, {parts.config.hidden_size}]")
    t2d = torch.zeros(parts.config.vocab_size, dtype=torch.bool)
    t2d[d2t] = True
    tensors["d2t"] = d2t - torch.arange(len(d2t), dtype=d2t.dtype)  # offsets
    tensors["t2d"] = t2d
    tensors["lm_head.weight"] = head[d2t].contiguous()  # the target's dtype: dspark drafts with these exact rows
    return tensors


# ---- import ----------------------------------------------------------------------------------------
def from_speculators(src: str | Path, dst: str | Path, *, force: bool = False) -> Path:
    """Convert a speculators dspark / dflash checkpoint in src into a dspark drafter dir in dst."""
    dst = Path(dst)
    parts = read_speculators(Path(src))
    prepare_output(dst, force)
    write_dspark(dst, parts)
    return dst


def read_speculators(src: Path) -> DrafterParts:
    """A speculators checkpoint dir as validated dspark DrafterParts."""
    raw = read_json(src / CONFIG)
    config, metadata = drafter_config(raw, str(src / CONFIG))
    tensors = dspark_tensors(read_weights(src), config, str(src))
    return sts_parts(src, config, tensors, metadata).validate(str(src))


def drafter_config(raw: dict[str, Any], source: str) -> tuple[DrafterConfig, dict[str, Any]]:
    """A speculators config.json dict -> (DrafterConfig, dspark metadata)."""
    kind = raw.get("speculators_model_type")
    if kind not in MODEL_TYPES:
        raise ValueError(f"{source}: speculators_model_type {kind!r} is not supported (dspark reads {MODEL_TYPES})")
    v = {**DEFAULTS[kind], **{k: raw[k] for k in DEFAULTS[kind] if k in raw}}
    _refuse(not v["sample_from_anchor"], source, "sample_from_anchor=false (the anchor is the bonus token and "
            "slot k predicts x_k); dspark drafters are anchor-first (slot k predicts x_{k+1})")
    _refuse(raw.get("projector_type", "dflash") != "dflash", source, f"projector_type {raw.get('projector_type')!r}")
    layer = raw.get("transformer_layer_config")
    _refuse(not isinstance(layer, dict), source, "no transformer_layer_config")
    _refuse(any(t != "full_attention" for t in layer.get("layer_types") or []), source, "sliding-window layers")
    aux = raw.get("aux_hidden_state_layer_ids")
    _refuse(not aux, source, "no aux_hidden_state_layer_ids (pass them when training/converting with speculators)")
    _refuse(0 in aux, source, "aux_hidden_state_layer_ids contains 0 (the embedding output)")
    _refuse(raw.get("mask_token_id") is None, source, "no mask_token_id")
    conf, markov = bool(v["enable_confidence_head"]), int(v["markov_rank"])
    _refuse(conf and markov > 0 and not v["confidence_head_with_markov"], source,
            "a confidence head without the Markov embedding next to a Markov head")
    hidden = int(layer["hidden_size"])
    _refuse(raw.get("target_hidden_size") not in (None, hidden), source,
            f"target_hidden_size {raw.get('target_hidden_size')} != hidden_size {hidden}")
    vocab = int(layer["vocab_size"])
    draft_vocab = int(raw.get("draft_vocab_size", 32000))
    config = DrafterConfig(
        hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]),
        num_attention_heads=int(layer["num_attention_heads"]),
        num_key_value_heads=int(layer.get("num_key_value_heads") or layer["num_attention_heads"]),
        head_dim=int(layer.get("head_dim") or hidden // int(layer["num_attention_heads"])),
        vocab_size=vocab, target_layer_ids=tuple(int(i) - 1 for i in aux),
        mask_token_id=int(raw["mask_token_id"]), rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta(layer, source), num_layers=int(layer.get("num_hidden_layers", 1)),
        block_size=int(raw.get("block_size", 8)), markov_rank=markov,
        markov_head_type=str(v["markov_head_type"]), confidence_head=conf,
        draft_vocab_size=None if draft_vocab == vocab else draft_vocab, qk_norm=True,
        attention_bias=bool(layer.get("attention_bias", False)),
    )
    metadata = raw.get("dspark")
    if not isinstance(metadata, dict):
        metadata = {"imported_from": {"format": "speculators", "speculators_model_type": kind,
                                      "speculators_version": raw.get("speculators_version"),
                                      "verifier": (raw.get("speculators_config") or {}).get("verifier")}}
    return config, metadata


def dspark_tensors(weights: Tensors, config: DrafterConfig, source: str) -> Tensors:
    """speculators weights -> dspark names; d2t offsets become absolute target ids."""
    tensors = {k: v for k, v in weights.items() if k not in VERIFIER_KEYS}
    if "d2t" in tensors:
        if config.draft_vocab_size is None:
            tensors.pop("d2t")  # a full-vocabulary identity map: dspark keeps none
        else:
            offsets = tensors.pop("d2t").long()
            tensors["d2t"] = offsets + torch.arange(len(offsets))
            t2d = weights.get("t2d")
            if t2d is not None and not torch.equal(t2d.bool().nonzero().flatten(), tensors["d2t"].sort().values):
                raise ValueError(f"{source}: d2t and t2d name different draft vocabularies")
    elif config.draft_vocab_size is not None:
        raise ValueError(f"{source}: draft_vocab_size {config.draft_vocab_size} < vocab_size but no d2t tensor")
    return join_mlp(tensors)


def rope_theta(layer: dict[str, Any], source: str) -> float:
    """Plain RoPE base from rope_parameters / rope_theta; scaled RoPE is refused."""
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    _refuse(kind != "default", source, f"rope type {kind!r} (dspark drafters use plain RoPE)")
    return float(rope.get("rope_theta") or layer.get("rope_theta") or 10000.0)


def _refuse(bad: bool, source: str, what: str) -> None:
    if bad:
        raise ValueError(f"{source}: unsupported for a dspark drafter: {what}")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _target_layers(parts: DrafterParts, target: Path | None) -> int:
    """The target's layer count (from target/config.json or the training record), 0 if unknown."""
    if target is not None and (target / CONFIG).is_file():
        return int(read_json(target / CONFIG).get("num_hidden_layers") or 0)
    trained_for = parts.metadata.get("trained_for", {}) if isinstance(parts.metadata, dict) else {}
    return int(trained_for.get("num_hidden_layers") or 0)


__all__ = ["from_speculators", "is_speculators", "read_speculators", "to_speculators", "write_speculators"]
