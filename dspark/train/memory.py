"""Keeping freed memory in the process within a training step, handing it back between steps.

glibc serves every allocation above its mmap threshold (at most 32 MB, often far less) with a fresh
mapping and unmaps it on free, and trims the top of its heap as soon as it is free, so a training step's
large temporaries (vocabulary-sized logits, activations, gradients: tens to hundreds of MB, made and freed
thousands of times a step) cost page faults and the zeroing of new pages on first touch. On 2 cores that
was ~15-20% of a step: a bf16 -> fp32 copy of a [32, 16384] block took 0.7 ms from fresh pages and 0.2 ms
from reused ones. keep_freed_memory() raises both thresholds, so freed blocks stay in the heap and the
next ones reuse them, as PyTorch's caching allocator does on a GPU.

Kept forever, the heap fragments: blocks of each step's own sizes pile up, and a run grew by ~0.6 GB a
step until it was killed for memory at 22 GB (step 65). So the trainer calls release_freed_memory()
(malloc_trim) after every optimizer step: within a step memory is reused, between steps it goes back, and
resident memory stayed at 1.3-1.7 GB over the same steps (bench/train_speed.py prints it), against 2-3.4 GB
with glibc's defaults.

DSPARK_KEEP_FREED_MEMORY=0 leaves glibc's defaults. Elsewhere than glibc (macOS, musl) nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "DSPARK_KEEP_FREED_MEMORY"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_libc: ctypes.CDLL | None = None  # set once the thresholds are raised


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process (once); whether they were raised."""
    global _libc
    if _libc is not None:
        return True
    if os.environ.get(ENV, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # 1 GiB: the largest block mallopt's int takes comfortably; a larger one still gets its own mapping
    if mallopt(_M_MMAP_THRESHOLD, 1 << 30) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1):
        _libc = libc
    return _libc is not None


def release_freed_memory() -> None:
    """Hand the heap's free memory back to the system (malloc_trim), after keep_freed_memory(); a no-op
    otherwise."""
    if _libc is not None:
        _libc.malloc_trim(0)
