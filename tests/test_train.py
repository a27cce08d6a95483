"""Training pipeline on a tiny random target: datagen resume, overfit, kill/resume, 2 ranks == 1 rank."""
from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from conftest import make_tiny_model

from dspark.drafters.blocks import IGNORE
from dspark.train.datagen import Prompt, generate_shards, load_sequences
from dspark.train.features import target_batch
from dspark.train.losses import vocab_loss
from dspark.train.trainer import Trainer, TrainConfig


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A tiny llama target and 24 generated sequences (shards of 8, random-weight gibberish)."""
    root = tmp_path_factory.mktemp("train")
    model = make_tiny_model(root / "model", "llama", num_hidden_layers=3)
    prompts = [Prompt(f"Question {i}: what is {i} plus {i + 1}?", "synthetic") for i in range(24)]
    data = root / "data"
    logs: list[str] = []
    generate_shards(prompts[:16], data, model=str(model), shard_size=8, max_tokens=16, max_num_seqs=8,
                    kv_cache_mb=16, log=logs.append)
    return model, data, prompts, root


def _cfg(model, data, run_dir, **kw) -> TrainConfig:
    base = dict(data=[str(data)], run_dir=str(run_dir), model=str(model), num_layers=1,
                block_size=4, markov_rank=8, target_layer_ids=[0, 1], mask_token_id=16, batch_size=4,
                anchors=8, steps=6, lr=3e-3, warmup=0.2, val_every_nth=0, ckpt_every=2, seed=1,
                target_dtype="float32", compute_dtype="float32")  # exact comparisons across batch layouts
    base.update(kw)
    return TrainConfig(**base)


def test_datagen_resumes_and_skips_finished_shards(tiny_setup):
    model, data, prompts, _ = tiny_setup
    logs: list[str] = []
    man = generate_shards(prompts[:16], data, model=str(model), shard_size=8, max_tokens=16, max_num_seqs=8,
                          kv_cache_mb=16, log=logs.append)
    assert logs == [] and len(man["shards"]) == 2  # nothing regenerated
    seqs = load_sequences(data)
    assert len(seqs) == 16 and all(mask.any() and not mask[0] for _, mask, _ in seqs)
    first = load_sequences(data, max_shards=1)  # what `dspark train --max-shards 1` trains on
    assert len(first) == 8 and all(torch.equal(a[0], b[0]) for a, b in zip(first, seqs))
    recipe = json.loads((data / "manifest.json").read_text())["recipe"]
    assert recipe["temperature"] == 0.0 and recipe["max_tokens"] == 16 and recipe["sources"] == {"synthetic": 16}
    with pytest.raises(ValueError, match="different recipe"):
        generate_shards(prompts[:16], data, model=str(model), shard_size=8, max_tokens=30, log=logs.append)
    with pytest.raises(ValueError, match="different recipe"):  # other prompts: another suffix line
        generate_shards(prompts[:16], data, model=str(model), shard_size=8, max_tokens=16, prompt_suffix="Be brief.",
                        log=logs.append)


def test_a_manifest_from_before_a_recipe_field_still_resumes(tiny_setup, tmp_path):
    """A recipe field added later (prompt_suffix) reads as its default in a manifest written without it."""
    import shutil

    model, data, prompts, _ = tiny_setup
    old = tmp_path / "old"
    shutil.copytree(data, old)
    man = json.loads((old / "manifest.json").read_text())
    del man["recipe"]["prompt_suffix"]
    (old / "manifest.json").write_text(json.dumps(man))
    logs: list[str] = []
    again = generate_shards(prompts[:16], old, model=str(model), shard_size=8, max_tokens=16, max_num_seqs=8,
                            kv_cache_mb=16, log=logs.append)
    assert logs == [] and len(again["shards"]) == 2


def test_skip_answered_leaves_only_new_prompts_and_is_in_the_recipe(tiny_setup, tmp_path):
    """--skip-answered DIR: the prompts DIR's shards answered (matched by their templated ids) are left
    out, the others kept in order; a rerun that skips a different set is another recipe."""
    from transformers import AutoTokenizer

    from dspark.train.datagen import answered_prompts, drop_answered

    model, data, prompts, _ = tiny_setup
    tok = AutoTokenizer.from_pretrained(str(model))
    answered = answered_prompts([data])
    assert len(answered) == 16
    left = drop_answered({"synthetic": prompts[4:24]}, answered, tok)
    assert [p.text for p in left["synthetic"]] == [p.text for p in prompts[16:24]]
    out = tmp_path / "new"
    man = generate_shards(left["synthetic"], out, model=str(model), shard_size=8, max_tokens=8, max_num_seqs=8,
                          kv_cache_mb=16, skip_answered=[str(data)], log=lambda *_: None)
    assert man["recipe"]["skip_answered"] == ["data"] and len(answered_prompts([out]) & answered) == 0
    with pytest.raises(ValueError, match="different recipe"):
        generate_shards(left["synthetic"], out, model=str(model), shard_size=8, max_tokens=8, log=lambda *_: None)
    with pytest.raises(FileNotFoundError, match="no finished shards"):
        answered_prompts([tmp_path / "empty"])


def test_prompt_suffix_goes_on_its_own_line(tmp_path):
    from dspark.train.datagen import read_prompt_file

    f = tmp_path / "q.jsonl"
    f.write_text(json.dumps({"question": "What is 2 + 3? "}) + "\n" + json.dumps({"turns": ["Name a colour."]}) + "\n")
    assert [p.text for p in read_prompt_file(f)] == ["What is 2 + 3?", "Name a colour."]
    assert [p.text for p in read_prompt_file(f, suffix="Answer in \\boxed{}.")] == [
        "What is 2 + 3?\nAnswer in \\boxed{}.", "Name a colour.\nAnswer in \\boxed{}."]
    assert {p.source for p in read_prompt_file(f, suffix="x")} == {"q"}


@pytest.mark.parametrize("spec", ["none", "ngram"])
def test_engine_generator_writes_the_served_greedy_answers(tiny_setup, tmp_path, spec):
    """--generator engine: each answer is what the serving engine answers that prompt (speculation or
    not), the stop token kept; --start-shard leaves the earlier shards alone."""
    from dspark import LLM, SamplingParams

    model, _, prompts, _ = tiny_setup
    out = tmp_path / "engine"
    man = generate_shards(prompts[:16], out, model=str(model), shard_size=8, max_tokens=16, max_num_seqs=8,
                          kv_cache_mb=16, generator="engine", speculative_algorithm=spec, start_shard=1,
                          log=lambda *_: None)
    assert set(man["shards"]) == {"shard_00001.pt"} and man["recipe"]["generator"] == "engine"
    shard = torch.load(out / "shard_00001.pt")
    off, plens = shard["offsets"].tolist(), shard["prompt_lens"].tolist()
    seqs = [shard["tokens"][a:b].tolist() for a, b in zip(off, off[1:])]
    llm = LLM(str(model), max_num_seqs=8, kv_cache_mb=16)
    served = llm.generate([s[:p] for s, p in zip(seqs, plens)], SamplingParams(max_tokens=16))
    assert [s[p:] for s, p in zip(seqs, plens)] == [o.token_ids for o in served]
    assert shard["finish"] == [o.finish_reason for o in served]


def test_code_prompts_in_each_style():
    """One prompt per stdlib function in each style: a description to implement, or the function's
    header and docstring in a code block; the two cover the same functions. The "tests" style is
    HumanEval's whole prompt shape over more modules, methods inside their class header."""
    from dspark.train.code_prompts import TESTS_HEADER, stdlib_code_prompts

    describe, complete = stdlib_code_prompts(), stdlib_code_prompts(style="complete")
    assert len(describe) == len(complete) > 100
    assert {p.source for p in describe} == {"stdlib_code"} and {p.source for p in complete} == {"stdlib_completion"}
    name = describe[0].text.split("`")[1].split("(")[0]
    head = complete[0].text.split("```python\n")[1]
    assert head.startswith(f"def {name}(") and '"""' in head and complete[0].text.endswith("```")
    assert len(stdlib_code_prompts(5, style="complete")) == 5
    with pytest.raises(ValueError, match="style"):
        stdlib_code_prompts(style="haiku")
    tests = stdlib_code_prompts(style="tests")
    assert len(tests) > 3 * len(complete) and {p.source for p in tests} == {"stdlib_tests"}
    assert len({p.text for p in tests}) == len(tests)
    assert all(p.text.startswith(TESTS_HEADER + "\n```python\n") and p.text.endswith('"""\n\n```') for p in tests)
    method = next(p.text for p in tests if "class " in p.text)
    assert "\n    def " in method and '\n        """ ' in method
    import ast
    for p in tests[::50]:  # every sampled prompt is Python that parses
        ast.parse(p.text.split("```python\n")[1].rsplit("```", 1)[0])


