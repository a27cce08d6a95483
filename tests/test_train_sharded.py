"""Scale-out training: sharded datagen (disjoint rank slices, per-rank manifests, resume) and lost-worker resume."""
from __future__ import annotations

import argparse
import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import make_tiny_model

from dspark.train.datagen import (PART, Prompt, generate_shards, load_sequences, rank_shards, read_manifest,
                                  shard_rank)
from dspark.train.trainer import Trainer, TrainConfig

N_PROMPTS, SHARD_SIZE = 18, 4  # 5 shards, the last one short: rank 0 -> 0, 2, 4; rank 1 -> 1, 3


def _gen(prompts, out, model, rank, world, logs):
    return generate_shards(prompts, out, model=str(model), shard_size=SHARD_SIZE, max_tokens=8, max_num_seqs=4,
                           kv_cache_mb=16, rank=rank, world_size=world, log=logs.append)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """A tiny llama target and the same 18 prompts answered by two 'ranks' into one directory."""
    root = tmp_path_factory.mktemp("sharded")
    model = make_tiny_model(root / "model", "llama", num_hidden_layers=3)
    prompts = [Prompt(f"Question {i}: what is {i} times {i + 2}?", "synthetic") for i in range(N_PROMPTS)]
    data = root / "data"
    logs = {0: [], 1: []}
    mans = {r: _gen(prompts, data, model, r, 2, logs[r]) for r in (0, 1)}
    return model, prompts, data, logs, mans


def test_rank_assignment():
    slices = [rank_shards(7, r, 3) for r in range(3)]
    assert slices == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(sum(slices, [])) == list(range(7))
    assert shard_rank(env={}) == (0, 1)
    assert shard_rank(env={"RANK": "1", "WORLD_SIZE": "2"}) == (1, 2)
    assert shard_rank(0, 4, env={"RANK": "1", "WORLD_SIZE": "2"}) == (0, 4)  # explicit flags win
    with pytest.raises(ValueError):
        shard_rank(2, 2, env={})


def test_ranks_disjoint_and_cover_every_prompt_once(sharded):
    model, prompts, data, logs, _ = sharded
    wrote = {r: sorted(line.split(":")[0] for line in logs[r]) for r in (0, 1)}
    assert wrote == {0: ["shard_00000.pt", "shard_00002.pt", "shard_00004.pt"],
                     1: ["shard_00001.pt", "shard_00003.pt"]}
    per_rank = {r: json.loads((data / PART.format(r)).read_text())["shards"] for r in (0, 1)}
    assert sorted(per_rank[0]) == wrote[0] and sorted(per_rank[1]) == wrote[1]  # each rank its own manifest
    seen = []
    for r in (0, 1):
        for name in wrote[r]:
            seen += torch.load(data / name)["prompt_index"]
    assert sorted(seen) == list(range(N_PROMPTS))  # every prompt exactly once
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    for k, (ids, mask, src) in enumerate(load_sequences(data)):  # shard order == prompt order
        plen = int(mask.long().argmax())
        assert prompts[k].text in tok.decode(ids[:plen]) and mask[plen:].all() and src == "synthetic"
    man = read_manifest(data)
    assert sorted(man["shards"]) == [f"shard_{i:05d}.pt" for i in range(5)]
    assert sum(s["sequences"] for s in man["shards"].values()) == N_PROMPTS
    assert json.loads((data / "manifest.json").read_text())["shards"] == man["shards"]
    assert man["recipe"]["total_prompts"] == N_PROMPTS and man["recipe"]["model_path"]


def test_sharded_equals_single_process(sharded, tmp_path):
    model, prompts, data, _, _ = sharded
    logs: list[str] = []
    _gen(prompts[:8], tmp_path / "one", model, 0, 1, logs)  # shards 0 and 1, one process
    for name in ("shard_00000.pt", "shard_00001.pt"):
        a, b = torch.load(data / name), torch.load(tmp_path / "one" / name)
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["offsets"], b["offsets"])


def test_rerun_regenerates_only_the_missing_shard(sharded):
    model, prompts, data, _, _ = sharded
    lost = data / "shard_00003.pt"
    before = torch.load(lost)
    lost.unlink()  # rank 1 "died" before writing it
    assert "shard_00003.pt" not in read_manifest(data)["shards"]  # shard files are the truth
    logs0: list[str] = []
    _gen(prompts, data, model, 0, 2, logs0)
    assert logs0 == []  # rank 0 has nothing to do (and loads no model)
    logs1: list[str] = []
    man = _gen(prompts, data, model, 1, 2, logs1)
    assert [line.split(":")[0] for line in logs1] == ["shard_00003.pt"]
    assert torch.equal(torch.load(lost)["tokens"], before["tokens"]) and len(man["shards"]) == 5
    logs: list[str] = []
    assert len(_gen(prompts, data, model, 0, 1, logs)["shards"]) == 5 and logs == []  # any world size resumes
    with pytest.raises(ValueError, match="different recipe"):
        generate_shards(prompts[:8], data, model=str(model), shard_size=SHARD_SIZE, max_tokens=8, rank=1,
                        world_size=2, log=logs.append)


