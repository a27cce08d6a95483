"""Drafter trainer: anchored blocks, DSpark losses, AdamW + warm-up/cosine, resumable, DDP-ready."""
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
from dspark.train.config import TrainConfig, config_from_args
from dspark.train.features import SeqFeatures, load_cached, target_features
from dspark.train.losses import combine, dspark_loss_parts, position_weights, summarize

CKPT = "ckpt.pt"


def run_from_args(args: argparse.Namespace) -> int:
    """CLI entry: one process, or one rank under torchrun."""
    cfg = config_from_args(args)
    if args.features_only:
        cfg.steps, cfg.stop_after = 0, 0
    trainer = Trainer(cfg)
    if not args.features_only:
        trainer.fit()
    return 0


# ---- data ------------------------------------------------------------------------------------------
def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, gen: torch.Generator) -> torch.Tensor:
    """Up to max_anchors positions p (sorted) where p and p+1 are both loss tokens, uniform w/o replacement."""
    ok = loss_mask[:-1] & loss_mask[1:]
    cand = ok.nonzero().flatten()
    if len(cand) > max_anchors:
        cand = cand[torch.randperm(len(cand), generator=gen)[:max_anchors]].sort().values
    return cand


def collate(samples: list[SeqFeatures], anchors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad a batch: ids/mask [B,S], hidden [B,S,m*d], top-K [B,S,K], anchor_pos/valid [B,A]."""
    b = len(samples)
    s = max(len(x.ids) for x in samples)
    a = max(1, max(len(x) for x in anchors))
    k = samples[0].top_ids.shape[1]
    out = {"ids": torch.zeros(b, s, dtype=torch.long), "mask": torch.zeros(b, s, dtype=torch.bool),
           "hidden": torch.zeros(b, s, samples[0].hidden.shape[1]), "top_ids": torch.zeros(b, s, k, dtype=torch.long),
           "top_probs": torch.zeros(b, s, k), "anchor_pos": torch.zeros(b, a, dtype=torch.long),
           "anchor_valid": torch.zeros(b, a, dtype=torch.bool)}
    for i, (x, an) in enumerate(zip(samples, anchors)):
        n = len(x.ids)
        out["ids"][i, :n], out["mask"][i, :n] = x.ids, x.loss_mask
        out["hidden"][i, :n] = x.hidden.float()
        out["top_ids"][i, :n], out["top_probs"][i, :n] = x.top_ids, x.top_probs
        out["anchor_pos"][i, :len(an)], out["anchor_valid"][i, :len(an)] = an, True
    return out


class OnlineFeatures:
    """Sequences whose target features are computed on first use by a teacher-forced target pass."""

    def __init__(self, decoder, seqs: list[tuple[torch.Tensor, int]], layers: list[int], topk: int):
        self.decoder, self.seqs, self.layers, self.topk = decoder, seqs, layers, topk

    def __len__(self) -> int:
        return len(self.seqs)

    def get_many(self, idx: list[int]) -> list[SeqFeatures]:
        """Features for several sequences in one ragged target forward."""
        ids = [self.seqs[i][0] for i in idx]
        feats = target_features(self.decoder, ids, self.layers, self.topk)
        return [SeqFeatures(x, torch.arange(len(x)) >= self.seqs[i][1], h, t, p)
                for i, x, (h, t, p) in zip(idx, ids, feats)]


class CachedFeatures:
    """Sequences with precomputed features held in memory."""

    def __init__(self, items: list[SeqFeatures]):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def get_many(self, idx: list[int]) -> list[SeqFeatures]:
        """The cached features of these sequences."""
        return [self.items[i] for i in idx]


# ---- training --------------------------------------------------------------------------------------
class Trainer:
    """Builds target, data, drafter and optimizer; fit() trains with checkpoints and validation."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.rank, self.world = _init_distributed()
        self.device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
                                   if torch.cuda.is_available() and self.world > 1 else
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._load_target()
        self._load_data()
        self._build_model()

    def _load_target(self) -> None:
        from dspark.llm import resolve_model_path
        from dspark.models.loader import load_decoder, resolve_dtype

        self.model_path = resolve_model_path(self.cfg.model)
        self.target_cfg = json.loads((self.model_path / "config.json").read_text())
        dtype = resolve_dtype(self.cfg.target_dtype, str(self.device))
        self.decoder = load_decoder(self.model_path, dtype=dtype, device=str(self.device), pack=True,
                                    quantization="auto")  # the target as the engine serves it

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
        from dspark.train.datagen import load_sequences
        from dspark.train.features import cache_features

        c = self.cfg
        self.dcfg = self._draft_config()
        layers = list(self.dcfg.target_layer_ids)
        raw = load_sequences(c.data, c.max_shards)
        if not raw:
            raise ValueError(f"no shard_*.pt in {c.data}: run `dspark train-data` first")
        if c.cache_dir:
            if self.rank == 0:
                cache_features(c.data, c.cache_dir, self.decoder, layers, c.topk,
                               log=lambda m: print(f"[features] {m}", flush=True), max_shards=c.max_shards)
            _barrier(self.world)
            items = load_cached(c.data, c.cache_dir, c.max_shards)
            store: Any = CachedFeatures(items)
        else:
            store = OnlineFeatures(self.decoder, [(ids, plen) for ids, plen, _ in raw], layers, c.topk)
        self.store = store
        n = len(raw)
        self.val_idx = [i for i in range(n) if c.val_every_nth and i % c.val_every_nth == 0]
        held = set(self.val_idx)
        self.train_idx = [i for i in range(n) if i not in held]
        self.sources = {}
        for i in self.train_idx:
            self.sources[raw[i][2]] = self.sources.get(raw[i][2], 0) + 1
        self.train_tokens = sum(len(raw[i][0]) - raw[i][1] for i in self.train_idx)
        self._raw = raw

    def _build_model(self) -> None:
        from dspark.train.vocab import build_d2t, coverage, token_counts

        c, dcfg = self.cfg, self.dcfg
        d2t, self.vocab_info = None, {}
        init = self._init_tensors()
        if init is not None and "d2t" in init:
            d2t = init["d2t"].long()
            self.vocab_info = {"draft_vocab_size": dcfg.draft_vocab_size, "from": c.init_from}
        elif dcfg.draft_vocab_size is not None:
            counts = token_counts(((self._raw[i][0], torch.arange(len(self._raw[i][0])) >= self._raw[i][1])
                                   for i in self.train_idx), dcfg.vocab_size)
            eos = self.target_cfg.get("eos_token_id", [])
            d2t = build_d2t(counts, dcfg.draft_vocab_size, always=eos if isinstance(eos, list) else [eos])
            self.vocab_info = {"draft_vocab_size": dcfg.draft_vocab_size,
                               "train_token_coverage": round(coverage(counts, d2t), 5)}
        torch.manual_seed(c.seed)
        dec = self.decoder
        self.model = DSparkDrafter(dcfg, dec.embed_tokens.weight, dec.lm_head.weight, d2t=d2t,
                                   dtype=torch.float32).to(self.device)
        if init is not None:
            self.model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in init.items()},
                                       strict=True)
        self.ddp = self.model
        if self.world > 1:
            self.ddp = torch.nn.parallel.DistributedDataParallel(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=c.lr, betas=(0.9, 0.95), weight_decay=c.weight_decay)
        self.global_batch = c.batch_size * self.world
        self.steps_per_epoch = max(1, len(self.train_idx) // self.global_batch)
        self.total_steps = c.steps or max(1, int(math.ceil(c.epochs * self.steps_per_epoch)))
        self.weights = position_weights(dcfg.block_size, c.decay, self.device)
        self.step = 0

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
        if theirs != self.dcfg:
            diff = {k: (v, getattr(self.dcfg, k)) for k, v in theirs.to_dict().items()
                    if v != self.dcfg.to_dict()[k]}
            raise ValueError(f"--init-from {src}: drafter config differs from this run's (theirs, ours): {diff}")
        return load_file(str(src / WEIGHTS))

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

    def make_batch(self, idx: list[int], epoch: int) -> tuple[dict[str, torch.Tensor], int]:
        """Collated features + per-sequence anchors (seeded by epoch and sequence index); token count."""
        samples = self.store.get_many(idx)
        anchors = []
        for i, s in zip(idx, samples):
            g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + epoch) * 10_000_019 + i)
            anchors.append(sample_anchors(s.loss_mask, self.cfg.anchors, g))
        return collate(samples, anchors), sum(len(s.ids) for s in samples)

    # -- one pass
    def loss_parts(self, batch: dict[str, torch.Tensor], module: torch.nn.Module):
        """Forward the drafter over all anchored blocks -> LossParts."""
        b = {k: v.to(self.device) for k, v in batch.items()}
        g = self.dcfg.block_size
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.compute_dtype == "bfloat16"):
            out = module(b["hidden"], b["ids"], b["anchor_pos"], b["anchor_valid"])
        labels, valid = block_labels(b["ids"], b["anchor_pos"], b["anchor_valid"], g, b["mask"])
        rows = b["anchor_pos"].unsqueeze(-1) + torch.arange(g, device=self.device)  # p_t row of slot k
        bsz, a, _ = rows.shape
        flat = rows.clamp(max=b["ids"].shape[1] - 1).view(bsz, a * g, 1)
        kk = b["top_ids"].shape[-1]
        top_ids = b["top_ids"].gather(1, flat.expand(-1, -1, kk)).view(bsz, a, g, kk)
        top_probs = b["top_probs"].gather(1, flat.expand(-1, -1, kk)).view(bsz, a, g, kk)
        if self.model.d2t is not None:
            top_ids = self.model.t2d[top_ids]
        return dspark_loss_parts(out.logits, out.conf_logits, self.model.draft_labels(labels), valid,
                                 top_ids, top_probs, self.weights)

    def train_step(self, step: int) -> tuple[dict, int]:
        """One optimizer step on this step's global batch; returns global stats and local tokens."""
        epoch = step // self.steps_per_epoch
        batch, ntok = self.make_batch(self.batch_indices(step), epoch)
        self.model.train()
        parts = self.loss_parts(batch, self.ddp)
        dens = torch.stack([parts.ce_den, parts.den]).double()
        _all_reduce(dens, self.world)
        loss = combine(parts, float(dens[0]), float(dens[1]), scale=float(self.world))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        for grp in self.opt.param_groups:
            grp["lr"] = self.lr_at(step)
        self.opt.step()
        stats = parts.stats()
        _all_reduce(stats, self.world)
        return summarize(stats, self.dcfg.block_size), ntok

    @torch.no_grad()
    def validate(self, batch_size: int | None = None) -> dict:
        """Same metrics on the held-out split (fixed anchors), summed over ranks."""
        self.model.eval()
        mine = self.val_idx[self.rank::self.world]
        bs = batch_size or self.cfg.batch_size
        total = None
        for j in range(0, len(mine), bs):
            batch, _ = self.make_batch(mine[j:j + bs], epoch=-1)
            st = self.loss_parts(batch, self.model).stats()
            total = st if total is None else total + st
        if total is None:
            total = torch.zeros(6 + 4 * self.dcfg.block_size, dtype=torch.float64)
        _all_reduce(total, self.world)
        return summarize(total, self.dcfg.block_size)

    # -- checkpoints
    def save_checkpoint(self) -> None:
        """Atomic ckpt.pt: model, optimizer, step, RNG, data position (rank 0 writes)."""
        if self.rank == 0:
            state = {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step,
                     "epoch": self.step // self.steps_per_epoch, "rng": torch.get_rng_state(),
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
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])
        random.setstate(state["py_rng"])
        return True

    def _log(self, record: dict) -> None:
        if self.rank == 0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def fit(self) -> dict:
        """Train to total_steps (resuming if a checkpoint exists), validate, export; returns val metrics."""
        from tqdm import tqdm

        resumed = self.maybe_resume()
        c = self.cfg
        if self.rank == 0:
            print(f"[train] {len(self.train_idx)} train / {len(self.val_idx)} val sequences, "
                  f"{self.total_steps} steps x {self.global_batch} seqs, world {self.world}"
                  + (f", resumed at step {self.step}" if resumed else ""), flush=True)
        bar = tqdm(total=self.total_steps, initial=self.step, disable=self.rank != 0, dynamic_ncols=True)
        t_start, tok_seen = time.perf_counter(), 0
        while self.step < self.total_steps:
            if c.stop_after is not None and self.step >= c.stop_after:
                bar.close()
                return {}
            m, ntok = self.train_step(self.step)
            self.step += 1
            tok_seen += ntok * self.world
            tps = tok_seen / (time.perf_counter() - t_start)
            bar.update(1)
            bar.set_postfix_str(f"loss {m['loss']:.3f} acc {'/'.join(f'{a:.2f}' for a in m['acc'])} "
                                f"{tps:.0f} tok/s")
            if self.step % c.log_every == 0:
                self._log({"step": self.step, "lr": self.lr_at(self.step - 1), "tok_s": round(tps, 1), **m})
            if c.val_interval and self.step % c.val_interval == 0 and self.step < self.total_steps:
                self._log({"step": self.step, "val": self.validate()})
            if self.step % c.ckpt_every == 0 or self.step == self.total_steps:
                self.save_checkpoint()
        bar.close()
        val = self.validate() if self.val_idx else {}
        self._log({"step": self.step, "val": val, "final": True})
        if self.rank == 0 and val:
            print("[val] " + json.dumps({k: (round(v, 4) if isinstance(v, float) else [round(x, 3) for x in v])
                                         for k, v in val.items()}), flush=True)
        if c.export and self.rank == 0:
            self.export(c.export, val)
        _barrier(self.world)
        return val

    def recipe(self, val: dict) -> dict:
        """Training recipe + data recipe + validation metrics for the checkpoint metadata."""
        manifest = Path(self.cfg.data) / "manifest.json"
        data = json.loads(manifest.read_text()) if manifest.exists() else {}
        cfg = dataclasses.asdict(self.cfg)
        return {"trained_for": {"model": self.target_cfg.get("_name_or_path") or str(self.model_path.name),
                                "hidden_size": self.dcfg.hidden_size, "vocab_size": self.dcfg.vocab_size,
                                "num_hidden_layers": self.target_cfg.get("num_hidden_layers")},
                "train": {k: cfg[k] for k in ("batch_size", "anchors", "lr", "warmup", "min_lr_ratio",
                                               "weight_decay", "grad_clip", "decay", "topk", "seed",
                                               "val_every_nth", "epochs")},
                "steps": self.total_steps, "world_size": self.world,
                "losses": "0.1 CE + 0.9 TV + 1.0 BCE(conf, 1 - 0.5|p_d - p_t|_1), w_k = exp(-(k-1)/decay)",
                "train_sequences": len(self.train_idx), "train_response_tokens": self.train_tokens,
                "val_sequences": len(self.val_idx), "sources": self.sources,
                "data_recipe": data.get("recipe", {}), "vocab": self.vocab_info, "init_from": self.cfg.init_from,
                "val": val, **self.cfg.recipe}

    def export(self, directory: str, val: dict) -> None:
        """save_pretrained in save_dtype (the loader casts back to the target's dtype)."""
        import copy

        model = copy.deepcopy(self.model).cpu()
        if self.cfg.save_dtype == "bfloat16":
            model = model.to(torch.bfloat16)
        meta = self.recipe(val)
        if self.model.d2t is not None:
            from dspark.train.vocab import time_draft

            meta["vocab"]["draft_block_time"] = time_draft(copy.deepcopy(self.model).cpu().eval())
        model.save_pretrained(directory, metadata=meta)
        print(f"[export] {directory}", flush=True)


# ---- distributed helpers ---------------------------------------------------------------------------
def _init_distributed() -> tuple[int, int]:
    """(rank, world) from torchrun's environment; gloo on CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def _all_reduce(t: torch.Tensor, world: int) -> None:
    if world > 1:
        dist.all_reduce(t)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()
