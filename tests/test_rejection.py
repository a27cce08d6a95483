"""Lossless acceptance: greedy prefix matching and speculative sampling (docs/method.md#losslessness)."""
from __future__ import annotations

import pytest
import torch

from dspark.sampling.rejection import Acceptance, accept_greedy, accept_sampled, residual_probs


def _logits_with_argmax(argmax: list[int], vocab: int = 6) -> torch.Tensor:
    """Logits [len(argmax), vocab] whose row-wise argmax is `argmax`."""
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 3.0
    return logits


def test_greedy_all_accepted_gets_bonus() -> None:
    acc = accept_greedy([1, 2, 3], _logits_with_argmax([1, 2, 3, 4]))
    assert acc == Acceptance(tokens=[1, 2, 3, 4], num_accepted=3)


def test_greedy_first_mismatch_gets_correction() -> None:
    acc = accept_greedy([1, 5, 3], _logits_with_argmax([1, 2, 3, 4]))
    assert acc == Acceptance(tokens=[1, 2], num_accepted=1)
    acc = accept_greedy([0, 2], _logits_with_argmax([1, 2, 3]))
    assert acc == Acceptance(tokens=[1], num_accepted=0)


def test_greedy_no_drafts_is_plain_argmax() -> None:
    assert accept_greedy([], _logits_with_argmax([4])) == Acceptance(tokens=[4], num_accepted=0)


def test_greedy_shape_errors() -> None:
    with pytest.raises(ValueError):
        accept_greedy([1, 2], _logits_with_argmax([1, 2]))  # needs l + 1 rows
    with pytest.raises(ValueError):
        accept_greedy([9], _logits_with_argmax([1, 2]))  # out of vocabulary


def _random_dists(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random target and draft distribution [V], each with one zeroed entry (top-k mismatch)."""
    g = torch.Generator().manual_seed(seed)
    p_t = torch.rand(vocab, generator=g, dtype=torch.float64) ** 2
    p_d = torch.rand(vocab, generator=g, dtype=torch.float64) ** 2
    p_t[0] = 0.0  # draft may propose a token the target cannot emit
    p_d[1] = 0.0  # target mass the draft never proposes
    return p_t / p_t.sum(), p_d / p_d.sum()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_sampling_rule_is_exact(seed: int) -> None:
    """Enumerate the draft token: sum_x p_d(x)[min(1,p_t/p_d) 1{y=x} + (1-min) residual(y)] == p_t(y)."""
    p_t, p_d = _random_dists(seed, vocab=7)
    out = torch.zeros_like(p_t)
    resid = residual_probs(p_t, p_d)
    for x in range(p_t.numel()):
        if p_d[x] == 0:
            continue
        keep = min(1.0, float(p_t[x] / p_d[x]))
        out[x] += p_d[x] * keep
        out += p_d[x] * (1.0 - keep) * resid
    torch.testing.assert_close(out, p_t, atol=1e-12, rtol=0)


def test_residual_falls_back_to_target() -> None:
    p = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(residual_probs(p, p), p.double())


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_sampled_first_token_matches_target_monte_carlo(num_drafts: int) -> None:
    """Run accept_sampled itself: the first committed token is distributed as p_t[0]."""
    vocab, trials = 5, 8000
    p_t0, p_d0 = _random_dists(11, vocab)
    target = torch.stack([p_t0] + [torch.full((vocab,), 1.0 / vocab, dtype=torch.float64)] * num_drafts)  # [l+1, V]
    draft = torch.stack([p_d0] * num_drafts)  # [l, V]
    g = torch.Generator().manual_seed(1234)
    drafts = torch.multinomial(draft, trials, replacement=True, generator=g).T.tolist()  # [trials, l]
    counts = torch.zeros(vocab, dtype=torch.float64)
    accepted_first = 0
    for xs in drafts:
        acc = accept_sampled(xs, draft, target, g)
        assert 1 <= len(acc.tokens) == acc.num_accepted + 1 <= num_drafts + 1
        assert acc.tokens[: acc.num_accepted] == xs[: acc.num_accepted]
        counts[acc.tokens[0]] += 1
        accepted_first += acc.num_accepted > 0
    freq = counts / trials
    assert float((freq - p_t0).abs().max()) < 0.02, (freq, p_t0)
    assert freq[0] == 0.0  # a token with p_t = 0 is never emitted
    accept_rate = float(torch.minimum(p_t0, p_d0).sum())  # 1 - TV distance
    assert abs(accepted_first / trials - accept_rate) < 0.02


def test_sampled_zero_drafts_is_plain_sampling() -> None:
    vocab, trials = 4, 4000
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]])  # [1, V]
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(vocab)
    for _ in range(trials):
        acc = accept_sampled([], torch.empty(0, vocab), p, g)
        assert acc.num_accepted == 0 and len(acc.tokens) == 1
        counts[acc.tokens[0]] += 1
    assert float((counts / trials - p[0]).abs().max()) < 0.03


def test_sampled_identical_distributions_accept_everything() -> None:
    probs = torch.softmax(torch.randn(4, 9, generator=torch.Generator().manual_seed(3)), -1)  # [l+1, V]
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        acc = accept_sampled([2, 7, 1], probs[:3], probs, g)
        assert acc.num_accepted == 3 and acc.tokens[:3] == [2, 7, 1]


def test_sampled_shape_errors() -> None:
    with pytest.raises(ValueError):
        accept_sampled([1], torch.full((1, 4), 0.25), torch.full((1, 4), 0.25), None)
    with pytest.raises(ValueError):
        accept_sampled([1, 2], torch.full((1, 4), 0.25), torch.full((3, 4), 0.25), None)
