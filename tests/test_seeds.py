"""Seeded sampling is reproducible under speculation: a request's text depends on its seed and the
target alone -- not on the drafter, the planner's windows, or the other requests in the batch -- and
equals plain decoding with the same seed. (That the keyed draws are exactly the target's distribution
is checked by the chi-square tests in test_lossless_sampling.py.)"""
from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.sampling.keyed import accept_keyed, couple_drafts, position_noise, sample_keyed, token_noise
from dspark.sampling.sampler import warp_candidates, warp_probs
from test_speculative import drafters, sps_file  # noqa: F401 - fixtures

PROMPT = [99, 98, 97, 96, 95, 94]
OTHERS = [[5, 6, 7, 8, 5, 6, 7], [8, 8, 4000, 12], [1234, 5], [300, 42, 7, 7], [11, 12, 13], [4000, 3],
          [17, 17, 17, 17, 17, 17, 17, 17, 17]]


def seeded(seed: int, **kw) -> SamplingParams:
    kw = dict(max_tokens=10, temperature=0.9, top_k=50, ignore_eos=True) | kw
    return SamplingParams(seed=seed, **kw)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return LLM(tiny_llama_dir, kv_cache_mb=8)


@pytest.fixture(scope="module")
def dspark(tiny_llama_dir, drafters, sps_file):  # noqa: F811
    return LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="DSPARK", draft_model=drafters["DSPARK"],
               sps_table=sps_file)  # the throughput planner: windows depend on the batch


def test_alone_in_a_batch_and_plain_give_the_same_text(plain, dspark):
    for seed in (3, 2**64 - 1):
        alone = dspark.generate([PROMPT], seeded(seed))[0].token_ids
        batch = dspark.generate([*OTHERS[:3], PROMPT, *OTHERS[3:]],
                                [seeded(100 + i) for i in range(3)] + [seeded(seed)] +
                                [SamplingParams(max_tokens=12, ignore_eos=True)] * 4)[3].token_ids
        assert alone == batch == plain.generate([PROMPT], seeded(seed))[0].token_ids, seed
    assert dspark.engine.stats.verified > 0  # speculation did run


def test_coupled_drafts_from_the_target_distribution_are_all_accepted():
    """Drafts drawn with the verification's own noise: a perfect drafter (q = p) is always accepted,
    where drafts with independent noise would mostly be rejected."""
    probs = torch.softmax(torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 0.5, -1)
    for seed in range(20):
        drafts = couple_drafts(probs[:4], seed, position=7)
        assert accept_keyed(drafts, probs, seed, position=7).num_accepted == 4
    independent = [accept_keyed(sample_keyed(probs[:4], seed + 1000, 7), probs, seed, 7).num_accepted
                   for seed in range(20)]
    assert sum(independent) < 10


def test_keyed_sampling_units():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    a = sample_keyed(probs, seed=7, position=10)
    assert a == sample_keyed(probs, seed=7, position=10) != sample_keyed(probs, seed=8, position=10)
    assert sample_keyed(probs[1:], seed=7, position=11) == a[1:]  # a row's token depends on its position only
    assert torch.equal(position_noise(7, [11], 50), position_noise(7, [10, 11], 50)[1:])
    acc = accept_keyed([a[0], (a[1] + 1) % 50], probs, seed=7, position=10)
    assert (acc.tokens, acc.num_accepted) == ([a[0], a[1]], 1)  # the mismatch is replaced by the target's token
    point = torch.zeros(1, 50)
    point[0, 4] = 1.0
    assert sample_keyed(point, seed=1, position=0) == [4]  # zero-probability tokens never win


def test_a_tokens_noise_depends_on_its_id_alone():
    """token_noise for a row's candidates is the whole vocabulary's noise at those ids, and it is Exp(1)."""
    full = position_noise(5, [3, 4], 1000)
    ids = torch.tensor([[999, 0, 17, 500], [2, 999, 3, 0]])
    assert torch.equal(token_noise(5, [3, 4], ids), full.gather(1, ids))
    assert torch.equal(token_noise(5, [4], torch.tensor([7, 8])), full[1:, 7:9])
    big = position_noise(1, range(20), 50_000).flatten()
    assert abs(big.mean().item() - 1) < 0.01 and abs((big > 1).float().mean().item() - 0.3679) < 0.005
    assert abs(torch.corrcoef(torch.stack([big[:-1], big[1:]]))[0, 1].item()) < 0.01  # neighbouring ids


def test_a_race_among_the_top_k_picks_what_the_whole_vocabulary_would():
    """The engine samples a seeded request among its top-k candidates (warp_candidates); the token is the
    one the race over every token id with warp_probs' distribution picks."""
    logits = torch.randn(6, 3000, generator=torch.Generator().manual_seed(2)) * 3
    for seed in range(40):
        for top_k, top_p in ((20, 1.0), (50, 0.8), (1, 1.0)):
            probs, ids = warp_candidates(logits, 0.7, top_k, top_p)
            assert ids is not None and ids.shape[1] >= top_k
            full = warp_probs(logits, 0.7, top_k, top_p)
            assert sample_keyed(probs, seed, 3, ids) == sample_keyed(full, seed, 3), (seed, top_k, top_p)
            assert accept_keyed([], probs[:1], seed, 3, ids[:1]).tokens == sample_keyed(full[:1], seed, 3)
            assert couple_drafts(full, seed, 3) == sample_keyed(full, seed, 3)  # drafts race on q's support
