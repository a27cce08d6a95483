"""The drafter's inference form: feeding committed context and drafting one block per request, with
the weights fused so that a drafting round makes few, large calls.

Why: a drafting round is paid on every speculative step. At batch 1 on a CPU the module-by-module pass
cost ~0.4 of a target step, mostly call overhead and weights streamed from memory, and only the part
of a round that the drafts' survival pays back is worth spending. Here:
- the context K/V of every drafter layer come from one projection of the fed features;
- a layer's q, k and v come from one matmul, its gate and up from another;
- the LM head also computes the hidden half of the confidence logit (one extra row);
- each sequential position costs one small matmul: the Markov bias and the token half of the
  confidence logit together (the vanilla head; gated and recurrent heads run their own step);
- requests are padded into one batch and the block is one pass per layer, whatever their number.
On a CPU with packed bf16 kernels every matrix is in oneDNN's packed layout. Drafts need not be
bit-identical between batch shapes (verification keeps the output exact whatever is drafted), so calls
are not padded to fixed row counts the way the target's are.

The training form (DSparkDrafter.forward_train) stays the reference this must match
(tests/test_drafter.py::test_train_matches_draft).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from dspark.drafters.blocks import block_positions, draft_mask
from dspark.drafters.cache import DrafterCache
from dspark.models.layers import apply_rotary

Linear = Callable[[torch.Tensor], torch.Tensor]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool) -> Linear:
    """x [..., in] -> [..., out]: a packed oneDNN call, or F.linear on the tensors as they are."""
    weight = weight.detach().contiguous()
    bias = None if bias is None else bias.detach()
    if pack:
        from dspark.models.packing import PackedLinear

        return PackedLinear(weight, bias)  # no row_chunk: no padding to fixed row counts
    return partial(F.linear, weight=weight, bias=bias)


def _fused(linears, pack: bool) -> Linear:
    """nn.Linears over the same input as one call: their outputs side by side."""
    bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
    return _linear(torch.cat([lin.weight for lin in linears]), bias, pack)


class _Layer:
    """One drafter layer's fused weights (norm modules are the drafter's own)."""

    def __init__(self, layer, pack: bool):
        a = layer.self_attn
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm = a.q_norm if a.qk_norm else None
        self.k_norm = a.k_norm if a.qk_norm else None
        self.qkv = _fused([a.q_proj, a.k_proj, a.v_proj], pack)
        self.o = _linear(a.o_proj.weight, a.o_proj.bias, pack)
        self.gate_up = _linear(layer.mlp.gate_up.weight, layer.mlp.gate_up.bias, pack)
        self.down = _linear(layer.mlp.down.weight, layer.mlp.down.bias, pack)
        self.intermediate = layer.mlp.intermediate


class DraftRunner:
    """Inference-only: extend_many() and draft() of a DSparkDrafter on fused weights. Built from the
    drafter's weights as they are; build a new one after the weights change."""

    def __init__(self, drafter, pack: bool = False):
        c = drafter.config
        self.drafter = drafter
        self.num_heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gamma, self.vd = c.block_size, c.draft_vocab
        self.layers = [_Layer(layer, pack) for layer in drafter.layers]
        self.fc = _linear(drafter.fc.weight, None, pack)
        attns = [layer.self_attn for layer in drafter.layers]
        self.ctx_kv = _fused([lin for a in attns for lin in (a.k_proj, a.v_proj)], pack)
        self.ctx_k_norms = [a.k_norm for a in attns] if c.qk_norm else None
        d, mh, conf = c.hidden_size, drafter.markov_head, drafter.confidence_head
        w_conf = conf.proj.weight.detach() if conf is not None else None  # [1, d (+ r)]
        head = drafter.lm_head if conf is None else torch.cat([drafter.lm_head, w_conf[:, :d]])
        self.head = _linear(head, None, pack)  # [Vd (+1 confidence row)]
        self.conf = conf  # its bias is read at each call: an STS offset may be folded in after packing
        self.markov = mh
        self.token_rows: Linear | None = None  # vanilla head: W1[x] -> [Markov bias ; confidence token half]
        self.conf_token: Linear | None = None  # other heads: W1[x] -> confidence token half
        if mh is not None:
            w_tok = w_conf[:, d:] if conf is not None else None
            if mh.head_type == "vanilla":
                w2 = mh.markov_w2.weight
                self.token_rows = _linear(w2 if w_tok is None else torch.cat([w2, w_tok]), None, pack)
            elif w_tok is not None:
                self.conf_token = _linear(w_tok, None, pack)

    # ---- context ---------------------------------------------------------------------------------
    @torch.no_grad()
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target features [n, m*d] at positions [n] -> context K/V of every layer [n, layers, 2, kvh, hd]."""
        dr, n = self.drafter, features.shape[0]
        ctx = dr.hidden_norm(self.fc(features.to(dr.fc.weight.dtype)))
        kv = self.ctx_kv(ctx).view(n, len(self.layers), 2, self.kv_heads, self.head_dim)
        k = kv[:, :, 0]
        if self.ctx_k_norms is not None:
            k = torch.stack([norm(k[:, i]) for i, norm in enumerate(self.ctx_k_norms)], dim=1)
        cos, sin = dr.rotary.cos_sin(positions, k.dtype)
        k = apply_rotary(k.reshape(n, -1, self.head_dim), cos, sin).view_as(k)
        return torch.stack([k, kv[:, :, 1]], dim=2)

    @torch.no_grad()
    def extend_many(self, caches: Sequence[DrafterCache], target_hidden: Sequence[torch.Tensor],
                    start_pos: Sequence[int]) -> None:
        """See DSparkDrafter.extend_many."""
        sizes = [h.shape[0] for h in target_hidden]
        if sum(sizes):
            device = target_hidden[0].device
            pos = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(start_pos, sizes)])
            kv = self.context_kv(torch.cat(list(target_hidden)), pos)
        offset = 0
        for cache, start, n in zip(caches, start_pos, sizes):
            cache.truncate(start)
            if n:
                cache.append(kv[offset:offset + n])
            offset += n

    # ---- one block per request ---------------------------------------------------------------------
    @torch.no_grad()
    def block(self, caches: Sequence[DrafterCache], anchors: torch.Tensor, anchor_pos: torch.Tensor,
              num_drafts: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The parallel pass: anchors, anchor_pos [R] -> (final-normed hidden [R, n, d], base logits
        [R, n, Vd] fp32, the confidence logits' hidden half plus bias [R, n] fp32 or None) of the first
        n = num_drafts (default gamma) slots. The backbone always runs the whole block (its slots attend
        to each other); only the heads skip the slots nobody will verify."""
        dr, r, g = self.drafter, len(caches), self.gamma
        lengths = [c.length for c in caches]
        ctx = pad_sequence([c.kv[:c.length] for c in caches], batch_first=True)  # [R, L, layers, 2, kvh, hd]
        mask = None
        if min(lengths) != max(lengths):
            mask = draft_mask(torch.as_tensor(lengths, device=anchors.device), max(lengths), g).unsqueeze(1)
        pos = block_positions(anchor_pos, g).reshape(-1)
        cos, sin = dr.rotary.cos_sin(pos, ctx.dtype)
        x = dr.embed_weight[dr._block_ids(anchors)].reshape(r * g, -1).to(ctx.dtype)
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, layer.input_norm(x), ctx[:, :, i], mask, cos, sin, r)
            gate, up = layer.gate_up(layer.post_norm(x)).split(layer.intermediate, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        h = dr.norm(x.view(r, g, -1)[:, :num_drafts or g])
        return (h, *self.heads(h))

    def heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final-normed hidden h [..., d] -> (base logits [..., Vd] fp32, the confidence logit's hidden
        half plus its bias [...] fp32, or None without a confidence head)."""
        out = self.head(h).float()
        if self.conf is None:
            return out, None
        return out[..., :self.vd], out[..., self.vd] + self.conf.proj.bias.float()

    def _attention(self, layer: _Layer, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
        """x [R*gamma, d] normed; ctx [R, L, 2, kvh, hd] -> attention output after o_proj [R*gamma, d]."""
        h, hkv, hd, g = self.num_heads, self.kv_heads, self.head_dim, self.gamma
        qkv = layer.qkv(x).view(r * g, h + 2 * hkv, hd)
        q, k, v = qkv.split([h, hkv, hkv], dim=1)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        qk = apply_rotary(torch.cat([q, k], dim=1), cos, sin)
        q = qk[:, :h].view(r, g, h, hd).transpose(1, 2)
        keys = torch.cat([ctx[:, :, 0], qk[:, h:].view(r, g, hkv, hd)], dim=1).transpose(1, 2)
        vals = torch.cat([ctx[:, :, 1], v.reshape(r, g, hkv, hd)], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=h != hkv)
        return layer.o(out.transpose(1, 2).reshape(r * g, h * hd))

    # ---- the sequential heads ------------------------------------------------------------------------
    def step(self, prev: torch.Tensor, h: torch.Tensor, base: torch.Tensor, conf: torch.Tensor | None,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One position: previous tokens prev [R] (target ids), hidden h [R, d], base logits [R, Vd] and the
        confidence's hidden half [R] -> (corrected logits [R, Vd], confidence logits [R], next state)."""
        if self.markov is None:
            return base, conf, state
        emb = self.markov.prev_embedding(prev)
        if self.token_rows is not None:  # vanilla: bias and the confidence's token half in one product
            rows = self.token_rows(emb).float()
            z = base + rows[:, :self.vd]
            return z, (conf + rows[:, self.vd] if conf is not None else None), state
        bias, state = self.markov.step(emb, h, state)
        if conf is not None:
            conf = conf + self.conf_token(emb).float().squeeze(-1)
        return base + bias.float(), conf, state
