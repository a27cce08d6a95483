"""The machine a process runs on: what a cached timing (an SPS table) and a benchmark report name it by, and
whether its CPU has AMX tiles (the trainer's choice of target pass)."""
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


def amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (PyTorch's own check; False where this PyTorch lacks it)."""
    import torch

    check = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(check and check())
