"""Verify-length planners: how many of each request's drafts to verify this round (docs/method.md#planners).

conf[r][k-1] is the drafter's confidence c_{r,k}: the probability that draft k of request r survives
given that drafts 1..k-1 survived. Prefix survival is a_{r,k} = c_{r,1} * ... * c_{r,k}. Every planner
returns l_r in 0..len(conf[r]) per request.

Losslessness rule shared by all planners here: whether draft x_k is verified may depend on x_<k (and
on anything fixed before this round) but never on x_k itself. Since c_{k+1} is computed from the sampled
x_k, a planner that lets a_{k+1} influence the admission of x_k skews the output distribution
(docs/method.md#losslessness-rule, and the two-position case in docs/method.md#the-counterexample).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import deque
from typing import Callable, Hashable, Sequence

from dspark.speculative.config import PlannerKind, ThroughputVariant, choices
from dspark.speculative.cost_table import SPSTable



def _check_conf(conf: Sequence[Sequence[float]]) -> None:
    """Raise ValueError unless every confidence is a finite number in [0, 1]."""
    for r, row in enumerate(conf):
        for k, c in enumerate(row):
            try:
                v = float(c)
            except (TypeError, ValueError):
                v = math.nan
            if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"confidence conf[{r}][{k}] = {c!r} is not in [0, 1]")


def survival(conf_row: Sequence[float]) -> list[float]:
    """Prefix survival probabilities a_k = prod_{i<=k} c_i of one request (non-increasing)."""
    out: list[float] = []
    acc = 1.0
    for c in conf_row:
        acc *= float(c)
        out.append(acc)
    return out


def _survival_pool(surv: Sequence[Sequence[float]]) -> list[tuple[float, int, int]]:
    """All (a, r, j) with a > 0 (j 1-based), sorted by a descending, ties by (r, j).

    a is non-increasing in j (products of factors <= 1 round monotonically), so the order respects
    each request's prefixes: (r, j) always comes before (r, j + 1).
    """
    pool = [(a, r, j) for r, row in enumerate(surv) for j, a in enumerate(row, start=1) if a > 0.0]
    pool.sort(key=lambda item: (-item[0], item[1], item[2]))
    return pool


def _lengths_from_prefix(num_requests: int, admitted: Sequence[tuple[float, int, int]]) -> list[int]:
    """Verify lengths from an admitted prefix of a survival pool."""
    lengths = [0] * num_requests
    for _, r, j in admitted:
        lengths[r] = max(lengths[r], j)
    return lengths


def plan_fixed(num_drafts: Sequence[int]) -> list[int]:
    """Verify every draft: l_r = num_drafts[r]."""
    if any(n < 0 for n in num_drafts):
        raise ValueError(f"negative draft count in {list(num_drafts)}")
    return [int(n) for n in num_drafts]


def plan_threshold(conf: Sequence[Sequence[float]], threshold: float) -> list[int]:
    """Static threshold: l_r = number of leading drafts with c_k >= threshold."""
    _check_conf(conf)
    lengths: list[int] = []
    for row in conf:
        n = 0
        while n < len(row) and row[n] >= threshold:
            n += 1
        lengths.append(n)
    return lengths


def plan_algorithm1(
    conf: Sequence[Sequence[float]], table: SPSTable, early_stop: bool = True, extra_tokens: int = 0,
    context_tokens: int | None = None,
) -> list[int]:
    """docs/method.md#algorithm-1: greedily admit drafts by survival while tau* x SPS(B) improves.

    extra_tokens: other tokens sharing the verify pass (prefill chunks of joining requests). They
    count in B and, being work done, in tau*: a step already long with prefill makes a draft's
    marginal cost relatively larger, so fewer drafts pay. context_tokens: the requests' cached
    tokens in all (SPSTable.sps prices the step's attention with it; None: the profiled context).

    early_stop=False keeps scanning and takes the best prefix of the sorted pool instead. That variant
    is NOT lossless (a_{k+1}, which depends on the sampled x_k, then decides whether x_k is verified);
    it exists only so tests can demonstrate the bias.
    """
    _check_conf(conf)
    num_requests = len(conf)
    if num_requests == 0:
        return []
    pool = _survival_pool([survival(row) for row in conf])
    batch = num_requests + extra_tokens  # B: one anchor token per request, plus the prefill tokens
    tau = float(batch)  # tau*: expected tokens of work done
    best = tau * table.sps(batch, num_requests, context_tokens)  # Theta_best
    best_len = 0
    for n, (a, _, _) in enumerate(pool, start=1):
        batch += 1
        tau += a
        theta = tau * table.sps(batch, num_requests, context_tokens)
        if theta > best:
            best, best_len = theta, n
        elif early_stop:
            break
    return _lengths_from_prefix(num_requests, pool[:best_len])


def lagged_budget(lagged: Sequence[Sequence[float]], table: SPSTable, cap: int, extra_tokens: int = 0,
                  context_tokens: int | None = None, min_gain: float = 0.0) -> int:
    """The verify budget K of plan_lagged_topk: argmax over K in 0..cap of (R + the K largest lagged
    survival probs) x SPS(R + K) (first maximum), or 0 unless it beats K = 0 by min_gain."""
    num_requests = len(lagged)
    ranked = sorted((a for row in lagged for a in survival(row)), reverse=True)
    base = num_requests + extra_tokens
    gain = float(base)
    plain = gain * table.sps(base, num_requests, context_tokens)
    best, budget = plain, 0
    for k in range(1, cap + 1):
        gain += ranked[k - 1] if k - 1 < len(ranked) else 0.0
        theta = gain * table.sps(base + k, num_requests, context_tokens)
        if theta > best:
            best, budget = theta, k
    return 0 if best <= plain * (1.0 + min_gain) else budget


def plan_lagged_topk(
    conf_now: Sequence[Sequence[float]],
    conf_lagged: Sequence[Sequence[float]],
    table: SPSTable,
    extra_tokens: int = 0,
    context_tokens: int | None = None,
    min_gain: float = 0.0,
    budget: int | None = None,
) -> list[int]:
    """docs/method.md#lagged-budget: budget K from lagged confidences by global argmax, spent on current top-K.

    K = argmax_K (R + sum of the K largest lagged survival probs) x SPS(R + K), for K from 0 to the
    number of drafts available now (first maximum wins). The K drafts with the largest current survival
    (prefix-respecting; zero-survival drafts are skipped, so fewer may be verified) are then verified.
    conf_lagged[r] is request r's confidence row from two rounds back; its values must not depend on
    this round's drafts, which is what makes the unconstrained search lossless. extra_tokens and
    context_tokens: as in plan_algorithm1 (R becomes R + extra_tokens in both factors). min_gain: a
    budget K > 0 must beat plain verification (K = 0) by this fraction of expected tokens/s, else
    nothing is verified (a margin for the SPS table's measurement error; 0 = the plain argmax).
    """
    _check_conf(conf_now)
    _check_conf(conf_lagged)
    num_requests = len(conf_now)
    if len(conf_lagged) != num_requests:
        raise ValueError(f"{len(conf_lagged)} lagged confidence rows for {num_requests} requests")
    if num_requests == 0:
        return []
    cap = sum(len(row) for row in conf_now)  # value-independent upper bound on the budget
    if budget is None:  # else computed by the caller from the same lagged rows before drafting
        budget = lagged_budget(conf_lagged, table, cap, extra_tokens, context_tokens, min_gain)
    pool = _survival_pool([survival(row) for row in conf_now])
    return _lengths_from_prefix(num_requests, pool[:budget])


def _conditional(prefix_survival: Sequence[float]) -> list[float]:
    """Conditional survival c_k = a_k / a_(k-1) from prefix survival a_1 >= a_2 >= ..., in [0, 1]."""
    out, prev = [], 1.0
    for a in prefix_survival:
        a = min(max(float(a), 0.0), prev)
        out.append(a / prev if prev > 0 else 0.0)
        prev = a
    return out


def _check_batch(request_ids: Sequence[Hashable], conf: Sequence[Sequence[float]]) -> None:
    """Raise ValueError if ids and confidence rows do not pair up one-to-one."""
    if len(request_ids) != len(conf):
        raise ValueError(f"{len(request_ids)} request ids but {len(conf)} confidence rows")
    if len(set(request_ids)) != len(request_ids):
        raise ValueError(f"duplicate request ids in {list(request_ids)}")


def speculation_pays(lagged: Sequence[Sequence[float]], table: SPSTable,
                     draft_seconds: float | Callable[[int], float], extra_tokens: int = 0,
                     context_tokens: int | None = None, min_gain: float = 0.0) -> bool:
    """Whether drafting this round is expected to beat plain decoding, drafting time included.

    Plain: R tokens per 1 / SPS(R) seconds. Speculating with a budget of K drafts: R + (sum of the K
    largest lagged survival probabilities) tokens per 1 / SPS(R + K) + draft_seconds (a number, or a
    function of K: a round drafts no more than its budget, see ThroughputPlanner.num_drafts). Inputs are fixed
    before this round's drafts exist, so skipping the drafter on this basis is lossless. extra_tokens
    (prefill sharing the pass) add to R on both sides; context_tokens as in plan_algorithm1. min_gain:
    drafting must beat plain decoding by at least this fraction of tokens/s.
    """
    _check_conf(lagged)
    if not lagged:
        return False
    seqs = len(lagged)
    r = seqs + extra_tokens
    plain = r * table.sps(r, seqs, context_tokens)
    gain = float(r)
    cost = draft_seconds if callable(draft_seconds) else lambda _k: draft_seconds
    for k, a in enumerate(sorted((a for row in lagged for a in survival(row)), reverse=True), start=1):
        gain += a
        if gain / (1.0 / table.sps(r + k, seqs, context_tokens) + cost(k)) > plain * (1.0 + min_gain):
            return True
    return False


class Planner(ABC):
    """Per-round verify-length policy; may keep per-request state until release()."""

    @abstractmethod
    def plan(self, request_ids: Sequence[str | int], conf: Sequence[Sequence[float]],
             extra_tokens: int = 0, context_tokens: int | None = None) -> list[int]:
        """Verify lengths l_r (0..len(conf[r])) for this round's requests; extra_tokens: other
        tokens (prefill) sharing this round's verify pass; context_tokens: the requests' cached
        tokens in all (None: unknown)."""

    def should_draft(self, request_ids: Sequence[str | int], extra_tokens: int = 0,
                     context_tokens: int | None = None) -> bool:
        """Whether to run the drafter this round at all (asked before drafting)."""
        return True

    def num_drafts(self, request_ids: Sequence[str | int], max_drafts: int, extra_tokens: int = 0,
                   context_tokens: int | None = None) -> int:
        """How many drafts per request this round can use (asked before drafting; default all)."""
        return max_drafts

    def observe(self, request_id: str | int, verified: int, accepted: int) -> None:
        """This round's outcome for a request: of the `verified` drafts planned, the first `accepted`
        survived (no-op for planners that do not learn from outcomes)."""

    def release(self, request_id: str | int) -> None:
        """Forget any state kept for a finished request (no-op for stateless planners)."""


class FixedPlanner(Planner):
    """Verify every draft (DFlash / n-gram baselines, static mode)."""

    def plan(self, request_ids: Sequence[str | int], conf: Sequence[Sequence[float]],
             extra_tokens: int = 0, context_tokens: int | None = None) -> list[int]:
        """l_r = len(conf[r])."""
        _check_batch(request_ids, conf)
        return plan_fixed([len(row) for row in conf])


class ThresholdPlanner(Planner):
    """Truncate each request's block at its first confidence below a fixed threshold."""

    def __init__(self, threshold: float = 0.5) -> None:
        """threshold in [0, 1]."""
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold

    def plan(self, request_ids: Sequence[str | int], conf: Sequence[Sequence[float]],
             extra_tokens: int = 0, context_tokens: int | None = None) -> list[int]:
        """l_r = number of leading drafts with c >= threshold."""
        _check_batch(request_ids, conf)
        return plan_threshold(conf, self.threshold)


class ThroughputPlanner(Planner):
    """Maximise expected tokens/s against a measured SPS table (lagged top-K or Algorithm 1)."""

    def __init__(self, table: SPSTable | None, variant: str = "lagged", lag: int = 2,
                 draft_seconds: dict[int, float] | None = None, probe_every: int = 8,
                 prior: Sequence[float] | None = None, idle_probe_every: int = 32,
                 min_gain: float = 0.0, outlook_weight: float = 0.25,
                 draft_seconds_one: dict[int, float] | None = None, block_size: int = 0,
                 backoff: bool = True, measured_weight: float = 8.0) -> None:
        """variant in {"lagged", "algorithm1", "auto"} (auto: algorithm1 in rounds of one request and no
        prefill, lagged in the others); lag = rounds between a confidence row and its use.

        draft_seconds: measured time of one drafting pass per batch size. With it, the drafter is
        skipped in rounds where, by each request's outlook, that time and the SPS table, no verify
        budget beats plain decoding; a request that has gone `probe_every` rounds without drafts
        makes the round draft anyway, so its outlook stays current. A request's outlook is a moving
        average of the prefix survival of its drafted rounds (each new row weighs `outlook_weight`,
        starting from the prior): one round's confidences say little about the next round's, and a
        skip lasts until the next probe, so deciding on the latest row alone skipped drafting after
        every unlucky round even on text where drafting pays.

        prior: prefix survival per draft position (a_1 >= a_2 >= ...) that stands in for a request's
        confidences until it has its own: the rates measured on the drafter's held-out calibration
        logs (sts.json "survival_rate"). Fixed before any request runs, so using it is lossless and
        keeps seeded runs reproducible. Without one, a new request is assumed to keep every draft
        (survival 1) and always drafts. Where even the prior cannot pay at the round's load (a long
        batch: every draft costs more than a typical one brings), probes come only every
        `idle_probe_every` rounds: a probe is a full drafting pass, and most find nothing to verify.

        draft_seconds_one and block_size: the same rounds with one draft instead of block_size; with
        them a round's cost follows its lagged budget (num_drafts), not the whole block's.

        backoff: a probe after which speculation still cannot pay doubles the request's probe interval,
        up to `idle_probe_every`; a round where it pays resets it. On text where the drafter fails,
        probes at a fixed interval cost a drafting pass each and find nothing.

        measured_weight: the drafter's confidences are calibrated on its training mix; on other text
        they can forecast more survival than the request's drafts achieve (or less). The planner counts,
        per request, the drafts its verified rounds tested (a round tests drafts 1..min(l, accepted + 1))
        against the sum of their confidences, and scales the confidences it plans with (outlook, lagged
        rows) by (survived + w) / (forecast + w), w = measured_weight drafts of pseudo-count (a new
        request starts at 1; 0 turns the correction off). Past rounds only, so it is lossless.

        min_gain: speculation (drafting, and a lagged verify budget) must beat plain decoding by this
        fraction of expected tokens/s. The SPS table and drafting times are measurements with errors of
        several percent on a shared host; near break-even, an error-free zero gain is a real loss (the
        costs are certain, the gain is a forecast), so a margin keeps speculation from hurting there.
        """
        if table is None:
            raise ValueError("the throughput planner needs a profiled SPS table (got None)")
        if variant not in choices(ThroughputVariant):
            raise ValueError(f"unknown throughput variant {variant!r}; choose from {choices(ThroughputVariant)}")
        if lag < 1:
            raise ValueError(f"lag must be >= 1 round, got {lag}")
        if probe_every < 1 or idle_probe_every < probe_every:
            raise ValueError(f"probe_every must be >= 1 round and idle_probe_every >= probe_every, "
                             f"got {probe_every} and {idle_probe_every}")
        self.table, self.variant, self.lag, self.probe_every = table, variant, lag, probe_every
        self.idle_probe_every = idle_probe_every
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
        self.min_gain = min_gain
        if not 0.0 < outlook_weight <= 1.0:
            raise ValueError(f"outlook_weight must be in (0, 1], got {outlook_weight}")
        self.outlook_weight = outlook_weight
        self._outlook: dict[str | int, list[float]] = {}  # request id -> averaged prefix survival
        self._width = 0  # the widest block asked for (num_drafts): history rows are this long
        self._round_budget: tuple = (None, None)  # (round key, lagged budget) from num_drafts, for plan()
        self.prior = _conditional(prior) if prior else None
        self.draft_table = dict(sorted((draft_seconds or {}).items()))
        self.draft_one = dict(sorted((draft_seconds_one or {}).items()))  # rounds of one draft
        self.block_size = block_size  # the drafts of a whole block (draft_seconds' rounds)
        # request id -> confidence rows of its last `lag` rounds, oldest first
        self._history: dict[str | int, deque[list[float]]] = {}
        self._undrafted: dict[str | int, int] = {}  # request id -> rounds since it last drafted
        self.backoff = backoff
        self._backoff: dict[str | int, int] = {}  # request id -> doublings of its probe interval
        self._probed: set[str | int] = set()  # requests whose last drafted round was a probe
        if measured_weight < 0:
            raise ValueError(f"measured_weight must be >= 0, got {measured_weight}")
        self.measured_weight = measured_weight
        self._row: dict[str | int, list[float]] = {}  # request id -> this round's confidence row (for observe)
        self._tested: dict[str | int, list[float]] = {}  # request id -> [drafts survived, their forecast]

    def draft_seconds(self, num_requests: int, num_drafts: int | None = None) -> float | None:
        """Drafting time for a batch: linear between measured sizes, proportional beyond the largest.
        With num_drafts below the block (and the one-draft times measured), linear between a round of
        one draft and a whole block: the heads run per draft, the backbone once."""
        whole = self._interpolate(self.draft_table, num_requests)
        if whole is None or num_drafts is None or not self.draft_one or self.block_size <= 1 \
                or num_drafts >= self.block_size:
            return whole
        one = self._interpolate(self.draft_one, num_requests)
        return one + (whole - one) * (max(num_drafts, 1) - 1) / (self.block_size - 1)

    @staticmethod
    def _interpolate(pts: dict[int, float], num_requests: int) -> float | None:
        if not pts:
            return None
        if num_requests in pts:
            return pts[num_requests]
        sizes = list(pts)
        lo = max((n for n in sizes if n < num_requests), default=None)
        hi = min((n for n in sizes if n > num_requests), default=None)
        if lo is None:
            return pts[hi]
        if hi is None:
            return pts[lo] * num_requests / lo
        return pts[lo] + (pts[hi] - pts[lo]) * (num_requests - lo) / (hi - lo)

    def _prior_row(self, n: int) -> list[float] | None:
        """The prior's conditional confidences for n drafts (its last value repeated past its end)."""
        if self.prior is None:
            return None
        return [self.prior[min(k, len(self.prior) - 1)] for k in range(n)]

    def should_draft(self, request_ids: Sequence[str | int], extra_tokens: int = 0,
                     context_tokens: int | None = None) -> bool:
        """Draft unless speculation cannot pay this round (see speculation_pays), judged by each request's
        outlook scaled by its measured survival. A new request is judged by the prior (with no prior, or
        no measured drafting time, the round drafts). A request that has gone its probe interval without
        drafts makes the round draft anyway, so its confidences stay current: `probe_every` rounds,
        doubled after each probe that left speculation unpaying (backoff) up to `idle_probe_every`, which
        is also the interval where the prior cannot pay at this load."""
        r = len(request_ids)
        if self.draft_seconds(r) is None:
            return True

        def t(budget: int) -> float:  # a round drafts min(block, budget) per request
            return self.draft_seconds(r, min(budget, self.block_size or budget))

        latest = []
        for rid in request_ids:
            outlook = self._outlook.get(rid)
            latest.append(self._scaled(rid, _conditional(outlook)) if outlook else self.prior)  # None: draft
        if any(row is None for row in latest) or speculation_pays(latest, self.table, t, extra_tokens,
                                                                  context_tokens, self.min_gain):
            for rid in request_ids:
                self._undrafted[rid] = 0
                self._backoff.pop(rid, None)
                self._probed.discard(rid)
            return True
        for rid in request_ids:  # a probe that left speculation unpaying: wait longer for the next
            if rid in self._probed:
                self._probed.discard(rid)
                if self.backoff:
                    self._backoff[rid] = self._backoff.get(rid, 0) + 1
        idle = [self._undrafted.get(rid, 0) + 1 for rid in request_ids]  # rounds without drafts
        backed_off = [self.probe_every << min(self._backoff.get(rid, 0), 30) for rid in request_ids]
        due = max(idle) >= self.idle_probe_every or any(i >= b for i, b in zip(idle, backed_off)) and (
            self.prior is None or speculation_pays([self.prior] * r, self.table, t, extra_tokens, context_tokens,
                                                   self.min_gain))
        if due:
            for rid in request_ids:
                self._undrafted[rid] = 0
                self._probed.add(rid)
            return True
        for rid in request_ids:
            self._undrafted[rid] = self._undrafted.get(rid, 0) + 1
        return False

    def plan(self, request_ids: Sequence[str | int], conf: Sequence[Sequence[float]],
             extra_tokens: int = 0, context_tokens: int | None = None) -> list[int]:
        """Verify lengths for this round; conf is also recorded for later rounds' lagged budgets."""
        _check_batch(request_ids, conf)
        for rid, row in zip(request_ids, conf):
            self._update_outlook(rid, row)
            self._row[rid] = [float(c) for c in row]
        round_key, budget = self._round_budget
        self._round_budget = (None, None)
        if self._plans_current(request_ids, extra_tokens):  # this round's rows, scaled by past rounds only
            lengths = plan_algorithm1([self._scaled(rid, row) for rid, row in zip(request_ids, conf)], self.table,
                                      early_stop=True, extra_tokens=extra_tokens, context_tokens=context_tokens)
        else:
            lagged = self._lagged_rows(request_ids, [len(row) for row in conf])
            lengths = plan_lagged_topk(conf, lagged, self.table, extra_tokens, context_tokens, self.min_gain,
                                       budget if round_key == (tuple(request_ids), extra_tokens, context_tokens)
                                       else None)
        for rid, row in zip(request_ids, conf):
            self._history.setdefault(rid, deque(maxlen=self.lag)).append(self._widened(rid, row))
        return lengths

    def num_drafts(self, request_ids: Sequence[str | int], max_drafts: int, extra_tokens: int = 0,
                   context_tokens: int | None = None) -> int:
        """The lagged variant's verify budget is fixed before the round's drafts exist, and no request
        can be given more drafts than the budget: drafting past it would only be thrown away. Where
        the budget is 0 (a round the planner drafts to refresh confidences), the whole block."""
        self._width = max(self._width, max_drafts)
        if self._plans_current(request_ids, extra_tokens):
            return max_drafts
        lagged = self._lagged_rows(request_ids, [max_drafts] * len(request_ids))
        budget = lagged_budget(lagged, self.table, max_drafts * len(request_ids), extra_tokens, context_tokens,
                               self.min_gain)
        # plan() of this round finds the same budget (its cap, the drafts made, is at least K): keep it
        self._round_budget = ((tuple(request_ids), extra_tokens, context_tokens), budget)
        return min(max_drafts, budget) if budget else max_drafts

    def _plans_current(self, request_ids: Sequence[str | int], extra_tokens: int) -> bool:
        """Whether this round runs Algorithm 1 on its own confidences rather than the lagged budget: always
        for the algorithm1 variant; for auto, a round of one request with no prefill sharing its pass.
        A round's batch is fixed before it drafts, so choosing by it keeps either rule lossless."""
        return self.variant == ThroughputVariant.ALGORITHM1 or (
            self.variant == ThroughputVariant.AUTO and len(request_ids) == 1 and not extra_tokens)

    def _lagged_rows(self, request_ids: Sequence[str | int], widths: Sequence[int]) -> list[Sequence[float]]:
        """Each request's confidence row from `lag` rounds back, or a value-free stand-in."""
        lagged: list[Sequence[float]] = []
        for rid, width in zip(request_ids, widths):
            hist = self._history.get(rid)
            if hist is not None and len(hist) == self.lag:
                lagged.append(self._scaled(rid, hist[0]))
            else:
                # No history `lag` rounds back (a new request). Substituting the current row would
                # break the causal barrier: the global argmax could then let a_{k+1} (a function of
                # the sampled x_k) decide whether x_k is verified -- the bias of
                # docs/method.md#the-counterexample. Instead use
                # a value-free prior: the drafter's measured survival rates, or, without them,
                # survival 1 at every position (optimistic: it may over-verify for `lag` rounds,
                # whereas 0 would force plain decoding on every new request's first rounds).
                lagged.append(self._prior_row(width) or [1.0] * width)
        return lagged

    def _widened(self, rid: str | int, row: Sequence[float]) -> list[float]:
        """A round's confidence row as history: a round that drafted fewer than the widest block
        (num_drafts) continues it with the request's outlook, so a later budget is not capped at
        this round's width. A history row is read `lag` rounds later, when everything known in this
        round is fixed, so continuing it with the outlook stays value-free."""
        out = [float(c) for c in row]
        if len(out) >= self._width:
            return out
        outlook = self._outlook.get(rid)
        tail = _conditional(outlook) if outlook else self._prior_row(self._width) or [1.0] * self._width
        tail = tail + [tail[-1]] * (self._width - len(tail))
        return out + tail[len(out):self._width]

    def _update_outlook(self, rid: str | int, row: Sequence[float]) -> None:
        """Fold one drafted round's confidences into the request's averaged prefix survival."""
        now = survival(row)
        if not now:
            return
        old = self._outlook.get(rid) or (survival(self._prior_row(len(now))) if self.prior is not None else now)
        for k in range(len(old), len(now)):  # at least as long as this row: the prior's rates beyond it
            old = old + [old[-1] * (self.prior[min(k, len(self.prior) - 1)] if self.prior else 1.0)]
        w = self.outlook_weight
        new = [(1.0 - w) * a + w * b for a, b in zip(old, now)]
        for c in _conditional(old)[len(now):]:  # positions this round did not draft keep their rates
            new.append(new[-1] * c)
        self._outlook[rid] = new

    def observe(self, request_id: str | int, verified: int, accepted: int) -> None:
        """Count the drafts this round tested against their confidences (see measured_weight)."""
        row = self._row.pop(request_id, None)
        if not row or verified <= 0:
            return
        tested = min(verified, accepted + 1, len(row))
        counts = self._tested.setdefault(request_id, [0.0, 0.0])
        counts[0] += min(accepted, tested)
        counts[1] += sum(row[:tested])

    def measured_scale(self, request_id: str | int) -> float:
        """(drafts survived + w) / (their confidences' sum + w): 1 until the request has tested drafts."""
        survived, forecast = self._tested.get(request_id, (0.0, 0.0))
        w = self.measured_weight
        return 1.0 if w == 0 else (survived + w) / (forecast + w)

    def _scaled(self, rid: str | int, row: Sequence[float]) -> list[float]:
        """A confidence row scaled by the request's measured survival (each value capped at 1)."""
        g = self.measured_scale(rid)
        return [min(1.0, g * float(c)) for c in row]

    def release(self, request_id: str | int) -> None:
        """Drop the request's confidence history."""
        for state in (self._history, self._outlook, self._undrafted, self._backoff, self._row, self._tested):
            state.pop(request_id, None)
        self._probed.discard(request_id)


def make_planner(name: str, table: SPSTable | None = None, **kw: object) -> Planner:
    """Build a planner by name ("fixed", "threshold", "throughput"); extra kwargs go to its constructor."""
    if name not in choices(PlannerKind):
        raise ValueError(f"unknown planner {name!r}; choose from {', '.join(choices(PlannerKind))}")
    if name == PlannerKind.FIXED:
        return FixedPlanner(**kw)  # type: ignore[arg-type]
    if name == PlannerKind.THRESHOLD:
        return ThresholdPlanner(**kw)  # type: ignore[arg-type]
    if table is None:
        raise ValueError("planner 'throughput' needs a profiled SPS table (table=None given)")
    return ThroughputPlanner(table, **kw)  # type: ignore[arg-type]
