"""The target as plain dense passes over padded batches, for training: teacher-forced features and batched
generation with a static KV cache.

The engine's decoder is built for serving: a paged cache, kernels that are fastest at a few rows, and fp32
attention that keeps every row bit-identical whatever the window. Training wants the opposite trade:
thousands of rows per call, no cache between calls. DenseTarget takes a loaded decoder's linears as they
are: the served 4-bit layers of the embedded GGUF run on dspark's 4-bit kernel (the served weights and
activation rounding, and on one core ~1.2x the packed bf16 pass at a few thousand rows), plain weights are
packed once for oneDNN. Attention is causal SDPA: forward_packed() over sequences packed end to end without
padding (the training pass), forward() over right-padded [B, S] batches, where padding at the end never
changes an earlier position (generation's prefill). `agreement()` measures how often its argmax equals the
served path's, the figure a drafter trained on it is judged by.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from dspark.cache import blocks_for
from dspark.host import amx_tiles
from dspark.models import native
from dspark.models.layers import apply_rotary, silu_gate
from dspark.models.packing import PackedLinear, packing_supported
from dspark.train.config import TARGET_QUANTIZATIONS


def _rows(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A norm over x [..., d] as rows [N, d]: the form dspark's one-call RMSNorm kernel takes (models/layers.py),
    where [B, S, d] would take the slower PyTorch route."""
    return norm(x.reshape(-1, x.shape[-1])).view(x.shape)


class _Linear:
    """A decoder's linear map over the last axis: a 4-bit one (models/int4.py) through its own kernel; plain
    weights oneDNN-packed in bf16 on a CPU that has it, else F.linear."""

    def __init__(self, module: torch.nn.Module):
        self.module = None if isinstance(module, torch.nn.Linear) else module
        self.weight, self.bias = (module.weight, module.bias) if self.module is None else (None, None)
        plain = self.module is None and packing_supported(self.weight.dtype, self.weight.device)
        self.packed = PackedLinear(self.weight, self.bias) if plain else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.module is not None:
            return self.module(x)
        return self.packed.forward(x) if self.packed is not None else F.linear(x, self.weight, self.bias)


@dataclass
class _Layer:
    qkv: _Linear
    o: _Linear
    gate_up: _Linear
    down: _Linear
    norm1: torch.nn.Module
    norm2: torch.nn.Module
    q_norm: torch.nn.Module | None
    k_norm: torch.nn.Module | None


@dataclass
class Generation:
    """One generated response."""

    tokens: list[int]  # response ids (the stop token included when one ended it)
    finish_reason: str  # "stop" or "length"


def dense_quantization(quantization: str, device: str = "cpu") -> str:
    """The loader's quantization for a dense target: "served" (the served weights: layers that already are
    4-bit groups stay so where a kernel takes them), "none" (plain weights; the embedded GGUF's 4-bit groups
    dequantised) or "auto", the faster of the two here. On a CPU with AMX tiles that is plain: PyTorch's
    packed bf16 matmuls take the dense pass's many rows faster than the 4-bit kernel's VNNI dot products
    (2-core Sapphire Rapids: the trainer's target pass 1.0 against 2.5 s a step, data generation 860
    against 738 tokens/s); elsewhere the served 4-bit layers (2-core Zen 4: 4.05 against 4.41 s, data generation +24%).
    The two agree with the served decoder's argmax about equally often. Forcing 4-bit weights onto a model
    that has none is refused: a drafter would learn a target other than the one served."""
    if quantization not in TARGET_QUANTIZATIONS:
        raise ValueError(f"target quantization must be one of {', '.join(TARGET_QUANTIZATIONS)}, got {quantization!r}")
    if quantization == "auto" and torch.device(device).type == "cpu" and amx_tiles():
        return "none"
    return "auto" if quantization == "served" else quantization


