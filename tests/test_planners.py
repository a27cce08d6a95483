"""Verify-length planners (docs/method.md#planners), including the two-position losslessness
counterexample (docs/method.md#the-counterexample)."""
from __future__ import annotations

from typing import Callable, Sequence

import pytest
import torch

from dspark.sampling.rejection import accept_sampled, residual_probs
from dspark.speculative.cost_table import SPSTable
from dspark.speculative.planners import (
    FixedPlanner,
    Planner,
    ThresholdPlanner,
    ThroughputPlanner,
    make_planner,
    plan_algorithm1,
    plan_fixed,
    plan_lagged_topk,
    plan_threshold,
    speculation_pays,
)

Conf = Sequence[Sequence[float]]


def test_fixed_and_threshold_basics() -> None:
    assert plan_fixed([3, 0, 7]) == [3, 0, 7]
    conf = [[0.9, 0.6, 0.4, 0.9], [0.3, 0.9], [], [0.5, 0.5]]
    assert plan_threshold(conf, 0.5) == [2, 0, 0, 2]
    assert plan_threshold(conf, 0.0) == [4, 2, 0, 2]
    assert FixedPlanner().plan(["a", "b"], [[0.1, 0.1], [0.2]]) == [2, 1]
    assert ThresholdPlanner(0.55).plan([1, 2, 3, 4], conf) == [2, 0, 0, 0]
    with pytest.raises(ValueError):
        plan_threshold([[1.5]], 0.5)
    with pytest.raises(ValueError):
        FixedPlanner().plan(["a"], [[0.5], [0.5]])


def test_algorithm1_admits_in_survival_order() -> None:
    # Each extra token costs 10% step time: admitting survival a helps while a > tau* x 0.1 / 1.1...
    table = SPSTable({b: 1.0 / (1.0 + 0.1 * b) for b in range(1, 16)})
    conf = [[0.9, 0.9, 0.1], [0.5, 0.9]]  # survival r0: .9 .81 .081; r1: .5 .45
    # Pool order: (0,1) .9, (0,2) .81, (1,1) .5, (1,2) .45, (0,3) .081; check Theta by hand.
    def theta(tau: float, b: int) -> float:
        return tau * table.sps(b)
    assert theta(2.9, 3) > theta(2, 2)
    assert theta(3.71, 4) > theta(2.9, 3)
    assert theta(4.21, 5) > theta(3.71, 4)
    assert theta(4.66, 6) > theta(4.21, 5)
    assert theta(4.741, 7) < theta(4.66, 6)
    assert plan_algorithm1(conf, table) == [2, 2]
    flat = SPSTable({1: 1.0})  # extrapolates as time proportional to tokens: nothing pays off
    assert plan_algorithm1(conf, flat) == [0, 0]
    free = SPSTable({b: 1.0 for b in range(1, 16)})  # verification is free: admit every a > 0
    assert plan_algorithm1(conf + [[0.0, 0.5]], free) == [3, 2, 0]
    assert plan_algorithm1([], free) == []


def test_algorithm1_stops_at_first_non_improving_candidate() -> None:
    table = SPSTable({1: 1.0, 2: 0.6, 3: 0.6, 4: 0.6})
    conf = [[0.5, 1.0, 1.0]]  # survival .5 .5 .5: first step 1.5*.6 < 1, later prefixes 2.5*.6 > 1
    assert plan_algorithm1(conf, table) == [0]
    assert plan_algorithm1(conf, table, early_stop=False) == [3]


# ---- docs/method.md#the-counterexample: R = 1, gamma = 2, vocabulary {A, B} -------------------
APPENDIX_TABLE = SPSTable({1: 1.0, 2: 0.5, 3: 0.45})
P_TARGET = torch.tensor([0.7, 0.3], dtype=torch.float64)
P_DRAFT = torch.tensor([0.5, 0.5], dtype=torch.float64)
C1 = 0.8
C2_AFTER = {0: 0.9, 1: 0.0}  # c2 = 0.9 after A, 0 after B


