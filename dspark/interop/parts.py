"""DrafterParts: a drafter checkpoint in memory (config, dspark-named tensors, metadata, STS) and its dspark I/O."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from dspark.drafters.config import DrafterConfig
from dspark.drafters.io import (CONFIG, STS, WEIGHTS, config_dict, fold_sts_offset, parse_config, read_sts,
                                read_sts_offset)
from dspark.drafters.model import DSparkDrafter
from dspark.interop.layout import Tensors, check_tensors, read_json, write_checkpoint, write_json

TARGET_DIR = "target_dir"  # metadata key: the target dir an export was made against (the checkpoint's memory)


@dataclass
class DrafterParts:
    """Everything a converter moves between layouts; tensors use dspark's parameter names."""

    config: DrafterConfig
    tensors: Tensors  # dspark state_dict names (d2t holds absolute target ids [Vd])
    metadata: dict[str, Any] = field(default_factory=dict)
    sts: list[float] | None = None  # per-position STS temperatures
    sts_offset: float = 0.0  # sts.json's logit offset, already folded into the tensors' confidence-head bias
    survival: list[float | None] | None = None  # sts.json's survival_rate: the throughput planner's prior

    def validate(self, source: str) -> DrafterParts:
        """Raise ValueError unless the tensors are exactly those of DSparkDrafter(config)."""
        check_tensors(self.config, self.tensors, source)
        return self

    def build(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> DSparkDrafter:
        """A DSparkDrafter around the target's embedding and LM head, holding these weights."""
        model = DSparkDrafter(self.config, embed_weight, lm_head_weight, d2t=self.tensors.get("d2t"))
        model.load_state_dict(self.tensors, strict=True)
        model.metadata = copy.deepcopy(self.metadata)
        model.sts_temperatures = list(self.sts) if self.sts else None
        model.sts_offset = self.sts_offset
        return model


def read_dspark(src: Path) -> DrafterParts:
    """A dspark-format drafter dir (drafters/io.py layout) without building the model."""
    config, metadata = parse_config(read_json(src / CONFIG), src)
    return sts_parts(src, config, load_file(str(src / WEIGHTS)), metadata)


def sts_parts(src: Path, config: DrafterConfig, tensors: Tensors, metadata: dict[str, Any]) -> DrafterParts:
    """DrafterParts with the STS side file of `src` applied: temperatures kept, logit offset folded in."""
    offset = read_sts_offset(src / STS)
    raw = json.loads((src / STS).read_text()) if (src / STS).is_file() else None  # read_sts_offset above parsed it already
    survival = raw.get("survival_rate") if isinstance(raw, dict) else None
    return DrafterParts(config, fold_sts_offset(tensors, offset, src / STS), metadata, read_sts(src / STS), offset,
                        survival if isinstance(survival, list) else None)


def write_dspark(dst: Path, parts: DrafterParts) -> None:
    """Write parts in the layout DSparkDrafter.from_pretrained reads."""
    write_checkpoint(dst, config_dict(parts.config, parts.metadata), parts.tensors)
    write_sts(dst, parts)


def write_sts(dst: Path, parts: DrafterParts) -> None:
    """sts.json beside the weights (every layout here keeps it as a side file): the temperatures and the
    measured survival rates (the offset is already in the confidence head's bias)."""
    if parts.sts:
        extra = {"survival_rate": list(parts.survival)} if parts.survival else {}
        write_json(dst / STS, {"temperatures": list(parts.sts), **extra})


def with_target(metadata: dict[str, Any], target: Path | None) -> dict[str, Any]:
    """The metadata an export writes: the training record plus the target dir it was made against, so a
    checkpoint converted back (and re-exported) finds its target without --target."""
    if target is None:
        return metadata
    return {**metadata, TARGET_DIR: str(Path(target).expanduser().resolve())}
