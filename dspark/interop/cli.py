"""`dspark convert`: move a drafter between the dspark, speculators (vLLM) and DeepSpec (SGLang) layouts,
or write it as the draft GGUF llama.cpp's `--spec-type draft-dspark` loads."""
from __future__ import annotations

import sys


def register(sub) -> None:
    from dspark.interop.gguf_draft import OUTTYPES

    p = sub.add_parser("convert", help="convert a drafter checkpoint between dspark, speculators and DeepSpec, "
                                       "or to a llama.cpp draft GGUF",
                       description="SRC's format is detected from its config.json. SRC may be the word "
                                   "'embedded' (the DSpark drafter shipped for the embedded target).")
    p.add_argument("--to", required=True, choices=("speculators", "dspark", "deepspec", "gguf"),
                   help="format to write (gguf: the llama.cpp draft file for --spec-type draft-dspark)")
    p.add_argument("src", metavar="SRC", help="drafter directory, or 'embedded'")
    p.add_argument("dst", metavar="DST", help="output directory (must be empty unless --force); for --to gguf "
                                              "the .gguf file (must not exist unless --force)")
    p.add_argument("--target", default=None,
                   help="target model dir (default: the one the checkpoint remembers; for SRC embedded the "
                        "embedded model): needed for --to deepspec and --to gguf, and for --to speculators "
                        "with a reduced draft vocabulary (its LM head rows are written); also records the verifier")
    p.add_argument("--verifier", default=None,
                   help="verifier name recorded in a speculators config (e.g. Qwen/Qwen3-4B; default: --target)")
    p.add_argument("--model-type", choices=("dspark", "dflash"), default=None,
                   help="speculators_model_type (default: dflash for a drafter without heads, else dspark)")
    p.add_argument("--target-gguf", default=None, metavar="FILE",
                   help="--to gguf: copy the tokenizer keys from the target's own GGUF (the file llama-server -m "
                        "loads) instead of building them from --target's tokenizer.json (default for the embedded "
                        "target: its GGUF)")
    p.add_argument("--outtype", choices=OUTTYPES, default="auto",
                   help="--to gguf: dtype of the weight matrices (default auto: the drafter's own); norms are F32")
    p.add_argument("--force", action="store_true", help="overwrite the checkpoint files of a non-empty DST")
    p.set_defaults(func=run)


def run(args) -> int:
    from dspark.interop.convert import convert, detect_format, resolve_source

    out = convert(args.src, args.dst, to=args.to, target=args.target, verifier=args.verifier,
                  model_type=args.model_type, force=args.force, target_gguf=args.target_gguf,
                  outtype=args.outtype, verbose=True)
    src = resolve_source(args.src)
    print(f"{detect_format(src)} {src} -> {args.to} {out}", file=sys.stderr)
    print(out)
    return 0
