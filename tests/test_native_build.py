"""The kernels build wherever they can run: test_native.py skips where library() is None, so a C change
that breaks the build on a capable CPU would otherwise pass as skips."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dspark.models import native

# Linux's names for what csrc/layer_ops.c's dspark_supported() asks the CPU for
NEEDED = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"}


def _cpu_flags() -> set[str]:
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return set()
    for line in info.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not NEEDED <= _cpu_flags(), reason="this CPU (or OS) does not report AVX-512 BF16 and VNNI")
@pytest.mark.skipif(not (os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")), reason="no C compiler")
def test_kernels_build_and_load_on_a_capable_cpu(monkeypatch):
    monkeypatch.delenv(native.ENV, raising=False)  # DSPARK_KERNELS=torch would switch them off on purpose
    assert native.library() is not None, native.why()