def _first_token_distribution(plan: Callable[[Conf], list[int]]) -> torch.Tensor:
    """Exact law of the first committed token: enumerate x1 and apply the acceptance rule."""
    out = torch.zeros(2, dtype=torch.float64)
    for x1 in (0, 1):
        length = plan([[C1, C2_AFTER[x1]]])[0]
        if length == 0:
            out += P_DRAFT[x1] * P_TARGET  # plain sampling from the target
            continue
        keep = min(1.0, float(P_TARGET[x1] / P_DRAFT[x1]))
        out[x1] += P_DRAFT[x1] * keep
        out += P_DRAFT[x1] * (1.0 - keep) * residual_probs(P_TARGET, P_DRAFT)
    return out


def _first_token_monte_carlo(plan: Callable[[Conf], list[int]], trials: int, seed: int) -> torch.Tensor:
    """Same law estimated by running the planner and accept_sampled on sampled drafts."""
    g = torch.Generator().manual_seed(seed)
    target = torch.stack([P_TARGET] * 3)  # [gamma+1, V]
    draft = torch.stack([P_DRAFT] * 2)  # [gamma, V]
    counts = torch.zeros(2, dtype=torch.float64)
    xs = torch.multinomial(draft, trials, replacement=True, generator=g).T.tolist()  # [trials, 2]
    for x1, x2 in xs:
        length = plan([[C1, C2_AFTER[x1]]])[0]
        acc = accept_sampled([x1, x2][:length], draft[:length], target[: length + 1], g)
        counts[acc.tokens[0]] += 1
    return counts / trials


def test_appendix_a_early_stop_is_lossless() -> None:
    plan = lambda conf: plan_algorithm1(conf, APPENDIX_TABLE)  # noqa: E731
    torch.testing.assert_close(_first_token_distribution(plan), P_TARGET, atol=1e-12, rtol=0)
    assert abs(float(_first_token_monte_carlo(plan, 3000, 0)[0]) - 0.7) < 0.04


def test_appendix_a_without_early_stop_is_biased() -> None:
    plan = lambda conf: plan_algorithm1(conf, APPENDIX_TABLE, early_stop=False)  # noqa: E731
    assert plan([[C1, 0.9]]) == [2] and plan([[C1, 0.0]]) == [0]
    biased = torch.tensor([0.85, 0.15], dtype=torch.float64)
    torch.testing.assert_close(_first_token_distribution(plan), biased, atol=1e-12, rtol=0)
    assert abs(float(_first_token_monte_carlo(plan, 3000, 1)[0]) - 0.85) < 0.04


@pytest.mark.parametrize("lagged", [[], [0.0, 0.0], [0.8, 0.9], [1.0, 1.0], [0.99, 0.1]])
def test_appendix_a_lagged_topk_is_lossless(lagged: list[float]) -> None:
    plan = lambda conf: plan_lagged_topk(conf, [lagged], APPENDIX_TABLE)  # noqa: E731
    torch.testing.assert_close(_first_token_distribution(plan), P_TARGET, atol=1e-12, rtol=0)


# ---- lagged top-K ---------------------------------------------------------------------------------
LAG_TABLE = SPSTable({2: 1.0, 3: 0.9, 4: 0.8, 5: 0.5, 6: 0.5, 7: 0.5, 8: 0.5})


