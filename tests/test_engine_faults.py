"""One request's failure stays its own: sampling values at their extremes decode safely, and a request
whose processing raises inside a step is failed alone (finish_reason "error", its cache freed) while
the other requests of the step finish exactly as they would have. Plain and DSpark engines."""
from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from test_speculative import save_random_drafter

PROMPTS = [[5, 17, 300, 42, 7], [8, 8, 4000], [99, 98, 97, 96, 95], [1234, 5]]
N = 8
GREEDY = SamplingParams(max_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def drafter(tiny_llama_dir, tmp_path_factory):
    return save_random_drafter(tiny_llama_dir, tmp_path_factory.mktemp("faults") / "dspark", dspark=True)


@pytest.fixture(scope="module", params=["plain", "DSPARK"])
def llm(request, tiny_llama_dir, drafter):
    spec = {} if request.param == "plain" else dict(speculative_algorithm="DSPARK", draft_model=drafter,
                                                    planner="fixed")  # fixed: every draft is verified
    return LLM(tiny_llama_dir, kv_cache_mb=8, **spec)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def assert_idle(llm):
    assert not llm.engine.has_unfinished() and llm.engine.cache.usage == 0


@pytest.mark.parametrize("kw", [
    dict(temperature=1.0, top_p=1e-46),  # 0 in float32: every token used to be dropped -> NaN
    dict(temperature=100.0, top_k=1, top_p=5e-324),
    dict(temperature=1e-300),  # logits / 1e-300 overflow: greedy
])
def test_extremes_that_mean_greedy_decode_greedily(llm, reference, kw):
    outs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True, seed=1, **kw))
    assert [o.token_ids for o in outs] == [r[:4] for r in reference[:2]]
    assert_idle(llm)


def test_other_extremes_sample_normally(llm):
    p = SamplingParams(max_tokens=4, ignore_eos=True, seed=2, temperature=100.0, top_k=10**9, top_p=1.0 - 1e-12)
    outs = llm.generate(PROMPTS[:2], p)
    assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in outs)
    assert_idle(llm)


def _poison(monkeypatch, obj, name: str, hit) -> None:
    """Make obj.name raise for the calls where hit(*args) is true."""
    real = getattr(obj, name)

    def poisoned(*args, **kw):
        if hit(*args):
            raise RuntimeError("injected fault")
        return real(*args, **kw)

    monkeypatch.setattr(obj, name, poisoned)


def _is_victim(seq) -> bool:
    return seq.prompt_token_ids == PROMPTS[1] and len(seq.output_token_ids) >= 3  # mid-generation


def _check_only_the_victim_failed(llm, reference, outs) -> None:
    victim = outs[1]
    assert victim.finish_reason == "error" and "injected fault" in victim.error
    assert victim.token_ids == reference[1][:len(victim.token_ids)]  # what it had is kept, nothing more
    assert [o.token_ids for i, o in enumerate(outs) if i != 1] == [r for i, r in enumerate(reference) if i != 1]
    assert all(o.finish_reason == "length" and o.error is None for i, o in enumerate(outs) if i != 1)
    assert_idle(llm)


def test_a_request_failing_in_its_own_processing_fails_alone(llm, reference, monkeypatch):
    _poison(monkeypatch, llm.engine, "_commit", lambda seq, tokens: _is_victim(seq))
    _check_only_the_victim_failed(llm, reference, llm.generate(PROMPTS, GREEDY))


def test_a_failing_batched_forward_is_retried_request_by_request(llm, reference, monkeypatch):
    engine = llm.engine
    victim = lambda windows: any(_is_victim(engine._seqs[w.request_id]) for w in windows)  # noqa: E731
    _poison(monkeypatch, engine.runner, "run", victim)
    _check_only_the_victim_failed(llm, reference, llm.generate(PROMPTS, GREEDY))


def test_a_transient_batched_failure_loses_nothing(llm, reference, monkeypatch):
    failures = []

    def first_batch(windows):
        if len(windows) > 1 and not failures:
            failures.append(len(windows))
            return True
        return False

    _poison(monkeypatch, llm.engine.runner, "run", first_batch)
    outs = llm.generate(PROMPTS, GREEDY)
    assert failures and [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert_idle(llm)


def test_a_failing_final_detokenization_fails_only_that_request(llm, reference, monkeypatch):
    import dspark.engine.llm_engine as engine_module

    _poison(monkeypatch, engine_module, "final_text", lambda seq, tok: seq.prompt_token_ids == PROMPTS[1])
    outs = llm.generate(PROMPTS, GREEDY)
    assert outs[1].finish_reason == "error" and outs[1].token_ids == reference[1]
    assert [o.token_ids for o in outs] == reference and [o.finish_reason for o in outs].count("length") == 3
    assert_idle(llm)
