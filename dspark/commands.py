"""The core subcommands: prepare, generate, profile, demo."""
from __future__ import annotations

import json
import sys
import time

from dspark.cli_args import (add_model_args, add_speculative_args, engine_config, model_options, positive,
                             speculative_options)


# The demo's default prompt (written for it, in no training or eval set): a word problem answered step by step,
# the kind of text the shipped drafter drafts best.
DEMO_PROMPT = ("A farmer has 12 cows. Each cow gives 8 liters of milk a day, and he sells the milk for 2 dollars "
               "a liter. How much money does he make in a week? Please reason step by step.")


def register(sub) -> None:
    p = sub.add_parser("prepare", help="convert the embedded default model and build dspark's CPU kernels, "
                                       "once (safe to repeat)")
    p.set_defaults(func=prepare)

    g = sub.add_parser("generate", help="answer one prompt, streaming the text")
    g.add_argument("prompt")
    add_model_args(g)
    g.add_argument("--max-tokens", type=positive, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    g.add_argument("--json", action="store_true", help="print one JSON result instead of streaming text")
    add_speculative_args(g)
    g.set_defaults(func=generate)

    f = sub.add_parser("profile", help="measure the target's steps/s per verify batch size (the SPS table)")
    add_model_args(f)
    f.add_argument("--max-tokens", type=positive, default=128, help="largest verify batch to measure, in tokens")
    f.add_argument("--max-seqs", type=positive, default=1,
                   help="also measure loaded steps of 2..N sequences (the server's --max-running-requests)")
    f.add_argument("--window", type=positive, default=8, help="widest verify window of a loaded step (1 + block size)")
    f.add_argument("--repeats", type=positive, default=5)
    f.add_argument("--out", default=None, help="JSON path (default: print it)")
    f.set_defaults(func=profile)

    d = sub.add_parser("demo", help="the same prompt with plain decoding and with DSpark, side by side")
    add_model_args(d)
    d.add_argument("--prompt", default=DEMO_PROMPT,
                   help="default: a grade-school word problem, where the shipped drafter's drafts survive best "
                        "(mean accept length ~3); on open chat it is ~1-2 and DSpark runs at about plain speed")
    d.add_argument("--max-tokens", type=positive, default=128)
    add_speculative_args(d)
    d.set_defaults(func=demo, speculative_algorithm="DSPARK")


def prepare(args) -> int:
    from dspark.models import native, native_avx2
    from dspark.models.embedded import ensure_embedded_model

    print(ensure_embedded_model())
    # build dspark's CPU kernels now, so that a first start does not
    print("dspark kernels:", ("built" + (", matmuls on AMX tiles" if native.amx() else "")
                              + (", 4-bit matmuls on 8-bit activations" if native.act8() else ""))
          if native.library() is not None else f"not used ({native.why()})")
    print("dspark AVX2 kernels (fp32 models):", "built" if native_avx2.library() is not None
          else f"not used ({native_avx2.why()})")
    return 0


def _sampling(args):
    from dspark import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.seed)


def generate(args) -> int:
    from dspark import LLM

    params = _sampling(args)
    # one prompt: the planner's cost table needs no loaded steps
    llm = LLM(config=engine_config({**model_options(args), **speculative_options(args), "max_num_seqs": 1}))
    prompt = args.prompt if args.raw else llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    shown, out = "", None
    for out in llm.stream(prompt, params):
        if not args.json and out.text.startswith(shown) and not out.text.endswith("\ufffd"):
            sys.stdout.write(out.text[len(shown):])
            sys.stdout.flush()
            shown = out.text
    seconds = time.perf_counter() - start
    n = len(out.token_ids)
    summary = {"tokens": n, "seconds": round(seconds, 3), "tokens_per_s": round(n / seconds, 2),
               "finish_reason": out.finish_reason, "mean_accept_length": round(out.mean_accept_length, 3)}
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, **summary}))
    else:
        if out.text.startswith(shown):
            sys.stdout.write(out.text[len(shown):])
        spec = f", accept length {out.mean_accept_length:.2f}" if args.speculative_algorithm != "NONE" else ""
        print(f"\n[{n} tokens in {seconds:.2f} s, {n / seconds:.1f} tokens/s{spec}, finish: {out.finish_reason}]",
              file=sys.stderr)
    return 0


def profile(args) -> int:
    import torch

    from dspark.models.embedded import resolve_model_path
    from dspark.models.loader import load_decoder, resolve_dtype
    from dspark.speculative.profile import measure_sps

    path = resolve_model_path(args.model)
    decoder = load_decoder(path, dtype=resolve_dtype(args.dtype, args.device), device=args.device, pack=True,
                           quantization=args.quantization)
    table = measure_sps(decoder, max_tokens=args.max_tokens, max_seqs=args.max_seqs, window=args.window,
                        repeats=args.repeats, name=path.name)
    if args.out:
        table.save(args.out)
        print(f"wrote {args.out} ({torch.get_num_threads()} threads)", file=sys.stderr)
    else:
        print(json.dumps(table.to_dict(), indent=2))
    return 0


def demo(args) -> int:
    """Plain decoding vs the chosen speculative method on one prompt: both texts, the lossless verdict
    and the speedup (a one-prompt `dspark bench race`)."""
    from dspark.bench.offline import encode_prompts
    from dspark.bench.race import format_race, race_methods, run_race

    plain, method = race_methods(args)
    ids = encode_prompts(plain.tokenizer, [args.prompt], False)
    result = run_race(plain, method, [("demo prompt", ids[0])], args.max_tokens, plain.tokenizer, progress=False)
    row = result["prompts"][0]
    print(f"prompt: {args.prompt}\n")
    print(f"--- plain decoding ---\n{row['plain_text']}\n")
    print(f"--- {result['method']} ---\n{row['method_text']}\n")
    print(format_race(result))
    return 0 if result["identical"] else 1
