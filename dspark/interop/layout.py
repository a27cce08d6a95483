"""What the three checkpoint layouts share: the Qwen3-style body names, safetensors I/O, shape checks.

dspark, speculators and DeepSpec name the drafter body alike (`fc`, `hidden_norm`, `layers.N.*`,
`norm`, `markov_head.*`, `confidence_head.proj`). The one difference is the MLP: dspark fuses
gate and up into `mlp.gate_up` [2I, d] (gate rows first) with `mlp.down`; the others keep
`mlp.gate_proj` / `mlp.up_proj` / `mlp.down_proj`. Splitting and re-joining rows is exact.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dspark.drafters.config import DrafterConfig
from dspark.drafters.io import CONFIG, STS, WEIGHTS

Tensors = dict[str, torch.Tensor]

_GATE_UP = re.compile(r"^(layers\.\d+\.mlp)\.gate_up\.(weight|bias)$")
_DOWN = re.compile(r"^(layers\.\d+\.mlp)\.down\.(weight|bias)$")
_GATE = re.compile(r"^(layers\.\d+\.mlp)\.gate_proj\.(weight|bias)$")
_UP = re.compile(r"^(layers\.\d+\.mlp)\.up_proj\.(weight|bias)$")
_DOWN_PROJ = re.compile(r"^(layers\.\d+\.mlp)\.down_proj\.(weight|bias)$")


def split_mlp(tensors: Tensors) -> Tensors:
    """dspark body names -> HF names: `mlp.gate_up` [2I, ...] becomes `mlp.gate_proj` + `mlp.up_proj`."""
    out: Tensors = {}
    for name, t in tensors.items():
        if m := _GATE_UP.match(name):
            if t.shape[0] % 2:
                raise ValueError(f"{name} has an odd row count {t.shape[0]}; expected [2 * intermediate, ...]")
            gate, up = t.chunk(2, dim=0)
            out[f"{m[1]}.gate_proj.{m[2]}"] = gate.contiguous()
            out[f"{m[1]}.up_proj.{m[2]}"] = up.contiguous()
        elif m := _DOWN.match(name):
            out[f"{m[1]}.down_proj.{m[2]}"] = t
        else:
            out[name] = t
    return out


def join_mlp(tensors: Tensors) -> Tensors:
    """HF body names -> dspark names: `mlp.gate_proj` + `mlp.up_proj` become `mlp.gate_up` (gate rows first)."""
    out: Tensors = {}
    ups = {name: t for name, t in tensors.items() if _UP.match(name)}
    for name, t in tensors.items():
        if m := _GATE.match(name):
            up_name = f"{m[1]}.up_proj.{m[2]}"
            if up_name not in ups:
                raise ValueError(f"{name} has no matching {up_name}")
            up = ups.pop(up_name)
            if up.shape != t.shape or up.dtype != t.dtype:
                raise ValueError(f"{name} {list(t.shape)} and {up_name} {list(up.shape)} differ in shape or dtype")
            out[f"{m[1]}.gate_up.{m[2]}"] = torch.cat([t, up], dim=0)
        elif m := _DOWN_PROJ.match(name):
            out[f"{m[1]}.down.{m[2]}"] = t
        elif not _UP.match(name):
            out[name] = t
    if ups:
        raise ValueError(f"up_proj without gate_proj: {sorted(ups)}")
    return out


def strip_prefix(tensors: Tensors, prefix: str = "model.") -> Tensors:
    """Drop a wrapper prefix (`model.layers.0...` -> `layers.0...`) if every body key carries it."""
    if tensors and all(k.startswith(prefix) or k.startswith("lm_head.") for k in tensors):
        return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in tensors.items()}
    return tensors


# ---- files -----------------------------------------------------------------------------------------
def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from path, with the file named in any error."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def read_weights(directory: Path) -> Tensors:
    """All tensors of a checkpoint dir: model.safetensors or a sharded model.safetensors.index.json."""
    single = directory / WEIGHTS
    if single.is_file():
        return load_file(str(single))
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        tensors: Tensors = {}
        for shard in sorted(set(read_json(index).get("weight_map", {}).values())):
            tensors.update(load_file(str(directory / shard)))
        return tensors
    shards = sorted(directory.glob("*.safetensors"))
    if len(shards) == 1:
        return load_file(str(shards[0]))
    raise FileNotFoundError(f"no {WEIGHTS} (or sharded index) in {directory}")


def read_target_tensor(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor:
    """The first of `names` found in a HF target's safetensors (one tensor read, not the whole model)."""
    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        candidates = [(name, target_dir / weight_map[name]) for name in names if name in weight_map]
    else:
        candidates = [(name, f) for name in names for f in sorted(target_dir.glob("*.safetensors"))]
    for name, file in candidates:
        with safe_open(str(file), "pt") as f:
            if name in f.keys():  # noqa: SIM118 (a safe_open handle is not a dict)
                return f.get_tensor(name)
    raise FileNotFoundError(f"none of {list(names)} in the safetensors of target {target_dir}")


def target_lm_head(target_dir: Path) -> torch.Tensor:
    """The target's output projection [V, d] (its input embedding when the two are tied)."""
    return read_target_tensor(target_dir, ("lm_head.weight", "model.embed_tokens.weight", "embed_tokens.weight"))


def target_embedding(target_dir: Path) -> torch.Tensor:
    """The target's input embedding [V, d]."""
    return read_target_tensor(target_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))


def prepare_output(dst: Path, force: bool) -> None:
    """Create dst; refuse a non-empty one unless force (then its old checkpoint files are replaced)."""
    if dst.exists() and not dst.is_dir():
        raise NotADirectoryError(f"destination {dst} exists and is not a directory")
    if dst.is_dir() and any(dst.iterdir()):
        if not force:
            raise ValueError(f"destination {dst} is not empty; pass --force (force=True) to overwrite it")
        for stale in (CONFIG, WEIGHTS, STS, "model.safetensors.index.json"):
            (dst / stale).unlink(missing_ok=True)
        for shard in dst.glob("model-*.safetensors"):
            shard.unlink()
    dst.mkdir(parents=True, exist_ok=True)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Indented JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_checkpoint(dst: Path, config: dict[str, Any], tensors: Tensors) -> None:
    """config.json + model.safetensors (contiguous CPU tensors, HF's 'pt' metadata)."""
    write_json(dst / CONFIG, config)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(dst / WEIGHTS),
              metadata={"format": "pt"})


# ---- validation ------------------------------------------------------------------------------------
def check_tensors(config: DrafterConfig, tensors: Tensors, source: str) -> None:
    """Names and shapes of dspark-named tensors must be exactly what DSparkDrafter(config) holds."""
    from dspark.drafters.model import DSparkDrafter

    meta = torch.empty(config.vocab_size, config.hidden_size, device="meta")
    d2t = tensors.get("d2t")
    if config.draft_vocab_size is not None and d2t is None:
        raise ValueError(f"{source}: draft_vocab_size={config.draft_vocab_size} but no d2t mapping")
    expected = {k: tuple(v.shape) for k, v in
                DSparkDrafter(config, meta, meta, d2t=d2t, dtype=torch.float32).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in tensors.items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = [f"{k}: {list(got[k])} != expected {list(expected[k])}"
             for k in sorted(set(got) & set(expected)) if got[k] != expected[k]]
    problems = ([f"missing {missing}"] if missing else []) + ([f"unexpected {unexpected}"] if unexpected else []) \
        + ([f"shape mismatch: {'; '.join(wrong)}"] if wrong else [])
    if problems:
        raise ValueError(f"{source} does not match its config: " + " | ".join(problems))
