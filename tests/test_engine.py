"""Engine: continuous batching is invisible in the output; cache memory is reclaimed; preemption
never drops or changes a request."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark import LLM, SamplingParams

PROMPTS = [[5, 17, 300, 42, 7], [8, 8, 4000], [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89], [1234]]
N = 12


def hf_greedy(model_dir, prompt: list[int], n: int) -> list[int]:
    """Reference: transformers, full forward each step (no cache), argmax."""
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_mb=4, dtype="float32")  # compared with transformers in fp32


def test_batched_equals_single_equals_transformers(tiny_llm, tiny_llama_dir):
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    batched = [o.token_ids for o in tiny_llm.generate(PROMPTS, params)]
    single = [tiny_llm.generate([p], params)[0].token_ids for p in PROMPTS]
    assert batched == single
    assert batched == [hf_greedy(tiny_llama_dir, p, N) for p in PROMPTS]


def test_requests_join_and_leave_at_different_steps(tiny_llm):
    params = SamplingParams(max_tokens=N, ignore_eos=True)
    expected = [tiny_llm.generate([p], params)[0].token_ids for p in PROMPTS]
    engine = tiny_llm.engine
    lengths = [N, 3, N, 7]
    ids, done, step = [], {}, 0
    while len(done) < len(PROMPTS):
        if step < len(PROMPTS) * 2 and step % 2 == 0:  # a new request every other step
            i = step // 2
            ids.append(engine.add_request(PROMPTS[i], SamplingParams(max_tokens=lengths[i], ignore_eos=True)))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        step += 1
    assert [done[r] for r in ids] == [e[:n] for e, n in zip(expected, lengths)]
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert engine.num_running == engine.num_waiting == 0


def test_preemption_keeps_outputs(tiny_llama_dir):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = LLM(tiny_llama_dir, kv_cache_mb=4)
    cramped = LLM(tiny_llama_dir, max_total_tokens=96, kv_block_size=4)  # 96 tokens for 8 requests of ~50
    prompts = PROMPTS * 2
    want = [o.token_ids for o in roomy.generate(prompts, params)]
    got = [o.token_ids for o in cramped.generate(prompts, params)]
    assert got == want
    assert cramped.engine.stats.preemptions > 0
    assert cramped.engine.cache.num_free_blocks == 24


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llm):
    params = SamplingParams(max_tokens=N, temperature=0.9, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    alone = tiny_llm.generate([PROMPTS[0]], params)[0].token_ids
    together = tiny_llm.generate(PROMPTS, params)[0].token_ids
    assert alone == together
    other = tiny_llm.generate([PROMPTS[0]], SamplingParams(max_tokens=N, temperature=0.9, seed=8,
                                                           ignore_eos=True))[0].token_ids
    assert other != alone


def test_stop_conditions(embedded_llm):
    llm = embedded_llm
    greedy = llm.generate("Count from one to ten: one, two,", SamplingParams(max_tokens=30))[0]
    assert greedy.finish_reason in ("stop", "length")
    text = greedy.text
    stop = text[len(text) // 3 : len(text) // 3 + 4]
    cut = llm.generate("Count from one to ten: one, two,", SamplingParams(max_tokens=30, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    tok = greedy.token_ids[3]
    by_id = llm.generate("Count from one to ten: one, two,",
                         SamplingParams(max_tokens=30, stop_token_ids=[tok]))[0]
    assert by_id.token_ids == greedy.token_ids[: greedy.token_ids.index(tok) + 1]
    assert by_id.finish_reason == "stop"
    short = llm.generate("Count from one to ten: one, two,", SamplingParams(max_tokens=2))[0]
    assert (short.token_ids, short.finish_reason) == (greedy.token_ids[:2], "length")


def test_chat_ends_with_eos(embedded_llm):
    out = embedded_llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(max_tokens=64))[0]
    assert out.finish_reason == "stop"
    assert out.text.strip()
    assert out.token_ids[-1] == embedded_llm.tokenizer.eos_token_id
