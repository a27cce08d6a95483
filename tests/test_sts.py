"""STS fit on synthetic miscalibrated confidence logits: ECE drops at every position."""
from __future__ import annotations

import numpy as np

from dspark.train.sts import ece, fit_sts, format_table, prefix_probs, reliability_png


def _synthetic(n: int = 20000, gamma: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    true_z = rng.normal(1.0, 1.5, size=(n, gamma))
    accept = rng.random((n, gamma)) < 1 / (1 + np.exp(-true_z))
    survived = np.cumprod(accept, axis=1)
    valid = np.ones((n, gamma), dtype=bool)
    valid[: n // 10, 3:] = False  # blocks cut short by the end of the sequence
    return true_z, survived, valid


def test_ece_basics():
    p = np.array([0.1, 0.1, 0.9, 0.9])
    assert abs(ece(p, np.array([0, 0, 1, 1]), 15) - 0.1) < 1e-12
    assert ece(np.array([0.5, 0.5]), np.array([0.0, 1.0]), 15) == 0.0


def test_sts_fixes_overconfident_logits(tmp_path):
    true_z, survived, valid = _synthetic()
    res = fit_sts(3.0 * true_z, survived, valid)  # overconfident by a factor of 3
    assert all(a < b for a, b in zip(res["ece_after"], res["ece_before"]))
    assert max(res["ece_after"]) < 0.02 < min(res["ece_before"][1:])
    assert all(2.0 < t < 4.5 for t in res["temperatures"])
    cal = prefix_probs(3.0 * true_z, np.array(res["temperatures"]))
    assert abs(cal[valid[:, 4], 4].mean() - survived[valid[:, 4], 4].mean()) < 0.02
    assert "ECE before" in format_table(res)
    reliability_png(3.0 * true_z, survived, valid, res["temperatures"], tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_sts_keeps_calibrated_logits():
    true_z, survived, valid = _synthetic(seed=1)
    res = fit_sts(true_z, survived, valid)
    assert all(0.7 < t < 1.4 for t in res["temperatures"])
    assert max(res["ece_after"]) < 0.02
