"""SPS cost table: lookup, interpolation, extrapolation, JSON round trip and validation."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark.speculative.cost_table import SPSTable

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


def _loaded() -> SPSTable:
    # one sequence: 10 ms + 1 ms per token; 4 sequences: 20 ms + 5 ms per draft; 8 sequences: 40 + 10 per draft
    return SPSTable({b: 1 / (0.010 + 0.001 * b) for b in (1, 2, 4, 8)},
                    by_seqs={4: {4 + e: 1 / (0.020 + 0.005 * e) for e in (0, 4, 8)},
                             8: {8 + e: 1 / (0.040 + 0.010 * e) for e in (0, 4, 8)}},
                    context=100, kv_seconds=1e-5)


def test_loaded_steps_read_their_own_curve() -> None:
    t = _loaded()
    assert 1 / t.sps(8, 8) == pytest.approx(0.040) and 1 / t.sps(12, 8) == pytest.approx(0.080)
    assert t.sps(6, 4) == pytest.approx((1 / 0.020 + 1 / 0.040) / 2)  # inside the 4-sequence curve
    assert 1 / t.sps(4) == pytest.approx(0.014)  # one sequence: the one-sequence curve
    # 6 sequences: step time halfway between 4 and 8 sequences at the same number of drafts (2)
    assert 1 / t.sps(8, 6) == pytest.approx((1 / t.sps(6, 4) + 1 / t.sps(10, 8)) / 2)
    # 2 sequences: a third of the way from the one-sequence curve (1 + 2 tokens) to 4 sequences (4 + 2)
    assert 1 / t.sps(4, 2) == pytest.approx(1 / t.sps(3) + (1 / t.sps(6, 4) - 1 / t.sps(3)) / 3)
    # 16 sequences: extended through the two largest counts
    assert 1 / t.sps(16, 16) == pytest.approx(0.040 + (0.040 - 0.020) * 2)
    # a table without loaded curves prices every step by its tokens alone (the old behaviour)
    assert _table().sps(4, 3) == _table().sps(4)


def test_context_moves_the_step_time_by_kv_seconds() -> None:
    t = _loaded()
    assert t.sps(8, 8, context_tokens=800) == t.sps(8, 8)  # the profiled context
    assert 1 / t.sps(8, 8, context_tokens=2800) == pytest.approx(0.040 + 2000 * 1e-5)
    assert 1 / t.sps(8, 8, context_tokens=0) == pytest.approx(0.032)
    assert 1 / SPSTable({1: 100.0}, context=10, kv_seconds=1.0).sps(1, context_tokens=0) == pytest.approx(0.005)  # floor
    assert _table().sps(2, context_tokens=10_000) == _table().sps(2)  # no kv_seconds measured


def test_loaded_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "sps.json"
    _loaded().save(path)
    data = json.loads(path.read_text())
    assert set(data["sps_by_seqs"]) == {"4", "8"} and data["context"] == 100 and data["kv_seconds"] == 1e-5
    loaded = SPSTable.load(path)
    assert loaded.points_by_seqs == _loaded().points_by_seqs
    assert loaded.sps(10, 6, 500) == _loaded().sps(10, 6, 500)


@pytest.mark.parametrize("extra", [
    {"sps_by_seqs": []},
    {"sps_by_seqs": {"4": 3}},
    {"sps_by_seqs": {"four": {"4": 1.0}}},
    {"sps_by_seqs": {"1": {"4": 1.0}}},  # one sequence lives in "sps"
    {"sps_by_seqs": {"4": {"2": 1.0}}},  # fewer tokens than sequences
    {"sps_by_seqs": {"4": {"4": -1.0}}},
    {"kv_seconds": -1.0},
    {"context": "long"},
])
def test_malformed_loaded_tables_name_the_path(tmp_path: Path, extra: dict) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(META | {"sps": {"1": 1.0}} | extra))
    with pytest.raises(ValueError, match="bad.json"):
        SPSTable.load(path)
