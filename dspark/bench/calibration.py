"""Read the calibration evidence an STS file may carry (ECE per position, reliability bins) for the report.

Accepted shapes (all optional next to "temperatures"):
    "ece_before": [per position], "ece_after": [per position]     or  "ece": {"before": [...], "after": [...]}
    "reliability": [{"confidence": [per bin], "accuracy": [per bin], "count": [per bin]}, ...]  (per position,
                   after STS)                                      or  {"before": [...], "after": [...]}
A file with temperatures only yields None: there is nothing to draw. A reliability.png next to the file
(what `dspark train calibrate` draws) is copied into the report.
"""
from __future__ import annotations

import json
from pathlib import Path


def _floats(x) -> list[float] | None:
    if isinstance(x, list) and all(isinstance(v, (int, float)) for v in x):
        return [float(v) for v in x]
    return None


def _bins(x) -> list[dict] | None:
    if not isinstance(x, list):
        return None
    out = []
    for pos in x:
        if not isinstance(pos, dict) or _floats(pos.get("confidence")) is None or _floats(pos.get("accuracy")) is None:
            return None
        out.append({"confidence": _floats(pos["confidence"]), "accuracy": _floats(pos["accuracy"]),
                    "count": _floats(pos.get("count")) or [1.0] * len(pos["confidence"])})
    return out


def load_calibration(path: str | Path | None) -> dict | None:
    """The normalised calibration data of an STS JSON file, or None if it has none (or is missing)."""
    if path is None or not Path(path).is_file():
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    ece = data.get("ece")
    held_out = bool(_floats(data.get("ece_test_after")))  # measured on logs the fit never saw: report those
    before = _floats(data.get("ece_test_before" if held_out else "ece_before")) or (
        _floats(ece.get("before")) if isinstance(ece, dict) else None)
    after = _floats(data.get("ece_test_after" if held_out else "ece_after")) or (
        _floats(ece.get("after")) if isinstance(ece, dict) else _floats(ece))
    rel = data.get("reliability")
    rel_before, rel_after = (_bins(rel.get("before")), _bins(rel.get("after"))) if isinstance(rel, dict) \
        else (None, _bins(rel))
    if not any((before, after, rel_before, rel_after)):
        return None
    diagram = Path(path).with_name("reliability.png")  # drawn by `dspark train calibrate` next to sts.json
    return {"source": _shown(path), "temperatures": _floats(data.get("temperatures")), "ece_before": before,
            "ece_after": after, "held_out": held_out, "reliability_before": rel_before, "reliability_after": rel_after,
            "diagram": _shown(diagram) if diagram.is_file() else None}


def _shown(path: str | Path) -> str:
    """The path as a report shows it: relative to the working directory when inside it (no machine's
    absolute paths in a committed report)."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)
