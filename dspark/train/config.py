"""TrainConfig and the `dspark train` options (no torch import, so the CLI stays fast to start)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TrainConfig:
    """Everything a training run depends on (stored in the checkpoint and the exported metadata)."""

    data: str = ""
    run_dir: str = ""
    model: str | None = None  # target dir; None = embedded SmolLM2
    cache_dir: str | None = None  # cached features (see features.cache_features); None = online
    export: str | None = None
    max_shards: int | None = None  # train on the first N data shards only
    init_from: str | None = None  # a drafter checkpoint of the same config to start from (weights and d2t)
    # drafter
    num_layers: int = 1
    block_size: int = 7
    markov_rank: int = 64
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    draft_vocab_size: int | None = None
    # optimisation
    batch_size: int = 8  # sequences per rank per step
    anchors: int = 64  # max anchors per sequence
    steps: int | None = None
    epochs: float = 1.0
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    decay: float = 4.0  # g of w_k = exp(-(k-1)/g)
    topk: int = 64  # p_t is kept as its top-K
    seed: int = 0
    val_every_nth: int = 20  # every n-th sequence is held out for validation
    val_interval: int = 0  # steps between validations (0: only at the end)
    ckpt_every: int = 50
    log_every: int = 1
    stop_after: int | None = None  # leave after this many optimizer steps in total (simulated kill)
    save_dtype: str = "bfloat16"
    target_dtype: str = "auto"  # the target that computes features: auto = bf16 packed where supported
    compute_dtype: str = "float32"  # "bfloat16": autocast (fp32 master weights), the DeepSpec recipe
    threads: int | None = None
    recipe: dict[str, Any] = field(default_factory=dict)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """argparse options mirroring TrainConfig."""
    d = TrainConfig()
    p.add_argument("--data", required=True, help="train-data directory (shard_*.pt)")
    p.add_argument("--run-dir", required=True, help="where ckpt.pt, metrics.jsonl (and feature cache) live")
    p.add_argument("--model", default=None, help="target model dir (default: embedded SmolLM2)")
    p.add_argument("--cache-dir", default=None, help="cached target features (computed here if missing)")
    p.add_argument("--online", action="store_true", help="compute target features per batch, no cache")
    p.add_argument("--features-only", action="store_true", help="fill the feature cache, then exit")
    p.add_argument("--export", default=None, help="save the trained drafter here (config.json + safetensors)")
    p.add_argument("--max-shards", type=int, default=None, metavar="N", help="use only the first N data shards")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this drafter checkpoint's weights (and draft vocabulary); same shapes")
    for name in ("num_layers", "block_size", "markov_rank", "batch_size", "anchors", "topk", "seed",
                 "val_every_nth", "val_interval", "ckpt_every", "log_every"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--markov-head-type", default=d.markov_head_type, choices=("vanilla", "gated", "rnn"))
    p.add_argument("--no-confidence-head", action="store_true")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated (default: spread over depth)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="top-N tokens of the data (default: full)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --epochs)")
    p.add_argument("--stop-after", type=int, default=None)
    for name in ("epochs", "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip", "decay"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--save-dtype", default=d.save_dtype, choices=("float32", "bfloat16"))
    p.add_argument("--compute-dtype", default="bfloat16", choices=("float32", "bfloat16"),
                   help="drafter compute dtype (autocast; weights stay fp32)")
    p.add_argument("--target-dtype", default=d.target_dtype, choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype of the target computing features (auto: bfloat16 on AMX / AVX-512-bf16 CPUs)")
    p.add_argument("--threads", type=int, default=None)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed add_train_args options."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["confidence_head"] = not args.no_confidence_head
    if args.target_layer_ids:
        kw["target_layer_ids"] = [int(x) for x in args.target_layer_ids.split(",")]
    if args.online:
        kw["cache_dir"] = None
    elif not args.cache_dir:
        kw["cache_dir"] = str(Path(args.run_dir) / "features")
    return TrainConfig(**kw)