def test_lagged_budget_follows_lagged_confidences() -> None:
    conf_now = [[0.9, 0.9, 0.9], [0.2, 0.2, 0.2]]  # current: request 0 far more promising
    # lagged survival .9, .8 then zeros -> K = 2 (Theta 2, 2.61, 2.96, 1.85, ...), spent on request 0
    assert plan_lagged_topk(conf_now, [[0.9, 0.0, 0.0], [0.8, 0.0, 0.0]], LAG_TABLE) == [2, 0]
    assert plan_lagged_topk(conf_now, [[0.0] * 3, [0.0] * 3], LAG_TABLE) == [0, 0]
    assert plan_lagged_topk(conf_now, [[1.0] * 3, [1.0] * 3], LAG_TABLE) == [3, 3]
    # the same lagged input gives the same budget whatever the current confidences are
    assert sum(plan_lagged_topk([[0.1] * 3, [0.95] * 3], [[0.9, 0.0, 0.0], [0.8, 0.0, 0.0]], LAG_TABLE)) == 2
    # zero current survival is never verified even within budget
    assert plan_lagged_topk([[0.9, 0.0, 0.5], [0.0, 0.3, 0.3]], [[1.0] * 3, [1.0] * 3], LAG_TABLE) == [1, 0]


def test_lagged_budget_is_a_global_argmax() -> None:
    table = SPSTable({1: 1.0, 2: 0.6, 3: 0.6, 4: 0.6})
    # lagged survival .5 .5 .5: K=1 is worse than K=0, but K=3 is best (an early stop would give 0)
    assert plan_lagged_topk([[0.7, 0.7, 0.7]], [[0.5, 1.0, 1.0]], table) == [3]


def test_throughput_planner_uses_confidences_two_rounds_back() -> None:
    table = SPSTable({1: 1.0, 2: 0.6, 3: 0.6, 4: 0.6})
    planner = ThroughputPlanner(table)  # lagged variant
    low, high = [0.1, 0.1, 0.1], [0.99, 0.99, 0.99]
    # rounds 1-2: no history -> value-free prior (survival 1): budget argmax (1+K) SPS(1+K) = 3
    assert planner.plan(["r"], [low]) == [3]
    assert planner.plan(["r"], [high]) == [3]
    assert planner.plan(["r"], [high]) == [0]  # uses round 1 (low): K=1 gives 1.1*.6 < 1
    assert planner.plan(["r"], [low]) == [3]  # uses round 2 (high), spent on current survival > 0
    planner.release("r")
    assert planner.plan(["r"], [low]) == [3]  # history forgotten: prior again
    alg1 = ThroughputPlanner(table, variant="algorithm1")
    assert alg1.plan(["r"], [high]) == plan_algorithm1([high], table)


def test_auto_variant_plans_lone_requests_with_algorithm1_and_batches_lagged() -> None:
    table = SPSTable({1: 1.0, 2: 0.6, 3: 0.6, 4: 0.6, 5: 0.5, 6: 0.5, 7: 0.5, 8: 0.5},
                     by_seqs={2: {2: 0.9, 3: 0.6, 4: 0.6, 5: 0.6, 6: 0.55, 7: 0.5, 8: 0.5}})
    low, high = [0.1, 0.1, 0.1], [0.99, 0.99, 0.99]
    auto, lagged, alg1 = (ThroughputPlanner(table, variant=v) for v in ("auto", "lagged", "algorithm1"))
    # alone: this round's confidences decide (lagged would verify 3 on its value-free prior, then the
    # budget of two rounds back), and the lone round asks for the whole block
    for conf in ([low], [high], [high], [low]):
        assert auto.num_drafts(["r"], 3) == alg1.num_drafts(["r"], 3) == 3
        assert auto.plan(["r"], conf) == alg1.plan(["r"], conf)
    assert auto.plan(["r"], [low]) == [0] and lagged.plan(["r"], [low]) == [3]
    # with prefill sharing the pass, or beside another request: the lagged budget, from the rows its lone
    # rounds recorded (rounds alone keep the history a later batch needs)
    for p in (auto, lagged):
        p.release("r")
        for conf in ([low], [high]):  # r's lagged row is now `low`, s has the prior: a budget of 3, not 6
            p.plan(["r"], conf)
    both = ([high, high], ["r", "s"])
    assert auto.num_drafts(both[1], 3) == lagged.num_drafts(both[1], 3) == 3
    assert auto.plan(both[1], both[0]) == lagged.plan(both[1], both[0]) == [2, 1]
    assert auto.plan(["r"], [high], extra_tokens=1) == lagged.plan(["r"], [high], extra_tokens=1)


