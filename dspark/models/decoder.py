"""One decoder for the Llama, Qwen2 and Qwen3 families, run over ragged batches on a paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from dspark.cache import AttentionMetadata, KVCache
from dspark.models.attention import KV_ALIGN, invariant_attention, sdpa_attention
from dspark.models.config import ModelConfig
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary


@dataclass(frozen=True)
class DecoderOutput:
    """What one forward returns."""

    logits: torch.Tensor | None  # [R, V] for the requested rows, fp32
    hidden: torch.Tensor | None  # [T, m * d] outputs of the requested layers, concatenated


def kv_cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache dtype: the model's, except fp32 under half-precision weights on a CPU. There the
    attention kernel's bf16 rounding depends on how many queries and keys share a call, so a row of
    a verify window would not match the same row decoded alone; in fp32 it does, which keeps
    speculative decoding token-identical to plain decoding (tests/test_packing.py)."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


class Attention(nn.Module):
    """Grouped-query attention with fused qkv, optional q/k RMSNorm (Qwen3) and qkv bias (Qwen2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.h, self.hkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.h + 2 * self.hkv) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor,
                v_pool: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.h + 2 * self.hkv, self.hd)
        if self.q_norm is None:  # one RoPE call for q and k together
            qk = apply_rotary(qkv[:, : self.h + self.hkv], cos, sin)
            q, k = qk[:, : self.h], qk[:, self.h:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, : self.h]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, self.h : self.h + self.hkv]), cos, sin)
        v = qkv[:, self.h + self.hkv:]
        dt = q.dtype
        if k_pool.dtype != dt:  # fp32 cache under bf16 weights on CPU: see Decoder.kv_dtype
            q, k, v = q.to(k_pool.dtype), k.to(k_pool.dtype), v.to(k_pool.dtype)
        k_pool.index_copy_(0, meta.slot_mapping, k)
        v_pool.index_copy_(0, meta.slot_mapping, v)
        b, s = meta.kv_index.shape
        keys = k_pool.index_select(0, meta.kv_index.view(-1)).view(b, s, self.hkv, self.hd).transpose(1, 2)
        vals = v_pool.index_select(0, meta.kv_index.view(-1)).view(b, s, self.hkv, self.hd).transpose(1, 2)
        if meta.q_index is None:  # one sequence: no padding
            qp = q.reshape(1, t, self.h, self.hd).transpose(1, 2)
        else:
            qp = q.new_zeros(b * meta.max_q, self.h, self.hd).index_copy_(0, meta.q_index, q)
            qp = qp.view(b, meta.max_q, self.h, self.hd).transpose(1, 2)
        attend = invariant_attention if k_pool.dtype != dt else sdpa_attention
        out = attend(qp, keys, vals, meta.mask).to(dt)
        out = out.transpose(1, 2).reshape(b * meta.max_q, self.h * self.hd)  # [B*Q, H*hd]
        if meta.q_index is not None:
            out = out.index_select(0, meta.q_index)
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, x, cos, sin, k_pool, v_pool, meta):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_pool, v_pool, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The target model. `forward` appends a ragged batch of tokens to the cache and returns logits
    for exactly the rows asked for, plus the hidden states of chosen layers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(torch.tensor(cfg.inv_freq), cfg.rope_scale, min(cfg.max_position_embeddings, 4096))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def kv_dtype(self) -> torch.dtype:
        return kv_cache_dtype(self.dtype, self.device)

    def new_cache(self, num_blocks: int, block_size: int = 16) -> KVCache:
        c = self.config
        return KVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       num_blocks=num_blocks, block_size=block_size, dtype=self.kv_dtype, device=self.device,
                       kv_align=KV_ALIGN if self.kv_dtype != self.dtype else 1)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, *, logits_rows: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = ()) -> DecoderOutput:
        """input_ids, positions: [T]; logits_rows: [R] indices into T (None = no logits)."""
        x = self.embed_tokens(input_ids)  # [T, d]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        wanted = set(hidden_layers)
        taps = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i], cache.v[i], meta)
            if i in wanted:
                taps[i] = x
        hidden = torch.cat([taps[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        logits = None
        if logits_rows is not None:
            logits = self.lm_head(self.norm(x.index_select(0, logits_rows))).float()
        return DecoderOutput(logits=logits, hidden=hidden)
