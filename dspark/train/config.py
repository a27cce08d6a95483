"""TrainConfig and the `dspark train` options (no torch import, so the CLI stays fast to start)."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any


TARGET_QUANTIZATIONS = ("auto", "served", "none")  # the dense target pass's weights (train/dense_target.dense_quantization)


def add_target_quantization_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """--target-quantization, as train, train-data and calibrate take it (prefix: before its help)."""
    p.add_argument("--target-quantization", default="auto", choices=TARGET_QUANTIZATIONS,
                   help=prefix + "weights of the target pass: served keeps layers that already are 4-bit groups (the "
                   "embedded GGUF) on dspark's 4-bit kernel on a CPU, as the engine serves them; none dequantises them "
                   "for a plain bf16 / fp32 pass; auto is the faster of the two: none on CPUs with AMX tiles, served "
                   "elsewhere")


@dataclass
class TrainConfig:
    """Everything a training run depends on (stored in the checkpoint and the exported metadata)."""

    data: list[str] = field(default_factory=list)  # train-data directories, mixed
    run_dir: str = ""
    model: str | None = None  # target dir; None = embedded SmolLM2
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
    batch_size: int = 8  # sequences per rank per optimizer step
    micro_tokens: int = 4096  # padded tokens per forward (gradient accumulation inside a step)
    max_seq_len: int = 1024  # sequences are cut to this many tokens
    anchors: int = 64  # max anchors per sequence
    steps: int | None = None
    epochs: float = 1.0
    lr: float = 6e-4
    warmup: float = 0.04
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    decay: float = 4.0  # g of w_k = exp(-(k-1)/g)
    ce_weight: float = 0.1  # loss = ce_weight CE + tv_weight TV + conf_weight BCE (DeepSpec: 0.1 / 0.9 / 1.0)
    tv_weight: float = 0.9
    conf_weight: float = 1.0
    conf_label: str = "tv"  # confidence target: "tv" (1 - TV/2, sampled acceptance) or "greedy" (argmax match)
    seed: int = 0
    val_every_nth: int = 20  # every n-th sequence of each data directory is held out
    val_max: int = 0  # validate on at most this many held-out sequences per directory (0: all)
    ckpt_every: int = 50
    curve_start: int = 0  # learning-curve points at curve_start x 10^(k/4) tokens (0: none)
    curve_snapshots: bool = True  # also save the drafter at each curve point (run_dir/curve/)
    log_every: int = 1
    stop_after: int | None = None  # leave after this many optimizer steps in total (simulated kill)
    save_dtype: str = "bfloat16"
    target_dtype: str = "auto"  # the dense target pass computing features: auto = bf16 where supported
    target_quantization: str = "auto"  # its weights: served (4-bit layers stay 4-bit), none (plain), auto (the faster)
    compute_dtype: str = "auto"  # drafter weights and activations (auto: as target_dtype); AdamW keeps fp32 masters
    threads: int | None = None
    device: str = "auto"  # where the target pass and the drafter run: auto = cuda:$LOCAL_RANK when CUDA is there
    feature_cache_gb: float = 0.0  # keep target passes in memory up to this many GiB (0: recompute every time)
    recipe: dict[str, Any] = field(default_factory=dict)


def add_train_args(p: argparse.ArgumentParser) -> None:
    """argparse options mirroring TrainConfig."""
    d = TrainConfig()
    p.add_argument("--data", required=True, action="append",
                   help="train-data directory (shard_*.pt), DIR:K to take its training sequences K times "
                        "an epoch; repeat to mix several (every --val-every-nth of each is held out)")
    p.add_argument("--run-dir", required=True, help="where ckpt.pt, metrics.jsonl and curve/ live")
    p.add_argument("--model", default=None, help="target model dir (default: embedded SmolLM2)")
    p.add_argument("--export", default=None, help="save the trained drafter here (config.json + safetensors)")
    p.add_argument("--max-shards", type=int, default=None, metavar="N", help="use only the first N data shards")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from this drafter checkpoint's weights (and draft vocabulary); same config, "
                        "or another --draft-vocab-size (fresh vocabulary, Markov rows carried over by token)")
    for name in ("num_layers", "block_size", "markov_rank", "batch_size", "micro_tokens", "max_seq_len", "anchors",
                 "seed", "val_every_nth", "val_max", "ckpt_every", "log_every", "curve_start"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--markov-head-type", default=d.markov_head_type, choices=("vanilla", "gated", "rnn"))
    p.add_argument("--no-confidence-head", action="store_true")
    p.add_argument("--target-layer-ids", default=None, help="comma-separated (default: spread over depth)")
    p.add_argument("--mask-token-id", type=int, default=None)
    p.add_argument("--draft-vocab-size", type=int, default=None, help="top-N tokens of the data (default: full)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: from --epochs)")
    p.add_argument("--stop-after", type=int, default=None)
    for name in ("epochs", "lr", "warmup", "min_lr_ratio", "weight_decay", "grad_clip", "decay",
                 "ce_weight", "tv_weight", "conf_weight"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(d, name))
    p.add_argument("--conf-label", default=d.conf_label, choices=("tv", "greedy"),
                   help="the confidence head's target: tv = 1 - TV/2 (what sampling accepts), greedy = 1 "
                        "where the drafter's argmax is the target's (what greedy verification accepts)")
    p.add_argument("--save-dtype", default=d.save_dtype, choices=("float32", "bfloat16"))
    p.add_argument("--compute-dtype", default=d.compute_dtype, choices=("auto", "float32", "bfloat16"),
                   help="drafter weights and activations (AdamW keeps fp32 master weights); auto: bfloat16 "
                        "where the CPU has fast bf16 matmuls (AMX / AVX-512-bf16) or on CUDA, else float32")
    p.add_argument("--no-curve-snapshots", dest="curve_snapshots", action="store_false",
                   help="learning-curve points log metrics only (no drafter snapshot under RUN_DIR/curve)")
    p.add_argument("--target-dtype", default=d.target_dtype, choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype of the target computing features (auto: bfloat16 on AMX / AVX-512-bf16 CPUs)")
    add_target_quantization_arg(p)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default=d.device,
                   help="where the target pass and the drafter run: auto (cuda:$LOCAL_RANK where CUDA is "
                        "available, else cpu), cpu, cuda or cuda:N")
    p.add_argument("--feature-cache-gb", type=float, default=d.feature_cache_gb, metavar="GB",
                   help="keep each sequence's target pass in memory (up to GB GiB) so later epochs and "
                        "validations skip it; ~14 KB a token in fp32, 7 in bf16 (default 0: recompute)")
    p.add_argument("--twin", action="append", default=[], metavar="'OPTIONS'",
                   help="train another drafter beside this one on the same batches, sharing each step's "
                        "target pass: OPTIONS (quoted) change only this run's drafter, init, losses, "
                        "optimiser, --run-dir and --export, e.g. --twin '--run-dir runs/train/flash "
                        "--markov-rank 0 --no-confidence-head'; repeat for more")


# what a --twin may set differently from the run it trains beside: everything else decides the batches,
# the target pass or the schedule, which the twins share
TWIN_FIELDS = frozenset({"run_dir", "export", "init_from", "num_layers", "markov_rank", "markov_head_type",
                         "confidence_head", "mask_token_id", "draft_vocab_size", "lr", "warmup", "min_lr_ratio",
                         "weight_decay", "grad_clip", "decay", "ce_weight", "tv_weight", "conf_weight",
                         "conf_label", "save_dtype", "compute_dtype", "ckpt_every", "curve_snapshots"})


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed add_train_args options."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    kw = {k: v for k, v in vars(args).items() if k in names}
    kw["confidence_head"] = not args.no_confidence_head
    if args.target_layer_ids:
        kw["target_layer_ids"] = [int(x) for x in args.target_layer_ids.split(",")]
    return TrainConfig(**kw)


def twin_configs(args: argparse.Namespace) -> list[TrainConfig]:
    """The --twin runs: the main options overridden by each twin's own, checked to share the batches."""
    import shlex

    p = argparse.ArgumentParser(prog="dspark train --twin")
    add_train_args(p)
    for action in p._actions:  # only what the twin string sets
        action.default, action.required = argparse.SUPPRESS, False
    main = config_from_args(args)
    out = []
    for text in args.twin:
        given = vars(p.parse_args(shlex.split(text)))
        if "twin" in given:
            raise ValueError(f"--twin {text!r}: a twin cannot hold --twin")
        twin = config_from_args(argparse.Namespace(**{**vars(args), **given}))
        changed = sorted(f.name for f in dataclasses.fields(TrainConfig)
                         if getattr(twin, f.name) != getattr(main, f.name) and f.name not in TWIN_FIELDS)
        if changed:
            raise ValueError(f"--twin {text!r} changes {', '.join(changed)}: a twin trains on the same batches "
                             f"and schedule; it may set only {', '.join(sorted(TWIN_FIELDS))}")
        out.append(twin)
    dirs = [c.run_dir for c in [main, *out]]
    if len(set(dirs)) < len(dirs):
        raise ValueError(f"--twin: every run needs its own --run-dir (got {dirs})")
    exports = [c.export for c in [main, *out] if c.export]
    if len(set(exports)) < len(exports):
        raise ValueError(f"--twin: every run needs its own --export (got {exports})")
    return out