def test_cli_flags_and_env(monkeypatch):
    from dspark.train.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train-data", "--out", "x", "--code-prompts", "3", "--rank", "1", "--world-size", "4"])
    assert shard_rank(args.rank, args.world_size) == (1, 4)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    args = parser.parse_args(["train-data", "--out", "x", "--code-prompts", "3"])
    assert shard_rank(args.rank, args.world_size) == (2, 3)


@pytest.mark.parametrize("flags", [["--code-test-prompts", "-3"], ["--sharegpt", "x"], ["--shard-size", "0"],
                                   ["--max-tokens", "-1"], ["--start-shard", "-2"]])
def test_train_data_refuses_bad_counts_with_a_message(flags, capsys):
    """A negative count once took all prompts but the last N (a slice), and shard size 0 divided by zero."""
    from dspark.train.cli import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["train-data", "--out", "x", *flags])
    assert e.value.code == 2 and f"argument {flags[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # calibrate's sizes too, before it loads the target
        parser.parse_args(["calibrate", "--drafter", "d", "--data", "x", "--bins", "0"])
    assert e.value.code == 2 and "argument --bins: must be at least 1" in capsys.readouterr().err


@pytest.mark.parametrize("kw, match", [({"shard_size": 0}, "shard_size"), ({"max_num_seqs": 0}, "max_num_seqs"),
                                       ({"time_limit": 0}, "time_limit")])
def test_generate_shards_refuses_bad_sizes_before_loading_anything(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        generate_shards([Prompt("hi", "x")], tmp_path / "d", model=str(tmp_path / "no-model"), **kw)
    assert not (tmp_path / "d").exists()


def _cfg(model, data, run_dir, **kw) -> TrainConfig:
    base = dict(data=[str(data)], run_dir=str(run_dir), model=str(model), num_layers=1,
                block_size=4, markov_rank=8, target_layer_ids=[0, 1], mask_token_id=16, batch_size=4,
                anchors=8, steps=5, lr=3e-3, warmup=0.2, val_every_nth=6, ckpt_every=2, seed=1,
                threads=1, compute_dtype="float32", target_dtype="float32")  # 1 thread: oversubscribed shared cores are several times slower
    base.update(kw)
    return TrainConfig(**base)


def _params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.named_parameters()}


def _killed_rank(rank: int, world: int, port: int, model, data, run_dir) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    Trainer(_cfg(model, data, run_dir, batch_size=2, stop_after=3)).fit()  # dies after step 3; ckpt at step 2
    torch.distributed.destroy_process_group()


def test_merged_data_trains_and_lost_worker_resume(sharded, tmp_path):
    """The merged shards load in the trainer; a 2-rank job lost after step 3 resumes from its step-2
    checkpoint (here on one surviving process with the same global batch) and matches an uninterrupted run."""
    model, _, data, _, _ = sharded
    full = Trainer(_cfg(model, data, tmp_path / "full"))
    assert len(full.train_idx) + len(full.val_idx) == N_PROMPTS and len(full.val_idx) == 3
    val = full.fit()
    assert val and full.recipe(val)["data_recipe"]["data"]["total_prompts"] == N_PROMPTS
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # fork, not spawn: the ranks inherit the imported modules (spawn re-imports torch + dspark, ~20 s here)
    mp.start_processes(_killed_rank, args=(2, port, model, data, tmp_path / "job"), nprocs=2, join=True,
                       start_method="fork")
    assert torch.load(tmp_path / "job" / "ckpt.pt", weights_only=False)["step"] == 2
    resumed = Trainer(_cfg(model, data, tmp_path / "job"))  # 1 rank x 4 == 2 ranks x 2: same data order
    resumed.fit()
    assert resumed.step == 5
    # Summation order differs between 2 ranks and 1; Adam divides by sqrt(v), so a Markov-embedding row
    # with a near-zero gradient can move by a few 1e-4 on rounding alone (weights are ~0.02-0.2; lr 3e-3,
    # so a wrong batch or a bad resume moves weights by ~1e-3 and more, in many elements).
    for k, v in _params(full).items():
        torch.testing.assert_close(_params(resumed)[k], v, atol=3e-4, rtol=1e-4)
