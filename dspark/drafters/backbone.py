"""The DFlash-style parallel backbone: drafter layers whose K/V are [projected context ; block]."""
from __future__ import annotations

import torch
from torch import nn

from dspark.drafters.config import DrafterConfig
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: each [B, S, kv_heads, hd]


def rope(x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
    """RoPE on x [B, T, heads, hd] at positions [B, T]."""
    b, t, h, d = x.shape
    cos, sin = rotary.cos_sin(positions.reshape(-1), x.dtype)
    return apply_rotary(x.reshape(b * t, h, d), cos, sin).view(b, t, h, d)


def block_attention(q: torch.Tensor, k_blk: torch.Tensor, v_blk: torch.Tensor, ctx: KV,
                    ctx_len: torch.Tensor) -> torch.Tensor:
    """Training attention of A blocks at once, linear in A: block a attends to the context rows
    < ctx_len[b, a] and bidirectionally to its own gamma slots, never to another block.

    q [B, A, g, H, hd] (rotated, normed); k_blk / v_blk [B, A, g, Hkv, hd]; ctx K/V [B, S, Hkv, hd];
    ctx_len [B, A] -> [B, A, g, H, hd]. One softmax over [context ; own block] per query, in fp32.
    A dense mask over every block's keys would cost A * g * (S + A * g) per head; this costs A * g * (S + g).
    The scores stay in q's dtype (a bf16 matmul has nothing more to give) with the scale folded into q:
    the softmax accumulates in fp32 inside, and every extra pass over the [.., A, g, S] scores is time.
    """
    b, a, g, h, hd = q.shape
    kc, vc = ctx
    s, hkv = kc.shape[1], kc.shape[2]
    rep = h // hkv
    qh = (q * hd ** -0.5).reshape(b, a, g, hkv, rep, hd).permute(0, 3, 4, 1, 2, 5)  # [B, Hkv, rep, A, g, hd]
    s_ctx = qh.reshape(b, hkv, rep * a * g, hd) @ kc.permute(0, 2, 3, 1)  # [B, Hkv, rep*A*g, S]
    s_ctx = s_ctx.view(b, hkv, rep, a, g, s)
    s_own = qh @ k_blk.permute(0, 3, 1, 4, 2).unsqueeze(2)  # [B, Hkv, rep, A, g, g]
    scores = torch.cat([s_ctx, s_own], dim=-1)
    hidden = torch.arange(s, device=q.device) >= ctx_len.unsqueeze(-1)  # [B, A, S]
    scores[..., :s].masked_fill_(hidden.view(b, 1, 1, a, 1, s), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    out = p[..., :s].reshape(b, hkv, rep * a * g, s) @ vc.transpose(1, 2)  # [B, Hkv, rep*A*g, hd]
    out = out.view(b, hkv, rep, a, g, hd) + p[..., s:] @ v_blk.permute(0, 3, 1, 2, 4).unsqueeze(2)
    return out.permute(0, 3, 4, 1, 2, 5).reshape(b, a, g, h, hd)


class DrafterAttention(nn.Module):
    """Block queries attend to injected context K/V and to their own block's K/V."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def key_value(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> KV:
        """K (normed, rotated) and V of x [B, T, d] at positions [B, T] -> each [B, T, kv_heads, hd]."""
        b, t, _ = x.shape
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        return rope(k, positions, rotary), v

    def query(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        """Queries (normed, rotated) of x [B, T, d] at positions [B, T] -> [B, T, heads, hd]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        return rope(q, positions, rotary)

    def forward_blocks(self, x: torch.Tensor, positions: torch.Tensor, ctx: KV, ctx_len: torch.Tensor,
                       rotary: Rotary) -> torch.Tensor:
        """Training: x [B, A, g, d] block states at positions [B, A, g]; block a sees ctx rows < ctx_len[:, a]."""
        b, a, g, d = x.shape
        flat, pos = x.reshape(b, a * g, d), positions.reshape(b, a * g)
        q = self.query(flat, pos, rotary).view(b, a, g, self.heads, self.head_dim)
        kb, vb = (t.view(b, a, g, self.kv_heads, self.head_dim) for t in self.key_value(flat, pos, rotary))
        out = block_attention(q, kb, vb, ctx, ctx_len)
        return self.o_proj(out.reshape(b, a, g, self.heads * self.head_dim))


class DrafterLayer(nn.Module):
    """Pre-norm decoder layer: KV-injected attention then SwiGLU MLP."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward_blocks(self, x: torch.Tensor, positions: torch.Tensor, ctx: KV, ctx_len: torch.Tensor,
                       rotary: Rotary) -> torch.Tensor:
        """Training form over anchored blocks: x [B, A, g, d] -> [B, A, g, d]."""
        x = x + self.self_attn.forward_blocks(self.input_layernorm(x), positions, ctx, ctx_len, rotary)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    """Context projection (fc + hidden_norm), the drafter layers and the final norm."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        d = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_context_layers * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg.rms_norm_eps)  # the context norm of docs/method.md#context-features
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        # Kept outside the module tree on purpose: .to(bf16) must not cast the fp32 RoPE table,
        # and cos_sin() already follows the positions' device.
        object.__setattr__(self, "rotary", Rotary(inv_freq))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """Target features [B, S, m*d] at positions [B, S] -> per layer (K, V) [B, S, kvh, hd]."""
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        return [layer.self_attn.key_value(ctx, positions, self.rotary) for layer in self.layers]

    def run_blocks(self, x: torch.Tensor, positions: torch.Tensor, ctx: list[KV],
                   ctx_len: torch.Tensor) -> torch.Tensor:
        """Training: block inputs x [B, A, g, d] at positions [B, A, g], block a seeing context rows
        < ctx_len[:, a] -> final-normed hidden [B, A, g, d]."""
        for layer, kv in zip(self.layers, ctx):
            x = layer.forward_blocks(x, positions, kv, ctx_len, self.rotary)
        return self.norm(x)
