"""Measured target speed per verify batch size: the SPS table the throughput planners optimise against.

File format (JSON, version 1):
    {"version": 1, "model": str, "dtype": str, "threads": int, "torch": str, "device": str,
     "sps": {"1": float, "2": float, ...}}
where sps[B] is the number of target forward passes per second at B packed tokens.
"""
from __future__ import annotations

import bisect
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

FORMAT_VERSION = 1
_META_KEYS: dict[str, type] = {"model": str, "dtype": str, "threads": int, "torch": str, "device": str}


class SPSTable:
    """Steps per second of the target forward as a function of verify batch size in tokens."""

    def __init__(
        self,
        sps: Mapping[int, float],
        *,
        model: str = "",
        dtype: str = "",
        threads: int = 0,
        torch_version: str = "",
        device: str = "",
    ) -> None:
        """Validate and store measured points {tokens: steps/s}; raises ValueError if malformed."""
        if not sps:
            raise ValueError("SPS table needs at least one measured size")
        points: dict[int, float] = {}
        for size, value in sps.items():
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"SPS table size {size!r} is not a positive integer")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"SPS at size {size} is not a number: {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"SPS at size {size} must be finite and > 0, got {value!r}")
            points[size] = float(value)
        self._sizes: tuple[int, ...] = tuple(sorted(points))
        self._values: tuple[float, ...] = tuple(points[s] for s in self._sizes)
        self.model, self.dtype, self.threads = model, dtype, threads
        self.torch_version, self.device = torch_version, device

    @property
    def max_tokens(self) -> int:
        """Largest measured verify batch size (tokens)."""
        return self._sizes[-1]

    @property
    def points(self) -> dict[int, float]:
        """A copy of the measured {tokens: steps/s} points."""
        return dict(zip(self._sizes, self._values))

    def sps(self, tokens: int) -> float:
        """Steps/s at `tokens`: measured value, linear interpolation, or decreasing extrapolation."""
        if tokens < 1:
            raise ValueError(f"verify batch size must be >= 1 token, got {tokens}")
        sizes, values = self._sizes, self._values
        if tokens <= sizes[0]:
            return values[0]  # below the smallest measurement: assume no faster than it
        if tokens <= sizes[-1]:
            hi = bisect.bisect_left(sizes, tokens)  # first measured size >= tokens
            if sizes[hi] == tokens:
                return values[hi]
            lo = hi - 1
            frac = (tokens - sizes[lo]) / (sizes[hi] - sizes[lo])
            return values[lo] + frac * (values[hi] - values[lo])
        # Beyond the table: extend step time linearly with the last segment's time per token; if that
        # segment is flat or speeds up (a jagged curve), use the last point's average time per token.
        t_last = 1.0 / values[-1]
        slope = t_last / sizes[-1]
        if len(sizes) >= 2:
            seg = (t_last - 1.0 / values[-2]) / (sizes[-1] - sizes[-2])
            if seg > 0:
                slope = seg
        return 1.0 / (t_last + slope * (tokens - sizes[-1]))

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready version-1 representation."""
        return {
            "version": FORMAT_VERSION,
            "model": self.model,
            "dtype": self.dtype,
            "threads": self.threads,
            "torch": self.torch_version,
            "device": self.device,
            "sps": {str(s): v for s, v in zip(self._sizes, self._values)},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>") -> "SPSTable":
        """Parse a version-1 mapping; ValueError naming `source` if anything is missing or invalid."""
        def bad(msg: str) -> ValueError:
            return ValueError(f"malformed SPS table {source}: {msg}")

        if not isinstance(data, dict):
            raise bad("top level is not a JSON object")
        missing = [k for k in ("version", *_META_KEYS, "sps") if k not in data]
        if missing:
            raise bad(f"missing keys {missing}")
        if data["version"] != FORMAT_VERSION:
            raise bad(f"unsupported version {data['version']!r} (expected {FORMAT_VERSION})")
        for key, typ in _META_KEYS.items():
            if isinstance(data[key], bool) or not isinstance(data[key], typ):
                raise bad(f"{key!r} must be {typ.__name__}, got {data[key]!r}")
        raw = data["sps"]
        if not isinstance(raw, dict) or not raw:
            raise bad("'sps' must be a non-empty object {tokens: steps_per_second}")
        sps: dict[int, float] = {}
        for key, value in raw.items():
            try:
                size = int(key)
            except (TypeError, ValueError):
                raise bad(f"sps key {key!r} is not an integer") from None
            sps[size] = value
        try:
            return cls(
                sps,
                model=data["model"],
                dtype=data["dtype"],
                threads=data["threads"],
                torch_version=data["torch"],
                device=data["device"],
            )
        except ValueError as exc:
            raise bad(str(exc)) from None

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "SPSTable":
        """Read a table from a JSON file; ValueError naming the path if unreadable or malformed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"cannot read SPS table {os.fspath(path)}: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"malformed SPS table {os.fspath(path)}: invalid JSON ({exc})") from exc
        return cls.from_dict(data, source=os.fspath(path))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table as JSON (atomically: temp file then rename)."""
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, target)

    def __repr__(self) -> str:
        return f"SPSTable(model={self.model!r}, device={self.device!r}, sizes={self._sizes[0]}..{self.max_tokens})"
