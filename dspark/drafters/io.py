"""Drafter checkpoints: config.json + model.safetensors (own weights only) + optional sts.json."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file

from dspark.drafters.config import DrafterConfig

if TYPE_CHECKING:
    from dspark.drafters.model import DSparkDrafter

CONFIG, WEIGHTS, STS = "config.json", "model.safetensors", "sts.json"
FORMAT = "dspark-drafter"


def save_drafter(model: "DSparkDrafter", directory: str | Path, metadata: dict[str, Any] | None = None) -> None:
    """Write the drafter's config, trained weights (and d2t), and STS temperatures if it has them."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(model.metadata if metadata is None else metadata)
    config = {"format": FORMAT, **model.config.to_dict(), "dspark": meta}
    (out / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    if model.sts_temperatures is not None:
        (out / STS).write_text(json.dumps({"temperatures": list(model.sts_temperatures)}, indent=2) + "\n")


def load_drafter(cls: type["DSparkDrafter"], directory: str | Path, embed_weight: torch.Tensor,
                 lm_head_weight: torch.Tensor) -> "DSparkDrafter":
    """Rebuild a drafter from save_drafter's files around the target's embedding and LM head."""
    src = Path(directory)
    raw = json.loads((src / CONFIG).read_text())
    if raw.pop("format", FORMAT) != FORMAT:
        raise ValueError(f"{src / CONFIG} is not a {FORMAT} checkpoint")
    metadata = raw.pop("dspark", {}) or {}
    config = DrafterConfig.from_dict(raw)
    tensors = load_file(str(src / WEIGHTS))
    model = cls(config, embed_weight, lm_head_weight, d2t=tensors.get("d2t"))
    model.load_state_dict(tensors, strict=True)
    model.metadata = metadata
    model.sts_temperatures = read_sts(src / STS)
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
