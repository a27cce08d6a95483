"""The training pipeline on a GPU: data generation and training on CUDA give what the CPU gives, up to
float rounding. Skipped where CUDA is not available; DSPARK_TEST_DEVICE=cpu runs the same checks with
the CPU on both sides (the test's own logic, on any machine)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import make_tiny_model

from dspark.train.datagen import Prompt, generate_shards, load_sequences
from dspark.train.device import train_device
from dspark.train.trainer import Trainer, TrainConfig, fit_together

DEVICE = os.environ.get("DSPARK_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="needs CUDA (or DSPARK_TEST_DEVICE=cpu)")
QUIET = dict(log=lambda *_: None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama target, 16 prompts and their greedy answers generated on the CPU in fp32."""
    root = tmp_path_factory.mktemp("cuda")
    model = make_tiny_model(root / "model", "llama", num_hidden_layers=3)
    prompts = [Prompt(f"Question {i}: what is {i} plus {i + 1}?", "synthetic") for i in range(16)]
    generate_shards(prompts, root / "data-cpu", model=str(model), shard_size=8, max_tokens=16, max_num_seqs=5,
                    device="cpu", dtype="float32", **QUIET)
    return model, prompts, root


def test_greedy_answers_on_the_device_are_the_cpus(tiny):
    """5 slots for 8 prompts a shard: slots refill mid-shard, so decode steps run with idle slots too."""
    model, prompts, root = tiny
    generate_shards(prompts, root / "data-dev", model=str(model), shard_size=8, max_tokens=16, max_num_seqs=5,
                    device=DEVICE, dtype="float32", **QUIET)
    cpu, dev = load_sequences(root / "data-cpu"), load_sequences(root / "data-dev")
    assert len(dev) == 16 and all(mask.sum() >= 1 for _, mask, _ in dev)
    same = sum(torch.equal(a[0], b[0]) for a, b in zip(cpu, dev))
    assert same >= 14, f"only {same} of 16 greedy answers match the CPU's"  # a near-tie may flip in fp32


def test_sampled_bf16_answers_on_the_device(tiny):
    model, prompts, root = tiny
    out = root / "sampled"
    man = generate_shards(prompts[:8], out, model=str(model), shard_size=8, max_tokens=12, max_num_seqs=3,
                          device=DEVICE, dtype="bfloat16", temperature=0.7, top_p=0.8, top_k=20, **QUIET)
    seqs = load_sequences(out)
    assert len(seqs) == 8 and man["recipe"]["target_dtype"] == "bfloat16"
    assert all(0 < int(mask.sum()) <= 12 and int(ids.max()) < 49152 for ids, mask, _ in seqs)


def _cfg(model, data, run_dir, device, **kw) -> TrainConfig:
    base = dict(data=[str(data)], run_dir=str(run_dir), model=str(model), num_layers=1, block_size=4,
                markov_rank=8, target_layer_ids=[0, 1], mask_token_id=16, batch_size=4, anchors=8, steps=4,
                lr=3e-3, warmup=0.25, val_every_nth=4, ckpt_every=2, seed=1, draft_vocab_size=512,
                target_dtype="float32", compute_dtype="float32", device=device, curve_snapshots=False)
    base.update(kw)
    return TrainConfig(**base)


def test_twins_trained_on_the_device_match_the_cpu(tiny, tmp_path):
    """A DSpark drafter and its DFlash twin, trained, validated and exported on the device in fp32, end
    where the CPU's do (Adam may turn rounding noise on near-zero gradients into up to lr a step)."""
    from safetensors.torch import load_file

    model, _, root = tiny
    flash = dict(markov_rank=0, confidence_head=False)
    runs = {}
    for dev in ("cpu", DEVICE):
        lead = Trainer(_cfg(model, root / "data-cpu", tmp_path / f"{dev}-a", dev, export=str(tmp_path / f"{dev}-x")))
        twin = Trainer(_cfg(model, root / "data-cpu", tmp_path / f"{dev}-b", dev, **flash), share_target=lead)
        assert lead.device == twin.device == train_device(dev)
        runs[dev] = (lead, twin, fit_together([lead, twin]))
    for ref, got in zip(runs["cpu"][:2], runs[DEVICE][:2]):
        for k, v in ref.model.state_dict().items():
            torch.testing.assert_close(got.model.state_dict()[k].cpu(), v, atol=2e-2, rtol=0, msg=k)
    val_cpu, val_dev = runs["cpu"][2][0], runs[DEVICE][2][0]
    assert val_dev["loss"] == pytest.approx(val_cpu["loss"], rel=2e-2)
    saved = load_file(str(tmp_path / f"{DEVICE}-x" / "model.safetensors"))
    state = runs[DEVICE][0].model.state_dict()
    for k, v in saved.items():
        assert torch.equal(v, state[k].cpu().to(v.dtype)), k
    assert json.loads((tmp_path / f"{DEVICE}-x" / "config.json").read_text())["dspark"]["steps"] == 4


def test_bf16_training_on_the_device_resumes(tiny, tmp_path):
    """The dtype a GPU run uses by default (bf16 target and drafter): killed after step 3, resumed to 4."""
    model, _, root = tiny
    bf16 = dict(target_dtype="bfloat16", compute_dtype="bfloat16")
    Trainer(_cfg(model, root / "data-cpu", tmp_path / "r", DEVICE, stop_after=3, **bf16)).fit()
    tr = Trainer(_cfg(model, root / "data-cpu", tmp_path / "r", DEVICE, **bf16))
    val = tr.fit()
    assert tr.step == 4 and tr.model.fc.weight.dtype == torch.bfloat16 and torch.isfinite(torch.tensor(val["loss"]))

