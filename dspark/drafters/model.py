"""DSparkDrafter: parallel backbone + sequential head + confidence head, for training and inference."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dspark.drafters.backbone import Backbone
from dspark.drafters.blocks import IGNORE, block_positions, gather_tokens
from dspark.drafters.cache import DrafterCache
from dspark.drafters.config import DrafterConfig
from dspark.drafters.heads import ConfidenceHead, MarkovHead, biased_logits
from dspark.drafters.runner import DraftRunner
from dspark.sampling.sampler import sample, warp_candidates


@dataclass
class TrainOutput:
    """Teacher-forced outputs for all anchored blocks."""

    logits: torch.Tensor  # [B, A, gamma, Vd] in the drafter's dtype, base + sequential bias
    base_logits: torch.Tensor | None  # [B, A, gamma, Vd] in the drafter's dtype, backbone only (U_k); None
    # on selected slots with a stateless Markov head (fused into logits, forward_train)
    conf_logits: torch.Tensor | None  # [B, A, gamma] fp32; None without a confidence head


@dataclass
class DraftOutput:
    """One block of drafts per request."""

    tokens: torch.Tensor  # [R, gamma] int64 target-vocab ids x1..x_gamma
    probs: torch.Tensor | None  # [R, gamma, V] fp32 distribution sampled from (one-hot if greedy); None: all greedy
    logits: torch.Tensor | None  # [R, gamma, Vd] fp32 corrected logits (before warping); None if not asked for
    conf_logits: torch.Tensor | None  # [R, gamma] fp32; None without a confidence head


class DSparkDrafter(Backbone):
    """The DSpark block drafter (DFlash when markov_rank=0 and confidence_head=False)."""

    def __init__(self, config: DrafterConfig, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 d2t: torch.Tensor | None = None, *, dtype: torch.dtype | None = None):
        super().__init__(config)
        self.config = config
        v, d = config.vocab_size, config.hidden_size
        for name, w in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(w.shape) != (v, d):
                raise ValueError(f"{name} must be [{v}, {d}], got {list(w.shape)}")
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)  # frozen, the target's
        if config.draft_vocab_size is None:
            self.d2t = None
            self.register_buffer("lm_head", lm_head_weight.detach(), persistent=False)
        else:
            d2t = _check_d2t(d2t, config).to(lm_head_weight.device)
            self.register_buffer("d2t", d2t)  # [Vd] draft id -> target id; saved with the drafter
            self.register_buffer("lm_head", lm_head_weight.detach()[d2t], persistent=False)
            t2d = torch.full((v,), -1, dtype=torch.long, device=d2t.device)
            self.register_buffer("t2d", t2d.index_copy(0, d2t, torch.arange(len(d2t), device=d2t.device)),
                                 persistent=False)
        r = config.markov_rank
        self.markov_head = (MarkovHead(vocab_size=v, draft_vocab_size=config.draft_vocab, rank=r, hidden_size=d,
                                       head_type=config.markov_head_type) if r > 0 else None)
        self.confidence_head = ConfidenceHead(d + r) if config.confidence_head else None
        self.metadata: dict[str, Any] = {}  # passthrough "dspark" dict of config.json (training recipe...)
        self.sts_temperatures: list[float] | None = None
        self.survival_prior: list[float] | None = None  # sts.json "survival_rate": the planner's prior
        self.sts_offset = 0.0  # sts.json "logit_offset", already folded into the confidence head's bias
        self.init_weights()
        # One dtype for weights and the shared buffers (default: the target's), so no per-call casts.
        self.to(device=embed_weight.device, dtype=dtype or embed_weight.dtype)

    def forward(self, *args: Any, **kwargs: Any) -> TrainOutput:
        """Alias of forward_train, so wrappers such as DDP see the training pass."""
        return self.forward_train(*args, **kwargs)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """HF-style init of the drafter's own matrices: N(0, std), zero biases (norm weights keep 1)."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()

    # ---- shared pieces -------------------------------------------------------------------------
    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """Base logits U [..., Vd] of final-normed hidden h [..., d], in its dtype: the losses read a bf16
        row in fp32 as they go (train/losses.py), where whole [N, Vd] fp32 copies and their gradients'
        casts back were ~5% of a training step."""
        return h @ self.lm_head.to(h.dtype).T

    def _block_ids(self, anchors: torch.Tensor) -> torch.Tensor:
        """[embed anchor, mask, ..., mask] ids: anchors [...] -> [..., gamma]."""
        ids = torch.full((*anchors.shape, self.config.block_size), self.config.mask_token_id,
                         dtype=torch.long, device=anchors.device)
        ids[..., 0] = anchors
        return ids

    def to_target_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """Scatter a draft-vocab tensor [..., Vd] into target space [..., V] (zeros elsewhere)."""
        if self.d2t is None:
            return x
        out = x.new_zeros(*x.shape[:-1], self.config.vocab_size)
        return out.index_copy_(-1, self.d2t, x)

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target-id labels -> draft-vocab ids (IGNORE where unsupervised or outside the draft vocab)."""
        if self.d2t is None:
            return labels
        mapped = self.t2d[labels.clamp(min=0)]
        return mapped.masked_fill((labels < 0) | (mapped < 0), IGNORE)

    # ---- training ------------------------------------------------------------------------------
    def forward_train(self, ctx_features: torch.Tensor, input_ids: torch.Tensor, anchor_pos: torch.Tensor,
                      anchor_valid: torch.Tensor, select: torch.Tensor | None = None) -> TrainOutput:
        """All A blocks of each sequence in one masked pass.

        ctx_features [B, S, m*d] target features at every position; input_ids [B, S]; anchor_pos [B, A]
        (block a = input_ids[anchor] + masks at anchor..anchor+gamma-1); anchor_valid [B, A] (only used
        to keep padded anchors in range; the loss masks them via blocks.block_labels). With select
        [B, A, gamma] bool, the heads run only on the selected slots and the outputs are rows [N, ...]
        in select's order: the LM head and the vocabulary-sized tensors after it cost nothing for slots
        the loss leaves out.
        """
        block_ids, positions, h = self.block_states(ctx_features, input_ids, anchor_pos, anchor_valid)
        prev = gather_tokens(input_ids, positions)  # teacher forcing: slot k sees x_k = input_ids[anchor+k]
        if select is not None and not self._recurrent:  # stateless heads: per slot, so select first
            return self._selected_heads(prev[select], h[select])
        base = self._head(h)
        logits, conf = self._heads_teacher_forced(prev, h, base)
        if select is not None:  # a recurrent head needs whole blocks: select after it
            logits, base = logits[select], base[select]
            conf = conf[select] if conf is not None else None
        return TrainOutput(logits=logits, base_logits=base, conf_logits=conf)

    def _selected_heads(self, prev: torch.Tensor, h: torch.Tensor) -> TrainOutput:
        """A stateless head's outputs on selected slots: prev ids [N], h [N, d]; the LM head and the Markov
        bias in one matmul (heads.biased_logits), so base_logits is None where there is a Markov head."""
        if self.markov_head is None:
            logits = self._head(h)
            return TrainOutput(logits=logits, base_logits=logits, conf_logits=self._confidence(h, None))
        emb = self.markov_head.prev_embedding(prev)
        return TrainOutput(logits=biased_logits(self.markov_head, h, emb, self.lm_head), base_logits=None,
                           conf_logits=self._confidence(h, emb))

    def _confidence(self, h: torch.Tensor, emb: torch.Tensor | None) -> torch.Tensor | None:
        return self.confidence_head(h, emb).float() if self.confidence_head is not None else None

    @property
    def _recurrent(self) -> bool:
        return self.markov_head is not None and self.markov_head.head_type == "rnn"

    def block_states(self, ctx_features: torch.Tensor, input_ids: torch.Tensor, anchor_pos: torch.Tensor,
                     anchor_valid: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The backbone over every anchored block -> block ids, positions [B, A, gamma] and final-normed
        hidden h [B, A, gamma, d] (padded anchors sit at position 0)."""
        b, s = input_ids.shape
        anchor_pos = torch.where(anchor_valid.bool(), anchor_pos, 0).clamp(0, s - 1)
        ctx = self.context_kv(ctx_features, torch.arange(s, device=input_ids.device).expand(b, s))
        positions = block_positions(anchor_pos, self.config.block_size)  # [B, A, gamma]
        block_ids = self._block_ids(input_ids.gather(1, anchor_pos))  # [B, A, gamma]
        x = self.embed_weight[block_ids].to(self.fc.weight.dtype)
        h = self.run_blocks(x, positions, ctx, anchor_pos)  # block a sees the context before its anchor
        return block_ids, positions, h

    def _heads_teacher_forced(self, prev: torch.Tensor, h: torch.Tensor,
                              base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev ids [..., gamma], h [..., gamma, d], base [..., gamma, Vd] -> (logits, conf logits); any
        leading shape for the stateless heads, [B, A, gamma] blocks for the recurrent one."""
        emb = None
        logits = base
        if self.markov_head is not None:
            emb = self.markov_head.prev_embedding(prev)  # [..., r]
            if self._recurrent:
                bias = self.markov_head.block_bias(emb.flatten(0, 1), h.flatten(0, 1))  # [B*A, gamma, Vd]
            else:
                bias = self.markov_head.step(emb, h, None)[0]
            logits = base + bias.view_as(base).to(base.dtype)
        return logits, self._confidence(h, emb)

    # ---- inference -----------------------------------------------------------------------------
    _runner: DraftRunner | None = None
    _runner_key: tuple | None = None

    def pack(self, weight_bits: int = 8) -> "DSparkDrafter":
        """Inference on a CPU: draft with fused weights in dspark's 8-bit kernels' (or, weight_bits=4, its 4-bit
        kernel's) or oneDNN's packed layout (drafters/runner.py), built once from the weights as they are now;
        training must use an unpacked drafter."""
        self._runner, self._runner_key = DraftRunner(self, pack=True, weight_bits=weight_bits), None
        return self

    def runner(self) -> DraftRunner:
        """The inference form of this drafter: the packed one after pack(), else fused copies of the
        current weights (rebuilt when a weight changes)."""
        if self._runner is not None and self._runner_key is None:
            return self._runner
        key = tuple((p.data_ptr(), None if p.is_inference() else p._version) for p in self.parameters())
        if self._runner is None or key != self._runner_key:
            self._runner, self._runner_key = DraftRunner(self), key
        return self._runner

    def new_cache(self, capacity: int = 64) -> DrafterCache:
        """An empty per-request context cache on the drafter's device, in its dtype, or in fp32 where it drafts on
        dspark's kernels: their attention reads fp32 keys and values, and a round of one request then reads
        them where they lie (DraftRunner.greedy_block) instead of a copy."""
        c = self.config
        dtype = torch.float32 if self.runner()._native else self.fc.weight.dtype
        return DrafterCache(num_layers=c.num_layers, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                            dtype=dtype, device=self.fc.weight.device, capacity=capacity)

    @torch.no_grad()
    def extend(self, cache: DrafterCache, target_hidden: torch.Tensor, start_pos: int) -> None:
        """Add committed positions start_pos.. from target features [n, m*d] (drops any cached tail first)."""
        self.extend_many([cache], [target_hidden], [start_pos])

    @torch.no_grad()
    def extend_many(self, caches: Sequence[DrafterCache], target_hidden: Sequence[torch.Tensor],
                    start_pos: Sequence[int]) -> None:
        """extend() for several requests in one projection: their rows are packed into one call."""
        for cache, start in zip(caches, start_pos):
            if start > cache.length:
                raise ValueError(f"extend at position {start} would leave a gap after {cache.length} cached")
        self.runner().extend_many(caches, target_hidden, start_pos)

    @torch.no_grad()
    def draft(self, caches: Sequence[DrafterCache], anchors: Sequence[int], anchor_pos: Sequence[int], *,
              temperature: float | Sequence[float] = 0.0, top_k: int | Sequence[int] = -1,
              top_p: float | Sequence[float] = 1.0,
              generators: Sequence[torch.Generator | None] | None = None,
              num_drafts: int | None = None, return_logits: bool = True) -> DraftOutput:
        """Draft one block for each of R requests; sampling params may be scalars or per request.
        num_drafts (1..gamma, default gamma): only the first n drafts are made (the same n tokens a
        whole block would start with; the later slots' heads are skipped). return_logits=False leaves
        DraftOutput.logits None: the engine never reads them, and gathering them costs a copy of
        R x n x Vd fp32 (7 MB at 16 requests)."""
        r, g = len(caches), self.config.block_size
        if r == 0 or not r == len(anchors) == len(anchor_pos):
            raise ValueError(f"draft needs one anchor and anchor position per cache, got {r} caches")
        if num_drafts is not None:
            if not 1 <= num_drafts <= g:
                raise ValueError(f"num_drafts must be in 1..{g} (the block size), got {num_drafts}")
            g = num_drafts
        for cache, p in zip(caches, anchor_pos):
            if cache.length > p:
                raise ValueError(f"drafter cache holds {cache.length} positions but the anchor sits at {p}")
        device = self.fc.weight.device
        prev = torch.as_tensor(list(anchors), dtype=torch.long, device=device)
        positions = torch.as_tensor(list(anchor_pos), dtype=torch.long, device=device)
        runner = self.runner()
        params = _per_row(r, temperature, top_k, top_p)
        greedy = not return_logits and all(t <= 0 for t, _, _ in params)
        if greedy:  # the whole block and its picks in one kernel call where it runs
            picked = runner.greedy_block(caches, prev, positions, g)
            if picked is not None:
                return DraftOutput(tokens=picked[0], probs=None, logits=None, conf_logits=picked[1])
        h, base, conf_h = runner.block(caches, prev, positions, g)
        if greedy:
            picked = runner.greedy_picks(prev, base, conf_h, self.d2t)
            if picked is not None:
                return DraftOutput(tokens=picked[0], probs=None, logits=None, conf_logits=picked[1])
        gens = list(generators) if generators is not None else [None] * r
        state = self.markov_head.init_state((r,), h) if self.markov_head is not None else None
        tokens, probs, logits, confs = [], [], [], []
        for k in range(g):
            z, conf, state = runner.step(prev, h[:, k], base[:, k], None if conf_h is None else conf_h[:, k], state)
            ids, p = _choose(z, params, gens)  # draft-vocab ids [R], probs [R, Vd] or None
            prev = self.d2t[ids] if self.d2t is not None else ids
            tokens.append(prev)
            probs.append(p)
            if return_logits:
                logits.append(z)
            confs.append(conf)
        any_sampled = probs[0] is not None
        return DraftOutput(
            tokens=torch.stack(tokens, 1),
            probs=self.to_target_vocab(torch.stack(probs, 1)) if any_sampled else None,
            logits=torch.stack(logits, 1) if return_logits else None,
            conf_logits=torch.stack(confs, 1) if self.confidence_head is not None else None,
        )

    # ---- checkpoints ---------------------------------------------------------------------------
    def save_pretrained(self, directory: str | Path, metadata: dict[str, Any] | None = None) -> None:
        """config.json (+ "dspark" metadata), model.safetensors (own weights only), sts.json if set."""
        from dspark.drafters.io import save_drafter

        save_drafter(self, directory, metadata)

    @classmethod
    def from_pretrained(cls, directory: str | Path, embed_weight: torch.Tensor,
                        lm_head_weight: torch.Tensor) -> "DSparkDrafter":
        """Load a save_pretrained directory around the target's embedding and LM head."""
        from dspark.drafters.io import load_drafter

        return load_drafter(cls, directory, embed_weight, lm_head_weight)


def _check_d2t(d2t: torch.Tensor | None, config: DrafterConfig) -> torch.Tensor:
    """Validate the draft->target id map [Vd]."""
    if d2t is None:
        raise ValueError("draft_vocab_size is set, so a d2t mapping [draft_vocab_size] is required")
    d2t = torch.as_tensor(d2t, dtype=torch.long)
    if tuple(d2t.shape) != (config.draft_vocab,):
        raise ValueError(f"d2t must have shape [{config.draft_vocab}], got {list(d2t.shape)}")
    if d2t.min() < 0 or d2t.max() >= config.vocab_size or d2t.unique().numel() != d2t.numel():
        raise ValueError("d2t must hold distinct target ids in [0, vocab_size)")
    return d2t


def _per_row(r: int, temperature: Any, top_k: Any, top_p: Any) -> list[tuple[float, int, float]]:
    """Broadcast scalar or per-request sampling params to R (temperature, top_k, top_p) rows."""
    cols = [list(x) if isinstance(x, Sequence) else [x] * r for x in (temperature, top_k, top_p)]
    if any(len(c) != r for c in cols):
        raise ValueError(f"per-request sampling params must have {r} entries")
    return [(float(t), int(k), float(p)) for t, k, p in zip(*cols)]


def _choose(z: torch.Tensor, params: list[tuple[float, int, float]],
            gens: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick one draft id per row of z [R, Vd]: argmax when greedy, else sample the warped distribution
    (among the row's top-k or nucleus candidates: warp_candidates) -> ids [R], and the
    distributions they were drawn from [R, Vd] (one-hot for greedy rows), or None when every row is greedy."""
    ids = z.argmax(-1)
    if all(t <= 0 for t, _, _ in params):
        return ids, None
    probs = torch.zeros_like(z).scatter_(-1, ids.unsqueeze(-1), 1.0)  # greedy rows: one-hot
    uniform = len(set(params)) == 1
    warped = warp_candidates(z, *params[0]) if uniform else None
    for i, (t, k, p) in enumerate(params):
        if t <= 0:
            continue
        (rows, cands), j = (warped, i) if warped is not None else (warp_candidates(z[i:i + 1], t, k, p), 0)
        row = rows[j:j + 1]
        pick = int(sample(row, gens[i])[0])
        if cands is None:
            probs[i], ids[i] = row[0], pick
        else:
            probs[i].zero_().scatter_(0, cands[j], row[0].to(probs.dtype))
            ids[i] = cands[j, pick]
    return ids, probs
