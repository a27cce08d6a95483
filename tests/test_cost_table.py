"""SPS cost table: lookup, interpolation, extrapolation, JSON round trip and validation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.spec.cost_table import SPSTable

META = {"version": 1, "model": "tiny", "dtype": "float32", "threads": 2, "torch": "2.13.0", "device": "cpu"}


def _table() -> SPSTable:
    return SPSTable({1: 100.0, 2: 90.0, 4: 50.0}, model="tiny", dtype="float32", threads=2,
                    torch_version="2.13.0", device="cpu")


def test_exact_and_interpolated() -> None:
    t = _table()
    assert t.sps(1) == 100.0 and t.sps(2) == 90.0 and t.sps(4) == 50.0
    assert t.sps(3) == pytest.approx(70.0)
    assert t.max_tokens == 4


def test_below_smallest_and_invalid_size() -> None:
    t = SPSTable({4: 10.0, 8: 5.0})
    assert t.sps(1) == 10.0
    with pytest.raises(ValueError):
        t.sps(0)


def test_extrapolation_keeps_decreasing_and_positive() -> None:
    t = _table()
    # last segment: step time 1/90 -> 1/50 over 2 tokens
    slope = (1 / 50 - 1 / 90) / 2
    assert t.sps(6) == pytest.approx(1 / (1 / 50 + 2 * slope))
    values = [t.sps(b) for b in range(4, 2000, 7)]
    assert all(v > 0 for v in values)
    assert all(a > b for a, b in zip(values, values[1:]))


def test_extrapolation_of_jagged_or_single_point_tables() -> None:
    jagged = SPSTable({1: 10.0, 2: 12.0})  # last segment speeds up: use average time per token
    assert jagged.sps(4) == pytest.approx(1 / (1 / 12 + 2 * (1 / 12) / 2))
    assert jagged.sps(3) > jagged.sps(4) > jagged.sps(50) > 0
    single = SPSTable({1: 10.0})
    assert single.sps(3) == pytest.approx(10.0 / 3)


def test_save_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "sps.json"
    _table().save(path)
    data = json.loads(path.read_text())
    assert data == {**META, "sps": {"1": 100.0, "2": 90.0, "4": 50.0}}
    loaded = SPSTable.load(path)
    assert loaded.points == _table().points
    assert (loaded.model, loaded.dtype, loaded.threads, loaded.torch_version, loaded.device) == (
        "tiny", "float32", 2, "2.13.0", "cpu")


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps([1, 2]),
        json.dumps({k: v for k, v in META.items() if k != "dtype"} | {"sps": {"1": 1.0}}),
        json.dumps(META),  # no sps
        json.dumps(META | {"sps": {}}),
        json.dumps(META | {"sps": {"1": 0.0}}),
        json.dumps(META | {"sps": {"1": -3.0}}),
        json.dumps(META | {"sps": {"1": "fast"}}),
        json.dumps(META | {"sps": {"one": 1.0}}),
        json.dumps(META | {"sps": {"0": 1.0}}),
        json.dumps(META | {"version": 2, "sps": {"1": 1.0}}),
        json.dumps(META | {"threads": "two", "sps": {"1": 1.0}}),
    ],
)
def test_malformed_files_name_the_path(tmp_path: Path, content: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match="bad.json"):
        SPSTable.load(path)


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="absent.json"):
        SPSTable.load(tmp_path / "absent.json")


def test_constructor_rejects_bad_points() -> None:
    for points in ({}, {1: float("nan")}, {1: float("inf")}, {-1: 2.0}):
        with pytest.raises(ValueError):
            SPSTable(points)
