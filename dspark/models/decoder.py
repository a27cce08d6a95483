"""One decoder for the Llama, Qwen2 and Qwen3 families, run over ragged batches on a paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from dspark.cache import DEFAULT_BLOCK_SIZE, AttentionGroup, AttentionMetadata, KVCache
from dspark.models import native, native_avx2
from dspark.models.attention import KV_ALIGN, invariant_attention, sdpa_attention
from dspark.models.config import ModelConfig
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary


@dataclass(frozen=True)
class DecoderOutput:
    """What one forward returns."""

    logits: torch.Tensor | None  # [R, V] for the requested rows, fp32
    hidden: torch.Tensor | None  # [T, m * d] outputs of the requested layers, concatenated


@dataclass(frozen=True)
class KernelRope:
    """RoPE left to dspark's kernel, which applies it while writing the cache (native.rope_store):
    the positions [T] int64, the fp32 cos / signed sin tables [n, hd], and q's attention scale."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_scale: float


def kv_cache_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The KV cache dtype where dspark's own attention does not read it (else bf16: Decoder.bf16_cache): the
    model's, except fp32 under half-precision weights on a CPU. There PyTorch's attention rounds to bf16
    depending on how many queries and keys share a call, so a row of a verify window would not match the same
    row decoded alone; in fp32 it does, which keeps speculative decoding token-identical to plain decoding
    (tests/test_packing.py)."""
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
        # attention's kernels: True (dspark's where they run), or "avx2" where the layers' 4-bit kernels are the
        # AVX2 ones (set by the loader): their fused layers attend on that library, so must the per-op path
        self._kernels: bool | str = native.library() is not None or native_avx2.library() is not None
        self.invariant = False  # the window-invariant attention even where the cache has the model's dtype (Decoder.invariant)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | KernelRope, kv_pool: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """rope: per-head cos, sin tables from Decoder.rope_tables ([T, H + 2 Hkv, hd]), or a KernelRope."""
        t, dt, h, hkv = x.shape[0], x.dtype, self.h, self.hkv
        qkv = self.qkv_proj.forward(x).view(t, h + 2 * hkv, self.hd)
        if isinstance(rope, KernelRope):  # one kernel call: RoPE, q's scale, the cache write, fp32 q
            if qkv.dtype == torch.float32:  # fp32 rows: the AVX2 library's
                q = native_avx2.rope_store(qkv.contiguous(), rope.positions, rope.cos, rope.sin, rope.q_scale, h, hkv,
                                           kv_pool, meta.slot_mapping)
            else:
                q = native.rope_store(native.loaded(), qkv, rope.positions, rope.cos, rope.sin, rope.q_scale, h, hkv,
                                      kv_pool, meta.slot_mapping)
        else:
            if kv_pool.dtype != dt:  # fp32 cache under bf16 weights on CPU (see kv_cache_dtype): one cast, RoPE in fp32
                qkv = qkv.to(kv_pool.dtype)
            if self.q_norm is not None:
                qkv = torch.cat([self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + hkv]), qkv[:, h + hkv:]], dim=1)
            # one call rotates q (and scales it by 1/sqrt(hd)) and k; v passes through (cos 1, sin 0)
            qkv = apply_rotary(qkv, *rope)
            kv_pool.index_copy_(1, meta.slot_mapping, qkv[:, h:].transpose(0, 1))  # keys and values in one write
            q = qkv[:, :h]
        if len(meta.groups) == 1:
            return self.o_proj.forward(self._attend(q, kv_pool, meta.groups[0], dt))
        out = x.new_empty(t, h * self.hd)
        for group in meta.groups:
            out.index_copy_(0, group.rows, self._attend(q.index_select(0, group.rows), kv_pool, group, dt))
        return self.o_proj.forward(out)

    def _reads_in_place(self, qp: torch.Tensor, kv_pool: torch.Tensor, dt: torch.dtype) -> str | None:
        """Which of dspark's attention kernels _attend's invariant route would run here ("avx512", "avx2"), or None
        for neither: then its paged form reads a gathered group's keys from the pool itself (the same bits as over
        the gathered copy)."""
        if not (kv_pool.dtype != dt or self.invariant) or not self._kernels:
            return None
        if self._kernels is True and native.loaded() is not None:
            return "avx512" if native.attention_fits(qp, kv_pool) else None
        if native_avx2.loaded() is not None and native_avx2.attention_fits(qp, kv_pool):
            return "avx2"  # where invariant_attention would take the AVX2 kernel: "avx2" layers, or no AVX-512 library
        return None

    def _attend(self, q: torch.Tensor, kv_pool: torch.Tensor, g: AttentionGroup, dt: torch.dtype) -> torch.Tensor:
        """One group's attention: q [Tg, H, hd] (scaled, rotated) -> [Tg, H * hd] in dt."""
        t, h, hkv = q.shape[0], self.h, self.hkv
        b, s = g.mask.shape[0], g.mask.shape[-1]
        if g.q_index is None:  # one sequence: no padding
            qp = q.reshape(1, t, h, self.hd).transpose(1, 2)
        else:
            qp = q.new_zeros(b * g.max_q, h, self.hd).index_copy_(0, g.q_index, q)
            qp = qp.view(b, g.max_q, h, self.hd).transpose(1, 2)
        kernel = self._reads_in_place(qp, kv_pool, dt) if g.kv_start is None and g.kv_index is not None else None
        if kernel == "avx512":
            out = native.attention_paged(native.loaded(), qp, kv_pool, g.kv_index, g.mask, dt)  # no gather
        elif kernel == "avx2":
            out = native_avx2.attention_paged(qp, kv_pool, g.kv_index, g.mask).to(dt)
        else:
            if g.kv_start is not None:  # one sequence in consecutive blocks: a view, no gather
                kvs = kv_pool[:, g.kv_start:g.kv_start + s].unsqueeze(1)
            else:
                kvs = kv_pool.view(-1, self.hd).index_select(0, g.kv_rows).view(2 * hkv, b, s, self.hd)
            keys, vals = kvs[:hkv], kvs[hkv:]  # [Hkv, B, S, hd]
            if kv_pool.dtype != dt or self.invariant:
                out = invariant_attention(qp, keys, vals, g.mask, kernels=self._kernels, out_dtype=dt)
            else:
                out = sdpa_attention(qp, keys, vals, g.mask).to(dt)
        out = out.transpose(1, 2).reshape(b * g.max_q, h * self.hd)  # [B*Q, H*hd]
        return out if g.q_index is None else out.index_select(0, g.q_index)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(self, x, rope, kv_pool, meta):
        h = self.self_attn.forward(self.input_layernorm.forward(x), rope, kv_pool, meta)
        x, normed = self.post_attention_layernorm.add_forward(x, h)  # x + h and its norm: one kernel call
        return x + self.mlp.forward(normed)

    def fusable(self) -> bool:
        """Whether forward_fused() can run this layer: every projection on one of dspark's 4-bit kernels (bf16
        rows: csrc/layer.c; fp32 rows: csrc/avx2_layer.c), no biases, q/k norms or shapes the kernels do not take."""
        from dspark.models.int4 import Int4Linear

        a, m = self.self_attn, self.mlp
        linears = (a.qkv_proj, a.o_proj, m.gate_up, m.down)
        kernel = getattr(a.qkv_proj, "_kernel", None)  # "dspark" (csrc/layer.c) or "avx2" (csrc/avx2_layer.c)
        return (kernel in ("dspark", "avx2")
                and all(isinstance(lin, Int4Linear) and lin._kernel == kernel and lin.bias is None for lin in linears)
                and a.q_norm is None and a.hd % 32 == 0 and m.intermediate % 16 == 0
                and self.input_layernorm.weight.shape[0] % 16 == 0)

    def forward_fused(self, x: torch.Tensor, rope: KernelRope, kv_pool: torch.Tensor, meta: AttentionMetadata,
                      scratch: torch.Tensor, q_buf: torch.Tensor) -> torch.Tensor:
        """forward() for one sequence reading consecutive cache rows, as one kernel call (csrc/layer.c:
        the same kernels in the same order, so the same bits); scratch and q_buf from Decoder.forward."""
        a, m, g = self.self_attn, self.mlp, meta.groups[0]
        out = torch.empty_like(x)
        args = [
            x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], self.input_layernorm._cached_weight(None).data_ptr(),
            self.post_attention_layernorm._cached_weight(None).data_ptr(), self.input_layernorm.eps,
            a.qkv_proj.packed.data_ptr(), a.o_proj.packed.data_ptr(), m.gate_up.packed.data_ptr(),
            m.down.packed.data_ptr(), a.h, a.hkv, a.hd, m.intermediate, rope.positions.data_ptr(),
            rope.cos.data_ptr(), rope.sin.data_ptr(), rope.q_scale, kv_pool.data_ptr(), kv_pool.shape[1],
            meta.slot_mapping.data_ptr(), g.kv_start, g.mask.data_ptr(), g.mask.shape[-1], scratch.data_ptr(),
            q_buf.data_ptr()]
        if x.dtype == torch.float32:  # fp32 rows: the AVX2 library's layer, on an fp32 cache
            native_avx2.loaded().dspark_avx2_layer(*args, torch.get_num_threads())
        else:
            native.loaded().dspark_layer(*args, int(kv_pool.dtype == torch.bfloat16), torch.get_num_threads())
        return out


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
        self.quantization = "none"  # the weight format the loader chose (models/loader._apply_quantization)
        self.lm_head_q8: nn.Module | None = None  # the LM head in its own 8-bit groups, where the loader found them
        self.kernels = native.library() is not None  # dspark's CPU kernels (models/native.py) run this model
        self._kernel_rope = self.kernels and not cfg.qk_norm and cfg.head_dim % 32 == 0
        self._avx2_rope = native_avx2.library() is not None and not cfg.qk_norm and cfg.head_dim % 16 == 0
        self._fused: bool | None = None  # every layer runs as one kernel call for one sequence (set on first use)
        self._weights: tuple[torch.Tensor, float] | bool | None = None  # see _layer_weights (built on first use)
        self._weight_refs: list[torch.Tensor] = []  # the tensors whose addresses _weights holds
        self._taps: dict[tuple[int, ...], torch.Tensor] = {}  # hidden_layers -> dspark_step's taps

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def weight_format(self) -> str:
        """The dtype, plus the weight quantization where there is one: "bfloat16", "bfloat16/int4"."""
        name = str(self.dtype).removeprefix("torch.")
        name = name if self.quantization == "none" else f"{name}/{self.quantization}"
        return name if self.lm_head_q8 is None else f"{name}+q8-head"

    @property
    def bf16_cache(self) -> bool:
        """Whether the KV cache is bf16: a bf16 model on a CPU whose RoPE, cache writes and attention all run on
        dspark's kernels, which widen each key and value to fp32 as they read it and compute every row alone, so
        a row stays the same whatever its window (half the bytes of an fp32 cache to read every step)."""
        return self._kernel_rope and self.dtype == torch.bfloat16 and self.device.type == "cpu"

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16_cache else kv_cache_dtype(self.dtype, self.device)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin per head for the fused qkv rows [T, H + 2 Hkv, hd], in the cache's dtype
        (RoPE runs there): q heads carry the attention scale 1/sqrt(hd) (exact for a power-of-two
        head_dim), k heads plain RoPE, v heads the identity. Built once a forward for all layers."""
        c = self.config
        cos, sin = self.rotary.cos_sin(positions, self.kv_dtype)  # [T, 1, hd]
        t, scale = cos.shape[0], c.head_dim ** -0.5
        shape = lambda n: (t, n, c.head_dim)  # noqa: E731
        cos = torch.cat([(cos * scale).expand(shape(c.num_heads)), cos.expand(shape(c.num_kv_heads)),
                         cos.new_ones(()).expand(shape(c.num_kv_heads))], dim=1)
        sin = torch.cat([(sin * scale).expand(shape(c.num_heads)), sin.expand(shape(c.num_kv_heads)),
                         sin.new_zeros(()).expand(shape(c.num_kv_heads))], dim=1)
        return cos, sin

    def _one_sequence(self, meta: AttentionMetadata) -> bool:
        """Whether this step can run every layer fused (DecoderLayer.forward_fused): one sequence whose
        window reads consecutive cache rows, and layers the fused call takes."""
        if len(meta.groups) != 1:
            return False
        g = meta.groups[0]
        if g.kv_start is None or g.q_index is not None or g.rows is not None or not g.mask.is_contiguous():
            return False
        return self._layers_fused()

    def _layers_fused(self) -> bool:
        """Whether every layer is fusable (DecoderLayer.fusable), found once."""
        if self._fused is None:
            self._fused = all(layer.fusable() for layer in self.layers)
        return self._fused

    def _windows_fused(self, meta: AttentionMetadata) -> bool:
        """Whether this step is several sequences' windows (decodes and verify windows, no prefill chunk:
        AttentionMetadata.windows) on fused layers: csrc/step.c then runs them in one call, attention reading the
        cache in place (dspark_attention_paged, unpadded), with the bits of the layer-by-layer path."""
        return meta.windows is not None and meta.windows.mask.is_contiguous() and self._layers_fused()

    def _one_call_library(self) -> str | None:
        """Which library's one-call step (csrc/step.c: "avx512", bf16 rows; csrc/avx2_step.c: "avx2", fp32 rows on
        the AVX2 layers and an fp32 cache) can run this model's steps, or None: every layer fused on that library's
        kernels, the embedding contiguous on a CPU."""
        w = self.embed_tokens.weight
        if w.device.type != "cpu" or not w.is_contiguous() or not self._layers_fused():
            return None
        kernel = getattr(self.layers[0].self_attn.qkv_proj, "_kernel", None)
        if self._kernel_rope and w.dtype == torch.bfloat16 and kernel == "dspark":
            return "avx512"
        if self._avx2_rope and w.dtype == torch.float32 and kernel == "avx2" and self.kv_dtype == torch.float32:
            return "avx2"
        return None

    def _step_in_one_call(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                          meta: AttentionMetadata, logits_rows: torch.Tensor | None,
                          hidden_layers: tuple[int, ...]) -> DecoderOutput | None:
        """forward() as one kernel call (csrc/step.c on bf16 rows, csrc/avx2_step.c on fp32 rows: the embedding,
        every layer, the final norm and the 8-bit LM head, the same kernels as the calls one by one, so the same
        bits), or None where that call does not run (_one_call_library): one sequence reading consecutive cache
        rows or several sequences' windows (_windows_fused), no layer tapped twice. Any other LM head runs after
        it here."""
        c, w = self.config, self.embed_tokens.weight
        t = input_ids.shape[0]
        library = self._one_call_library()
        if library is None or len(set(hidden_layers)) != len(hidden_layers):
            return None
        paged = not self._one_sequence(meta)
        if paged and not self._windows_fused(meta):
            return None
        weights = self._layer_weights()
        if weights is None:
            return None
        pointers, eps = weights
        d, kv, a = c.hidden_size, cache.kv, self.layers[0].self_attn
        g = meta.windows if paged else meta.groups[0]
        taps = self._taps.get(hidden_layers)
        if taps is None:
            taps = torch.full((len(self.layers),), -1, dtype=torch.int64)
            for j, i in enumerate(hidden_layers):
                taps[i] = j * d
            taps = self._taps[hidden_layers] = taps
        hidden = w.new_empty(t, len(hidden_layers) * d) if hidden_layers else None
        head = self.lm_head_q8
        on_kernel = head is not None and head.avx2 == (library == "avx2") and head.bias is None
        rows = None if logits_rows is None else logits_rows.to(torch.int64).contiguous()
        n = 0 if rows is None else rows.shape[0]
        logits = torch.empty(n, head._rows, dtype=torch.float32) if n and on_kernel else None
        x_out = w.new_empty(t, d) if n and not on_kernel else None
        ids, pos = input_ids.to(torch.int64).contiguous(), positions.to(torch.int64).contiguous()
        cos, sin = self.rotary.tables(pos)
        args = [
            ids.data_ptr(), w.data_ptr(), w.shape[0], t, len(self.layers), pointers.data_ptr(), d, eps, a.h, a.hkv,
            a.hd, c.intermediate_size, pos.data_ptr(), cos.data_ptr(), sin.data_ptr(), a.hd ** -0.5, kv.data_ptr(),
            kv.stride(0), kv.shape[2], meta.slot_mapping.data_ptr(), 0 if paged else g.kv_start,
            *((g.kv_index.data_ptr(), g.q_off.data_ptr(), g.q_lens.data_ptr(), g.mask.shape[0], g.mask.shape[1])
              if paged else (None, None, None, 1, t)), g.mask.data_ptr(), g.mask.shape[-1],
            taps.data_ptr() if hidden_layers else None, None if hidden is None else hidden.data_ptr(),
            0 if hidden is None else hidden.shape[1]]
        out_args = [None if x_out is None else x_out.data_ptr(), self.norm._cached_weight(None).data_ptr(),
                    self.norm.eps, head.packed.data_ptr() if logits is not None else None,
                    head._rows if logits is not None else 0]
        logit_args = [None if rows is None else rows.data_ptr(), n if logits is not None else 0,
                      None if logits is None else logits.data_ptr(), torch.get_num_threads()]
        if library == "avx2":
            status = native_avx2.loaded().dspark_avx2_step(*args, *out_args, *logit_args)
        else:
            status = native.loaded().dspark_step(*args, int(kv.dtype == torch.bfloat16), *out_args,
                                                 int(logits is not None and head.vnni), *logit_args)
        if status:
            raise IndexError(f"token ids must be in [0, {w.shape[0]})" if status == -1 else "logits rows out of range")
        if x_out is not None:  # an LM head the step does not run
            h = self.norm(x_out.index_select(0, rows))
            logits = self.lm_head(h).float() if head is None else head(h)
        elif logits is not None and head._rows != head.out_features:
            logits = logits[:, :head.out_features]
        elif rows is not None and not n:
            logits = torch.empty(0, c.vocab_size)
        return DecoderOutput(logits=logits, hidden=hidden)

    def _layer_weights(self) -> tuple[torch.Tensor, float] | None:
        """(every layer's weights for dspark_step: [layers * 6] int64 addresses of its two norm gains in fp32
        and its packed qkv, o, gate_up and down; the norms' eps), or None where the norms' eps differ (then the
        layers are called one by one). Built once, on the first fused step, from the weights as they are then (a
        served model's never change); the tensors stay referenced here."""
        if self._weights is None:
            refs = []
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                refs += [layer.input_layernorm._cached_weight(None),
                         layer.post_attention_layernorm._cached_weight(None),
                         a.qkv_proj.packed, a.o_proj.packed, m.gate_up.packed, m.down.packed]
            eps = {n.eps for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)}
            self._weight_refs = refs
            self._weights = (torch.tensor([w.data_ptr() for w in refs], dtype=torch.int64), eps.pop()) \
                if len(eps) == 1 else False
        return self._weights or None

    def new_cache(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> KVCache:
        c = self.config
        return KVCache(num_layers=c.num_layers, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
                       num_blocks=num_blocks, block_size=block_size, dtype=self.kv_dtype, device=self.device,
                       kv_align=KV_ALIGN if self.invariant else 1)

    @property
    def invariant(self) -> bool:
        """Whether a position's logits are the same bits in any window or batch, which is what keeps speculative
        verification token-identical to plain decoding: a CPU model in half precision (fp32 cache, window-invariant
        attention, or a bf16 cache that dspark's kernels read) or with 4-bit layers (kernels that compute each row
        alone; attention as before). A dense fp32 model is not: its matmuls' bits depend on the number of rows."""
        return self.bf16_cache or self.kv_dtype != self.dtype or self.quantization != "none"

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, *, logits_rows: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = ()) -> DecoderOutput:
        """input_ids, positions: [T]; logits_rows: [R] indices into T (None = no logits)."""
        if input_ids.device.type == "cpu":
            out = self._step_in_one_call(input_ids, positions, cache, meta, logits_rows, tuple(hidden_layers))
            if out is not None:
                return out
        x = self.embed_tokens(input_ids)  # [T, d]
        if x.device.type == "cpu" and ((self._kernel_rope and x.dtype == torch.bfloat16 and self.kv_dtype in (
                torch.float32, torch.bfloat16)) or (self._avx2_rope and x.dtype == torch.float32
                                                    and self.kv_dtype == torch.float32)):
            rope = KernelRope(positions.to(torch.int64).contiguous(), *self.rotary.tables(positions),
                              self.config.head_dim ** -0.5)
        else:
            rope = self.rope_tables(positions)
        wanted = set(hidden_layers)
        taps = {}
        if isinstance(rope, KernelRope) and self._one_sequence(meta) and x.is_contiguous():
            c, t = self.config, x.shape[0]
            scratch = x.new_empty(t * (5 * c.hidden_size + (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                                       + 3 * c.intermediate_size))
            q_buf = torch.empty(t * c.num_heads * c.head_dim, dtype=torch.float32)
            # where _step_in_one_call does not run: a layer tapped twice, an LM head of another kind
            for i, (layer, pool) in enumerate(zip(self.layers, cache.kv.unbind(0))):
                x = layer.forward_fused(x, rope, pool, meta, scratch, q_buf)
                if i in wanted:
                    taps[i] = x
        else:
            # hot loop: .forward() skips nn.Module.__call__'s hook handling (a few us a call, ~150 calls a step)
            for i, (layer, pool) in enumerate(zip(self.layers, cache.kv.unbind(0))):
                x = layer.forward(x, rope, pool, meta)
                if i in wanted:
                    taps[i] = x
        hidden = torch.cat([taps[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        logits = None
        if logits_rows is not None:
            h = self.norm(x.index_select(0, logits_rows))
            logits = self.lm_head(h).float() if self.lm_head_q8 is None else self.lm_head_q8(h)
        return DecoderOutput(logits=logits, hidden=hidden)