def test_package_prompts_in_the_tests_shape(monkeypatch, capsys):
    """HumanEval-shaped prompts from an installed package's modules, in a fixed order, quietly; a package that is
    not installed is left out, and its test modules never serve as prompts."""
    import ast

    from dspark.train import code_prompts

    monkeypatch.setattr(code_prompts, "PACKAGES", {"packaging": "Apache-2.0 / BSD-2-Clause", "no_such_pkg_x": "-"})
    prompts = code_prompts.package_test_prompts()
    assert len(prompts) > 20 and {p.source for p in prompts} == {"package_tests"}
    assert [p.text for p in prompts] == [p.text for p in code_prompts.package_test_prompts()]
    assert len({p.text for p in prompts}) == len(prompts) and len(code_prompts.package_test_prompts(7)) == 7
    assert all(p.text.startswith(code_prompts.TESTS_HEADER + "\n```python\n") for p in prompts)
    for p in prompts:
        ast.parse(p.text.split("```python\n")[1].rsplit("```", 1)[0])
    assert code_prompts._package_modules("no_such_pkg_x") == []
    assert not [m for m in code_prompts._package_modules("networkx") if ".tests" in m]
    assert capsys.readouterr().out == ""


@pytest.fixture(params=["kernels", "torch"])
def vocab_route(request, monkeypatch):
    """The vocabulary-sized training work on dspark's kernels (vocab_loss.c) and on PyTorch ops alone."""
    from dspark.models import native

    if request.param == "torch":
        monkeypatch.setenv(native.ENV, "torch")
    elif native.library() is None:
        pytest.skip(f"dspark's kernels do not run here: {native.why()}")
    return request.param


