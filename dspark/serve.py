"""`python -m dspark.serve [flags]`: the same as `dspark serve [flags]`."""
from __future__ import annotations

import sys

from dspark.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
