"""Drafter trainer: online target features, anchored blocks, DSpark losses, resumable, multi-process.

Each optimizer step takes `batch_size` sequences per rank, packs them by length into micro-batches of
at most `micro_tokens` tokens, runs the dense bf16 target over each micro-batch (features and exact
soft labels, nothing cached), then the drafter forward and backward; gradients add up in fp32 masters
(train/optim.py). Loss denominators are known from the data before any forward, so every micro-batch
and every rank backpropagates its exact share of the global loss.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dspark.drafters import DrafterConfig, DSparkDrafter, block_labels
from dspark.models.loader import resolve_dtype
from dspark.train.config import TrainConfig, config_from_args, twin_configs
from dspark.train.device import train_device
from dspark.train.features import FeatureCache, TargetBatch, target_batch
from dspark.train.losses import combine, dspark_loss_parts, position_weights, summarize
from dspark.train.memory import keep_freed_memory, release_freed_memory
from dspark.train.optim import MasterAdamW

CKPT = "ckpt.pt"
CURVE = "curve"  # run_dir/curve/tokens-N: drafter snapshots at the learning-curve points


def run_from_args(args: argparse.Namespace) -> int:
    """CLI entry: one process, or one rank under torchrun; with --twin, several drafters in one process."""
    twins = twin_configs(args)
    lead = Trainer(config_from_args(args))
    if twins:
        fit_together([lead, *(Trainer(c, share_target=lead) for c in twins)])
    else:
        lead.fit()
    return 0


# ---- data ------------------------------------------------------------------------------------------
def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Up to max_anchors positions p (sorted) where p and p+1 are both loss tokens, uniform w/o replacement."""
    ok = loss_mask[:-1] & loss_mask[1:]
    cand = ok.nonzero().flatten()
    if len(cand) > max_anchors:
        cand = cand[torch.randperm(len(cand), generator=gen)[:max_anchors]].sort().values
    return cand