def test_tv_is_exact_with_a_reduced_vocabulary(vocab_route):
    """p_t normalised over the full vocabulary; the drafter has no mass outside its vocabulary."""
    torch.manual_seed(0)
    pt_full = torch.softmax(torch.randn(3, 10), -1)
    d2t = torch.tensor([0, 2, 3, 7])
    logits = torch.randn(3, 4)
    pd_full = torch.zeros(3, 10).index_copy(1, d2t, torch.softmax(logits, -1))
    exact = (pd_full - pt_full).abs().sum(-1)
    _, tv, _ = vocab_loss(logits, pt_full[:, d2t], torch.arange(3), torch.zeros(3, dtype=torch.long))
    torch.testing.assert_close(tv, exact, atol=1e-5, rtol=0)


@pytest.mark.parametrize("chunk,v,dtype", [(1, 11, torch.float32), (3, 11, torch.float32), (64, 11, torch.float32),
                                           (3, 75, torch.float32), (3, 75, torch.bfloat16)])
def test_fused_vocab_loss_matches_autograd(chunk, v, dtype, vocab_route):
    """vocab_loss (chunked, hand-written backward; or dspark's kernel) == NLL + exact TV through autograd,
    values and gradients, in the logits' dtype; IGNORE labels give no NLL and no NLL gradient; hit is "the
    label has the highest logit". v = 75: whole vectors of 16 and a tail."""
    torch.manual_seed(1)
    n = 7
    logits = (3 * torch.randn(n, v)).to(dtype).requires_grad_(True)
    pt = torch.softmax(torch.randn(4, v), -1) * 0.9  # 10% of the target's mass outside the vocabulary
    rows = torch.tensor([0, 1, 1, 2, 3, 0, 2])
    labels = torch.tensor([3, IGNORE, 5, 0, 10, 2, IGNORE])
    labels[0] = int(logits[0].argmax())  # one certain hit
    g_nll, g_tv = torch.rand(n), torch.rand(n)

    log_pd = torch.log_softmax(logits.float(), -1)
    q = pt[rows]
    ok = labels >= 0
    nll_ref = -log_pd.gather(1, labels.clamp(min=0)[:, None]).squeeze(1) * ok
    tv_ref = (log_pd.exp() - q).abs().sum(-1) + (1 - q.sum(-1))
    ((nll_ref * g_nll).sum() + (tv_ref * g_tv).sum()).backward()
    grad_ref = logits.grad.clone()
    logits.grad = None

    nll, tv, hit = vocab_loss(logits, pt, rows, labels, chunk=chunk)
    ((nll * g_nll).sum() + (tv * g_tv).sum()).backward()
    torch.testing.assert_close(nll, nll_ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tv, tv_ref.detach(), atol=1e-5, rtol=1e-5)
    assert logits.grad.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the reference's gradient rounded once, as ours is
    torch.testing.assert_close(logits.grad, grad_ref, atol=tol, rtol=tol)
    assert torch.equal(hit, (logits.argmax(-1) == labels) & ok) and hit[0]


def test_soft_labels_are_the_targets_full_distribution(tiny_setup, vocab_route):
    """soft_labels: p_t on the draft ids from the full-vocabulary softmax, and the full-vocabulary argmax."""
    from dspark.models.loader import load_decoder
    from dspark.train.dense_target import DenseTarget
    from dspark.train.features import soft_labels

    model, _, _, _ = tiny_setup
    target = DenseTarget(load_decoder(model, quantization="none"))
    h = torch.randn(5, target.config.hidden_size)
    full = torch.softmax(target.logits(h).float(), -1)
    d2t = torch.tensor([1, 5, 17, 300])
    pt, greedy = soft_labels(target, h, d2t, chunk=2)
    torch.testing.assert_close(pt, full[:, d2t])
    assert torch.equal(greedy, full.argmax(-1))
    pt_all, _ = soft_labels(target, h, None, chunk=2)
    torch.testing.assert_close(pt_all, full)


