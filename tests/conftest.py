"""Shared fixtures: tiny random-weight Llama / Qwen2 / Qwen3 checkpoints and the embedded model."""
from __future__ import annotations

import pytest
import torch

from dspark.models.embedded import ensure_embedded_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, vocab_size=49152, rms_norm_eps=1e-6,
            eos_token_id=2, bos_token_id=1)


def make_tiny_model(path, arch: str, seed: int = 0, **overrides):
    """Save a random-weight HF model of family `arch` (with the embedded tokenizer) under `path`."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    from transformers import Qwen3Config, Qwen3ForCausalLM

    families = {
        "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=True)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=False)),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=32)),
    }
    cfg_cls, model_cls, extra = families[arch]
    torch.manual_seed(seed)
    cfg = cfg_cls(**{**TINY, **extra, **overrides})
    model = model_cls(cfg).eval()
    with torch.no_grad():  # random norms and biases too, so a missed weight shows up in parity tests
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(ensure_embedded_model())).save_pretrained(str(path))
    return path


@pytest.fixture(scope="session", params=["llama", "qwen2", "qwen3"])
def tiny_model_dir(request, tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def embedded_dir():
    return ensure_embedded_model()


@pytest.fixture(scope="session")
def embedded_llm():
    from dspark import LLM

    return LLM()
