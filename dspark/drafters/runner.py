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
- requests are padded into one batch and the block is one pass per layer, whatever their number;
- attention reads the context K/V as plain matrices (copied once per round into a buffer kept
  between rounds) and joins context and block in the scores, not by copying K/V next to the block's;
- the base logits stay in the drafter's dtype until a position is corrected (no whole-block fp32
  copy), and the engine does not ask for the corrected logits at all.
On a CPU with packed bf16 kernels every matrix is in oneDNN's packed layout. Where dspark's kernels
run (models/native.py) the matrices are 8-bit groups of 32 instead, multiplied by rows rounded to 8-bit
groups on VNNI (q8_vnni_mm.c: half the bytes of bf16, and faster than oneDNN's bf16 at every row count
measured, 1 to 224; the rounding moves a draft's logits by under 1%), or with weight_bits=4
(`draft_quantization="int4"`) 4-bit groups on the target's kernel (int4_mm.c; about half the bytes, the
shipped drafter's tau within 0.01); attention is the kernels' fp32
row-at-a-time attention over one key matrix per head, with RoPE and the block's K/V write in one call;
and greedy drafts through the vanilla Markov head are picked for every position in one call (markov.c)
instead of ~8 PyTorch ops per position. Drafts need not be bit-identical between batch shapes
(verification keeps the output exact whatever is drafted), so calls are not padded to fixed row counts
the way the target's are.

The training form (DSparkDrafter.forward_train) stays the reference this must match
(tests/test_drafter.py::test_train_matches_draft).
"""
from __future__ import annotations

import ctypes
import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.nn.functional as F

from dspark.drafters.blocks import block_positions, draft_mask
from dspark.drafters.cache import DrafterCache
from dspark.models import native, native_avx2
from dspark.models.int4 import Int4Linear
from dspark.models.layers import apply_rotary
from dspark.models.q8 import GROUP as Q8_GROUP, Q8Linear

Linear = Callable[[torch.Tensor], torch.Tensor]


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, pack: bool, bits: int = 8) -> Linear:
    """x [..., in] -> [..., out]: dspark's 8-bit kernels (VNNI on bf16 rows, AVX2 on fp32 rows), their 4-bit
    one (bits=4, bf16 rows), or a packed oneDNN call, or F.linear on the tensors as they are."""
    weight = weight.detach().contiguous()
    bias = None if bias is None else bias.detach()
    if pack:
        if weight.dtype == torch.bfloat16 and weight.shape[1] % Q8_GROUP == 0 and native.library() is not None:
            if bits == 4:
                return Int4Linear(weight, bias)
            return Q8Linear(weight, bias, out_dtype=torch.bfloat16, vnni=True)
        if weight.dtype == torch.float32 and weight.shape[1] % Q8_GROUP == 0 and native_avx2.library() is not None:
            return Q8Linear(weight, bias, avx2=True)
        from dspark.models.packing import PackedLinear

        return PackedLinear(weight, bias)  # no row_chunk: no padding to fixed row counts
    return partial(F.linear, weight=weight, bias=bias)


def _fused(linears, pack: bool, bits: int = 8) -> Linear:
    """nn.Linears over the same input as one call: their outputs side by side."""
    bias = None if linears[0].bias is None else torch.cat([lin.bias for lin in linears])
    return _linear(torch.cat([lin.weight for lin in linears]), bias, pack, bits)


def _on_kernel(lin: Linear, w4: bool, avx2: bool = False) -> bool:
    """Whether a projection is one the fused kernel calls take (csrc/layer.c): no bias or padded rows, on
    the 4-bit kernel where w4, else the 8-bit VNNI one; with avx2 (csrc/avx2_drafter.c), the 8-bit AVX2 one."""
    if w4:
        return isinstance(lin, Int4Linear) and lin._native and lin.bias is None and lin._rows == lin.out_features
    return (isinstance(lin, Q8Linear) and (lin.avx2 if avx2 else lin.vnni) and lin.bias is None
            and lin._rows == lin.out_features)


class _Layer:
    """One drafter layer's fused weights (norm modules are the drafter's own)."""

    def __init__(self, layer, pack: bool, bits: int):
        a = layer.self_attn
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm = a.q_norm if a.qk_norm else None
        self.k_norm = a.k_norm if a.qk_norm else None
        self.qkv = _fused([a.q_proj, a.k_proj, a.v_proj], pack, bits)
        self.o = _linear(a.o_proj.weight, a.o_proj.bias, pack, bits)
        self.gate_up = _linear(layer.mlp.gate_up.weight, layer.mlp.gate_up.bias, pack, bits)
        self.down = _linear(layer.mlp.down.weight, layer.mlp.down.bias, pack, bits)
        self.intermediate = layer.mlp.intermediate


def _fusable(layer: _Layer, head_dim: int, w4: bool, avx2: bool = False) -> bool:
    """Whether a layer runs as one kernel call (dspark_drafter_layer; with avx2, dspark_avx2_drafter_layer):
    projections _on_kernel, shapes the kernels take."""
    if avx2:
        return (all(_on_kernel(lin, False, True) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
                and head_dim % 16 == 0 and head_dim <= 256 and layer.intermediate % 8 == 0)
    return (all(_on_kernel(lin, w4) for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
            and head_dim % 32 == 0 and layer.intermediate % 16 == 0)


def _block_attention(q: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor, own_k: torch.Tensor,
                     own_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of a block's queries q [R, h, g, hd] over the cached context ctx_k, ctx_v [R, kvh, L, hd]
    followed by the block's own keys and values own_k, own_v [R, g, kvh, hd] (query heads grouped over
    kv heads as in GQA); mask [R, 1, g, L + g] or None -> [R, h, g, hd].

    Matmuls over the context and over the block apart, joined in the scores, so the context K/V are
    never copied next to the block's; scores in the drafter's dtype, an fp32 softmax (the shipped
    drafter's acceptance did not move against the fused kernel). For a handful of queries this is also
    cheaper than the fused CPU kernel, whose work is split by query blocks (at 16 requests it took ~3x
    as long)."""
    r, h, g, hd = q.shape
    kvh, length = ctx_k.shape[1], ctx_k.shape[2]
    rows = q.reshape(r, kvh, (h // kvh) * g, hd)
    scores = torch.cat([torch.matmul(rows, ctx_k.transpose(-1, -2)),
                        torch.matmul(rows, own_k.permute(0, 2, 3, 1))], dim=-1).float()
    scores = scores.view(r, kvh, h // kvh, g, length + g)
    if mask is not None:
        scores = scores.masked_fill(~mask.view(r, 1, 1, g, length + g), float("-inf"))
    probs = torch.softmax(scores.mul_(hd ** -0.5), dim=-1).to(q.dtype).view(r, kvh, (h // kvh) * g, -1)
    out = torch.matmul(probs[..., :length], ctx_v)
    out = out.add_(torch.matmul(probs[..., length:], own_v.transpose(1, 2)))
    return out.view(r, h, g, hd)


class DraftRunner:
    """Inference-only: extend_many() and draft() of a DSparkDrafter on fused weights. Built from the
    drafter's weights as they are; build a new one after the weights change."""

    def __init__(self, drafter, pack: bool = False, weight_bits: int = 8):
        """pack: the inference layouts (see the module docstring); weight_bits: 4 puts every projection and the
        LM head on dspark's 4-bit kernel (round to nearest, groups of 32) where it runs, 8 the default."""
        if weight_bits not in (4, 8):
            raise ValueError(f"drafter weight_bits must be 4 or 8, got {weight_bits}")
        c = drafter.config
        self.drafter = drafter
        self.num_heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.gamma, self.vd = c.block_size, c.draft_vocab
        self._ctx_buf: torch.Tensor | None = None  # see _context
        # attention and greedy picks on dspark's AVX-512 kernels (bf16 drafters; an fp32 one runs PyTorch's ops there)
        self._native = pack and native.library() is not None and drafter.fc.weight.dtype == torch.bfloat16
        bits = weight_bits
        self.layers = [_Layer(layer, pack, bits) for layer in drafter.layers]
        self.fc = _linear(drafter.fc.weight, None, pack, bits)
        attns = [layer.self_attn for layer in drafter.layers]
        self.ctx_kv = _fused([lin for a in attns for lin in (a.k_proj, a.v_proj)], pack, bits)
        self.ctx_k_norms = [a.k_norm for a in attns] if c.qk_norm else None
        d, mh, conf = c.hidden_size, drafter.markov_head, drafter.confidence_head
        w_conf = conf.proj.weight.detach() if conf is not None else None  # [1, d (+ r)]
        head = drafter.lm_head if conf is None else torch.cat([drafter.lm_head, w_conf[:, :d]])
        self.head = _linear(head, None, pack, bits)  # [Vd (+1 confidence row)]
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
        self._w4 = isinstance(self.fc, Int4Linear)  # the fused calls' projections are 4-bit
        self._fused_layers = self._native and all(_fusable(layer, c.head_dim, self._w4) for layer in self.layers)
        self._fused_context = (self._native and c.head_dim % 32 == 0 and c.hidden_size % 16 == 0
                               and all(_on_kernel(lin, self._w4) for lin in (self.fc, self.ctx_kv)))
        # an fp32 drafter on the AVX2 kernels: its layers, context projection and greedy picks one call each
        avx2 = (pack and not self._native and native_avx2.library() is not None
                and drafter.fc.weight.dtype == torch.float32 and c.hidden_size % 8 == 0)
        self._avx2_layers = avx2 and all(_fusable(layer, c.head_dim, False, True) for layer in self.layers)
        self._avx2_context = (avx2 and c.head_dim % 16 == 0 and c.head_dim <= 256
                              and all(_on_kernel(lin, False, True) for lin in (self.fc, self.ctx_kv)))
        # greedy picks through the vanilla Markov head in one call on fp32 rows (csrc/avx2_drafter.c)
        self._avx2_chain = (avx2 and isinstance(self.token_rows, Q8Linear) and self.token_rows.avx2
                            and self.token_rows.bias is None and mh.markov_w1.weight.dtype == torch.float32)
        self._ctx_k_gains = (None if self.ctx_k_norms is None else  # [layers, hd] fp32, for the fused call
                             torch.stack([norm._cached_weight(None) for norm in self.ctx_k_norms]).contiguous())
        self._chain = None  # (W1, packed W2, confidence token half): greedy picks in one call (markov.c)
        if self._native and mh is not None and mh.head_type == "vanilla" and mh.rank <= 256:
            self._chain = (mh.markov_w1.weight.detach().to(torch.bfloat16).contiguous(),
                           native.markov_pack(native.library(), mh.markov_w2.weight),
                           None if w_tok is None else w_tok[0].to(torch.bfloat16).contiguous())
        self._plan = self._block_plan()  # greedy_block()'s weights, or None where its one call does not run

    @property
    def _kernel_ctx(self) -> bool:
        """Whether the block pass runs on the kernels (_backbone_on_kernels), and _context lays the requests' context
        out as a cache pool per layer in fp32: dspark's AVX-512 kernels, or the AVX2 drafter layers. Read from the
        flags each time, so a test or benchmark that switches one off gets the op-by-op route whole."""
        return self._native or self._avx2_layers

    def _block_plan(self) -> "native.DraftWeights | None":
        """The fixed arguments of dspark_draft_block (csrc/draft_block.c) for greedy_block(), or None unless
        every part of a greedy round runs on dspark's kernels here: the fused layers, the LM head (with the
        confidence's hidden row) on the same kernel as the layers' projections, the vanilla Markov head's picks,
        one RMSNorm eps, a bf16 embedding. The tensors it points into are kept in self._plan_refs."""
        dr, c, head = self.drafter, self.drafter.config, self.head
        if not (self._fused_layers and self._chain is not None):
            return None
        head_on_kernel = (isinstance(head, Int4Linear) and head._native if self._w4 else
                          isinstance(head, Q8Linear) and head.vnni) and head.bias is None
        if not (head_on_kernel and dr.embed_weight.dtype == torch.bfloat16 and dr.embed_weight.is_contiguous()):
            return None
        norms = [self.layers[0].input_norm, dr.norm] + [n for layer in self.layers for n in (layer.input_norm,
                                                                                              layer.post_norm)]
        q_norms = [n for layer in self.layers for n in (layer.q_norm, layer.k_norm) if n is not None]
        if len({n.eps for n in norms}) != 1 or len({n.eps for n in q_norms}) > 1:
            return None
        refs, layer_ptrs = [], []
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else dr.norm
            ws = [layer.post_norm._cached_weight(None), nxt._cached_weight(None), layer.qkv.packed, layer.o.packed,
                  layer.gate_up.packed, layer.down.packed]
            ws += [None, None] if layer.q_norm is None else [layer.q_norm._cached_weight(None),
                                                              layer.k_norm._cached_weight(None)]
            refs += [w for w in ws if w is not None]
            layer_ptrs += [0 if w is None else w.data_ptr() for w in ws]
        layers = torch.tensor(layer_ptrs, dtype=torch.int64)
        w1, w2, w_tok = self._chain
        ln_in = self.layers[0].input_norm._cached_weight(None)
        refs += [layers, w1, w2, ln_in, dr.embed_weight, self.head.packed] + ([] if w_tok is None else [w_tok])
        d2t = None if dr.d2t is None else dr.d2t.to(torch.int64).contiguous()
        if d2t is not None:
            refs.append(d2t)
        self._plan_refs = refs
        return native.DraftWeights(
            embed=dr.embed_weight.data_ptr(), ln_in=ln_in.data_ptr(), layers=layers.data_ptr(),
            head=self.head.packed.data_ptr(), w1=w1.data_ptr(), w2=w2.data_ptr(),
            w_tok=None if w_tok is None else w_tok.data_ptr(), d2t=None if d2t is None else d2t.data_ptr(),
            n_layers=len(self.layers), d=c.hidden_size, h=self.num_heads, hkv=self.kv_heads, hd=self.head_dim,
            inter=self.layers[0].intermediate, vd=self.vd, head_rows=self.head._rows, rank=w1.shape[1],
            mask_id=c.mask_token_id, eps=norms[0].eps, qk_eps=q_norms[0].eps if q_norms else 1e-6,
            q_scale=self.head_dim ** -0.5, w4=int(self._w4))

    # ---- context ---------------------------------------------------------------------------------
    @torch.no_grad()
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Target features [n, m*d] at positions [n] -> context K/V of every layer [n, layers, 2, kvh, hd]."""
        dr, n = self.drafter, features.shape[0]
        if self._native and self._fused_context and features.dtype == torch.bfloat16 and features.is_contiguous():
            return self._context_kv_fused(features, positions)
        if self._avx2_context and features.dtype == torch.float32 and features.is_contiguous():
            return self._context_kv_avx2(features, positions)
        ctx = dr.hidden_norm(self.fc(features.to(dr.fc.weight.dtype)))
        kv = self.ctx_kv(ctx).view(n, len(self.layers), 2, self.kv_heads, self.head_dim)
        k = kv[:, :, 0]
        if self.ctx_k_norms is not None:
            k = torch.stack([norm(k[:, i]) for i, norm in enumerate(self.ctx_k_norms)], dim=1)
        cos, sin = dr.rotary.cos_sin(positions, k.dtype)
        k = apply_rotary(k.reshape(n, -1, self.head_dim), cos, sin).view_as(k)
        return torch.stack([k, kv[:, :, 1]], dim=2)

    def _context_kv_fused(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """context_kv() as one kernel call (csrc/layer.c, dspark_drafter_context)."""
        dr, (n, k_in), d = self.drafter, features.shape, self.drafter.config.hidden_size
        layers, hkv, hd = len(self.layers), self.kv_heads, self.head_dim
        out = torch.empty(n, layers, 2, hkv, hd, dtype=torch.bfloat16)
        scratch = torch.empty(n * d, dtype=torch.bfloat16)
        widest = max(k_in, d)
        xq = torch.empty(n * widest, dtype=torch.int8)
        e = torch.empty(n * widest // Q8_GROUP, dtype=torch.float32)
        sx = torch.empty(n * widest // Q8_GROUP, dtype=torch.int32)
        positions = positions.to(torch.int64).contiguous()
        cos, sin = dr.rotary.tables(positions)
        norms = self._ctx_k_gains
        native.loaded().dspark_drafter_context(
            features.data_ptr(), n, k_in, d, self.fc.packed.data_ptr(), dr.hidden_norm._cached_weight(None).data_ptr(),
            dr.hidden_norm.eps, self.ctx_kv.packed.data_ptr(), layers, hkv, hd,
            None if norms is None else norms.data_ptr(), 1e-6 if norms is None else self.ctx_k_norms[0].eps,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), scratch.data_ptr(), xq.data_ptr(),
            e.data_ptr(), sx.data_ptr(), int(self._w4), torch.get_num_threads())
        return out

    def _context_kv_avx2(self, features: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """context_kv() as one kernel call on fp32 rows (csrc/avx2_drafter.c, dspark_avx2_drafter_context)."""
        dr, (n, k_in), d = self.drafter, features.shape, self.drafter.config.hidden_size
        layers, hkv, hd = len(self.layers), self.kv_heads, self.head_dim
        out = torch.empty(n, layers, 2, hkv, hd, dtype=torch.float32)
        scratch = torch.empty(n * d, dtype=torch.float32)
        positions = positions.to(torch.int64).contiguous()
        cos, sin = dr.rotary.tables(positions)
        norms = self._ctx_k_gains
        native_avx2.loaded().dspark_avx2_drafter_context(
            features.data_ptr(), n, k_in, d, self.fc.packed.data_ptr(), dr.hidden_norm._cached_weight(None).data_ptr(),
            dr.hidden_norm.eps, self.ctx_kv.packed.data_ptr(), layers, hkv, hd,
            None if norms is None else norms.data_ptr(), 1e-6 if norms is None else self.ctx_k_norms[0].eps,
            positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), scratch.data_ptr(),
            torch.get_num_threads())
        return out

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
        [R, n, Vd] (see heads()), the confidence logits' hidden half plus bias [R, n] fp32 or None) of the first
        n = num_drafts (default gamma) slots. The backbone always runs the whole block (its slots attend
        to each other); only the heads skip the slots nobody will verify."""
        dr, r, g = self.drafter, len(caches), self.gamma
        lengths = [c.length for c in caches]
        ctx = self._context(caches)
        pos = block_positions(anchor_pos, g).reshape(-1)
        x = dr.embed_weight[dr._block_ids(anchors)].reshape(r * g, -1).to(dr.fc.weight.dtype)
        n = num_drafts or g
        if self._kernel_ctx:
            h = self._backbone_on_kernels(x, ctx, lengths, pos, r).view(r, g, -1)
            h = h[:, :n].contiguous() if n < g else h
        else:
            mask = None
            if min(lengths) != max(lengths):
                mask = draft_mask(torch.as_tensor(lengths, device=anchors.device), max(lengths), g).unsqueeze(1)
            cos, sin = dr.rotary.cos_sin(pos, x.dtype)
            for i, layer in enumerate(self.layers):
                x = x + self._attention(layer, layer.input_norm(x), ctx[i], mask, cos, sin, r)
                gate, up = layer.gate_up(layer.post_norm(x)).split(layer.intermediate, dim=-1)
                x = x + layer.down(F.silu(gate) * up)
            h = dr.norm(x.view(r, g, -1)[:, :n])
        return (h, *self.heads(h))

    def _context(self, caches: Sequence[DrafterCache]) -> torch.Tensor:
        """The requests' cached context side by side, [layers, 2, R, kvh, L, hd] contiguous, with L the
        longest (zeros past a request's own length), so every head's keys are one plain matrix for the
        matmuls (a strided one is copied again inside them). Written into a buffer kept between rounds
        (grown, never shrunk): a fresh one costs page faults on every round.

        On dspark's kernels it is [layers, 2, kvh, R, L + gamma, hd] fp32 instead: each layer's keys and
        values are then a cache pool as the target's attention kernels read and write it (heads outermost),
        and the block writes its own keys and values into the gamma rows after the context."""
        r, length = len(caches), max(c.length for c in caches)
        ref = caches[0].kv
        layers, _, kvh, _, hd = ref.shape
        kernel = self._kernel_ctx
        shape = (layers, 2, kvh, r, length + self.gamma, hd) if kernel else (layers, 2, r, kvh, length, hd)
        need = math.prod(shape)
        have = 0 if self._ctx_buf is None else self._ctx_buf.numel()
        if have < need:  # (the caches may be fp32 where the drafter is not: DSparkDrafter.new_cache)
            self._ctx_buf = ref.new_empty(max(need, 2 * have),
                                          dtype=torch.float32 if kernel else self.drafter.fc.weight.dtype)
        ctx = self._ctx_buf[:need].view(shape)
        per_request = ctx.transpose(2, 3) if kernel else ctx  # [layers, 2, R, kvh, rows, hd]
        for i, c in enumerate(caches):
            per_request[:, :, i, :, :c.length] = c.filled()
            if c.length < length:
                per_request[:, :, i, :, c.length:length] = 0
        return ctx

    def _backbone_on_kernels(self, x: torch.Tensor, ctx: torch.Tensor, lengths: list[int], pos: torch.Tensor,
                             r: int) -> torch.Tensor:
        """The block's layers on dspark's kernels: x [R*gamma, d] embedded block, ctx from _context ->
        final-normed hidden [R*gamma, d]. Per layer: the residual add joined to the next norm, RoPE with
        the block's K/V write, fp32 attention over one key matrix per head, SiLU-gating; each one call."""
        dr, g, lib = self.drafter, self.gamma, native.loaded()
        length, rows = max(lengths), ctx.shape[4]
        mask = draft_mask(torch.as_tensor(lengths), length, g).unsqueeze(1).contiguous()  # [R, 1, gamma, rows]
        slots = (torch.arange(r).unsqueeze(1) * rows + length + torch.arange(g)).reshape(-1)  # block rows in the pool
        cos, sin = dr.rotary.tables(pos)
        xn = self.layers[0].input_norm(x)
        if self._fused_layers or self._avx2_layers:
            return self._layers_fused(x, xn, ctx, mask, pos, cos, sin, slots, r)
        for i, layer in enumerate(self.layers):
            a = self._attention_on_kernels(layer, xn, ctx[i], mask, pos, cos, sin, slots, r)
            x, xn = layer.post_norm.add_forward(a, x)
            gu = layer.gate_up(xn)
            if layer.intermediate % 16 == 0 and gu.is_contiguous():
                m = layer.down(native.silu_mul(lib, gu))
            else:
                gate, up = gu.split(layer.intermediate, dim=-1)
                m = layer.down(F.silu(gate) * up)
            x, xn = (self.layers[i + 1].input_norm if i + 1 < len(self.layers) else dr.norm).add_forward(m, x)
        return xn

    def _layers_fused(self, x: torch.Tensor, xn: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor,
                      pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                      r: int) -> torch.Tensor:
        """_backbone_on_kernels' layers, one kernel call each (csrc/layer.c, dspark_drafter_layer; fp32 rows on the
        AVX2 kernels: csrc/avx2_drafter.c, dspark_avx2_drafter_layer)."""
        dr, lib = self.drafter, native.loaded()
        h, hkv, hd, g = self.num_heads, self.kv_heads, self.head_dim, self.gamma
        t, d, inter = x.shape[0], x.shape[1], self.layers[0].intermediate
        scratch = x.new_empty(t * (3 * d + (2 * h + 2 * hkv) * hd + 3 * inter))
        q_buf = torch.empty(t * h * hd, dtype=torch.float32)
        if self._avx2_layers:  # the AVX2 call takes no 8-bit row scratch (its matmuls round rows themselves)
            call, extra = native_avx2.loaded().dspark_avx2_drafter_layer, []
        else:
            widest = max(d, h * hd, inter)
            xq = torch.empty(t * widest, dtype=torch.int8)
            e = torch.empty(t * widest // Q8_GROUP, dtype=torch.float32)
            sx = torch.empty(t * widest // Q8_GROUP, dtype=torch.int32)
            call, extra = lib.dspark_drafter_layer, [xq.data_ptr(), e.data_ptr(), sx.data_ptr(), int(self._w4)]
        for i, layer in enumerate(self.layers):
            nxt = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else dr.norm
            x_out, xn_out = torch.empty_like(x), torch.empty_like(x)
            call(
                x.data_ptr(), xn.data_ptr(), x_out.data_ptr(), xn_out.data_ptr(), r, g, d,
                layer.post_norm._cached_weight(None).data_ptr(), nxt._cached_weight(None).data_ptr(),
                layer.post_norm.eps, layer.qkv.packed.data_ptr(), layer.o.packed.data_ptr(),
                layer.gate_up.packed.data_ptr(), layer.down.packed.data_ptr(),
                None if layer.q_norm is None else layer.q_norm._cached_weight(None).data_ptr(),
                None if layer.k_norm is None else layer.k_norm._cached_weight(None).data_ptr(),
                1e-6 if layer.q_norm is None else layer.q_norm.eps, h, hkv, hd, inter, pos.data_ptr(),
                cos.data_ptr(), sin.data_ptr(), hd ** -0.5, ctx[i].data_ptr(), ctx.shape[4], ctx.shape[4],
                slots.data_ptr(), mask.data_ptr(), scratch.data_ptr(), q_buf.data_ptr(), *extra,
                torch.get_num_threads())
            x, xn = x_out, xn_out
        return xn

    def _attention_on_kernels(self, layer: _Layer, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor,
                              pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                              r: int) -> torch.Tensor:
        """x [R*gamma, d] normed; ctx [2, kvh, R, rows, hd] fp32 (this layer's part of _context);
        cos / sin: fp32 tables covering pos -> attention output after o_proj [R*gamma, d]."""
        h, hkv, hd, g, lib = self.num_heads, self.kv_heads, self.head_dim, self.gamma, native.loaded()
        qkv = layer.qkv(x).view(r * g, h + 2 * hkv, hd)
        pool = ctx.view(2 * hkv, -1, hd)
        if layer.q_norm is None and hd % 32 == 0 and qkv.dtype == torch.bfloat16 and qkv.is_contiguous():
            q = native.rope_store(lib, qkv, pos, cos, sin, hd ** -0.5, h, hkv, pool, slots)
        else:
            q, k, v = qkv.float().split([h, hkv, hkv], dim=1)
            if layer.q_norm is not None:
                q, k = layer.q_norm(q), layer.k_norm(k)
            qk = apply_rotary(torch.cat([q, k], dim=1), cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))
            pool.index_copy_(1, slots, torch.cat([qk[:, h:], v], dim=1).transpose(0, 1))
            q = qk[:, :h] * hd ** -0.5
        out = native.attention(lib, q.view(r, g, h, hd).transpose(1, 2), ctx[0], ctx[1], mask,
                               out_dtype=x.dtype)  # [R, h, gamma, hd] laid out [R, gamma, h, hd]
        return layer.o(out.transpose(1, 2).reshape(r * g, h * hd))

    def heads(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final-normed hidden h [..., d] -> (base logits [..., Vd] in the drafter's dtype, converted to
        fp32 one position at a time by step(); the confidence logit's hidden half plus its bias [...]
        fp32, or None without a confidence head)."""
        out = self.head(h)
        if self.conf is None:
            return out, None
        return out[..., :self.vd], out[..., self.vd].float() + self.conf.proj.bias.float()

    @torch.no_grad()
    def greedy_block(self, caches: Sequence[DrafterCache], anchors: torch.Tensor, anchor_pos: torch.Tensor,
                     num_drafts: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """block() then greedy_picks() as one kernel call (csrc/draft_block.c: the same kernels in the same order,
        so the same drafts): anchors, anchor_pos [R] -> (the first num_drafts greedy drafts [R, n] as target ids,
        their confidence logits [R, n] fp32 or None); None where that call does not run (see _block_plan).
        One request whose cache is fp32 (new_cache() on this route) is read where it lies, the block's keys
        and values written after its context; several are copied side by side first (_context)."""
        if self._plan is None or native.loaded() is None:
            return None
        r, g, dr = len(caches), self.gamma, self.drafter
        if r and not 0 <= int(anchors.min()) <= int(anchors.max()) < dr.embed_weight.shape[0]:
            raise ValueError(f"anchor ids must be in [0, {dr.embed_weight.shape[0]})")
        if r == 1 and caches[0].kv.dtype == torch.float32:
            caches[0].reserve(caches[0].length + g)
            pool, ld = caches[0].kv, caches[0].capacity
        else:
            pool = self._context(caches)
            ld = pool.shape[4]
        anchor_pos = anchor_pos.to(torch.int64).contiguous()
        cos, sin = dr.rotary.tables(anchor_pos + (g - 1))
        lengths = torch.tensor([c.length for c in caches], dtype=torch.int64)
        anchors = anchors.to(torch.int64).contiguous()
        tokens = torch.empty(r, num_drafts, dtype=torch.int64)
        conf = None if self.conf is None else torch.empty(r, num_drafts, dtype=torch.float32)
        native.loaded().dspark_draft_block(
            ctypes.byref(self._plan), anchors.data_ptr(), anchor_pos.data_ptr(), lengths.data_ptr(), r, g,
            num_drafts, cos.data_ptr(), sin.data_ptr(), pool.data_ptr(), ld,
            0.0 if self.conf is None else float(self.conf.proj.bias.float()), tokens.data_ptr(),
            None if conf is None else conf.data_ptr(), torch.get_num_threads())
        return tokens, conf

    def greedy_picks(self, anchors: torch.Tensor, base: torch.Tensor, conf: torch.Tensor | None,
                     d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Greedy drafts of every position at once through the vanilla Markov head on dspark's kernel:
        anchors [R] target ids, base [R, n, Vd] and conf [R, n] from block() -> (target ids [R, n],
        confidence logits [R, n] or None); None where the kernel does not run (then step() per position)."""
        if self._avx2_chain and base.dtype == torch.float32:
            return self._greedy_picks_avx2(anchors, base, conf, d2t)
        if self._chain is None or native.loaded() is None or base.dtype != torch.bfloat16:
            return None
        w1, w2, w_tok = self._chain
        return native.markov_greedy(native.loaded(), anchors, base, w1, w2, w_tok if conf is not None else None,
                                    conf, d2t)

    def _greedy_picks_avx2(self, anchors: torch.Tensor, base: torch.Tensor, conf: torch.Tensor | None,
                           d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """greedy_picks() on fp32 rows (csrc/avx2_drafter.c, dspark_avx2_markov_greedy): step()'s arithmetic per
        position, the same 8-bit matmul for the Markov bias and the confidence's token half, so the same picks."""
        r, n, vd = base.shape
        w1, rows = self.markov.markov_w1.weight.detach(), self.token_rows
        if r and n and not 0 <= int(anchors.min()) <= int(anchors.max()) < w1.shape[0]:
            raise ValueError(f"anchor ids must be in [0, {w1.shape[0]})")
        w1 = w1.float().contiguous()
        base = base if base.stride(-1) == 1 else base.contiguous()
        anchors = anchors.to(torch.int64).contiguous()
        tokens = torch.empty(r, n, dtype=torch.int64)
        conf = None if conf is None else conf.float().contiguous()
        conf_out = None if conf is None else torch.empty(r, n, dtype=torch.float32)
        d2t = None if d2t is None else d2t.to(torch.int64).contiguous()
        scratch = torch.empty(r * (w1.shape[1] + rows._rows), dtype=torch.float32)
        native_avx2.loaded().dspark_avx2_markov_greedy(
            anchors.data_ptr(), base.data_ptr(), base.stride(0), base.stride(1), r, n, vd, w1.data_ptr(), w1.shape[1],
            rows.packed.data_ptr(), rows._rows, None if conf is None else conf.data_ptr(),
            None if d2t is None else d2t.data_ptr(), tokens.data_ptr(), None if conf_out is None else conf_out.data_ptr(),
            scratch.data_ptr(), torch.get_num_threads())
        return tokens, conf_out

    def _attention(self, layer: _Layer, x: torch.Tensor, ctx: torch.Tensor, mask: torch.Tensor | None,
                   cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
        """x [R*gamma, d] normed; ctx [2, R, kvh, L, hd] -> attention output after o_proj [R*gamma, d]."""
        h, hkv, hd, g = self.num_heads, self.kv_heads, self.head_dim, self.gamma
        qkv = layer.qkv(x).view(r * g, h + 2 * hkv, hd)
        q, k, v = qkv.split([h, hkv, hkv], dim=1)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        qk = apply_rotary(torch.cat([q, k], dim=1), cos, sin)
        q = qk[:, :h].view(r, g, h, hd).transpose(1, 2)
        out = _block_attention(q, ctx[0], ctx[1], qk[:, h:].view(r, g, hkv, hd),
                               v.reshape(r, g, hkv, hd), mask)
        return layer.o(out.transpose(1, 2).reshape(r * g, h * hd))

    # ---- the sequential heads ------------------------------------------------------------------------
    def step(self, prev: torch.Tensor, h: torch.Tensor, base: torch.Tensor, conf: torch.Tensor | None,
             state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One position: previous tokens prev [R] (target ids), hidden h [R, d], base logits [R, Vd] and the
        confidence's hidden half [R] -> (corrected logits [R, Vd], confidence logits [R], next state)."""
        if self.markov is None:
            return base.float(), conf, state
        emb = self.markov.prev_embedding(prev)
        if self.token_rows is not None:  # vanilla: bias and the confidence's token half in one product
            rows = self.token_rows(emb).float()
            z = base + rows[:, :self.vd]
            return z, (conf + rows[:, self.vd] if conf is not None else None), state
        bias, state = self.markov.step(emb, h, state)
        if conf is not None:
            conf = conf + self.conf_token(emb).float().squeeze(-1)
        return base + bias.float(), conf, state