def test_speculation_pays_counts_drafting_time() -> None:
    table = SPSTable({1: 10.0, 2: 9.5, 4: 9.0, 8: 8.0})  # plain: 10 tokens/s at batch 1
    sure = [[0.9, 0.9, 0.9]]  # survival .9 .81 .73: about 3.4 tokens per round at 9 rounds/s
    assert speculation_pays(sure, table, draft_seconds=0.0)
    assert speculation_pays(sure, table, draft_seconds=0.1)  # 3.4 / (0.11 + 0.1) = 16 > 10
    assert not speculation_pays(sure, table, draft_seconds=0.5)  # 3.4 / 0.61 = 5.6 < 10
    assert not speculation_pays([[0.05, 0.01]], table, draft_seconds=0.01)
    assert not speculation_pays([], table, draft_seconds=0.0)


def test_throughput_planner_skips_drafting_only_when_it_cannot_pay() -> None:
    table = SPSTable({1: 10.0, 2: 9.5, 4: 9.0, 8: 8.0})
    planner = ThroughputPlanner(table, draft_seconds={1: 0.05, 4: 0.11}, probe_every=3, backoff=False)
    assert planner.should_draft(["r"])  # no confidences yet
    planner.plan(["r"], [[0.05, 0.05]])
    assert [planner.should_draft(["r"]) for _ in range(6)] == [False, False, True, False, False, True]
    assert planner.should_draft(["r", "new"])  # a new request has no confidences yet: draft
    planner.plan(["r"], [[0.95, 0.95]])  # confidences came back up: one round is not enough...
    assert not planner.should_draft(["r"])
    for _ in range(3):  # ...a run of good rounds brings drafting back
        planner.plan(["r"], [[0.95, 0.95]])
    assert planner.should_draft(["r"])
    assert ThroughputPlanner(table).should_draft(["r"])  # no drafting times measured: always draft
    assert planner.draft_seconds(2) == pytest.approx(0.07) and planner.draft_seconds(8) == pytest.approx(0.22)
    with pytest.raises(ValueError, match="probe_every"):
        ThroughputPlanner(table, probe_every=0)


def test_one_unlucky_round_does_not_stop_drafting() -> None:
    """The skip decision reads a moving average of a request's rounds (from the prior), not its latest
    row: on text where drafting pays, a round of low confidences must not switch drafting off until
    the next probe."""
    table = SPSTable({1: 10.0, 2: 9.5, 4: 9.0, 8: 8.0})
    planner = ThroughputPlanner(table, draft_seconds={1: 0.02}, probe_every=8, prior=[0.8, 0.6])
    for _ in range(4):
        planner.plan(["r"], [[0.8, 0.75]])
    planner.plan(["r"], [[0.02, 0.5]])  # one unlucky round
    assert planner.should_draft(["r"])
    for _ in range(8):  # a request whose drafts keep failing is switched off
        planner.plan(["r"], [[0.02, 0.5]])
    assert not planner.should_draft(["r"])
    planner.release("r")
    assert planner.should_draft(["r"])  # forgotten: back to the prior
    with pytest.raises(ValueError, match="outlook_weight"):
        ThroughputPlanner(table, outlook_weight=0.0)


def test_make_planner() -> None:
    table = SPSTable({1: 1.0, 2: 0.9})
    assert isinstance(make_planner("fixed", None), FixedPlanner)
    threshold = make_planner("threshold", None, threshold=0.7)
    assert isinstance(threshold, ThresholdPlanner) and threshold.threshold == 0.7
    through = make_planner("throughput", table, variant="algorithm1")
    assert isinstance(through, ThroughputPlanner) and isinstance(through, Planner)
    with pytest.raises(ValueError, match="fixed.*threshold.*throughput"):
        make_planner("magic", table)
    with pytest.raises(ValueError, match="SPS table"):
        make_planner("throughput", None)
    with pytest.raises(ValueError, match="SPS table"):
        ThroughputPlanner(None)
    with pytest.raises(ValueError, match="variant"):
        ThroughputPlanner(table, variant="greedy")


