"""`dspark` command line. Subcommands live next to what they drive; each module registers its own."""
from __future__ import annotations

import argparse
import importlib
import sys

# modules with a register(subparsers) function, added when present
_PLUGINS = ("dspark.commands", "dspark.train.cli", "dspark.server.cli", "dspark.bench.cli", "dspark.interop.cli")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="DSpark speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not (e.name and name.startswith(e.name)):  # a missing plugin, not a broken import inside it
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