def test_soft_labels_argmax_takes_the_lowest_of_tied_ids(vocab_route):
    """Equal maxima (common in bf16 logits): the lowest id, as torch.argmax and the served path pick."""
    from dspark.train.features import soft_labels

    logits = torch.zeros(3, 50, dtype=torch.bfloat16)
    logits[:, [7, 33, 48]] = 2.0
    logits[1, 2] = 2.0

    class Target:
        def logits(self, rows):
            return rows

    _, greedy = soft_labels(Target(), logits, torch.arange(10))
    assert greedy.tolist() == [7, 2, 7]


def test_target_batch_labels_are_computed_once_per_rows_and_vocabulary():
    """TargetBatch.labels_at: a second drafter on the same batch (--twin) with the same rows and draft
    vocabulary reads the first one's soft labels; other rows or another vocabulary are computed anew."""
    from dspark.train.features import TargetBatch

    calls = []

    class Target:
        def logits(self, rows):
            calls.append(len(rows))
            return rows

    final = torch.randn(2, 4, 10)
    tb = TargetBatch(torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.bool), final, final)
    rows, d2t = torch.tensor([0, 3, 5]), torch.tensor([1, 4, 7])
    pt, greedy = tb.labels_at(Target(), rows, d2t)
    torch.testing.assert_close(pt, torch.softmax(final.flatten(0, 1)[rows], -1)[:, d2t])
    assert torch.equal(greedy, final.flatten(0, 1)[rows].argmax(-1))
    again = tb.labels_at(Target(), rows.clone(), d2t.clone())
    assert again[0] is pt and again[1] is greedy and calls == [3]
    tb.labels_at(Target(), torch.tensor([0, 3, 6]), d2t)
    tb.labels_at(Target(), torch.tensor([0, 3, 6]), torch.tensor([1, 4, 8]))
    tb.labels_at(Target(), torch.tensor([0, 3, 6]), None)
    assert calls == [3, 3, 3, 3]


def test_greedy_path_drops_slots_after_a_disagreement():
    from dspark.train.trainer import on_greedy_path

    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    greedy = torch.tensor([[[11, 12, 99, 14]]])  # rows 0..3 of anchor 0; the data has 13 where greedy says 99
    ok = on_greedy_path(greedy, ids[:, 1:5].view(1, 1, 4))  # data tokens at anchor 0 + 1..4
    assert ok[0, 0].tolist() == [True, True, True, False]  # slot 3 sits after the disagreement at slot 2


def test_confidence_label_and_loss_weights():
    """conf_label "tv" trains the head on 1 - TV/2, "greedy" on the argmax match; combine weighs the parts."""
    import torch.nn.functional as F

    from dspark.train.losses import combine, dspark_loss_parts

    torch.manual_seed(2)
    valid = torch.tensor([[[True, True, False]]])  # one block, gamma 3, two valid slots
    logits = torch.randn(2, 5)
    labels = logits.argmax(-1).clone()
    labels[1] = (labels[1] + 1) % 5  # slot 1 hits, slot 2 misses
    pt = torch.softmax(torch.randn(2, 5), -1)
    conf = torch.tensor([0.3, -0.2])
    weights = torch.tensor([1.0, 0.5, 0.25])
    tv_parts = dspark_loss_parts(logits, conf, labels, valid, pt, torch.arange(2), weights)
    greedy = dspark_loss_parts(logits, conf, labels, valid, pt, torch.arange(2), weights, conf_label="greedy")
    w = weights[:2]
    want = (w * F.binary_cross_entropy_with_logits(conf, torch.tensor([1.0, 0.0]), reduction="none")).sum()
    torch.testing.assert_close(greedy.conf_num, want)
    assert not torch.allclose(tv_parts.conf_num, greedy.conf_num)
    torch.testing.assert_close(tv_parts.ce_num, greedy.ce_num)  # the label choice leaves CE and TV alone
    only_ce = combine(greedy, 2.0, w_ce=1.0, w_tv=0.0, w_conf=0.0)
    torch.testing.assert_close(only_ce, greedy.ce_num / 2.0)
    with pytest.raises(ValueError, match="conf_label"):
        dspark_loss_parts(logits, conf, labels, valid, pt, torch.arange(2), weights, conf_label="sampled")


