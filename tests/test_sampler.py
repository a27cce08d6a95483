"""Sampling among the top-k candidates (the training-data generator's sampler) keeps warp_probs' distribution."""
import pytest
import torch

from dspark.sampling.sampler import sample_logits, warp_candidates, warp_probs, warp_top_k


def _scatter(probs: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(probs.shape[0], vocab).scatter_(-1, ids, probs)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 20, 0.8), (1.0, 5, 1.0), (1.3, 40, 0.5), (0.7, 1, 0.9)])
def test_top_k_candidates_carry_warp_probs_distribution(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(16, 500, generator=g) * 3).to(torch.bfloat16)  # bf16 values: ties are common
    logits[0, :30] = 20.0  # a row whose 30 top values tie: warp_probs keeps every tie of the k-th value
    logits[1, 100:110] = logits[1].max()  # ties at the top-p cut: the lowest ids stay, in both
    probs, ids = warp_top_k(logits, temperature, top_k, top_p)
    assert probs.shape == ids.shape and probs.shape[1] >= top_k
    if top_k < 30:
        assert probs.shape[1] >= 30  # every tie of row 0 is a candidate
    want = warp_probs(logits, temperature, top_k, top_p)
    torch.testing.assert_close(_scatter(probs, ids, 500), want, atol=1e-6, rtol=1e-5)


def test_samples_follow_the_warped_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 64, generator=g).mul(2).expand(40_000, 64).contiguous()
    want = warp_probs(logits[:1], 0.7, 10, 0.8)[0]
    got = sample_logits(logits, 0.7, 10, 0.8, torch.Generator().manual_seed(2))
    freq = torch.bincount(got, minlength=64).float() / len(got)
    assert bool((freq[want == 0] == 0).all())  # nothing outside top-k / top-p is ever drawn
    assert float((freq - want).abs().max()) < 0.01  # 40k draws: a few standard errors at most
    plain = sample_logits(logits[:8], 0.7, -1, 0.8, torch.Generator().manual_seed(2))  # no top-k: warp_probs
    assert bool((want[plain] > 0).all())


@pytest.mark.parametrize("top_k", [0, -1, 64])
def test_top_k_outside_the_vocabulary_is_refused(top_k):
    with pytest.raises(ValueError, match="top_k"):
        warp_top_k(torch.randn(2, 64), 1.0, top_k)


def test_drafter_picks_report_the_distribution_they_were_drawn_from():
    """The drafter's sampled rows draw among their top-k candidates; the distribution it reports (the q of
    rejection sampling) is warp_probs' full row, and greedy rows stay one-hot argmaxes."""
    from dspark.drafters.model import _choose

    z = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 3
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    mixed = [(0.7, 20, 0.8), (0.0, -1, 1.0), (1.0, -1, 0.9), (0.5, 5, 1.0)] + [(0.0, -1, 1.0)] * 2
    for params in ([(0.7, 20, 0.8)] * 6, mixed):
        ids, probs = _choose(z, params, gens)
        for i, (t, k, p) in enumerate(params):
            want = warp_probs(z[i:i + 1], t, k, p)[0] if t > 0 else torch.eye(300)[z[i].argmax()]
            torch.testing.assert_close(probs[i], want, atol=1e-6, rtol=1e-5)
            assert probs[i, ids[i]] > 0
    assert _choose(z, [(0.0, -1, 1.0)] * 6, gens)[1] is None


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])
def test_nucleus_candidates_are_warp_probs_top_p(scale):
    """Top-p without top-k runs on the nucleus alone (warp_nucleus): the same kept tokens as warp_probs' sort
    of the whole row, flat rows (nuclei past the first 64 candidates) and ties at the cut included."""
    from dspark.sampling.sampler import warp_nucleus

    g = torch.Generator().manual_seed(4)
    for _ in range(20):
        logits = torch.randn(3, 2000, generator=g) * scale
        for top_p in (0.3, 0.8, 0.95):
            probs, ids = warp_candidates(logits, 0.7, -1, top_p)
            want = warp_probs(logits, 0.7, -1, top_p)
            got = _scatter(probs, ids, 2000)
            assert torch.equal(got > 0, want > 0)
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    tied = torch.zeros(2, 500)
    tied[0, :3] = 5.0  # the cut falls among three equal tokens: the lowest ids stay
    tied[1, 10:300] = 1.0  # 290 tied tokens: more than the first candidates
    probs, ids = warp_nucleus(tied, 1.0, 0.5)
    assert torch.equal(_scatter(probs, ids, 500) > 0, warp_probs(tied, 1.0, -1, 0.5) > 0)
