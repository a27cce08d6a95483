"""Measured target speed per verify batch: the SPS table the throughput planners optimise against.

File format (JSON, version 1):
    {"version": 1, "model": str, "dtype": str, "threads": int, "torch": str, "device": str,
     "sps": {"1": float, "2": float, ...},
     "sps_by_seqs": {"8": {"8": float, "9": float, ...}, ...},   (optional)
     "context": int, "kv_seconds": float}                        (optional)
where sps[B] is the number of target forward passes per second at B packed tokens of one sequence, and
sps_by_seqs[R][B] the same for B tokens spread over R sequences (R decoding requests, B - R drafts).
Under load a step's cost is not a function of its tokens alone: R sequences attend over R contexts, and
the 4-bit kernel's cost per row grows past a few rows, so the marginal draft costs more than one
sequence's table says. Without sps_by_seqs every R reads the one-sequence curve.
Steps are measured with `context` cached tokens per sequence; kv_seconds is the measured extra step time
per cached token beyond that (attention reads every cached key), so a caller that passes a step's total
context gets the time of that step rather than of the profiled one.
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


def _check_points(sps: Mapping[int, float], what: str) -> dict[int, float]:
    """Validated {tokens: steps/s}; ValueError naming `what` if malformed."""
    if not sps:
        raise ValueError(f"{what} needs at least one measured size")
    points: dict[int, float] = {}
    for size, value in sps.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{what}: size {size!r} is not a positive integer")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{what}: SPS at size {size} is not a number: {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{what}: SPS at size {size} must be finite and > 0, got {value!r}")
        points[size] = float(value)
    return points


class _Curve:
    """Steps/s against tokens for one batch make-up: measured points, interpolation, extrapolation."""

    def __init__(self, points: Mapping[int, float]) -> None:
        self.sizes: tuple[int, ...] = tuple(sorted(points))
        self.values: tuple[float, ...] = tuple(points[s] for s in self.sizes)

    def sps(self, tokens: int) -> float:
        sizes, values = self.sizes, self.values
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


class SPSTable:
    """Steps per second of the target forward as a function of verify batch size in tokens, and
    optionally of the number of sequences sharing the step."""

    def __init__(
        self,
        sps: Mapping[int, float],
        *,
        by_seqs: Mapping[int, Mapping[int, float]] | None = None,
        context: int = 0,
        kv_seconds: float = 0.0,
        model: str = "",
        dtype: str = "",
        threads: int = 0,
        torch_version: str = "",
        device: str = "",
    ) -> None:
        """Validate and store measured points {tokens: steps/s} of one sequence, and optionally
        {sequences: {tokens: steps/s}} for steps shared by several; raises ValueError if malformed."""
        self._one = _Curve(_check_points(sps, "SPS table"))
        self._by_seqs: dict[int, _Curve] = {}
        for seqs, points in sorted((by_seqs or {}).items()):
            if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 2:
                raise ValueError(f"SPS table: sequence count {seqs!r} must be an integer >= 2")
            if not isinstance(points, Mapping):
                raise ValueError(f"SPS table: points for {seqs} sequences must be a mapping")
            checked = _check_points(points, f"SPS table at {seqs} sequences")
            if min(checked) < seqs:
                raise ValueError(f"SPS table at {seqs} sequences: a step has at least {seqs} tokens, "
                                 f"got size {min(checked)}")
            self._by_seqs[seqs] = _Curve(checked)
        if isinstance(context, bool) or not isinstance(context, int) or context < 0:
            raise ValueError(f"SPS table: context must be an integer >= 0, got {context!r}")
        if isinstance(kv_seconds, bool) or not isinstance(kv_seconds, (int, float)) \
                or not math.isfinite(kv_seconds) or kv_seconds < 0:
            raise ValueError(f"SPS table: kv_seconds must be a finite number >= 0, got {kv_seconds!r}")
        self.context, self.kv_seconds = context, float(kv_seconds)
        self.model, self.dtype, self.threads = model, dtype, threads
        self.torch_version, self.device = torch_version, device

    @property
    def max_tokens(self) -> int:
        """Largest measured verify batch size (tokens) of one sequence."""
        return self._one.sizes[-1]

    @property
    def points(self) -> dict[int, float]:
        """A copy of the measured one-sequence {tokens: steps/s} points."""
        return dict(zip(self._one.sizes, self._one.values))

    @property
    def points_by_seqs(self) -> dict[int, dict[int, float]]:
        """A copy of the measured {sequences: {tokens: steps/s}} points (sequences >= 2)."""
        return {r: dict(zip(c.sizes, c.values)) for r, c in self._by_seqs.items()}

    def sps(self, tokens: int, seqs: int = 1, context_tokens: int | None = None) -> float:
        """Steps/s of a step of `tokens` tokens over `seqs` sequences.

        context_tokens: the sequences' cached tokens in all; when given (and the table measured
        kv_seconds), the step time moves by kv_seconds per token away from the profiled
        seqs * context, never below half the profiled time.

        One sequence, or a table without per-sequence curves: the one-sequence curve (measured value,
        linear interpolation, decreasing extrapolation). Otherwise the step time at the same number of
        extra tokens (tokens - seqs) is interpolated linearly between the nearest measured sequence
        counts (the one-sequence curve counts as 1), and extended linearly past the largest.
        """
        if tokens < 1:
            raise ValueError(f"verify batch size must be >= 1 token, got {tokens}")
        if seqs < 1:
            raise ValueError(f"a step has at least 1 sequence, got {seqs}")
        value = self._sps(tokens, seqs)
        if context_tokens is None or not self.kv_seconds:
            return value
        t = 1.0 / value
        return 1.0 / max(0.5 * t, t + self.kv_seconds * (context_tokens - seqs * self.context))

    def _sps(self, tokens: int, seqs: int) -> float:
        if seqs == 1 or not self._by_seqs:
            return self._one.sps(tokens)
        if seqs in self._by_seqs:
            return self._by_seqs[seqs].sps(tokens)
        extra = max(0, tokens - seqs)
        curves = {1: self._one, **self._by_seqs}
        counts = sorted(curves)
        hi = next((r for r in counts if r > seqs), None)
        lo = max(r for r in counts if r < seqs)
        if hi is None:  # beyond the largest: extend through the two largest measured counts
            lo, hi = counts[-2], counts[-1]
        t_lo = 1.0 / curves[lo].sps(lo + extra)
        t_hi = 1.0 / curves[hi].sps(hi + extra)
        t = t_lo + (t_hi - t_lo) * (seqs - lo) / (hi - lo)
        return 1.0 / max(t, t_hi if seqs > hi else t_lo)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready version-1 representation."""
        return {
            "version": FORMAT_VERSION,
            "model": self.model,
            "dtype": self.dtype,
            "threads": self.threads,
            "torch": self.torch_version,
            "device": self.device,
            "sps": {str(s): v for s, v in self.points.items()},
            **({"sps_by_seqs": {str(r): {str(s): v for s, v in pts.items()}
                                for r, pts in self.points_by_seqs.items()}} if self._by_seqs else {}),
            **({"context": self.context, "kv_seconds": self.kv_seconds} if self.kv_seconds else {}),
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
        by_seqs: dict[int, dict[int, float]] = {}
        raw_by = data.get("sps_by_seqs", {})
        if not isinstance(raw_by, dict):
            raise bad("'sps_by_seqs' must be an object {sequences: {tokens: steps_per_second}}")
        for key, points in raw_by.items():
            if not isinstance(points, dict):
                raise bad(f"sps_by_seqs[{key!r}] must be an object {{tokens: steps_per_second}}")
            try:
                by_seqs[int(key)] = {int(k): v for k, v in points.items()}
            except (TypeError, ValueError):
                raise bad(f"sps_by_seqs[{key!r}] has a key that is not an integer") from None
        try:
            return cls(
                sps,
                by_seqs=by_seqs,
                context=data.get("context", 0),
                kv_seconds=data.get("kv_seconds", 0.0),
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
        seqs = f", seqs=1,{','.join(map(str, self._by_seqs))}" if self._by_seqs else ""
        return (f"SPSTable(model={self.model!r}, device={self.device!r}, "
                f"sizes={self._one.sizes[0]}..{self.max_tokens}{seqs})")