def test_overfit_loss_decreases_and_export(tiny_setup, tmp_path):
    model, data, _, _ = tiny_setup
    tr = Trainer(_cfg(model, data, tmp_path / "run", steps=20, lr=5e-3, draft_vocab_size=512,
                      export=str(tmp_path / "out"), val_every_nth=4))
    first = tr.validate()
    val = tr.fit()
    assert val["loss"] < first["loss"] - 0.05
    assert val["ce"] < first["ce"]
    meta = json.loads((tmp_path / "out" / "config.json").read_text())
    assert meta["draft_vocab_size"] == 512 and meta["dspark"]["val"]["loss"] == pytest.approx(val["loss"])


def test_init_from_starts_from_a_checkpoint(tiny_setup, tmp_path):
    from safetensors.torch import load_file

    model, data, _, _ = tiny_setup
    out = tmp_path / "first"
    Trainer(_cfg(model, data, tmp_path / "a", steps=3, draft_vocab_size=512, export=str(out))).fit()
    warm = Trainer(_cfg(model, data, tmp_path / "b", steps=3, draft_vocab_size=512, init_from=str(out)))
    saved = load_file(str(out / "model.safetensors"))
    state = warm.model.state_dict()
    assert set(saved) <= set(state)
    for k, v in saved.items():
        assert torch.equal(state[k], v.to(state[k].dtype)), k
    with pytest.raises(ValueError, match="differs"):
        Trainer(_cfg(model, data, tmp_path / "c", steps=3, draft_vocab_size=512, markov_rank=4, init_from=str(out)))
    # another draft vocabulary: a fresh one from the data; Markov output rows follow their target token
    other = Trainer(_cfg(model, data, tmp_path / "e", steps=3, draft_vocab_size=300, init_from=str(out)))
    old_d2t, new_d2t = saved["d2t"].tolist(), other.model.d2t.tolist()
    w2_old, w2_new = saved["markov_head.markov_w2.weight"], other.model.markov_head.markov_w2.weight
    shared = [t for t in new_d2t if t in old_d2t]
    assert shared and other.vocab_info["carried_over_from_init"] == len(shared)
    for t in shared[:20]:
        assert torch.equal(w2_new[new_d2t.index(t)], w2_old[old_d2t.index(t)].to(w2_new.dtype))
    torch.testing.assert_close(other.model.fc.weight, saved["fc.weight"].to(other.model.fc.weight.dtype))
    # a deeper drafter: the checkpoint's layers, then layers that add nothing until trained
    deep = Trainer(_cfg(model, data, tmp_path / "f", steps=2, draft_vocab_size=512, num_layers=3,
                        init_from=str(out), export=str(tmp_path / "deep")))
    tb = target_batch(deep.target, [deep.seqs[0][:2]], deep.dcfg.target_layer_ids)
    pos, valid = torch.tensor([[1, 3]]), torch.ones(1, 2, dtype=torch.bool)
    with torch.no_grad():
        torch.testing.assert_close(deep.model(tb.hidden, tb.ids, pos, valid).logits,
                                   warm.model(tb.hidden, tb.ids, pos, valid).logits)
    assert not deep.model.layers[2].mlp.down.weight.any()
    deep.fit()
    assert deep.model.layers[2].mlp.down.weight.any() and deep.model.layers[1].self_attn.o_proj.weight.any()
    # a wider Markov head: the checkpoint's rank, then columns that add nothing until trained
    wide = Trainer(_cfg(model, data, tmp_path / "w", steps=2, draft_vocab_size=512, markov_rank=16,
                        init_from=str(out)))
    with torch.no_grad():
        a, b = wide.model(tb.hidden, tb.ids, pos, valid), warm.model(tb.hidden, tb.ids, pos, valid)
    torch.testing.assert_close(a.logits, b.logits)
    torch.testing.assert_close(a.conf_logits, b.conf_logits)
    w2 = wide.model.markov_head.markov_w2.weight
    assert w2.shape[1] == 16 and not w2[:, 8:].any() and wide.model.markov_head.markov_w1.weight[:, 8:].any()
    wide.fit()
    assert wide.model.markov_head.markov_w2.weight[:, 8:].any()
    # DFlash from this DSpark's backbone: the Markov and confidence heads are left out, the rest is kept
    flash = Trainer(_cfg(model, data, tmp_path / "h", steps=1, draft_vocab_size=512, markov_rank=0,
                         confidence_head=False, init_from=str(out), export=str(tmp_path / "flash")))
    kept = flash.model.state_dict()
    assert not any(k.startswith(("markov_head", "confidence_head")) for k in kept)
    assert {k for k in saved if not k.startswith(("markov_head", "confidence_head"))} == set(kept)
    for k in kept:
        assert torch.equal(kept[k], saved[k].to(kept[k].dtype)), k
    flash.fit()
    with pytest.raises(ValueError, match="differs"):  # and not the other way round
        Trainer(_cfg(model, data, tmp_path / "i", draft_vocab_size=512, init_from=str(tmp_path / "flash")))
    with pytest.raises(ValueError, match="differs"):  # shallower is not a warm start
        Trainer(_cfg(model, data, tmp_path / "g", draft_vocab_size=512, init_from=str(tmp_path / "deep"),
                     num_layers=2))
    with pytest.raises(FileNotFoundError, match="not a drafter directory"):
        Trainer(_cfg(model, data, tmp_path / "d", init_from=str(tmp_path)))


