"""ModelConfig: the decoder's shape and flags, read from a Hugging Face config.json."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

# HF `architectures` entry -> family flags. One decoder serves all of them.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": {"qkv_bias_always": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias_always": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias_always": False, "qk_norm": True},
}


@dataclass(frozen=True)
class ModelConfig:
    """Shape and family flags of a Llama / Qwen2 / Qwen3 decoder."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    inv_freq: tuple[float, ...]  # RoPE inverse frequencies [head_dim/2], scaling applied
    rope_scale: float  # post-processing factor on cos/sin (yarn / longrope), 1.0 otherwise
    eos_token_ids: tuple[int, ...]
    raw: dict  # the config.json contents, for drafters and checkpoint metadata

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `path/config.json`; raise ValueError for unsupported architectures."""
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {path}; "
                f"dspark supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        flags = SUPPORTED_ARCHITECTURES[arch]
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        attention_bias = bool(raw.get("attention_bias", False))
        inv_freq, scale = _rope(path)
        eos = raw.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=flags["qkv_bias_always"] or attention_bias,
            o_bias=attention_bias and arch == "LlamaForCausalLM",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=flags["qk_norm"],
            inv_freq=tuple(inv_freq.tolist()),
            rope_scale=float(scale),
            eos_token_ids=tuple(eos),
            raw=raw,
        )


def _rope(path: Path) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling for every RoPE type transformers knows."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = AutoConfig.from_pretrained(str(path))
    params = getattr(cfg, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r} in {path}")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE changes with sequence length; dspark does not support it")
    return ROPE_INIT_FUNCTIONS[rope_type](cfg)