class DenseTarget:
    """A Decoder's weights run densely: forward() for teacher-forced features, generate() for data."""

    def __init__(self, decoder):
        """decoder: a dspark Decoder loaded unpacked, with plain weights (quantization "none") or the served
        4-bit layers ("int4"); the LM head runs on its full-precision weights either way (the drafter reads
        them, and the soft labels' kernel takes bf16 logits)."""
        if decoder.quantization not in ("none", "int4"):
            raise ValueError(f"DenseTarget takes plain or 4-bit weights, got quantization {decoder.quantization!r}")
        c = self.config = decoder.config
        self.dtype, self.device = decoder.dtype, decoder.device
        self.embed = decoder.embed_tokens.weight
        self.norm = decoder.norm
        self.lm_head = _Linear(decoder.lm_head)
        self.quantization = decoder.quantization
        self.rotary = decoder.rotary
        self.layers = []
        for layer in decoder.layers:
            at, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(_Linear(at.qkv_proj), _Linear(at.o_proj), _Linear(mlp.gate_up), _Linear(mlp.down),
                                      layer.input_layernorm, layer.post_attention_layernorm, at.q_norm, at.k_norm))
        self.h, self.hkv, self.hd = c.num_heads, c.num_kv_heads, c.head_dim
        self._kernels = native.library() is not None  # SiLU-gating on dspark's kernel (layers.silu_gate)
        self.eos = set(c.eos_token_ids)

    # ---- one layer -----------------------------------------------------------------------------
    def _qkv(self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, d] at positions [B, T] -> q [B, H, T, hd], k and v [B, Hkv, T, hd] (RoPE applied)."""
        b, t, _ = x.shape
        qkv = layer.qkv(_rows(layer.norm1, x)).view(b * t, self.h + 2 * self.hkv, self.hd)
        q, k, v = qkv.split([self.h, self.hkv, self.hkv], dim=1)
        if layer.q_norm is not None:
            q, k = layer.q_norm(q), layer.k_norm(k)
        cos, sin = self.rotary.cos_sin(positions.reshape(-1), x.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        shape = lambda n: (b, t, n, self.hd)  # noqa: E731
        return (q.view(shape(self.h)).transpose(1, 2), k.view(shape(self.hkv)).transpose(1, 2),
                v.reshape(shape(self.hkv)).transpose(1, 2))

    def _finish(self, layer: _Layer, x: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Residual adds around attention output att [B, H, T, hd] and the MLP."""
        b, _, t, _ = att.shape
        x = x + layer.o(att.transpose(1, 2).reshape(b, t, self.h * self.hd))
        gu = layer.gate_up(_rows(layer.norm2, x))
        act = silu_gate(gu.reshape(-1, gu.shape[-1]), self._kernels)  # as rows: one kernel pass where it runs
        return x + layer.down(act.view(*gu.shape[:-1], -1))

    # ---- teacher-forced ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: torch.Tensor, hidden_layers: Sequence[int] = (),
                cache: list | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Right-padded ids [B, S] -> (chosen layers' outputs [B, S, m*d] or None, final-normed hidden
        [B, S, d]). With `cache` (a list), each layer's (k, v) [B, Hkv, S, hd] is appended to it."""
        b, s = ids.shape
        x = self.embed[ids]
        pos = torch.arange(s, device=ids.device).expand(b, s)
        taps = {}
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos)
            if cache is not None:
                cache.append((k, v))
            att = causal_attention(q, k, v)
            x = self._finish(layer, x, att)
            if i in hidden_layers:
                taps[i] = x
        hidden = torch.cat([taps[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        return hidden, _rows(self.norm, x)

    @torch.no_grad()
    def forward_packed(self, seqs: Sequence[torch.Tensor],
                       hidden_layers: Sequence[int] = ()) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Sequences ids [L_i] packed end to end as rows, with no padding -> (chosen layers' outputs
        [sum L_i, m*d] or None, final-normed hidden [sum L_i, d]), each sequence's rows in turn.

        The linears, norms and MLPs run once over all rows; attention runs causally within each sequence.
        A micro-batch of mixed lengths padded to its longest spends about a third of its rows on padding,
        and the linears are most of the pass."""
        lengths = [len(s) for s in seqs]
        ids = torch.cat(list(seqs)).to(self.device)
        x = self.embed[ids].unsqueeze(0)  # [1, N, d]
        pos = torch.cat([torch.arange(n, device=ids.device) for n in lengths]).unsqueeze(0)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        taps = {}
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos)  # [1, H or Hkv, N, hd]
            att = q.new_empty(1, ids.numel(), self.h, self.hd)  # token-major, as _finish reads it
            for a, b in zip(starts, starts[1:]):
                att[:, a:b].copy_(causal_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]).transpose(1, 2))
            x = self._finish(layer, x, att.transpose(1, 2))
            if i in hidden_layers:
                taps[i] = x[0]
        hidden = torch.cat([taps[i] for i in hidden_layers], dim=-1) if hidden_layers else None
        return hidden, _rows(self.norm, x[0])

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden [..., d] -> logits [..., V] in the model dtype."""
        return self.lm_head(h)

    # ---- generation ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = -1, seed: int = 0, batch: int = 64,
                 max_len: int | None = None) -> list[Generation]:
        """Answer every prompt (token ids); `batch` slots decode together and a finished slot takes
        the next prompt at once (continuous batching over a static cache). Greedy at temperature 0."""
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # long prompts first
        longest = max((len(p) for p in prompts), default=0)
        max_len = max_len or longest + max_tokens
        gen = torch.Generator(device=self.device).manual_seed(seed)
        nb = min(batch, len(prompts))
        kv = torch.zeros(len(self.layers), 2, nb, self.hkv, max_len, self.hd, dtype=self.dtype, device=self.device)
        lengths = torch.zeros(nb, dtype=torch.long)
        owner = [-1] * nb  # prompt index per slot
        outs: dict[int, list[int]] = {}
        results: list[Generation | None] = [None] * len(prompts)
        last = torch.zeros(nb, dtype=torch.long, device=self.device)
        pending = deque(order)

        def finish(slot: int, reason: str) -> None:
            results[owner[slot]] = Generation(outs.pop(owner[slot]), reason)
            owner[slot] = -1

        while pending or any(o >= 0 for o in owner):
            free = [s for s in range(nb) if owner[s] < 0]
            if pending and free:
                take = [pending.popleft() for _ in free[:len(pending)]]
                first = self._prefill(kv, free[:len(take)], [prompts[i] for i in take], lengths,
                                      temperature, top_p, top_k, gen)
                for slot, i, tok in zip(free, take, first.tolist()):
                    owner[slot], outs[i] = i, [tok]
                    last[slot] = tok
                    if tok in self.eos:
                        finish(slot, "stop")
                    elif max_tokens <= 1 or lengths[slot] >= max_len:
                        finish(slot, "length")
                if pending and any(o < 0 for o in owner):
                    continue
            active = [s for s in range(nb) if owner[s] >= 0]
            if not active:
                continue
            idx = torch.as_tensor(active, device=self.device)
            nxt = self._decode(kv, last, lengths, active, idx, temperature, top_p, top_k, gen)
            # whole-batch updates: per-slot writes were one tiny copy each, a CUDA launch each on a GPU
            last[idx] = nxt
            lengths[active] += 1
            grown = lengths.tolist()
            for slot, tok in zip(active, nxt.tolist()):
                outs[owner[slot]].append(tok)
                if tok in self.eos:
                    finish(slot, "stop")
                elif len(outs[owner[slot]]) >= max_tokens or grown[slot] >= max_len:
                    finish(slot, "length")
        return results  # type: ignore[return-value]

    def _prefill(self, kv, slots: list[int], prompts: list[Sequence[int]], lengths: torch.Tensor,
                 temperature, top_p, top_k, gen) -> torch.Tensor:
        """Run new prompts densely, store their K/V in their slots; returns each one's first token.
        Prompts of similar length share a forward (see _length_groups), so short ones are not padded
        to the longest of the batch."""
        n = [len(p) for p in prompts]
        last_h = []
        for group in _length_groups(n):
            ids = torch.zeros(len(group), max(n[j] for j in group), dtype=torch.long, device=self.device)
            for row, j in enumerate(group):
                ids[row, :n[j]] = torch.as_tensor(list(prompts[j]), dtype=torch.long)
            cache: list = []
            _, h = self.forward(ids, cache=cache)
            for layer, (k, v) in enumerate(cache):
                for row, j in enumerate(group):
                    kv[layer, 0, slots[j], :, :n[j]] = k[row, :, :n[j]]
                    kv[layer, 1, slots[j], :, :n[j]] = v[row, :, :n[j]]
            last_h += [(j, h[row, n[j] - 1]) for row, j in enumerate(group)]
        for j, slot in enumerate(slots):
            lengths[slot] = n[j]
        last_h = torch.stack([x for _, x in sorted(last_h, key=lambda e: e[0])])
        return _pick(self.logits(last_h), temperature, top_p, top_k, gen)

    def _decode(self, kv, last: torch.Tensor, lengths: torch.Tensor, active: list[int], idx: torch.Tensor,
                temperature, top_p, top_k, gen) -> torch.Tensor:
        """One token for each active slot (`active`, and as `idx` on the device): write its K/V at its length,
        attend over its cache."""
        pos = lengths[active].to(self.device)  # [A] position of the token being fed (lengths stay on the CPU)
        x = self.embed[last[idx]].unsqueeze(1)  # [A, 1, d]
        lib = self._decode_kernel(kv)
        every = full = False
        if lib is None:  # SDPA over a span masked per slot
            span = int(pos.max()) + 1
            hidden = (torch.arange(span, device=self.device) > pos.unsqueeze(1)).view(len(active), 1, 1, span)
            # Past half the slots, attend from every slot's view of the cache (no copy) and keep the active
            # rows; below it, gather the active slots' K/V (a copy, cheaper than attending for idle slots).
            every = len(active) == kv.shape[2]  # all slots busy (most steps): no scatter or gather of rows
            full = 2 * len(active) > kv.shape[2]
            if full and not every:
                hidden = torch.ones(kv.shape[2], 1, 1, span, dtype=torch.bool, device=self.device).index_copy_(
                    0, idx, hidden)
                hidden[..., 0] = False  # idle slots see key 0 (active ones always do): no all-masked NaN rows
        # each new key's row in a layer's cache seen as [slots * Hkv * max_len, hd]: one index_copy_ a write
        rows = ((idx.unsqueeze(1) * self.hkv + torch.arange(self.hkv, device=self.device)) * kv.shape[4]
                + pos.unsqueeze(1)).reshape(-1)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, pos.unsqueeze(1))
            kv[i, 0].view(-1, self.hd).index_copy_(0, rows, k[:, :, 0].reshape(-1, self.hd))
            kv[i, 1].view(-1, self.hd).index_copy_(0, rows, v[:, :, 0].reshape(-1, self.hd))
            if lib is not None:  # each row reads its own slot's keys up to its length: no mask, span or gather
                att = native.decode_attention_bf16(lib, q[:, :, 0], kv[i, 0], kv[i, 1], idx, pos + 1)
                att = att.view(len(active), 1, self.h, self.hd).transpose(1, 2)
            elif every:
                att = decode_attention(q, kv[i, 0, :, :, :span], kv[i, 1, :, :, :span], hidden)
            elif full:
                qa = q.new_zeros(kv.shape[2], *q.shape[1:]).index_copy_(0, idx, q)
                att = decode_attention(qa, kv[i, 0, :, :, :span], kv[i, 1, :, :, :span], hidden)[idx]
            else:
                att = decode_attention(q, kv[i, 0, idx, :, :span], kv[i, 1, idx, :, :span], hidden)
            x = self._finish(layer, x, att)
        return _pick(self.logits(self.norm(x[:, 0])), temperature, top_p, top_k, gen)

    def _decode_kernel(self, kv: torch.Tensor):
        """dspark's kernel library where decode attention runs on it (a bf16 cache on a CPU), else None."""
        if self.dtype != torch.bfloat16 or kv.device.type != "cpu" or self.hd % 16 or self.hd > 256:
            return None
        return native.library()

    # ---- checks --------------------------------------------------------------------------------
    @torch.no_grad()
    def agreement(self, served, seqs: Sequence[torch.Tensor]) -> float:
        """Fraction of positions where this pass's argmax equals the served decoder's (teacher-forced)."""
        same = total = 0
        for s in seqs:
            _, h = self.forward(s.view(1, -1).to(self.device))
            mine = self.logits(h[0]).float().argmax(-1)
            theirs = served_logits(served, s).argmax(-1)
            same += int((mine.cpu() == theirs.cpu()).sum())
            total += len(s)
        return same / max(total, 1)


@torch.no_grad()
def served_pass(decoder, ids: torch.Tensor, *, logits: bool = True, hidden_layers: Sequence[int] = ()):
    """One sequence teacher-forced through the engine's decoder (the served path): its DecoderOutput,
    logits [L, V] at every position (or none) and the chosen layers' outputs [L, m*d]."""
    n = len(ids)
    cache = decoder.new_cache(blocks_for(n) + 1)
    cache.reserve("s", n)
    meta = cache.prepare(["s"], [n])
    pos = torch.arange(n, device=decoder.device)
    return decoder(ids.to(decoder.device), pos, cache, meta, logits_rows=pos if logits else None,
                   hidden_layers=hidden_layers)


def served_logits(decoder, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits [L, V] of one sequence through the served decoder."""
    return served_pass(decoder, ids).logits


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, expand: bool | None = None) -> torch.Tensor:
    """Causal attention of q [B, H, T, hd] over k, v [B, Hkv, T, hd] (grouped heads). On CUDA the K/V heads
    are repeated first (`expand`, default: on CUDA): SDPA with enable_gqa fell back to its math kernel
    there, 2 ms a call for a 500-token sequence on an H200 (torch 2.11), two thirds of a training step;
    with plain heads it takes the flash kernel. On the CPU enable_gqa reads the shared heads in place."""
    grouped = k.shape[1] != q.shape[1]
    if expand is None:
        expand = q.device.type == "cuda"
    if grouped and expand:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        grouped = False
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, hidden: torch.Tensor,
                     matmul: bool | None = None) -> torch.Tensor:
    """One query per slot: q [A, H, 1, hd] over keys / vals [A, Hkv, span, hd], positions where hidden
    [A, 1, 1, span] is True masked out -> [A, H, 1, hd]. On the CPU, SDPA with grouped KV heads reads
    strided views of the cache, ~8x faster in bf16 than two batched matmuls (8 against 65 ms for 64 slots
    x 500 keys on a 2-core AMX Xeon). On CUDA (`matmul`, default: on CUDA) the two matmuls run with each
    KV head's queries grouped, since a masked grouped SDPA there took the math kernel (2 ms a layer for
    256 slots on an H200, half of a generation step)."""
    if matmul is None:
        matmul = q.device.type == "cuda"
    if not matmul:
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=~hidden, enable_gqa=keys.shape[1] != q.shape[1])
    a, h, _, hd = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(a, hkv, h // hkv, hd)  # [A, Hkv, G, hd]: the queries of the heads sharing a KV head
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * hd ** -0.5  # [A, Hkv, G, span]
    scores.masked_fill_(hidden, float("-inf"))  # hidden [A, 1, 1, span] broadcasts over heads and groups
    out = torch.matmul(scores.softmax(-1).to(vals.dtype), vals)  # [A, Hkv, G, hd]
    return out.reshape(a, h, 1, hd)


def _length_groups(lengths: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices of `lengths` in groups of similar length (longest first), each padded to its longest by at
    most `max_padding` of its real tokens: a shard's prompts range from ~30 to ~2,000 tokens, and one
    padded batch would spend most of its prefill on padding."""
    groups: list[list[int]] = []
    real = 0
    for j in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        if groups and lengths[groups[-1][0]] * (len(groups[-1]) + 1) <= (1 + max_padding) * (real + lengths[j]):
            groups[-1].append(j)
            real += lengths[j]
        else:
            groups.append([j])
            real = lengths[j]
    return groups


def _pick(logits: torch.Tensor, temperature: float, top_p: float, top_k: int,
          gen: torch.Generator) -> torch.Tensor:
    """Next token per row of logits [R, V] (the model's dtype): argmax, or a sample of the warped fp32
    distribution. The argmax reads the logits as they are: an fp32 copy would pick the same token."""
    if temperature <= 0:
        return logits.argmax(-1)
    from dspark.sampling.sampler import sample_logits

    return sample_logits(logits, temperature, top_k, top_p, gen)