def test_new_requests_use_the_drafters_measured_survival_as_prior() -> None:
    table = SPSTable({1: 10.0, 2: 9.5, 4: 9.0, 8: 8.0})
    poor = ThroughputPlanner(table, draft_seconds={1: 0.01}, prior=[0.1, 0.02, 0.01])
    assert not poor.should_draft(["new"])  # 10% survival cannot pay: plain decoding from the start
    assert poor.prior == pytest.approx([0.1, 0.2, 0.5])  # conditional rates
    good = ThroughputPlanner(table, draft_seconds={1: 0.01}, prior=[0.9, 0.8, 0.7])
    assert good.should_draft(["new"])
    # plan(): the prior stands in for the lagged row of a request without history
    lagged_table = SPSTable({1: 1.0, 2: 0.6, 3: 0.6, 4: 0.6})
    assert ThroughputPlanner(lagged_table, prior=[0.3, 0.1, 0.05]).plan(["r"], [[0.99] * 3]) == [0]
    assert ThroughputPlanner(lagged_table).plan(["r"], [[0.99] * 3]) == [3]  # no prior: survival 1


def test_prefill_sharing_the_pass_shrinks_the_budget() -> None:
    # linear cost: 10 ms a step + 1 ms a token; survival .5 pays on a bare decode step, not beside 100 prefill tokens
    table = SPSTable({n: 1.0 / (0.010 + 0.001 * n) for n in (1, 2, 3, 4, 101, 102, 103, 104)})
    conf = [[0.5, 0.5, 0.5]]
    assert plan_algorithm1(conf, table) == [2]  # 1.75 tokens in 13 ms beats 1 in 11
    assert plan_algorithm1(conf, table, extra_tokens=100) == [0]
    assert plan_lagged_topk(conf, conf, table) == [2]
    assert plan_lagged_topk(conf, conf, table, extra_tokens=100) == [0]
    assert speculation_pays(conf, table, draft_seconds=0.0)
    assert not speculation_pays(conf, table, draft_seconds=0.0, extra_tokens=100)


def test_shipped_drafter_brings_its_survival_prior(tmp_path) -> None:
    import json

    from dspark.drafters.io import read_survival_prior
    from dspark.drafters.registry import shipped_drafter

    prior = read_survival_prior(shipped_drafter("DSPARK") / "sts.json")
    assert prior and all(0 <= b <= a <= 1 for a, b in zip(prior, prior[1:]))
    bad = tmp_path / "sts.json"
    bad.write_text(json.dumps({"temperatures": [1.0], "survival_rate": [1.5]}))
    with pytest.raises(ValueError, match="survival_rate"):
        read_survival_prior(bad)


def test_loaded_steps_are_priced_by_their_own_curve() -> None:
    # One sequence: 10 ms + 1 ms a token, so a draft is cheap. Eight sequences: 40 ms, and the first
    # draft costs 20 ms more (a second attention group and another block of the 4-bit kernel's rows).
    one = {n: 1.0 / (0.010 + 0.001 * n) for n in range(1, 64)}
    loaded = SPSTable(one, by_seqs={8: {8: 1 / 0.040, 9: 1 / 0.060, 16: 1 / 0.064, 24: 1 / 0.080}})
    blind = SPSTable(one)
    conf = [[0.6, 0.5, 0.5]] + [[0.3, 0.3, 0.3]] * 7  # 8 requests, one of them confident
    ids = [f"r{i}" for i in range(8)]
    assert sum(plan_algorithm1(conf, blind)) > 0  # priced as 8 tokens of one sequence, drafts pay
    assert plan_algorithm1(conf, loaded) == [0] * 8  # 1.6 tokens more for +50% time: they do not
    assert sum(plan_lagged_topk(conf, conf, blind)) > 0 and plan_lagged_topk(conf, conf, loaded) == [0] * 8
    assert speculation_pays(conf, blind, 1e-4) and not speculation_pays(conf, loaded, 1e-4)
    planner = ThroughputPlanner(loaded, draft_seconds={8: 1e-4})
    planner.plan(ids, conf)
    assert not planner.should_draft(ids)


