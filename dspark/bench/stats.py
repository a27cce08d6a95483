"""Small statistics helpers shared by the offline suite, the load generator and the reports."""
from __future__ import annotations

import math
import statistics
from typing import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    xs = sorted(v for v in values if v is not None and math.isfinite(v))
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def spread(values: Sequence[float]) -> dict:
    """Median, min, max and every run of a repeated measurement."""
    xs = [float(v) for v in values]
    if not xs:
        return {"median": None, "min": None, "max": None, "runs": []}
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def latency_summary(values: Sequence[float]) -> dict:
    """p50 / p90 / p99 and the mean of a latency sample (seconds)."""
    xs = [v for v in values if v is not None]
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99),
            "mean": sum(xs) / len(xs) if xs else None, "n": len(xs)}