def _params(tr: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.named_parameters()}


def test_resume_after_kill_matches_uninterrupted(tiny_setup, tmp_path):
    model, data, _, _ = tiny_setup
    full = Trainer(_cfg(model, data, tmp_path / "a", steps=5))
    full.fit()
    killed = Trainer(_cfg(model, data, tmp_path / "b", steps=5, stop_after=3))  # dies after step 3, ckpt at 2
    killed.fit()
    resumed = Trainer(_cfg(model, data, tmp_path / "b", steps=5))
    assert resumed.maybe_resume() and resumed.step == 2
    resumed.fit()
    logged = [json.loads(ln)["step"] for ln in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 5]  # step 3 of the killed run forgotten; the last is the final validation
    for k, v in _params(full).items():
        torch.testing.assert_close(_params(resumed)[k], v, atol=0, rtol=0)


def test_loss_options_reach_the_training_step(tiny_setup, tmp_path):
    """--ce-weight / --tv-weight / --conf-label change the trained weights and are recorded in the export."""
    model, data, _, _ = tiny_setup
    base = Trainer(_cfg(model, data, tmp_path / "a", steps=1))
    base.train_step(0)
    for kw in ({"ce_weight": 1.0, "tv_weight": 0.0}, {"conf_label": "greedy"}):
        other = Trainer(_cfg(model, data, tmp_path / "b", steps=1, **kw))
        other.train_step(0)
        assert any(not torch.equal(v, _params(base)[k]) for k, v in _params(other).items()), kw
    other = Trainer(_cfg(model, data, tmp_path / "c", steps=1, ce_weight=1.0, conf_label="greedy"))
    train = other.recipe({})["train"]
    assert train["ce_weight"] == 1.0 and train["conf_label"] == "greedy"
    assert other.recipe({})["losses"].startswith("1 CE") and "argmax p_d == argmax p_t" in other.recipe({})["losses"]
    # the tiny model's weights are not 4-bit groups: "auto" runs them plain, and the export says so
    assert other.recipe({})["target_pass"] == {"dtype": "float32", "weights": "none"}


def test_feature_cache_trains_the_same_weights(tiny_setup, tmp_path):
    """Two epochs with the target's passes kept in memory == two epochs recomputing them, bit for bit;
    after the first epoch no pass runs, and a zero budget caches nothing."""
    model, data, _, _ = tiny_setup
    plain = Trainer(_cfg(model, data, tmp_path / "a", steps=8, micro_tokens=64))  # 4 steps an epoch
    plain.fit()
    cached = Trainer(_cfg(model, data, tmp_path / "b", steps=8, micro_tokens=64, feature_cache_gb=1.0))
    passes = []
    forward = cached.target.forward_packed
    cached.target.forward_packed = lambda *a, **k: passes.append(cached.step) or forward(*a, **k)
    cached.fit()
    assert passes and max(passes) < 4 and len(cached.feature_cache.items) == 16
    for k, v in _params(plain).items():
        torch.testing.assert_close(_params(cached)[k], v, atol=0, rtol=0)
    tiny = Trainer(_cfg(model, data, tmp_path / "c", steps=1, feature_cache_gb=1e-9))
    tiny.fit()
    assert tiny.feature_cache.items == {}


def _rank_main(rank: int, world: int, port: int, model, data, run_dir, out_path) -> None:
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    tr = Trainer(_cfg(model, data, run_dir, batch_size=2, steps=1))
    tr.train_step(0)
    if rank == 0:
        torch.save(_params(tr), out_path)
    torch.distributed.barrier()  # neither rank tears gloo down while the other still uses it (seen: SIGABRT)
    torch.distributed.destroy_process_group()


