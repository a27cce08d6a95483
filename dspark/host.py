"""The machine a process runs on, as a cached timing (an SPS table) and a benchmark report name it."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux, else what the platform module says; "" if neither)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def cpu_identity() -> str:
    """The CPU's model name, core count and the vector ISA PyTorch dispatches to: what a timing measured
    on one machine is valid for (two hosts sharing a $DSPARK_HOME do not share their tables)."""
    import torch

    return f"{cpu_name()}|cores={os.cpu_count()}|isa={torch.backends.cpu.get_cpu_capability()}"
