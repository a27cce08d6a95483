"""Load a Decoder from a local Hugging Face directory (safetensors weights)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from dspark.models import native
from dspark.models.config import ModelConfig
from dspark.models.decoder import Decoder
from dspark.models.int4 import int4_kernel, quantize_linears_int4
from dspark.models.packing import pack_linears, packing_supported
from dspark.models.q8 import Q8Linear, native_q8

_PREFIX = "model."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATION_CHOICES = ("auto", "none", "int4")


def resolve_dtype(dtype: str, device: str = "cpu") -> torch.dtype:
    """A dtype name -> torch dtype. "auto": bf16 on CUDA and on CPUs with packed bf16 kernels (AMX /
    AVX-512-bf16), where verifying a block of drafts costs about what decoding one token does; fp32 elsewhere."""
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype != "auto":
        return DTYPES[dtype]
    if torch.device(device).type == "cuda" or packing_supported(torch.bfloat16, device):
        return torch.bfloat16
    return torch.float32


def load_decoder(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 pack: bool = False, quantization: str = "none") -> Decoder:
    """Build the decoder for `path/config.json` and load its safetensors weights. `pack`: for
    inference, put the linears in oneDNN's packed layout where that is supported (bf16 on CPU).
    `quantization` (see _apply_quantization): "int4" runs the layers' linears with 4-bit weights."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {quantization!r}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {path}: expected a local Hugging Face model directory")
    cfg = ModelConfig.from_pretrained(path)
    weights = _read_safetensors(path)
    with torch.device("meta"):
        model = Decoder(cfg)
    state = _to_dspark_names(weights, cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = type(model.rotary)(torch.tensor(cfg.inv_freq), cfg.rope_scale, 4096)
    model.quantization = _apply_quantization(quantization, model, dtype, device)
    model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
    for layer in model.layers:
        layer.self_attn.invariant = model.invariant
        if getattr(layer.self_attn.qkv_proj, "_kernel", None) == "avx2":
            layer.self_attn._kernels = "avx2"
    if pack and packing_supported(dtype, device):
        pack_linears(model, keep=("lm_head",))  # the drafter reads the (tied) LM head
    return model


def _apply_quantization(quantization: str, model: Decoder, dtype: torch.dtype, device: str) -> str:
    """Put the layers' linears in the chosen weight format; returns "none" or "int4" (4-bit groups of
    32 through a CPU int4 kernel, models/int4.int4_kernel: bf16 activations, or fp32 ones on the AVX2
    kernel; embeddings untouched, an LM head that is 8-bit groups already in its own form: models/q8.py).
    "auto" picks int4 only where it is lossless, i.e. the layers' weights already are 4-bit groups (a GGUF
    Q4_0/Q4_1 model such as the embedded default) and a kernel takes the dtype's rows; "int4"
    forces it (round-to-nearest quantization of other weights). Runs on the checkpoint's own values,
    before any cast rounds them."""
    if quantization == "none":
        return "none"
    kernel = int4_kernel(dtype, device)
    if quantization == "int4":
        if kernel is None:
            raise ValueError(f"quantization 'int4' needs dtype bfloat16 on a CPU with PyTorch's int4 kernel, or "
                             f"float32 on a CPU with AVX2 (got dtype {str(dtype).removeprefix('torch.')} on {device})")
        quantize_linears_int4(model.layers, dtype=dtype)
    elif not (kernel and quantize_linears_int4(model.layers, native_only=True, dtype=dtype)):
        return "none"
    # an LM head that already is 8-bit groups (a GGUF's Q8_0 head) runs in that form too, where dspark's
    # kernels run (on 8-bit rows too where the 4-bit matmuls take them, native.act8(), and always on the AVX2
    # kernel); the full-precision head stays for the drafter, which reads its rows (tied: the embeddings)
    if kernel in ("dspark", "avx2") and native_q8(model.lm_head.weight):
        model.lm_head_q8 = Q8Linear(model.lm_head.weight, vnni=native.act8(), avx2=kernel == "avx2")
    return "int4"


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {path}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                out[key] = f.get_tensor(key)
    return out


def _to_dspark_names(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF parameter names -> this decoder's (q/k/v and gate/up fused)."""
    def take(name: str) -> torch.Tensor:
        try:
            return w[_PREFIX + name] if _PREFIX + name in w else w[name]
        except KeyError:
            raise ValueError(f"checkpoint is missing weight {name!r}") from None

    state = {"embed_tokens.weight": take("embed_tokens.weight"), "norm.weight": take("norm.weight")}
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    else:
        state["lm_head.weight"] = w["lm_head.weight"]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        state[a + "qkv_proj.weight"] = torch.cat([take(a + f"{n}_proj.weight") for n in "qkv"])
        if cfg.qkv_bias:
            state[a + "qkv_proj.bias"] = torch.cat([take(a + f"{n}_proj.bias") for n in "qkv"])
        state[a + "o_proj.weight"] = take(a + "o_proj.weight")
        if cfg.o_bias:
            state[a + "o_proj.bias"] = take(a + "o_proj.bias")
        if cfg.qk_norm:
            state[a + "q_norm.weight"] = take(a + "q_norm.weight")
            state[a + "k_norm.weight"] = take(a + "k_norm.weight")
        m = p + "mlp."
        state[m + "gate_up.weight"] = torch.cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        state[m + "down.weight"] = take(m + "down_proj.weight")
        if cfg.mlp_bias:
            state[m + "gate_up.bias"] = torch.cat([take(m + "gate_proj.bias"), take(m + "up_proj.bias")])
            state[m + "down.bias"] = take(m + "down_proj.bias")
        state[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        state[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    return state
