"""`dspark` command line: generate (streams to the terminal), prepare (one-time model conversion)."""
from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="convert the embedded default model once (safe to repeat)")
    p.set_defaults(func=_prepare)
    g = sub.add_parser("generate", help="answer one prompt, streaming the text")
    g.add_argument("prompt")
    g.add_argument("--model", "--model-path", default=None, help="local HF directory (default: embedded SmolLM2)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="send the prompt as is (no chat template)")
    g.add_argument("--json", action="store_true", help="print one JSON result instead of streaming text")
    g.set_defaults(func=_generate)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _prepare(args) -> int:
    from dspark.models.embedded import ensure_embedded_model

    print(ensure_embedded_model())
    return 0


def _generate(args) -> int:
    from dspark import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(args.model)
    prompt = args.prompt if args.raw else llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    start = time.perf_counter()
    shown = ""
    out = None
    for out in llm.stream(prompt, params):
        if not args.json and out.text.startswith(shown) and not out.text.endswith("\ufffd"):
            sys.stdout.write(out.text[len(shown):])
            sys.stdout.flush()
            shown = out.text
    seconds = time.perf_counter() - start
    n = len(out.token_ids)
    summary = {"tokens": n, "seconds": round(seconds, 3), "tokens_per_s": round(n / seconds, 2),
               "finish_reason": out.finish_reason}
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, **summary}))
    else:
        sys.stdout.write(out.text[len(shown):] if out.text.startswith(shown) else "")
        print(f"\n[{n} tokens in {seconds:.2f} s, {n / seconds:.1f} tokens/s, finish: {out.finish_reason}]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