def test_two_ranks_equal_one_rank_double_batch(tiny_setup, tmp_path):
    model, data, _, _ = tiny_setup
    single = Trainer(_cfg(model, data, tmp_path / "one", batch_size=4, steps=1))
    single.train_step(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.pt"
    mp.spawn(_rank_main, args=(2, port, model, data, tmp_path / "two", out), nprocs=2, join=True)
    ddp = torch.load(out)
    for k, v in _params(single).items():
        torch.testing.assert_close(ddp[k], v, atol=2e-6, rtol=1e-4)


def test_calibrate_fits_sts_on_held_out_greedy_logs(tiny_setup, tmp_path):
    from dspark.train.cli import main

    model, data, _, _ = tiny_setup
    out = tmp_path / "drafter"
    Trainer(_cfg(model, data, tmp_path / "run", steps=2, draft_vocab_size=512, export=str(out))).fit()
    assert main(["calibrate", "--drafter", str(out), "--data", str(data), "--model", str(model),
                 "--val-every-nth", "4", "--dtype", "float32"]) == 0
    res = json.loads((out / "sts.json").read_text())
    assert len(res["temperatures"]) == 4 and len(res["ece_test_after"]) == 4 and sum(res["samples"]) > 0
    assert (out / "run_log.jsonl").exists()  # the run log travels with the export
    assert list(res["ece_test_by_source"]) == ["synthetic"]  # the one source: its ECE is the whole test half's
    assert res["ece_test_by_source"]["synthetic"]["after"] == res["ece_test_after"]
    import shutil  # two directories: one fit over both held-out splits, the test ECE of each reported

    shutil.copytree(data, tmp_path / "other")
    for shard in (tmp_path / "other").glob("shard_*.pt"):  # the same answers, from another source
        t = torch.load(shard)
        torch.save({**t, "sources": ["chat"] * len(t["sources"])}, shard)
    assert main(["calibrate", "--drafter", str(out), "--data", str(data), "--data", str(tmp_path / "other"),
                 "--model", str(model), "--val-every-nth", "4", "--dtype", "float32"]) == 0
    both = json.loads((out / "sts.json").read_text())
    assert both["samples"] == [2 * n for n in res["samples"]]
    assert "data + other" in both["source"] and list(both["ece_test_by_source"]) == ["chat", "synthetic"]


def test_per_set_curve_keeps_only_records_that_measured_the_set(tmp_path) -> None:
    from dspark.train.curve import curve_points

    def rec(tokens, tau, sets=None):
        val = {"greedy_tau": tau, "greedy_match": [0.5], "greedy_accept": [0.5]}
        if sets:
            val["sets"] = {k: {"greedy_tau": v, "greedy_match": [0.4], "greedy_accept": [0.4]} for k, v in sets.items()}
        return json.dumps({"tokens": tokens, "val": val})

    log = tmp_path / "run_log.jsonl"
    log.write_text("\n".join([rec(100, 1.7), rec(200, 1.8, {"a": 2.0}), rec(300, 1.9, {"a": 2.1, "b": 1.5})]))
    assert [p["tokens"] for p in curve_points([log])] == [100, 200, 300]
    assert [(p["tokens"], p["tau"]) for p in curve_points([log], "a")] == [(200, 2.0), (300, 2.1)]
    assert [(p["tokens"], p["tau"]) for p in curve_points([log], "b")] == [(300, 1.5)]


def test_keep_freed_memory_is_switchable(monkeypatch):
    """Raised once per process on glibc; DSPARK_KEEP_FREED_MEMORY=0 leaves the allocator as it is, and
    release_freed_memory() is then a no-op; after keep_freed_memory() it hands free pages back, but only
    once resident memory is above its budget."""
    import platform

    from dspark.train import memory

    monkeypatch.setattr(memory, "_libc", None)
    monkeypatch.setenv(memory.ENV, "0")
    assert memory.keep_freed_memory() is False and memory._libc is None
    assert memory.release_freed_memory(above=0) is False  # nothing to release
    monkeypatch.delenv(memory.ENV)
    if platform.libc_ver()[0] != "glibc":
        return
    assert memory.keep_freed_memory() is True and memory.keep_freed_memory() is True
    block = torch.ones(64, 2**20)  # 256 MB, in the heap now
    del block
    before = memory.resident_bytes()
    assert memory.release_freed_memory(above=before + 2**30) is False  # under budget: the pages stay
    assert memory.resident_bytes() > before - 128 * 2**20
    assert memory.release_freed_memory(above=0) is True
    assert memory.resident_bytes() < before - 128 * 2**20


def test_trim_budget(monkeypatch):
    from dspark.train import memory

    monkeypatch.setenv(memory.TRIM_ENV, "1.5")
    assert memory.trim_budget() == 3 * 2**29
    monkeypatch.setenv(memory.TRIM_ENV, "0")
    assert memory.trim_budget() == 0
    monkeypatch.setenv(memory.TRIM_ENV, "lots")
    with pytest.raises(ValueError, match="number of GiB"):
        memory.trim_budget()
    monkeypatch.delenv(memory.TRIM_ENV)
    assert 0 < memory.trim_budget() < os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_twins_train_the_weights_each_would_alone(tiny_setup, tmp_path):
    """--twin: drafters trained together on one target pass a step end bit-identical to each trained
    alone, through a kill and resume; the target runs once a step, not once per drafter."""
    from dspark.train.trainer import fit_together

    model, data, _, _ = tiny_setup
    flash = dict(markov_rank=0, confidence_head=False, num_layers=2, lr=1e-3)

    def counted(tr: Trainer) -> list[int]:
        calls, forward = [], tr.target.forward_packed
        tr.target.forward_packed = lambda *a, **k: calls.append(1) or forward(*a, **k)
        return calls

    alone = [Trainer(_cfg(model, data, tmp_path / "a", steps=4)), Trainer(_cfg(model, data, tmp_path / "b", steps=4, **flash))]
    passes_alone = counted(alone[0])
    for tr in alone:
        tr.fit()
    for stop in (3, None):  # killed after step 3 (checkpoint at 2), then resumed to the end
        lead = Trainer(_cfg(model, data, tmp_path / "ta", steps=4, stop_after=stop))
        twin = Trainer(_cfg(model, data, tmp_path / "tb", steps=4, stop_after=stop, **flash), share_target=lead)
        passes = counted(lead)
        fit_together([lead, twin])
    assert lead.step == twin.step == 4 and len(passes) == len(passes_alone) // 2  # steps 3-4 only, once each
    for together, single in zip((lead, twin), alone):
        for k, v in _params(single).items():
            torch.testing.assert_close(_params(together)[k], v, atol=0, rtol=0)


def test_twin_options_may_change_only_the_drafter(tmp_path):
    import argparse

    from dspark.train.config import add_train_args, twin_configs

    p = argparse.ArgumentParser()
    add_train_args(p)
    base = ["--data", "d1", "--run-dir", "r", "--markov-rank", "64", "--steps", "10"]
    twins = twin_configs(p.parse_args(base + ["--twin", "--run-dir r2 --markov-rank 0 --no-confidence-head",
                                              "--twin", "--run-dir r3 --num-layers 4 --lr 1e-3"]))
    assert [(t.run_dir, t.markov_rank, t.confidence_head, t.num_layers, t.steps) for t in twins] == [
        ("r2", 0, False, 1, 10), ("r3", 64, True, 4, 10)]
    assert twins[1].lr == 1e-3 and twins[1].data == ["d1"]
    for bad, match in ((["--twin", "--run-dir r2 --steps 20"], "changes steps"),
                       (["--twin", "--run-dir r2 --data d2"], "changes data"),
                       (["--twin", "--num-layers 4"], "its own --run-dir")):
        with pytest.raises(ValueError, match=match):
            twin_configs(p.parse_args(base + bad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_attention_forms_match_the_cpu_ones(dtype):
    """The forms the dense target takes on CUDA (K/V heads repeated for causal SDPA; grouped matmuls for
    masked decode attention) compute what the CPU forms do; run here on the CPU with the form forced."""
    from dspark.train.dense_target import causal_attention, decode_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 16, generator=g).to(dtype) for h in (6, 2, 2))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(causal_attention(q, k, v, expand=True), causal_attention(q, k, v, expand=False), **tol)
    qd = torch.randn(3, 6, 1, 16, generator=g).to(dtype)
    keys, vals = (torch.randn(3, 2, 11, 16, generator=g).to(dtype) for _ in range(2))
    hidden = torch.arange(11).view(1, 1, 1, 11) > torch.tensor([3, 10, 0]).view(3, 1, 1, 1)  # lengths 4, 11, 1
    got = decode_attention(qd, keys, vals, hidden, matmul=True)
    torch.testing.assert_close(got, decode_attention(qd, keys, vals, hidden, matmul=False), **tol)
    only_first = vals[2, :, :1].repeat_interleave(3, dim=0).unsqueeze(0)  # one visible key: its value, whatever q
    torch.testing.assert_close(got[2:].float(), only_first.float().view(1, 6, 1, 16), **tol)


def test_train_device_refuses_what_it_cannot_use(tmp_path, capsys):
    from dspark.cli import main
    from dspark.train.device import train_device

    with pytest.raises(ValueError, match="expected auto, cpu, cuda"):
        train_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            train_device("cuda")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    assert main(["train-data", "--out", str(tmp_path / "d"), "--prompts", str(prompts), "--device", "gpu"]) == 2
    assert "expected auto, cpu, cuda" in capsys.readouterr().err and not (tmp_path / "d").exists()