def test_longer_contexts_make_drafts_relatively_cheaper() -> None:
    # 10 ms + 10 ms a draft at the profiled 100-token contexts; attention adds 10 us a cached token
    table = SPSTable({n: 1.0 / (0.010 * n) for n in range(1, 9)}, by_seqs={2: {2 + e: 1.0 / (0.020 + 0.010 * e)
                                                                             for e in range(9)}},
                     context=100, kv_seconds=1e-5)
    conf = [[0.55, 0.9], [0.55, 0.9]]  # one draft per request adds 1.1 tokens for 20 ms
    assert plan_algorithm1(conf, table, context_tokens=200) == [0, 0]  # 40 ms -> 3.1 tokens in 40: no
    assert plan_algorithm1(conf, table, context_tokens=4200) != [0, 0]  # 60 ms base: 3.1 in 80 ms beats 2 in 60


def test_probes_are_rare_where_even_the_prior_cannot_pay() -> None:
    table = SPSTable({1: 10.0, 2: 9.5, 4: 9.0, 8: 8.0})
    def probes(prior: list[float]) -> list[bool]:
        planner = ThroughputPlanner(table, draft_seconds={1: 0.01}, probe_every=3, idle_probe_every=6, prior=prior,
                                    backoff=False)
        for _ in range(12):  # the request's own confidences, round after round: nothing pays
            planner.plan(["r"], [[0.05, 0.05]])
        return [planner.should_draft(["r"]) for _ in range(12)]
    assert probes([0.9, 0.8]) == [False, False, True] * 4  # the prior pays: probe every 3 rounds
    assert probes([0.1, 0.01]) == ([False] * 5 + [True]) * 2  # it does not: every 6
    with pytest.raises(ValueError, match="idle_probe_every"):
        ThroughputPlanner(table, probe_every=8, idle_probe_every=4)


def test_unproductive_probes_back_off() -> None:
    """A probe after which speculation still cannot pay doubles the request's probe interval (up to
    idle_probe_every); a round where it pays brings the interval back to probe_every."""
    table = SPSTable({1: 10.0, 2: 9.5, 4: 9.0, 8: 8.0})
    planner = ThroughputPlanner(table, draft_seconds={1: 0.01}, probe_every=2, idle_probe_every=8,
                                prior=[0.9, 0.8], outlook_weight=1.0, measured_weight=0)

    def rounds(n: int, conf: list[float]) -> list[bool]:
        out = []
        for _ in range(n):
            out.append(planner.should_draft(["r"]))
            if out[-1]:
                planner.plan(["r"], [conf])
        return out

    assert rounds(1, [0.05, 0.05]) == [True]  # the prior pays: a new request drafts
    poor = rounds(2 + 4 + 8 + 8, [0.05, 0.05])
    assert [i for i, d in enumerate(poor) if d] == [1, 5, 13, 21]  # probes after 2, 4, 8 and 8 rounds
    assert rounds(8, [0.95, 0.95]) == [False] * 7 + [True]  # the next probe finds drafts that pay...
    assert rounds(2, [0.05, 0.05]) == [True, False]  # ...so the round after drafts, and the interval is 2 again
    assert rounds(1 + 4, [0.05, 0.05]) == [True, False, False, False, True]
    planner.release("r")
    assert "r" not in planner._backoff


