"""Drafter checkpoints: config.json + model.safetensors (own weights only) + optional sts.json."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from dspark.drafters.config import DrafterConfig

if TYPE_CHECKING:
    from dspark.drafters.model import DSparkDrafter

CONFIG, WEIGHTS, STS = "config.json", "model.safetensors", "sts.json"
FORMAT = "dspark-drafter"
SPECULATORS_KEYS = ("speculators_model_type", "aux_hidden_state_layer_ids", "enable_confidence_head",
                    "sample_from_anchor", "transformer_layer_config", "target")
LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "rope_theta", "qk_norm", "attention_bias", "vocab_size")


def speculators_fields(config: DrafterConfig, trained_for: dict[str, Any] | None) -> dict[str, Any]:
    """The same facts under speculators' names, written next to dspark's own so either side can read them."""
    return {
        "speculators_model_type": "dspark" if config.markov_rank or config.confidence_head else "dflash",
        # speculators counts HF hidden_states (0 = the embeddings), so target layer i's output is i + 1
        "aux_hidden_state_layer_ids": [i + 1 for i in config.target_layer_ids],
        "enable_confidence_head": config.confidence_head,
        "sample_from_anchor": True,  # block position 0 is the anchor (the last committed token)
        "transformer_layer_config": {"num_hidden_layers": config.num_layers,
                                     **{k: getattr(config, k) for k in LAYER_KEYS}},
        "target": trained_for or {},
    }


def _check_aliases(raw: dict[str, Any], config: DrafterConfig, src: Path) -> None:
    """The speculators-named copies must agree with dspark's fields (a hand-edited file may not)."""
    expect = speculators_fields(config, raw.get("target"))
    if raw.get("aux_hidden_state_layer_ids") == list(config.target_layer_ids):
        raw = {**raw, "aux_hidden_state_layer_ids": expect["aux_hidden_state_layer_ids"]}  # dspark wrote them 0-based until 2026-12
    for key in ("aux_hidden_state_layer_ids", "enable_confidence_head", "transformer_layer_config"):
        if key in raw and raw[key] != expect[key]:
            raise ValueError(f"{src / CONFIG}: {key} = {raw[key]!r} disagrees with the drafter fields "
                             f"({expect[key]!r})")


def config_dict(config: DrafterConfig, metadata: dict[str, Any]) -> dict[str, Any]:
    """config.json content: dspark's fields, their speculators-named copies, and the metadata."""
    return {"format": FORMAT, **config.to_dict(), **speculators_fields(config, metadata.get("trained_for")),
            "dspark": metadata}


def parse_config(raw: dict[str, Any], src: Path) -> tuple[DrafterConfig, dict[str, Any]]:
    """Inverse of config_dict (an absent "format" means dspark's own): (config, metadata)."""
    raw = dict(raw)
    if raw.pop("format", FORMAT) != FORMAT:
        raise ValueError(f"{src / CONFIG} is not a {FORMAT} checkpoint")
    metadata = raw.pop("dspark", {}) or {}
    aliases = {k: raw.pop(k) for k in SPECULATORS_KEYS if k in raw}
    config = DrafterConfig.from_dict(raw)
    _check_aliases(aliases, config, src)
    return config, metadata


def save_drafter(model: "DSparkDrafter", directory: str | Path, metadata: dict[str, Any] | None = None) -> None:
    """Write the drafter's config, trained weights (and d2t), and STS temperatures if it has them."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(model.metadata if metadata is None else metadata)
    (out / CONFIG).write_text(json.dumps(config_dict(model.config, meta), indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    if model.sts_temperatures is not None:
        sts = {"temperatures": list(model.sts_temperatures)}
        if model.survival_prior is not None:
            sts["survival_rate"] = list(model.survival_prior)
        (out / STS).write_text(json.dumps(sts, indent=2) + "\n")


def load_drafter(cls: type["DSparkDrafter"], directory: str | Path, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor) -> "DSparkDrafter":
    """Rebuild a drafter from save_drafter's files around the target's embedding and LM head."""
    src = Path(directory)
    config, metadata = parse_config(json.loads((src / CONFIG).read_text()), src)
    offset = read_sts_offset(src / STS)
    tensors = fold_sts_offset(load_file(str(src / WEIGHTS)), offset, src / STS)
    model = cls(config, embed_weight, lm_head_weight, d2t=tensors.get("d2t"))
    model.load_state_dict(tensors, strict=True)
    model.metadata = metadata
    model.sts_temperatures = read_sts(src / STS)
    model.sts_offset = offset
    model.survival_prior = read_survival_prior(src / STS)
    return model


def read_sts(path: Path) -> list[float] | None:
    """Per-position STS temperatures from a JSON list or {"temperatures": [...]}; None if absent."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    temps = data["temperatures"] if isinstance(data, dict) else data
    if not isinstance(temps, list) or not all(isinstance(t, (int, float)) and t > 0 for t in temps):
        raise ValueError(f"{path}: temperatures must be a list of positive numbers")
    return [float(t) for t in temps]


def read_sts_offset(path: Path) -> float:
    """The shared confidence-logit offset of an sts.json ("logit_offset", 0 if absent)."""
    if not path.exists():
        return 0.0
    data = json.loads(path.read_text())
    off = data.get("logit_offset", 0.0) if isinstance(data, dict) else 0.0
    if isinstance(off, bool) or not isinstance(off, (int, float)) or not math.isfinite(off):
        raise ValueError(f"{path}: logit_offset must be a finite number, got {off!r}")
    return float(off)


CONF_BIAS = "confidence_head.proj.bias"


def fold_sts_offset(tensors: dict[str, torch.Tensor], offset: float, source: Path) -> dict[str, torch.Tensor]:
    """Tensors with a logit offset (read_sts_offset of `source`) added to the confidence head's bias.

    The offset shifts every confidence logit, which is exactly a shift of that bias; folded in at load,
    the engine and every exported layout keep temperature-only STS."""
    if not offset:
        return tensors
    if CONF_BIAS not in tensors:
        raise ValueError(f"{source}: a logit_offset needs a drafter with a confidence head")
    return {**tensors, CONF_BIAS: tensors[CONF_BIAS] + offset}


def refold_sts_offset(drafter: "DSparkDrafter", path: Path) -> None:
    """Replace the logit offset folded in at load (from the drafter's own sts.json) by the one of another
    STS file, in place: the confidence head's bias moves by the difference."""
    offset = read_sts_offset(path)
    if offset == drafter.sts_offset:
        return
    if drafter.confidence_head is None:
        raise ValueError(f"{path}: a logit_offset needs a drafter with a confidence head")
    with torch.no_grad():
        drafter.confidence_head.proj.bias += offset - drafter.sts_offset
    drafter.sts_offset = offset


def read_survival_prior(path: Path) -> list[float] | None:
    """The per-position prefix survival rates measured at calibration (sts.json "survival_rate"),
    up to the first position without samples; None if absent. The throughput planner's prior."""
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    rates = data.get("survival_rate") if isinstance(data, dict) else None
    if rates is None:
        return None
    out = []
    for r in rates:
        if r is None:
            break
        if not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ValueError(f"{path}: survival_rate entries must be numbers in [0, 1], got {r!r}")
        out.append(float(r))
    return out or None
