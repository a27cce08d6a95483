"""Format detection, conversion between any two layouts, and loading a drafter from any of them."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from dspark.drafters.config import DrafterConfig
from dspark.drafters.io import CONFIG, FORMAT
from dspark.drafters.model import DSparkDrafter
from dspark.interop import deepspec, speculators
from dspark.interop.layout import prepare_output, read_json
from dspark.interop.parts import DrafterParts, read_dspark, write_dspark

FORMATS = ("dspark", "speculators", "deepspec")
EMBEDDED = "embedded"  # CLI word for the drafter shipped for the embedded target


def detect_format(directory: str | Path) -> str:
    """'dspark', 'speculators' or 'deepspec' from a checkpoint dir's config.json; ValueError otherwise."""
    path = Path(directory)
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a checkpoint directory")
    raw = read_json(path / CONFIG)
    if raw.get("format") == FORMAT or _is_bare_dspark(raw):
        return "dspark"
    if speculators.is_speculators(raw):
        return "speculators"
    if deepspec.is_deepspec(raw):
        return "deepspec"
    if "dflash_config" in raw:
        raise ValueError(f"{path} is a z-lab DFlash checkpoint: its anchor is the bonus token (block_size-1 "
                         "drafts), not dspark's anchor-first block; it is not supported")
    raise ValueError(f"{path / CONFIG} is not a known drafter format (expected one of {FORMATS}: "
                     f"\"format\": \"{FORMAT}\", a speculators_model_type, or a DeepSpec Qwen3DSparkModel)")


def read_any(directory: str | Path) -> DrafterParts:
    """A drafter checkpoint of any known format as validated DrafterParts."""
    path = Path(directory)
    readers = {"dspark": read_dspark, "speculators": speculators.read_speculators,
               "deepspec": deepspec.read_deepspec}
    return readers[detect_format(path)](path).validate(str(path))


def resolve_source(src: str | Path) -> Path:
    """SRC as a path; the word 'embedded' names the shipped DSpark drafter (clear error if not there)."""
    if str(src) == EMBEDDED:
        from dspark.spec.factory import CHECKPOINTS, SHIPPED

        path = CHECKPOINTS / SHIPPED["DSPARK"]
        if not (path / CONFIG).is_file():
            raise FileNotFoundError(f"SRC 'embedded': no shipped DSPARK drafter at {path} (not trained or "
                                    "installed yet); pass a drafter directory instead")
        return path
    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"source {path} does not exist")
    return path


def convert(src: str | Path, dst: str | Path, *, to: str, target: str | Path | None = None,
            verifier: str | None = None, model_type: str | None = None, force: bool = False) -> Path:
    """Convert the drafter in src (any known format, or 'embedded') to format `to` in dst.

    target: the target model dir, required for `to="deepspec"` and for a reduced-vocabulary
    drafter going to speculators; verifier / model_type: see speculators.write_speculators.
    """
    if to not in FORMATS:
        raise ValueError(f"unknown output format {to!r}; choose one of {FORMATS}")
    if str(src) == EMBEDDED and target is None:  # the shipped drafter's target is the embedded model
        from dspark.models.embedded import embedded_model_dir

        target = embedded_model_dir() if (embedded_model_dir() / CONFIG).is_file() else None
    src, dst = resolve_source(src), Path(dst).expanduser()
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError("source and destination are the same directory")
    parts = read_any(src)
    if to == "speculators":
        return speculators.write_speculators(parts, dst, target=target, verifier=verifier,
                                             model_type=model_type, force=force)
    if to == "deepspec":
        if target is None:
            raise ValueError("--to deepspec needs the target model (--target DIR): DeepSpec checkpoints carry "
                             "its config, embedding and LM head")
        return deepspec.write_deepspec(parts, dst, target=target, force=force)
    prepare_output(dst, force)
    write_dspark(dst, parts)
    return dst


def load_any_drafter(directory: str | Path, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> DSparkDrafter:
    """DSparkDrafter.from_pretrained for a dspark, speculators or DeepSpec checkpoint dir."""
    path = Path(directory)
    fmt = detect_format(path)
    if fmt == "dspark":
        return DSparkDrafter.from_pretrained(path, embed_weight, lm_head_weight)
    if fmt == "deepspec":
        return deepspec.load_deepspec(path, embed_weight, lm_head_weight)
    return speculators.read_speculators(path).build(embed_weight, lm_head_weight)


def _is_bare_dspark(raw: dict) -> bool:
    """A dspark config.json without its "format" key (drafters/io.py still reads those)."""
    fields = {f.name for f in dataclasses.fields(DrafterConfig)}
    required = {f.name for f in dataclasses.fields(DrafterConfig) if f.default is dataclasses.MISSING}
    return "format" not in raw and required <= raw.keys() and set(raw) <= fields | {"dspark"}


__all__ = ["EMBEDDED", "FORMATS", "convert", "detect_format", "load_any_drafter", "read_any", "resolve_source"]
