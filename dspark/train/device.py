"""Where training and data generation run: a device name checked before anything loads."""
from __future__ import annotations

import os

import torch


def train_device(name: str = "auto") -> torch.device:
    """The device a training run or data generation uses: "auto" is cuda:$LOCAL_RANK where CUDA is
    available, else the CPU; a name torch does not know, or CUDA where it is missing, is a ValueError."""
    if name == "auto":
        return torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name}: CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {name!r}")
    return device
