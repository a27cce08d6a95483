"""The exported checkpoints, read by vLLM's `speculators` package itself (0.9.0) in its own environment.

speculators pins transformers and pulls torchvision/torchaudio, so it cannot live in the project's venv.
This test runs only where a Python with speculators is available: set DSPARK_SPECULATORS_PYTHON (or
keep /tmp/specenv, made as docs/interop.md describes). The speculators side loads each export with
SpeculatorModelConfig / DSparkDraftModel.from_pretrained (verifier weights from the tiny target), then
drafts the same block with its own modules (fc, hidden_norm, Qwen3DFlash layers, norm, lm_head, Markov
and confidence heads) and must reproduce dspark's logits and confidences; its own save_pretrained of the
loaded model must hold exactly the tensors of dspark's export.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dspark.drafters import DSparkDrafter
from dspark.interop import to_speculators
from tests.test_interop import CASES, context, draft, qwen3_dir, random_dspark, target  # noqa: F401

PYTHON = os.environ.get("DSPARK_SPECULATORS_PYTHON", "/tmp/specenv/bin/python")
pytestmark = pytest.mark.skipif(not Path(PYTHON).is_file(), reason="no Python with speculators installed")

SCRIPT = r"""
import json, sys, torch
from safetensors.torch import load_file
from speculators import SpeculatorModelConfig
from speculators.models.dspark import DSparkDraftModel
from speculators.models.dflash import DFlashDraftModel

for case in json.loads(sys.argv[1]):
    d = case["dir"]
    cfg = SpeculatorModelConfig.from_pretrained(d)
    cls = DSparkDraftModel if cfg.speculators_model_type == "dspark" else DFlashDraftModel
    model = cls.from_pretrained(d, dtype=torch.float32).eval()  # fp32 verifier weights, as dspark uses them
    model.config.transformer_layer_config._attn_implementation = "eager"  # full attention, no mask
    ref = load_file(case["ref"])
    for name, p in model.state_dict().items():
        assert not p.is_floating_point() or not p.isnan().any(), f"{name} left unloaded"
    feats, ids, tokens = ref["feats"], ref["block_ids"], ref["tokens"]
    n, b = feats.shape[0], ids.shape[0]
    with torch.no_grad():
        ctx = model.hidden_norm(model.fc(feats[None]))
        x = model.embed_tokens(ids[None])
        pos = torch.arange(n + b)[None]
        pe = model.rotary_emb(x, pos)
        for layer in model.layers:
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pos,
                      position_embeddings=pe)
        h = model.norm(x)
        logits = model.lm_head(h)
        prev = torch.cat([ids[:1], tokens[:-1]])[None]  # anchor-first: slot k is biased by x_k
        emb = None
        if getattr(model, "markov_head", None) is not None:
            emb = model.markov_head.prev_embeddings(prev)
            logits = logits + model.markov_head.block_bias(prev_token_ids=prev, hidden_states=h, prev_emb=emb)
        torch.testing.assert_close(logits[0], ref["logits"], atol=2e-3, rtol=2e-3)
        assert torch.equal(logits[0].argmax(-1), ref["draft_ids"]), case["name"]
        if getattr(model, "confidence_head", None) is not None:
            feat = h if emb is None or not cfg.confidence_head_with_markov else torch.cat([h, emb], -1)
            torch.testing.assert_close(model.confidence_head(feat)[0], ref["conf"], atol=2e-3, rtol=2e-3)
    # what speculators writes itself for this model holds the same tensors as dspark's export
    model.save_pretrained(case["resave"])
    ours, theirs = load_file(d + "/model.safetensors"), load_file(case["resave"] + "/model.safetensors")
    assert ours.keys() == theirs.keys(), sorted(set(ours) ^ set(theirs))
    for name in ours:
        assert ours[name].shape == theirs[name].shape, name
        assert torch.equal(ours[name].to(theirs[name].dtype), theirs[name]), name
    print("OK", case["name"], cfg.speculators_model_type, type(model).__name__, flush=True)
"""


def test_speculators_package_loads_and_drafts_like_dspark(qwen3_dir, target, tmp_path):  # noqa: F811
    feats, anchor = context(qwen3_dir)
    cases = []
    for name, kw in CASES.items():
        src = random_dspark(qwen3_dir, tmp_path / name / "src", **kw)
        spec = to_speculators(src, tmp_path / name / "spec", target=qwen3_dir)
        drafter = DSparkDrafter.from_pretrained(src, *target)
        out = draft(drafter, feats, anchor)
        block = drafter._block_ids(torch.tensor([anchor]))[0]
        d2t_inv = drafter.t2d if drafter.d2t is not None else None
        draft_ids = d2t_inv[out.tokens[0]] if d2t_inv is not None else out.tokens[0]
        ref = {"feats": feats.float(), "block_ids": block, "tokens": out.tokens[0].clone(),
               "draft_ids": draft_ids.clone(), "logits": out.logits[0].float()}
        if out.conf_logits is not None:
            ref["conf"] = out.conf_logits[0].float()
        save_file(ref, str(tmp_path / name / "ref.safetensors"))
        cases.append({"name": name, "dir": str(spec), "ref": str(tmp_path / name / "ref.safetensors"),
                      "resave": str(tmp_path / name / "resaved")})
    res = subprocess.run([PYTHON, "-c", SCRIPT, json.dumps(cases)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert res.stdout.count("OK ") == len(CASES), res.stdout
