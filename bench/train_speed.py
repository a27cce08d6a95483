"""Training throughput: the same optimizer steps of a `dspark train` recipe run on each route, interleaved
step by step in one process so host drift hits both alike, with where a step's time goes.

Routes: "kernels" (the trainer as it ships: the vocabulary-sized losses, their gradient and the target's
soft labels on dspark's kernels, models/csrc/vocab_loss.c; the dense target's SiLU-gating and norms too;
the target pass over each micro-batch's sequences packed without padding), "torch" (PyTorch ops alone),
"padded" (kernels, but the target pass over the micro-batch right-padded to its longest sequence, as
the trainer ran before packing; its rows are then gathered back, an extra copy of well under 1% of a
step), "unfused" (kernels, but the Markov bias as a matmul of its own added to the LM head's logits,
as the trainer ran before heads.biased_logits), "plain-target" (kernels, but the target pass on plain
weights, `--target-quantization none`: the embedded GGUF's 4-bit layers dequantised to packed bf16) and
"served-target" (kernels, but the target pass on the served 4-bit layers, `--target-quantization served`);
the default `auto` is one of the last two, by CPU. Each step index runs once per route on the same sequences
and anchors (the weights move on between them, which changes no shape). Training tokens are the target
tokens a step reads, the trainer's own tokens/s. Needs a data directory made by `dspark train-data` (docs/training.md).

    .venv/bin/python bench/train_speed.py --steps 4 -- --data runs/data/gen-chat [more dspark train options]

With `--twin 'OPTIONS'` among the train options (as `dspark train --twin`), every step also trains the
twins on the same target pass, and "twin steps" is their time; the other phases are the first drafter's.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from dspark.drafters.model import TrainOutput
from dspark.models import native
from dspark.models.loader import load_decoder
from dspark.train import features as features_mod
from dspark.train import trainer as trainer_mod
from dspark.train.config import add_train_args, config_from_args, twin_configs
from dspark.train.dense_target import DenseTarget, dense_quantization
from dspark.train.memory import release_freed_memory, resident_bytes

TARGET_ROUTES = {"plain-target": "none", "served-target": "served"}  # route -> --target-quantization of its pass
ROUTES = ("kernels", "torch", "padded", "unfused", *TARGET_ROUTES)

# the shipped drafter's recipe (dspark/checkpoints/README.md), so only --data must be given
DEFAULTS = ("--init-from dspark/checkpoints/smollm2-135m-dspark --num-layers 2 --markov-rank 64 --target-layer-ids "
            "1,8,15,22,28 --mask-token-id 16 --draft-vocab-size 16384 --batch-size 16 --micro-tokens 4096 "
            "--anchors 128 --conf-label greedy --lr 3e-4 --threads 2 --val-every-nth 20 --steps 1000").split()


@contextmanager
def route(name: str, trainer, targets=None):
    """The training step's vocabulary-sized work and the dense target's pointwise ops on `name` (targets: the
    DenseTargets that "plain-target" and "served-target" run, by route name)."""
    served = trainer.target
    if name in (targets or {}):
        trainer.target = targets[name]
    if name == "padded":
        trainer.target.forward_packed = _padded_pass(trainer.target)  # an instance attribute over the method
    if name == "unfused":
        trainer.model._selected_heads = _unfused_heads(trainer.model)
    saved = os.environ.get(native.ENV)
    if name == "torch":
        os.environ[native.ENV] = "torch"
    silu = trainer.target._kernels
    norms = [(m, m._kernels) for layer in trainer.target.layers for m in (layer.norm1, layer.norm2)]
    norms.append((trainer.target.norm, trainer.target.norm._kernels))
    if name == "torch":
        trainer.target._kernels = False
        for m, _ in norms:
            m._kernels = False
    try:
        yield
    finally:
        trainer.target = served
        trainer.target.__dict__.pop("forward_packed", None)
        trainer.model.__dict__.pop("_selected_heads", None)
        trainer.target._kernels = silu
        for m, k in norms:
            m._kernels = k
        if saved is None:
            os.environ.pop(native.ENV, None)
        else:
            os.environ[native.ENV] = saved


def _padded_pass(target):
    """forward_packed's contract on the padded pass: right-pad, run [B, S], keep each sequence's rows."""
    def forward(seqs, hidden_layers=()):
        ids = torch.nn.utils.rnn.pad_sequence([s.to(target.device) for s in seqs], batch_first=True)
        hidden, final = target.forward(ids, hidden_layers=hidden_layers)
        keep = torch.cat([torch.arange(len(s)) + i * ids.shape[1] for i, s in enumerate(seqs)]).to(ids.device)
        return None if hidden is None else hidden.flatten(0, 1)[keep], final.flatten(0, 1)[keep]
    return forward


def _unfused_heads(model):
    """_selected_heads as the trainer ran before heads.biased_logits: the LM head, then the Markov bias as a
    matmul of its own and the sum of the two [N, Vd] tensors."""
    def heads(prev, h):
        base = model._head(h)
        logits, conf = model._heads_teacher_forced(prev, h, base)
        return TrainOutput(logits=logits, base_logits=base, conf_logits=conf)
    return heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="steps timed per route (after one warm-up step each)")
    ap.add_argument("--routes", default="kernels,torch",
                    help="comma-separated: " + ", ".join(ROUTES))
    ap.add_argument("--json", default=None)
    ap.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then `dspark train` options (--data ...)")
    args = ap.parse_args()
    rest = [a for a in args.train_args if a != "--"]
    tp = argparse.ArgumentParser()
    add_train_args(tp)
    ns = tp.parse_args(DEFAULTS + ["--run-dir", "/tmp/dspark-train-speed"] + rest)
    cfg = config_from_args(ns)
    routes = args.routes.split(",")
    unknown = set(routes) - set(ROUTES)
    if unknown:
        sys.exit(f"unknown --routes {sorted(unknown)}: pick from {', '.join(ROUTES)}")
    if set(routes) - {"torch"} and native.library() is None:
        sys.exit(f"dspark's kernels do not run here: {native.why()}")
    tr = trainer_mod.Trainer(cfg)
    twins = [trainer_mod.Trainer(c, share_target=tr) for c in twin_configs(ns)]  # --twin: as fit_together
    targets = {}
    for name in set(routes) & set(TARGET_ROUTES):
        targets[name] = DenseTarget(load_decoder(tr.model_path, dtype=tr.target.dtype, device=str(tr.device),
                                                 quantization=dense_quantization(TARGET_ROUTES[name], str(tr.device))))
        if targets[name].quantization == tr.target.quantization:
            sys.exit(f"{name}: the trainer's own target pass already runs on those weights ({tr.target.quantization}; "
                     "a model without 4-bit layers has only plain ones)")

    phases: dict[str, float] = collections.defaultdict(float)
    sink = [phases]  # where the phases of the lead's step go (a twin's step is timed whole)

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            sink[0][name] += time.perf_counter() - t
            return out
        return wrapper

    trainer_mod.target_batch = timed("target pass", trainer_mod.target_batch)
    features_mod.soft_labels = timed("soft labels", features_mod.soft_labels)
    tr.loss_parts = timed("drafter forward + losses", tr.loss_parts)
    combine = trainer_mod.combine

    class _Timed:  # the loss whose backward() is timed
        def __init__(self, loss):
            self.loss = loss

        def backward(self):
            t = time.perf_counter()
            self.loss.backward()
            sink[0]["backward"] += time.perf_counter() - t

    trainer_mod.combine = lambda *a, **k: _Timed(combine(*a, **k))
    tr.opt.step = timed("optimizer", tr.opt.step)

    rows: dict[str, list[dict]] = {r: [] for r in routes}
    for step in range(args.steps + 1):  # step 0 warms up each route
        for name in routes:
            phases.clear()
            with route(name, tr, targets):
                t = time.perf_counter()
                micro = list(tr._micro(*tr.step_inputs(step))) if twins else None  # one target pass for all
                _, tokens = tr.train_step(step, micro)
                for twin in twins:
                    sink[0], t1 = collections.defaultdict(float), time.perf_counter()
                    twin.train_step(step, micro)
                    phases["twin steps"] += time.perf_counter() - t1
                    sink[0] = phases
                del micro
                release_freed_memory()  # as Trainer.fit does after each step
                dt = time.perf_counter() - t
            rec = {"step": step, "tokens": tokens, "seconds": round(dt, 3), "tokens_per_s": round(tokens / dt, 1),
                   **{k: round(v, 3) for k, v in phases.items()}, "rss_gb": round(resident_bytes() / 2**30, 2)}
            rec["drafter forward + losses"] = round(rec.get("drafter forward + losses", 0.0)
                                                    - rec.get("soft labels", 0.0), 3)  # soft labels run inside
            print(f"{name:8s} " + json.dumps(rec), flush=True)
            if step:
                rows[name].append(rec)
    summary = {}
    for name, recs in rows.items():
        keys = [k for k in recs[0] if k not in ("step", "tokens", "tokens_per_s", "rss_gb")]
        summary[name] = {"tokens_per_s": round(sum(r["tokens"] for r in recs) / sum(r["seconds"] for r in recs), 1),
                         **{k: round(statistics.median(r[k] for r in recs), 3) for k in keys}}
        print(f"{name:8s} {summary[name]['tokens_per_s']:.0f} training tokens/s; median seconds a step: "
              + ", ".join(f"{k} {v}" for k, v in summary[name].items() if k != "tokens_per_s"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": {k: getattr(cfg, k) for k in ("data", "batch_size", "anchors", "micro_tokens",
                                                                 "threads")},
                       "steps": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
