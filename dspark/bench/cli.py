"""`dspark bench offline | serve | race | roofline | report`: each writes into --out DIR (results.json,
results.md, PNGs), merging with what earlier bench commands left there."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dspark.cli_args import add_model_args, add_speculative_args, positive, positive_float
from dspark.speculative.config import DraftQuantization, VerifyMode, choices

# --quick: a smoke run of a minute or two: plain decoding against DSpark's default planner only
QUICK = {"num_prompts": 2, "max_tokens": 32, "repeats": 1, "methods": "ar,dspark-throughput"}


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) or v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return [int(v) for v in values]


def _common(p: argparse.ArgumentParser, out_default: str = "bench-results") -> None:
    p.add_argument("--out", default=out_default, help="report directory (results.json, results.md, PNGs)")
    p.add_argument("--quick", action="store_true", help="smoke version: few prompts, short outputs, one repeat")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _dataset_args(p: argparse.ArgumentParser, default_help: str = "") -> None:
    p.add_argument("--dataset", action="append", default=None, metavar="PATH|NAME",
                   help="JSONL file ({\"turns\": [...]}, first turn), a directory of them, or a packaged set "
                        "(human-eval, mt-bench); repeatable" + default_help)
    p.add_argument("--num-prompts", type=positive, default=None, help="first N prompts of each dataset (default 20)")
    p.add_argument("--raw", action="store_true", help="send prompts as is (no chat template)")


def register(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: offline suite, serving load, lossless race, roofline")
    bsub = bench.add_subparsers(dest="bench_command", required=True)

    o = bsub.add_parser("offline", help="methods x datasets x temperature x block size, interleaved")
    add_model_args(o)
    _dataset_args(o, " (default: the shipped eval sets, bench/data/eval: gsm8k, humaneval, mt-bench)")
    from dspark.bench.methods import DEFAULT_METHODS

    o.add_argument("--methods", default=None,
                   help="comma list of ar, ngram, dflash, dspark (= dspark-fixed, -threshold, -throughput), "
                        "dspark-algorithm1 (the throughput planner's algorithm1 variant), "
                        "hf, hf-pld, llama.cpp (llama-cpp-python), llama.cpp-server, llama.cpp-dspark, "
                        "llama.cpp-dspark-pmin (llama-server from `make llamacpp`) "
                        f"(default: {DEFAULT_METHODS}; with --quick: {QUICK['methods']})")
    o.add_argument("--max-tokens", type=positive, default=None, help="new tokens per prompt (default 256)")
    o.add_argument("--temperature", type=_floats, default=[0.0], help="comma list (default 0: greedy)")
    o.add_argument("--block-size", type=_ints, default=None, help="comma list of drafts per round (default: each "
                   "method's own)")
    o.add_argument("--concurrency", type=_ints, default=[1], help="comma list of closed-loop concurrencies "
                   "(engine methods; references run at 1)")
    o.add_argument("--repeats", type=positive, default=None, help="timed repeats (default 3)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    o.add_argument("--dspark-draft-model", default=None, help="DSpark drafter (default: the shipped one)")
    o.add_argument("--dflash-draft-model", default=None, help="DFlash drafter (default: the shipped one)")
    o.add_argument("--draft-quantization", default="auto", choices=choices(DraftQuantization),
                   help="both drafters' matrices (--speculative-draft-model-quantization; default: auto)")
    o.add_argument("--sps-table", default=None, help="SPS JSON for the throughput planner (default: profile once)")
    o.add_argument("--sts-path", default=None, help="STS JSON for DSpark (default: the drafter's)")
    o.add_argument("--threshold", type=float, default=0.5, help="for dspark-threshold")
    o.add_argument("--verify-mode", default="compact", choices=choices(VerifyMode))
    o.add_argument("--gguf", default=None, help="GGUF for llama.cpp (default: the embedded model's)")
    o.add_argument("--llama-p-min", type=float, default=None,
                   help="llama.cpp-dspark-pmin's --spec-draft-p-min (default 0.5)")
    _common(o)
    o.set_defaults(func=offline)

    s = bsub.add_parser("serve", help="load generator against an OpenAI-compatible server")
    s.add_argument("--url", default="http://127.0.0.1:30000", help="server base URL (default: %(default)s)")
    s.add_argument("--label", default=None, help="name of this server in the report (default: its model id)")
    s.add_argument("--mode", choices=["closed", "open"], default="closed")
    s.add_argument("--concurrency", type=_ints, default=None, help="closed loop levels (default 1,2,4,8,16,32)")
    s.add_argument("--rate", type=_floats, default=None, help="open loop levels in requests/s (default 0.5,1,2,4)")
    s.add_argument("--num-requests", type=positive, default=None, help="per level (default 64)")
    s.add_argument("--duration", type=positive_float, default=120.0, help="per level, seconds: no new request after it")
    s.add_argument("--request-timeout", type=positive_float, default=300.0)
    s.add_argument("--max-tokens", type=positive, default=None, help="default 256")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    s.add_argument("--model-name", default=None, help="model field of requests (default: first of /v1/models)")
    s.add_argument("--api-key", default=None)
    s.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    s.add_argument("--seed", type=int, default=0)
    _dataset_args(s)
    _common(s)
    s.set_defaults(func=serve)

    r = bsub.add_parser("race", help="plain decoding vs one method: lossless verdict and speedup")
    add_model_args(r)
    add_speculative_args(r)
    _dataset_args(r)
    r.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable), besides --dataset")
    r.add_argument("--max-tokens", type=positive, default=None, help="default 128")
    _common(r, out_default=None)
    r.set_defaults(func=race, speculative_algorithm="DSPARK")

    f = bsub.add_parser("roofline", help="read bandwidth, weight bytes, plain-decode ceiling, SPS curve")
    add_model_args(f)
    f.add_argument("--sps-table", default=None, help="read the SPS curve from this JSON instead of measuring it")
    f.add_argument("--max-tokens", type=positive, default=64, help="largest verify batch to profile")
    f.add_argument("--repeats", type=positive, default=5)
    f.add_argument("--context", type=positive, default=256, help="cached tokens under each profiled verify batch")
    f.add_argument("--max-seqs", type=positive, default=1,
                   help="also profile loaded steps of 2..N sequences (the planner prices batches with them)")
    f.add_argument("--window", type=positive, default=8, help="widest verify window of a loaded step (gamma + 1)")
    f.add_argument("--save-sps", default=None, help="also write the SPS table here (for --sps-table)")
    f.add_argument("--sts-path", default=None, help="STS JSON with ECE data: adds the calibration figure")
    _common(f)
    f.set_defaults(func=roofline)

    g = bsub.add_parser("report", help="redraw results.md and the PNGs from DIR/results.json")
    g.add_argument("--out", default="bench-results")
    g.add_argument("--sts-path", default=None, help="STS JSON with ECE data: adds the calibration figure")
    g.set_defaults(func=report)


def _finish(out: str, section: str, data, sts_path: str | None = None) -> None:
    from dspark.bench.calibration import load_calibration
    from dspark.bench.report import load_results, merge, write_report

    results = merge(load_results(Path(out)), section, data)
    cal = load_calibration(sts_path)
    if cal:
        results["calibration"] = cal
    files = write_report(Path(out), results)
    print(f"wrote {', '.join(files)} to {out}", file=sys.stderr)


def _pick(value, quick: bool, key: str, default):
    return value if value is not None else (QUICK[key] if quick else default)


def _shipped_sts(draft: str | None) -> str | None:
    from dspark.drafters.registry import shipped_path

    return str(Path(draft or shipped_path("DSPARK")) / "sts.json")


def offline(args) -> int:
    from dspark.bench.datasets import load_datasets, shipped_eval_sets
    from dspark.bench.methods import Setup, expand_methods
    from dspark.bench.offline import OfflineConfig, run_offline

    datasets = load_datasets(args.dataset or shipped_eval_sets(),
                             _pick(args.num_prompts, args.quick, "num_prompts", 20))
    from dspark.bench.methods import DEFAULT_METHODS

    methods = expand_methods(_pick(args.methods, args.quick, "methods", DEFAULT_METHODS))
    cfg = OfflineConfig(methods=methods, max_tokens=_pick(args.max_tokens, args.quick, "max_tokens", 256),
                        temperatures=args.temperature, block_sizes=args.block_size or [None],
                        concurrency=args.concurrency, repeats=_pick(args.repeats, args.quick, "repeats", 3),
                        seed=args.seed, raw=args.raw, ignore_eos=args.ignore_eos, progress=not args.no_progress)
    setup = Setup(model=args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                  dspark_draft=args.dspark_draft_model,
                  dflash_draft=args.dflash_draft_model, draft_quantization=args.draft_quantization,
                  sps_table=args.sps_table, sts_path=args.sts_path,
                  threshold=args.threshold, verify_mode=args.verify_mode, gguf=args.gguf,
                  llama_p_min=args.llama_p_min)
    result = run_offline(datasets, cfg, setup)
    _finish(args.out, "offline", result, args.sts_path or _shipped_sts(args.dspark_draft_model))
    _print_offline(result)
    return 0


def _print_offline(result: dict) -> None:
    print(f"{'dataset':<12}{'method':<22}{'conc':>5}{'T':>5}{'tokens/s':>10}{'speedup':>9}{'tau':>7}{'acc':>7}"
          "  matches ar")
    for c in result["cells"]:
        sp = f"{c['speedup']:.2f}x" if c["speedup"] else "-"
        tau = f"{c['tau']:.2f}" if c["tau"] else "-"
        acc = f"{c['draft_acceptance']:.3f}" if c.get("draft_acceptance") is not None else "-"
        match = {None: "n/a", True: "yes", False: "NO"}[c["matches_ar"]]
        print(f"{c['dataset']:<12}{c['label']:<22}{c['concurrency']:>5}{c['temperature']:>5g}"
              f"{c['tokens_per_s']['median']:>10.1f}{sp:>9}{tau:>7}{acc:>7}  {match}")
    calibrated = [c for c in result["cells"] if c.get("confidence_calibration")]
    if calibrated:
        print("confidence calibration, per draft position: forecast prefix survival / share that survived / ECE")
    for c in calibrated:
        cal = c["confidence_calibration"]
        row = " ".join(f"{f:.2f}/{y:.2f}/{e:.1%}" for f, y, e in zip(cal["forecast"], cal["survived"], cal["ece"]))
        print(f"{c['dataset']:<12}{c['label']:<22}{c['concurrency']:>5}{c['temperature']:>5g}  {row}")


def serve(args) -> int:
    from dspark.bench.datasets import load_datasets
    from dspark.bench.serve import ServeConfig, run_serve

    prompts = None
    if args.dataset:
        n = _pick(args.num_prompts, args.quick, "num_prompts", 20)
        prompts = [p for d in load_datasets(args.dataset, n) for p in d.prompts]
    if args.mode == "closed":
        levels = args.concurrency or ([1, 2] if args.quick else [1, 2, 4, 8, 16, 32])
    else:
        levels = args.rate or ([1.0] if args.quick else [0.5, 1.0, 2.0, 4.0])
    cfg = ServeConfig(url=args.url, mode=args.mode, levels=levels,
                      num_requests=args.num_requests or (4 if args.quick else 64), duration_s=args.duration,
                      request_timeout_s=args.request_timeout, max_tokens=_pick(args.max_tokens, args.quick, "max_tokens", 256),
                      temperature=args.temperature, endpoint=args.endpoint, model=args.model_name,
                      api_key=args.api_key, label=args.label or "", seed=args.seed, progress=not args.no_progress)
    result = run_serve(cfg, prompts, allow_remote=args.allow_remote)
    if not args.label:
        result["label"] = result["model"]
    _finish(args.out, "serve", result)
    for lv in result["levels"]:
        p50 = lv["tpot_s"]["p50"]
        print(f"{result['label']} {args.mode} {lv['level']:g}: {lv['ok']}/{lv['requests']} ok, "
              f"{lv['throughput_tokens_per_s']:.1f} tokens/s, per-token p50 "
              f"{'-' if p50 is None else f'{1000 * p50:.1f} ms'}, errors {lv['errors'] or 0}")
    return 0 if all(not lv["errors"] for lv in result["levels"]) else 1


def race(args) -> int:
    from dspark.bench.datasets import load_datasets
    from dspark.bench.offline import encode_prompts
    from dspark.bench.race import format_race, race_methods, run_race

    named = [(f"prompt {i}", p) for i, p in enumerate(args.prompt or [])]
    if args.dataset:
        n = _pick(args.num_prompts, args.quick, "num_prompts", 5)
        named += [(f"{d.name}#{i}", p) for d in load_datasets(args.dataset, n) for i, p in enumerate(d.prompts)]
    if not named:
        raise ValueError("give prompts with --dataset PATH or --prompt TEXT")
    plain, method = race_methods(args)
    ids = encode_prompts(plain.tokenizer, [p for _, p in named], args.raw)
    result = run_race(plain, method, [(n, i) for (n, _), i in zip(named, ids)],
                      _pick(args.max_tokens, args.quick, "max_tokens", 128), plain.tokenizer, not args.no_progress)
    print(format_race(result))
    if args.out:
        _finish(args.out, "race", result)
    return 0 if result["identical"] else 1


def roofline(args) -> int:
    from dspark.bench.roofline import run_roofline

    result = run_roofline(args.model, dtype=args.dtype, quantization=args.quantization, device=args.device,
                          sps_table=args.sps_table,
                          max_tokens=16 if args.quick else args.max_tokens, repeats=2 if args.quick else args.repeats,
                          bandwidth_mb=128 if args.quick else 256, save_sps=args.save_sps, context=args.context,
                          max_seqs=args.max_seqs, window=args.window, progress=not args.no_progress)
    _finish(args.out, "roofline", result, args.sts_path)
    print(f"read bandwidth {result['bandwidth_gb_s']:.1f} GB/s, weights {result['weight_bytes'] / 1e6:.0f} MB, "
          f"plain-decode ceiling {result['ceiling_tokens_per_s']:.1f} tokens/s")
    return 0


def report(args) -> int:
    from dspark.bench.calibration import load_calibration
    from dspark.bench.report import load_results, write_report

    results = load_results(Path(args.out))
    if not results:
        raise FileNotFoundError(f"no results.json in {args.out}")
    cal = load_calibration(args.sts_path)
    if cal:
        results["calibration"] = cal
    print(f"wrote {', '.join(write_report(Path(args.out), results))} to {args.out}", file=sys.stderr)
    return 0
