"""The drafters this project trains and ships for the embedded target (dspark/checkpoints/)."""
from __future__ import annotations

from pathlib import Path

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
SHIPPED = {"DSPARK": "smollm2-135m-dspark", "DFLASH": "smollm2-135m-dflash"}  # algorithm -> directory


def shipped_path(algorithm: str) -> Path:
    """Where the shipped drafter of an algorithm (DSPARK, DFLASH) lives, whether or not it is there."""
    return CHECKPOINTS / SHIPPED[algorithm]


def shipped_drafter(algorithm: str) -> Path:
    """The shipped drafter's directory; FileNotFoundError when it is not installed."""
    path = shipped_path(algorithm)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no shipped {algorithm} drafter at {path}; pass draft_model=PATH")
    return path