def test_measured_survival_scales_the_confidences_planned_with() -> None:
    """Rounds whose drafts survive less than their confidences forecast scale that request's outlook
    and lagged rows down, by (survived + w) / (forecast + w) over the drafts each round tested."""
    table = SPSTable({1: 10.0, 2: 9.5, 4: 9.0, 8: 8.0})
    planner = ThroughputPlanner(table, draft_seconds={1: 0.01}, prior=[0.8, 0.6], measured_weight=4.0)
    assert planner.measured_scale("r") == 1.0
    planner.plan(["r"], [[0.8, 0.75, 0.5]])
    planner.observe("r", 3, 0)  # draft 1 tested and failed: 0 survived of 0.8 forecast
    assert planner.measured_scale("r") == pytest.approx(4 / 4.8)
    planner.plan(["r"], [[0.8, 0.75, 0.5]])
    planner.observe("r", 3, 3)  # all three survived: 3 of 2.05
    assert planner.measured_scale("r") == pytest.approx(7 / 6.85)
    planner.plan(["r"], [[0.8, 0.75]])
    planner.observe("r", 0, 0)  # nothing verified: nothing tested
    assert planner.measured_scale("r") == pytest.approx(7 / 6.85)
    planner.observe("other", 2, 1)  # no planned row: ignored
    assert planner.measured_scale("other") == 1.0
    # a request whose drafts keep failing stops drafting though its confidences stay high
    def drafted(weight: float) -> list[bool]:
        liar = ThroughputPlanner(table, draft_seconds={1: 0.03}, prior=[0.8, 0.6], measured_weight=weight)
        out = []
        for _ in range(12):
            out.append(liar.should_draft(["x"]))
            if out[-1]:
                liar.plan(["x"], [[0.8, 0.75]])
                liar.observe("x", 2, 0)
        return out
    assert drafted(0.0) == [True] * 12  # confidences alone: drafting keeps looking worth it
    assert drafted(4.0)[-3:] == [False] * 3  # 0 survived of 0.8 forecast a round: it stops
    lagged_table = SPSTable({1: 1.0, 2: 0.7, 3: 0.6})
    honest = ThroughputPlanner(lagged_table, prior=[0.8, 0.6])
    for _ in range(3):
        honest.plan(["x"], [[0.8, 0.75]])
    assert honest.plan(["x"], [[0.8, 0.75]]) == [2]
    liar = ThroughputPlanner(lagged_table, prior=[0.8, 0.6])  # measured_weight 8
    for _ in range(10):  # scale 8 / (8 + 10 x 0.8) = 0.5
        liar.plan(["x"], [[0.8, 0.75]])
        liar.observe("x", 2, 0)
    assert liar.plan(["x"], [[0.8, 0.75]]) == [0]  # the lagged budget reads the scaled row
    with pytest.raises(ValueError, match="measured_weight"):
        ThroughputPlanner(table, measured_weight=-1.0)


def test_min_gain_keeps_break_even_speculation_off() -> None:
    table = SPSTable({1: 10.0, 2: 9.5})  # one draft of survival .1: 1.1 tokens at 9.5 steps/s = +4.5%
    assert speculation_pays([[0.1]], table, draft_seconds=0.0)
    assert speculation_pays([[0.1]], table, draft_seconds=0.0, min_gain=0.04)
    assert not speculation_pays([[0.1]], table, draft_seconds=0.0, min_gain=0.05)
    assert plan_lagged_topk([[0.5]], [[0.1]], table) == [1]
    assert plan_lagged_topk([[0.5]], [[0.1]], table, min_gain=0.05) == [0]
    assert plan_lagged_topk([[0.5]], [[0.9]], table, min_gain=0.05) == [1]  # +80%: well past the margin
    # the planner applies it to the lagged budget (here the prior) and to the drafting decision
    assert ThroughputPlanner(table, prior=[0.1]).plan(["r"], [[0.5]]) == [1]
    assert ThroughputPlanner(table, prior=[0.1], min_gain=0.05).plan(["r"], [[0.5]]) == [0]
    planner = ThroughputPlanner(table, draft_seconds={1: 0.0}, prior=[0.1], min_gain=0.05)
    planner.plan(["r"], [[0.1]])
    assert not planner.should_draft(["r"])
    assert ThroughputPlanner(table, draft_seconds={1: 0.0}, prior=[0.1]).should_draft(["r"])
    for bad in (-0.01, 1.0):
        with pytest.raises(ValueError, match="min_gain"):
            ThroughputPlanner(table, min_gain=bad)