def pad_anchors(anchors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence anchor lists -> anchor_pos [B, A] and anchor_valid [B, A]."""
    a = max(1, max(len(x) for x in anchors))
    pos = torch.zeros(len(anchors), a, dtype=torch.long)
    valid = torch.zeros(len(anchors), a, dtype=torch.bool)
    for i, an in enumerate(anchors):
        pos[i, :len(an)], valid[i, :len(an)] = an, True
    return pos, valid


def on_greedy_path(greedy: torch.Tensor, data_next: torch.Tensor) -> torch.Tensor:
    """[B, A, gamma] bool: slot k's context is one greedy decoding would reach, i.e. the data tokens at
    anchor+1 .. anchor+k-1 equal the target's greedy tokens there. Inference only reaches slot k after
    drafts 1..k-1 matched the target, so on text the target would not have written (human chats, sampled
    answers) the slots after a disagreement are left out; on the target's own greedy answers none are.

    greedy [B, A, gamma]: the target's greedy token at rows anchor+k (a prediction of position anchor+k+1);
    data_next [B, A, gamma]: the data token at anchor+k+1 (block_labels' labels)."""
    agree = (data_next == greedy).long().cumprod(-1).bool()  # slots 1..k+1 all agree
    return torch.cat([torch.ones_like(agree[..., :1]), agree[..., :-1]], dim=-1)


def micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group item indices, sorted by length, into runs whose padded size (count x longest) fits budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def data_spec(spec: str) -> tuple[str, int]:
    """"DIR" or "DIR:K" (its training sequences K times per epoch) -> (DIR, K)."""
    path, sep, k = spec.rpartition(":")
    if sep and k.isdigit() and int(k) >= 1:
        return path, int(k)
    return spec, 1


def load_dir(path: str, max_shards: int | None, max_len: int) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """(ids, loss mask, source) of one data directory's sequences, cut to max_len tokens."""
    from dspark.train.datagen import load_sequences

    seqs = load_sequences(path, max_shards)
    if not seqs:
        raise ValueError(f"no shard_*.pt in {path}: run `dspark train-data` first")
    return [(ids[:max_len], mask[:max_len], src) for ids, mask, src in seqs if mask[:max_len].sum() > 1]


# ---- training --------------------------------------------------------------------------------------
class Trainer:
    """Builds target, data, drafter and optimizer; fit() trains with checkpoints and validation."""

    def __init__(self, cfg: TrainConfig, share_target: Trainer | None = None):
        self.cfg = cfg
        keep_freed_memory()  # train/memory.py: a step's large temporaries reuse the heap (trimmed after it)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.device = train_device(cfg.device)
        self.rank, self.world = _init_distributed(self.device)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if share_target is None:
            self._load_target()
        else:  # a --twin: the lead's target (one copy in memory); its passes come from the lead's steps
            for name in ("model_path", "target_cfg", "target", "embed", "lm_head"):
                setattr(self, name, getattr(share_target, name))
        self.feature_cache = FeatureCache(int(cfg.feature_cache_gb * 2**30)) if cfg.feature_cache_gb > 0 else None
        self._load_data()
        self._build_model()

    def _load_target(self) -> None:
        from dspark.models.embedded import resolve_model_path
        from dspark.models.loader import load_decoder
        from dspark.train.dense_target import DenseTarget, dense_quantization

        self.model_path = resolve_model_path(self.cfg.model)
        self.target_cfg = json.loads((self.model_path / "config.json").read_text())
        dtype = resolve_dtype(self.cfg.target_dtype, str(self.device))
        decoder = load_decoder(self.model_path, dtype=dtype, device=str(self.device),
                               quantization=dense_quantization(self.cfg.target_quantization, str(self.device)))
        self.target = DenseTarget(decoder)
        self.embed, self.lm_head = decoder.embed_tokens.weight, decoder.lm_head.weight

    def _draft_config(self) -> DrafterConfig:
        c = self.cfg
        over: dict[str, Any] = dict(num_layers=c.num_layers, block_size=c.block_size, markov_rank=c.markov_rank,
                                    markov_head_type=c.markov_head_type, confidence_head=c.confidence_head,
                                    draft_vocab_size=c.draft_vocab_size)
        if c.target_layer_ids is not None:
            over["target_layer_ids"] = tuple(c.target_layer_ids)
        if c.mask_token_id is not None:
            over["mask_token_id"] = c.mask_token_id
        return DrafterConfig.for_target(self.target_cfg, **over)

    def _load_data(self) -> None:
        c = self.cfg
        self.dcfg = self._draft_config()
        self.seqs, self.val_idx, self.train_idx = [], [], []
        self.val_sets: dict[str, list[int]] = {}  # directory name -> its validation sequences
        for spec in c.data:  # every n-th sequence of each directory is held out; the rest repeat K times
            path, k = data_spec(spec)
            base = len(self.seqs)
            self.seqs += load_dir(path, c.max_shards, c.max_seq_len)
            held = []
            for j in range(len(self.seqs) - base):
                if c.val_every_nth and j % c.val_every_nth == 0:
                    held.append(base + j)
                else:
                    self.train_idx += [base + j] * k
            self.val_idx += held
            self.val_sets[Path(path).name] = held[:c.val_max] if c.val_max else held
        if not self.train_idx:
            raise ValueError("no training sequences left after the held-out split")
        self.sources: dict[str, int] = {}
        for i in self.train_idx:
            self.sources[self.seqs[i][2]] = self.sources.get(self.seqs[i][2], 0) + 1
        self.train_tokens = sum(int(self.seqs[i][1].sum()) for i in self.train_idx)

    def _build_model(self) -> None:
        c, dcfg = self.cfg, self.dcfg
        d2t, self.vocab_info = None, {}
        init = self._init_tensors()  # may build a fresh vocabulary (self.vocab_info)
        if init is not None and "d2t" in init:
            d2t = init["d2t"].long()
            self.vocab_info = self.vocab_info or {"draft_vocab_size": dcfg.draft_vocab_size, "from": c.init_from}
        elif dcfg.draft_vocab_size is not None:
            d2t, self.vocab_info = self._build_vocab()
        torch.manual_seed(c.seed)
        dtype = resolve_dtype(c.compute_dtype, str(self.device))  # bf16 on an AVX2-only CPU is ~5x slower than fp32
        self.model = DSparkDrafter(dcfg, self.embed, self.lm_head, d2t=d2t, dtype=dtype).to(self.device)
        if init is not None:
            init = self._widen_markov(init)
            missing, unexpected = self.model.load_state_dict(
                {k: v.to(dtype) if v.is_floating_point() else v for k, v in init.items()}, strict=False)
            if unexpected:
                raise ValueError(f"--init-from {c.init_from}: tensors this drafter does not have: {unexpected}")
            self._zero_new_layers(missing)
        self.opt = MasterAdamW(self.model.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        self.global_batch = c.batch_size * self.world
        self.steps_per_epoch = max(1, len(self.train_idx) // self.global_batch)
        self.total_steps = c.steps or max(1, int(math.ceil(c.epochs * self.steps_per_epoch)))
        self.weights = position_weights(dcfg.block_size, c.decay, self.device)
        self.step, self.tokens_seen, self.wall = 0, 0, 0.0
        self.tokens_before = int(self._init_meta().get("tokens_seen", 0))  # earlier runs (--init-from)

    def _build_vocab(self) -> tuple[torch.Tensor, dict]:
        """The draft vocabulary: the most frequent target outputs in the generated data (the target's own
        answers), else in every loss token of the mix."""
        from dspark.train.vocab import build_d2t, coverage, token_counts

        own = [i for i in self.train_idx if self.seqs[i][2] != "sharegpt_chat"] or self.train_idx
        counts = token_counts(((self.seqs[i][0], self.seqs[i][1]) for i in own), self.dcfg.vocab_size)
        eos = self.target_cfg.get("eos_token_id", [])
        d2t = build_d2t(counts, self.dcfg.draft_vocab_size, always=eos if isinstance(eos, list) else [eos])
        return d2t, {"draft_vocab_size": self.dcfg.draft_vocab_size, "counted_sequences": len(own),
                     "train_token_coverage": round(coverage(counts, d2t), 5)}

    def _init_meta(self) -> dict:
        """The "dspark" metadata of the --init-from drafter ({} without one)."""
        if not self.cfg.init_from:
            return {}
        return json.loads((Path(self.cfg.init_from) / "config.json").read_text()).get("dspark", {})

    def _init_tensors(self) -> dict[str, torch.Tensor] | None:
        """--init-from: the checkpoint's tensors, after checking its config matches this run's."""
        if not self.cfg.init_from:
            return None
        from safetensors.torch import load_file

        from dspark.drafters.io import CONFIG, WEIGHTS, parse_config

        src = Path(self.cfg.init_from)
        if not (src / CONFIG).is_file():
            raise FileNotFoundError(f"--init-from {src}: not a drafter directory (no {CONFIG})")
        theirs, _ = parse_config(json.loads((src / CONFIG).read_text()), src)
        diff = {k: (v, getattr(self.dcfg, k)) for k, v in theirs.to_dict().items() if v != self.dcfg.to_dict()[k]}
        tensors = load_file(str(src / WEIGHTS))
        allowed = set()  # a deeper drafter (layers appended), a wider Markov head, a fresh vocabulary, heads left out
        if "num_layers" in diff and diff["num_layers"][0] < diff["num_layers"][1]:
            allowed.add("num_layers")
        if (0 < theirs.markov_rank < self.dcfg.markov_rank
                and theirs.markov_head_type == self.dcfg.markov_head_type == "vanilla"):
            allowed.add("markov_rank")
        new_vocab = "draft_vocab_size" in diff and None not in diff["draft_vocab_size"]
        if new_vocab:
            allowed.add("draft_vocab_size")
        dropped = []  # DFlash from a DSpark checkpoint's backbone: without its Markov and confidence heads
        if self.dcfg.markov_rank == 0 and theirs.markov_rank > 0:
            allowed |= {"markov_rank", "markov_head_type"}
            dropped.append("markov_head.")
        if not self.dcfg.confidence_head and theirs.confidence_head:
            allowed.add("confidence_head")
            dropped.append("confidence_head.")
        if set(diff) - allowed:
            raise ValueError(f"--init-from {src}: drafter config differs from this run's (theirs, ours): {diff}")
        tensors = {k: v for k, v in tensors.items() if not k.startswith(tuple(dropped))}
        return self._new_vocab(tensors) if new_vocab else tensors

    def _zero_new_layers(self, missing: list[str]) -> None:
        """After loading a shallower --init-from checkpoint: the layers it lacks (appended after its own)
        start with zero output projections, so each adds nothing to the residual stream and the deeper
        drafter computes exactly what the checkpoint did until training moves them."""
        new = sorted({int(k.split(".")[1]) for k in missing if k.startswith("layers.")})
        whole = {f"layers.{i}.{name}" for i in new for name, _ in self.model.layers[i].named_parameters()}
        if set(missing) != whole:
            raise ValueError(f"--init-from checkpoint does not fit this drafter; missing: {sorted(missing)}")
        with torch.no_grad():
            for i in new:
                for out in (self.model.layers[i].self_attn.o_proj, self.model.layers[i].mlp.down):
                    out.weight.zero_()
                    if out.bias is not None:
                        out.bias.zero_()

    def _widen_markov(self, init: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A wider (vanilla) Markov head than the --init-from checkpoint's: its rank's columns are copied; the
        new columns of W1 keep their fresh init while those of W2 and the confidence head's weights on them
        start at zero, so the drafter computes exactly what the checkpoint did until training moves them
        (W2's new columns get gradients at once, W1's once W2's have moved)."""
        own = self.model.state_dict()
        out = dict(init)
        for k in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight"):
            if k not in init or k not in own or init[k].shape == own[k].shape:
                continue
            old, wide = init[k], own[k].detach().clone()
            if old.shape[0] != wide.shape[0] or old.shape[1] > wide.shape[1]:
                raise ValueError(f"--init-from {self.cfg.init_from}: {k} {tuple(old.shape)} does not fit "
                                 f"{tuple(wide.shape)}")
            if k != "markov_head.markov_w1.weight":
                wide[:, old.shape[1]:] = 0
            wide[:, :old.shape[1]] = old.to(wide.dtype)
            out[k] = wide
        return out

    def _new_vocab(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Warm start across draft vocabularies: a fresh vocabulary from this run's data; every tensor
        indexed by draft id (the Markov head's output rows) is carried over by target token, zero for
        tokens the old vocabulary lacked; everything else is vocabulary-free and kept as is."""
        d2t, self.vocab_info = self._build_vocab()
        old = tensors["d2t"].long()
        where = torch.full((self.dcfg.vocab_size,), -1, dtype=torch.long)
        where[old] = torch.arange(len(old))
        src = where[d2t]  # old draft id of each new draft token, -1 if new
        out = {"d2t": d2t}
        for k, v in tensors.items():
            if k != "d2t" and v.dim() >= 1 and v.shape[0] == len(old) and len(old) != self.dcfg.vocab_size:
                moved = v.new_zeros(len(d2t), *v.shape[1:])
                moved[src >= 0] = v[src[src >= 0]]
                v = moved
            out.setdefault(k, v)
        self.vocab_info["carried_over_from_init"] = int((src >= 0).sum())
        return out

    # -- schedule / data order
    def lr_at(self, step: int) -> float:
        """Linear warm-up then cosine decay to min_lr_ratio * lr."""
        c = self.cfg
        warm = max(1, int(round(c.warmup * self.total_steps)))
        if step < warm:
            return c.lr * (step + 1) / warm
        t = (step - warm) / max(1, self.total_steps - warm)
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))

    def batch_indices(self, step: int) -> list[int]:
        """This rank's sequence indices at a global step (a seeded permutation per epoch, drop-last)."""
        epoch, k = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
        perm = torch.randperm(len(self.train_idx), generator=g).tolist()
        chunk = perm[k * self.global_batch:(k + 1) * self.global_batch]
        mine = chunk[self.rank * self.cfg.batch_size:(self.rank + 1) * self.cfg.batch_size]
        return [self.train_idx[i] for i in mine]

    def anchors_for(self, idx: list[int], epoch: int) -> list[torch.Tensor]:
        """Anchors per sequence, seeded by (epoch, sequence index): the same whatever the batch layout."""
        out = []
        for i in idx:
            g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + epoch) * 10_000_019 + i)
            out.append(sample_anchors(self.seqs[i][1], self.cfg.anchors, g))
        return out

    def slot_mass(self, idx: list[int], anchors: list[torch.Tensor]) -> float:
        """The loss denominator of these sequences: the position-weighted count of valid block slots."""
        total = 0.0
        for i, an in zip(idx, anchors):
            ids, mask, _ = self.seqs[i]
            _, valid = block_labels(ids.unsqueeze(0), an.unsqueeze(0), torch.ones(1, len(an), dtype=torch.bool),
                                    self.dcfg.block_size, mask.unsqueeze(0))
            total += float((valid.float() * self.weights.cpu()).sum())
        return total

    # -- one pass
    def loss_parts(self, tb: TargetBatch, anchor_pos: torch.Tensor, anchor_valid: torch.Tensor):
        """Drafter forward over all anchored blocks of a target batch -> LossParts (the heads and the
        vocabulary-sized losses only on the slots the loss keeps)."""
        g = self.dcfg.block_size
        anchor_pos, anchor_valid = anchor_pos.to(self.device), anchor_valid.to(self.device)
        data_next, valid = block_labels(tb.ids, anchor_pos, anchor_valid, g, tb.loss_mask)
        b, s = tb.ids.shape
        rows = (anchor_pos.unsqueeze(-1) + torch.arange(g, device=self.device)).clamp(max=s - 1)  # slot k: anchor+k
        flat = rows + s * torch.arange(b, device=self.device).view(b, 1, 1)  # into [B*S]
        need, where = flat[valid].unique(return_inverse=True)  # each position's p_t once, however many blocks share it
        pt, greedy_rows = tb.labels_at(self.target, need, self.model.d2t)
        greedy = torch.zeros_like(data_next).masked_scatter_(valid, greedy_rows.index_select(0, where))
        keep = valid & on_greedy_path(greedy, data_next)
        out = self.model(tb.hidden, tb.ids, anchor_pos, anchor_valid, select=keep)
        labels = self.model.draft_labels(greedy[keep])
        return dspark_loss_parts(out.logits, out.conf_logits, labels, keep, pt, where[keep[valid]], self.weights,
                                 conf_label=self.cfg.conf_label)

    def _micro(self, idx: list[int], anchors: list[torch.Tensor]):
        """(target batch, anchor_pos, anchor_valid, token count) per micro-batch of these sequences."""
        for group in micro_batches([len(self.seqs[i][0]) for i in idx], self.cfg.micro_tokens):
            seqs = [self.seqs[idx[j]][:2] for j in group]
            tb = target_batch(self.target, seqs, self.dcfg.target_layer_ids, self.feature_cache,
                              [idx[j] for j in group])
            pos, valid = pad_anchors([anchors[j] for j in group])
            yield tb, pos, valid, sum(len(s[0]) for s in seqs)

    def step_inputs(self, step: int) -> tuple[list[int], list[torch.Tensor]]:
        """This step's sequences and their anchors."""
        idx = self.batch_indices(step)
        return idx, self.anchors_for(idx, step // self.steps_per_epoch)

    def train_step(self, step: int, micro: list | None = None) -> tuple[dict, int]:
        """One optimizer step on this step's global batch; returns global stats and local tokens.
        micro: this step's micro-batches (target passes) already computed, for a twin sharing them."""
        idx, anchors = self.step_inputs(step)
        den = torch.tensor([self.slot_mass(idx, anchors)], dtype=torch.float64)
        _all_reduce(den, self.world)
        self.model.train()
        stats, ntok = None, 0
        for tb, pos, valid, n in (self._micro(idx, anchors) if micro is None else micro):
            parts = self.loss_parts(tb, pos, valid)
            combine(parts, float(den), w_ce=self.cfg.ce_weight, w_tv=self.cfg.tv_weight,
                    w_conf=self.cfg.conf_weight).backward()
            self.opt.accumulate()
            st = parts.stats()
            stats, ntok = (st if stats is None else stats + st), ntok + n
        self.opt.step(self.lr_at(step), self.cfg.grad_clip, self.world)
        _all_reduce(stats, self.world)
        return summarize(stats, self.dcfg.block_size), ntok

    @torch.no_grad()
    def validate(self) -> dict:
        """Held-out metrics (fixed anchors), summed over ranks: all sets together, and per data directory
        under "sets" when there are several."""
        self.model.eval()
        totals = {}
        for name, held in self.val_sets.items():
            total = torch.zeros(6 + 4 * self.dcfg.block_size, dtype=torch.float64)
            mine = held[self.rank::self.world]
            for j in range(0, len(mine), self.cfg.batch_size):
                idx = mine[j:j + self.cfg.batch_size]
                for tb, pos, valid, _ in self._micro(idx, self.anchors_for(idx, epoch=-1)):
                    total += self.loss_parts(tb, pos, valid).stats()
            _all_reduce(total, self.world)
            totals[name] = total
        out = summarize(sum(totals.values()), self.dcfg.block_size)
        release_freed_memory()
        if len(totals) > 1:
            out["sets"] = {name: summarize(t, self.dcfg.block_size) for name, t in totals.items()}
        return out

    # -- checkpoints
    def save_checkpoint(self) -> None:
        """Atomic ckpt.pt: model, optimizer, step, tokens, wall time, RNG (rank 0 writes)."""
        if self.rank == 0:
            state = {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step,
                     "tokens_seen": self.tokens_seen, "wall": self.wall, "rng": torch.get_rng_state(),
                     "py_rng": random.getstate(), "drafter_config": self.dcfg.to_dict(),
                     "train_config": dataclasses.asdict(self.cfg)}
            tmp = self.run_dir / (CKPT + ".tmp")
            torch.save(state, tmp)
            tmp.replace(self.run_dir / CKPT)
        _barrier(self.world)

    def maybe_resume(self) -> bool:
        """Load ckpt.pt if present (config must match); True when resumed."""
        path = self.run_dir / CKPT
        if not path.exists():
            return False
        state = torch.load(path, map_location=self.device, weights_only=False)
        if state["drafter_config"] != self.dcfg.to_dict():
            raise ValueError(f"{path} was trained with another drafter config; use a new --run-dir")
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        self.step, self.tokens_seen, self.wall = int(state["step"]), int(state["tokens_seen"]), float(state["wall"])
        torch.set_rng_state(state["rng"].cpu())  # map_location moved it to the training device
        random.setstate(state["py_rng"])
        self._forget_log_after(self.step)
        return True

    def _forget_log_after(self, step: int) -> None:
        """Drop metrics.jsonl records of steps after the checkpoint: the resumed run logs them again, and
        a learning-curve point the killed run validated would otherwise appear twice in the run log."""
        path = self.run_dir / "metrics.jsonl"
        if self.rank != 0 or not path.exists():
            return
        lines = path.read_text().splitlines()
        kept = [ln for ln in lines if json.loads(ln).get("step", 0) <= step]
        if len(kept) < len(lines):
            path.write_text("".join(ln + "\n" for ln in kept))

    def _log(self, record: dict) -> None:
        if self.rank == 0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def _curve_point(self) -> None:
        """A learning-curve point: held-out metrics and a drafter snapshot at this many tokens."""
        val = self.validate()
        total = self.tokens_before + self.tokens_seen
        self._log({"step": self.step, "tokens": total, "wall_s": round(self.wall, 1), "val": val})
        if self.rank == 0 and self.cfg.curve_snapshots:
            self.export(str(self.run_dir / CURVE / f"tokens-{total}"), val, quiet=True)

    def fit(self) -> dict:
        """Train to total_steps (resuming if a checkpoint exists), validate, export; returns val metrics."""
        self.begin()
        while self.step < self.total_steps:
            if self.cfg.stop_after is not None and self.step >= self.cfg.stop_after:
                self.bar.close()
                return {}
            t0 = time.perf_counter()
            m, ntok = self.train_step(self.step)
            self.after_step(m, ntok, time.perf_counter() - t0)
        return self.finish()

    def begin(self, position: int | None = None) -> None:
        """Resume if a checkpoint exists, say what the run holds, open its progress bar (at a row of its
        own, named by the run dir, for one of several twins)."""
        from tqdm import tqdm

        resumed = self.maybe_resume()
        if self.rank == 0:
            print(f"[train] {self.run_dir.name}: {len(self.train_idx)} train / {len(self.val_idx)} val sequences "
                  f"({self.train_tokens} train loss tokens), {self.total_steps} steps x {self.global_batch} seqs, "
                  f"world {self.world}" + (f", resumed at step {self.step}" if resumed else ""), flush=True)
        self.bar = tqdm(total=self.total_steps, initial=self.step, disable=self.rank != 0, dynamic_ncols=True,
                        position=position, desc=None if position is None else self.run_dir.name)
        self.next_point = _next_curve_point(self.tokens_before + self.tokens_seen, self.cfg.curve_start)

    def after_step(self, m: dict, ntok: int, dt: float) -> None:
        """Count a finished step (dt: its wall time, target pass included): log, curve point, checkpoint."""
        c = self.cfg
        release_freed_memory()
        ntok_t = torch.tensor([float(ntok)], dtype=torch.float64)
        _all_reduce(ntok_t, self.world)
        self.step += 1
        self.tokens_seen += int(ntok_t)
        self.wall += dt
        self.bar.update(1)
        self.bar.set_postfix_str(f"loss {m['loss']:.3f} tau {m['greedy_tau']:.2f} {int(ntok_t) / dt:.0f} tok/s")
        if self.step % c.log_every == 0:
            self._log({"step": self.step, "tokens": self.tokens_before + self.tokens_seen,
                       "wall_s": round(self.wall, 1), "lr": self.lr_at(self.step - 1),
                       "tok_s": round(int(ntok_t) / dt, 1), **m})
        if c.curve_start and self.tokens_before + self.tokens_seen >= self.next_point and self.val_idx:
            self._curve_point()
            self.next_point = _next_curve_point(self.tokens_before + self.tokens_seen, c.curve_start)
        if self.step % c.ckpt_every == 0 or self.step == self.total_steps:
            self.save_checkpoint()

    def finish(self) -> dict:
        """After the last step: held-out validation, the final log record, the export."""
        c = self.cfg
        self.bar.close()
        val = self.validate() if self.val_idx else {}
        self._log({"step": self.step, "tokens": self.tokens_before + self.tokens_seen, "wall_s": round(self.wall, 1),
                   "val": val, "final": True})
        if self.rank == 0 and val:
            print("[val] " + json.dumps(_rounded(val)), flush=True)
        if c.export and self.rank == 0:
            self.export(c.export, val)
        _barrier(self.world)
        return val

    def recipe(self, val: dict) -> dict:
        """Training recipe + data recipe + validation metrics for the checkpoint metadata."""
        from dspark.train.datagen import read_manifest

        data = {}
        for spec in self.cfg.data:
            path, k = data_spec(spec)
            try:
                data[Path(path).name] = {**read_manifest(path).get("recipe", {}), "repeat": k}
            except FileNotFoundError:
                data[Path(path).name] = {"repeat": k}
        cfg = dataclasses.asdict(self.cfg)
        return {"trained_for": {"model": self.target_cfg.get("_name_or_path") or str(self.model_path.name),
                                "hidden_size": self.dcfg.hidden_size, "vocab_size": self.dcfg.vocab_size,
                                "num_hidden_layers": self.target_cfg.get("num_hidden_layers")},
                "train": {k: cfg[k] for k in ("batch_size", "micro_tokens", "anchors", "max_seq_len", "lr",
                                               "warmup", "min_lr_ratio", "weight_decay", "grad_clip", "decay",
                                               "seed", "val_every_nth", "epochs", "compute_dtype",
                                               "ce_weight", "tv_weight", "conf_weight", "conf_label")},
                "target_pass": {"dtype": str(self.target.dtype).removeprefix("torch."),
                                "weights": self.target.quantization},  # "int4": the served 4-bit layers
                "steps": self.total_steps, "world_size": self.world,
                "losses": self.loss_recipe(),
                "train_sequences": len(self.train_idx), "train_loss_tokens": self.train_tokens,
                "tokens_seen": self.tokens_before + self.tokens_seen, "train_wall_s": round(self.wall, 1),
                "val_sequences": len(self.val_idx), "sources": self.sources,
                "data_recipe": data, "vocab": self.vocab_info, "init_from": self.cfg.init_from,
                "val": val, **self.cfg.recipe}

    def loss_recipe(self) -> str:
        """The loss as trained, in words (checkpoint metadata)."""
        c = self.cfg
        label = "1 - 0.5|p_d - p_t|_1" if c.conf_label == "tv" else "argmax p_d == argmax p_t"
        return (f"{c.ce_weight:g} CE(target argmax) + {c.tv_weight:g} TV(exact, full-vocabulary p_t) + "
                f"{c.conf_weight:g} BCE(conf, {label}), w_k = exp(-(k-1)/decay), one global denominator")

    def export(self, directory: str, val: dict, quiet: bool = False) -> None:
        """save_pretrained in save_dtype (the loader casts back to the target's dtype)."""
        import copy

        model = copy.deepcopy(self.model).cpu()
        model = model.to(torch.bfloat16 if self.cfg.save_dtype == "bfloat16" else torch.float32)
        meta = self.recipe(val)
        if self.model.d2t is not None and not quiet:
            from dspark.train.vocab import time_draft

            meta["vocab"]["draft_block_time"] = time_draft(copy.deepcopy(model).eval())
        model.save_pretrained(directory, metadata=meta)
        if not quiet:
            self._export_curve(directory)
            print(f"[export] {directory}", flush=True)

    def _export_curve(self, directory: str) -> None:
        """The run log that travels with the checkpoint, and its learning curve (PNG + markdown table)."""
        from dspark.train.curve import write_curves, write_run_log

        log = write_run_log(directory, self.run_dir / "metrics.jsonl", self.cfg.init_from)
        write_curves(directory, log, list(self.val_sets) if len(self.val_sets) > 1 else [])


def _rounded(x: Any) -> Any:
    """Metrics with floats rounded for printing."""
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_rounded(v) for v in x]
    return round(x, 4) if isinstance(x, float) else x


def fit_together(trainers: list[Trainer]) -> list[dict]:
    """--twin: train several drafters on the same batches in one process. Each step's target passes are
    computed once (by the first trainer) and every drafter takes its optimizer step on them, so N drafters
    cost one target pass a step instead of N; each keeps its own checkpoint, log and export, and a run
    resumed from checkpoints at different steps brings the ones behind up first. The weights are those
    each would reach trained alone."""
    lead = trainers[0]
    if lead.world > 1:
        raise ValueError("--twin trains in one process (not under torchrun)")
    for i, t in enumerate(trainers):
        t.begin(position=i)
    stop = lead.cfg.stop_after
    while True:
        todo = [t for t in trainers if t.step < t.total_steps and (stop is None or t.step < stop)]
        if not todo:
            break
        step = min(t.step for t in todo)
        t0 = time.perf_counter()
        micro = list(lead._micro(*lead.step_inputs(step)))
        shared = time.perf_counter() - t0
        for t in todo:
            if t.step == step:
                t1 = time.perf_counter()
                m, ntok = t.train_step(step, micro)
                t.after_step(m, ntok, shared + time.perf_counter() - t1)
        del micro
    if stop is not None and any(t.step < t.total_steps for t in trainers):
        for t in trainers:
            t.bar.close()
        return [{} for _ in trainers]
    return [t.finish() for t in trainers]


def _next_curve_point(tokens: int, start: int) -> int:
    """The next learning-curve point after `tokens`: start x 10^(k/4) (four points a decade)."""
    if not start:
        return 0
    k = 0
    while start * 10 ** (k / 4) <= tokens:
        k += 1
    return int(start * 10 ** (k / 4))


# ---- distributed helpers ---------------------------------------------------------------------------
def _init_distributed(device: torch.device) -> tuple[int, int]:
    """(rank, world) from torchrun's environment; gloo on CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _all_reduce(t: torch.Tensor, world: int) -> None:
    """Sum over ranks in place; NCCL reduces only CUDA tensors, so a CPU one goes through the GPU."""
    if world <= 1:
        return
    if t.device.type == "cpu" and dist.get_backend() == "nccl":
        moved = t.cuda()
        dist.all_reduce(moved)
        t.copy_(moved)
    else:
        dist.all_reduce(t)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
