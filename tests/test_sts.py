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


def test_offset_fixes_a_biased_head_that_temperatures_cannot():
    from dspark.train.sts import OFFSETS, position_ece

    true_z, survived, valid = _synthetic(seed=2)
    biased = true_z + 1.2  # every confidence too high: sigmoid(z / T) cannot cross 0.5 to follow it
    temps_only = fit_sts(biased, survived, valid)
    both = fit_sts(biased, survived, valid, offsets=OFFSETS)
    assert temps_only["logit_offset"] == 0.0
    assert abs(both["logit_offset"] + 1.2) <= 0.15
    assert max(both["ece_after"]) < 0.015 < max(temps_only["ece_after"])
    assert both["ece_before"] == temps_only["ece_before"]  # before: the raw logits either way
    # held-out logs from the same source: the fitted offset and temperatures carry over
    z2, s2, v2 = _synthetic(seed=3)
    assert max(position_ece(z2 + 1.2, s2, v2, both["temperatures"], both["logit_offset"])) < 0.02
    assert "logit offset" in format_table(both)


def test_logit_offset_is_folded_into_the_confidence_bias(tmp_path):
    import json

    import pytest
    import torch
    from safetensors.torch import load_file

    from dspark.drafters import DrafterConfig, DSparkDrafter
    from dspark.drafters.io import CONF_BIAS, fold_sts_offset, read_sts_offset
    from dspark.interop.parts import read_dspark

    cfg = DrafterConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, vocab_size=50, target_layer_ids=[0, 1], mask_token_id=3, num_layers=1,
                        block_size=3, markov_rank=4, confidence_head=True)
    emb, head = torch.randn(50, 32), torch.randn(50, 32)
    model = DSparkDrafter(cfg, emb, head)
    model.sts_temperatures = [1.0, 2.0, 3.0]
    model.save_pretrained(tmp_path / "d")
    bias = load_file(str(tmp_path / "d" / "model.safetensors"))[CONF_BIAS]
    (tmp_path / "d" / "sts.json").write_text(json.dumps({"temperatures": [1.0, 2.0, 3.0], "logit_offset": -0.75}))
    loaded = DSparkDrafter.from_pretrained(tmp_path / "d", emb, head)
    torch.testing.assert_close(loaded.confidence_head.proj.bias.detach(), bias - 0.75)
    assert loaded.sts_offset == -0.75 and loaded.sts_temperatures == [1.0, 2.0, 3.0]
    parts = read_dspark(tmp_path / "d")  # the converters' reader folds it the same way
    torch.testing.assert_close(parts.tensors[CONF_BIAS], bias - 0.75)
    loaded.save_pretrained(tmp_path / "again")  # re-saved: folded bias, temperature-only sts.json, no double shift
    assert "logit_offset" not in json.loads((tmp_path / "again" / "sts.json").read_text())
    again = DSparkDrafter.from_pretrained(tmp_path / "again", emb, head)
    torch.testing.assert_close(again.confidence_head.proj.bias.detach(), bias - 0.75)
    (tmp_path / "bad.json").write_text(json.dumps({"temperatures": [1.0], "logit_offset": "high"}))
    with pytest.raises(ValueError, match="logit_offset"):
        fold_sts_offset({CONF_BIAS: bias}, read_sts_offset(tmp_path / "bad.json"), tmp_path / "bad.json")
    (tmp_path / "s.json").write_text(json.dumps({"temperatures": [1.0], "logit_offset": 0.5}))
    with pytest.raises(ValueError, match="confidence head"):
        fold_sts_offset({}, read_sts_offset(tmp_path / "s.json"), tmp_path / "s.json")