def test_lagged_budget_bounds_the_drafts_made() -> None:
    """The lagged budget is known before drafting, so a round drafts no more than it (a budget of 0,
    a refresh round, drafts the whole block); history rows of a short round are continued to the
    full width, so later budgets are not capped at it."""
    table = SPSTable({1: 10.0, 2: 9.9, 3: 9.8, 4: 6.0, 8: 3.0})  # a cliff after 3 tokens
    planner = ThroughputPlanner(table, prior=[0.9, 0.8, 0.7, 0.6])
    assert planner.num_drafts(["r"], 7) == 2  # 1 + 2 drafts = 3 tokens, the widest before the cliff
    assert planner.plan(["r"], [[0.9, 0.9]]) == [2]
    assert len(planner._history["r"][-1]) == 7
    assert planner.num_drafts(["r", "s"], 7) == 1  # two requests: 2 + 1 tokens, the widest before the cliff
    poor = ThroughputPlanner(table, prior=[0.01, 0.0001])
    assert poor.num_drafts(["r"], 7) == 7  # budget 0: a refresh round drafts everything
    assert ThroughputPlanner(table, variant="algorithm1", prior=[0.9]).num_drafts(["r"], 7) == 7
    assert FixedPlanner().num_drafts(["r"], 5) == 5


def test_drafting_time_follows_the_drafts_a_round_makes() -> None:
    """With one-draft rounds measured too, a round's drafting cost is priced at its budget's width:
    a prior that pays for one cheap draft is not refused for the price of a whole block."""
    table = SPSTable({1: 10.0, 2: 9.9, 3: 5.0})
    kw = dict(draft_seconds={1: 0.07}, prior=[0.5, 0.05])
    planner = ThroughputPlanner(table, draft_seconds_one={1: 0.01}, block_size=7, **kw)
    assert planner.draft_seconds(1) == pytest.approx(0.07)
    assert planner.draft_seconds(1, 4) == pytest.approx(0.04) and planner.draft_seconds(1, 9) == pytest.approx(0.07)
    assert planner.should_draft(["new"])  # 1.5 tokens / (0.101 s + 0.01 s) beats 10 tokens/s
    assert not ThroughputPlanner(table, **kw).should_draft(["new"])  # priced as a whole block: 0.171 s
    assert speculation_pays([[0.5]], table, draft_seconds=lambda k: 0.01 * k)


def test_outlook_blends_rounds_and_fills_undrafted_positions_from_the_prior() -> None:
    table = SPSTable({1: 10.0, 2: 9.9, 4: 9.0})
    planner = ThroughputPlanner(table, prior=[0.8, 0.4, 0.2])  # conditional rates 0.8, 0.5, 0.5
    planner.plan(["r"], [[1.0]])  # a one-draft round: 0.75 x prior + 0.25 x this round
    assert planner._outlook["r"] == pytest.approx([0.85])
    planner.plan(["r"], [[1.0, 1.0, 1.0]])  # positions 2-3 were never drafted: the prior's rates fill them
    assert planner._outlook["r"] == pytest.approx([0.8875, 0.56875, 0.409375])
    planner.plan(["r"], [[0.0]])  # a short round keeps the later positions' rates
    a1 = 0.75 * 0.8875
    assert planner._outlook["r"] == pytest.approx([a1, a1 * 0.56875 / 0.8875, a1 * 0.409375 / 0.8875])
