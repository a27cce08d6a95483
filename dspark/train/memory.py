"""Keeping freed memory in the process within a training step and between steps, handing it back once
the process holds too much.

glibc serves every allocation above its mmap threshold (at most 32 MB, often far less) with a fresh
mapping and unmaps it on free, and trims the top of its heap as soon as it is free, so a training step's
large temporaries (vocabulary-sized logits, activations, gradients: tens to hundreds of MB, made and freed
thousands of times a step) cost page faults and the zeroing of new pages on first touch. On 2 cores that
was ~15-20% of a step: a bf16 -> fp32 copy of a [32, 16384] block took 0.7 ms from fresh pages and 0.2 ms
from reused ones. keep_freed_memory() raises both thresholds, so freed blocks stay in the heap and the
next ones reuse them, as PyTorch's caching allocator does on a GPU.

Kept forever, the heap fragments: blocks of each step's own sizes pile up, and a run grew by ~0.6 GB a
step until it was killed for memory at 22 GB (step 65). So the trainer calls release_freed_memory()
(malloc_trim) after every optimizer step, which hands the free pages back once the process's resident
memory is above a budget (DSPARK_TRIM_ABOVE_GB, default half the machine's memory; 0: after every step).
Trimmed after every step, the next step faults its whole working set in again: ~6.5 GB a step for the
shipped drafter beside its DFlash twin (2-core Zen 4), ~11% of the run's CPU time in the kernel.

DSPARK_KEEP_FREED_MEMORY=0 leaves glibc's defaults. Elsewhere than glibc (macOS, musl) nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "DSPARK_KEEP_FREED_MEMORY"
TRIM_ENV = "DSPARK_TRIM_ABOVE_GB"
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


def release_freed_memory(above: int | None = None) -> bool:
    """Hand the heap's free memory back to the system (malloc_trim) if this process's resident memory is
    above `above` bytes (None: trim_budget()); after keep_freed_memory(), a no-op otherwise. Whether it
    trimmed."""
    if _libc is None:
        return False
    if resident_bytes() <= (trim_budget() if above is None else above):
        return False
    _libc.malloc_trim(0)
    return True


def trim_budget() -> int:
    """Resident bytes above which release_freed_memory() trims: DSPARK_TRIM_ABOVE_GB, else half the
    machine's memory (0 where it cannot be read: trim every time)."""
    value = os.environ.get(TRIM_ENV)
    if value is not None:
        try:
            return max(int(float(value) * 2**30), 0)
        except ValueError:
            raise ValueError(f"{TRIM_ENV} must be a number of GiB, got {value!r}") from None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2
    except (OSError, ValueError, AttributeError):
        return 0


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux; 0 elsewhere, which never reaches a budget)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
