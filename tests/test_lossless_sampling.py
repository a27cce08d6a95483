"""Lossless sampling, end to end: with temperature > 0, speculative decoding through LLMEngine draws
length-L continuations from exactly the target's own distribution, whatever the drafter proposes.

A tiny random Llama with a 6-token vocabulary makes the target's distribution over all V**L
continuations of a fixed prompt enumerable (teacher-forced forwards of the Hugging Face reference
model, warped with the engine's own warp_probs). Thousands of seeded requests are generated in
large batches and compared with it by a chi-square goodness-of-fit test; every seed is fixed, so each
p-value is deterministic. Both sampling paths are checked: unseeded requests (rejection sampling, drawn
from the global generator, itself seeded) and seeded ones (per-position keyed draws, sampling/keyed.py).
Negative controls break the acceptance rule on purpose and must be rejected, which shows the test has
the power to see a wrong rule.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from dspark.drafters import DrafterConfig, DSparkDrafter
from dspark.engine import llm_engine
from dspark.engine.llm_engine import LLMEngine
from dspark.config import CacheConfig, EngineConfig, SchedulerConfig
from dspark.models.loader import load_decoder
from dspark.sampling import rejection
from dspark.sampling.rejection import Acceptance
from dspark.sampling.sampler import sample, warp_probs
from dspark.sampling_params import SamplingParams
from dspark.speculative.block_drafter import BlockDrafterProposer
from dspark.speculative.cost_table import SPSTable
from dspark.speculative.planners import ThresholdPlanner, ThroughputPlanner
from dspark.speculative.proposer import Proposal

VOCAB = 6
LENGTH = 3  # generated tokens: the first from prefill, the rest from one or two verify rounds
PROMPT = [2, 4, 3]
TEMPERATURE = 0.7
GAMMA = 3  # drafts per round: one round can decide both remaining tokens, rejections at either
NUM_SAMPLES = 3000
BATCH = 1000  # concurrent requests per engine step
PASS_LEVEL = 1e-3  # a correct rule must not be rejected at this level
FAIL_LEVEL = 1e-6  # a broken rule must be rejected at this level


@pytest.fixture(autouse=True)
def one_thread():
    """Run single-threaded: the engine's many tiny per-request ops (softmax of [l+1, V] rows) open an
    OpenMP region each, which costs milliseconds apiece when the two shared cores are contended."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- the target and its exact distribution ---------------------------------------------------------
@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(dspark Decoder, HF reference model) of a random 3-layer Llama over VOCAB tokens.

    The LM head is scaled up so per-step distributions are peaked but not degenerate (entropy about
    1.1-1.3 nats of a possible 1.79 at TEMPERATURE).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB, rms_norm_eps=1e-6,
                      bos_token_id=0, eos_token_id=1, tie_word_embeddings=False)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            else:
                p.normal_(0.0, 0.3 if "lm_head" in name else 0.1)
    path = tmp_path_factory.mktemp("tiny_vocab_llama")
    hf.save_pretrained(str(path))
    return load_decoder(path), hf


def exact_distribution(hf, temperature: float, top_k: int = -1) -> torch.Tensor:
    """P(x1..xL | PROMPT) for every continuation, [V**L] fp64, cell index = digits x1..xL in base V.

    One teacher-forced forward over all V**(L-1) prefixes gives every conditional needed.
    """
    prefixes = list(itertools.product(range(VOCAB), repeat=LENGTH - 1))
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + list(c) for c in prefixes])).logits  # [V**(L-1), P+L-1, V]
    p0 = len(PROMPT) - 1
    steps = [warp_probs(logits[:, p0 + j], temperature, top_k).double() for j in range(LENGTH)]  # L x [.., V]
    steps = [s / s.sum(-1, keepdim=True) for s in steps]  # fp32 softmax rows renormalized in fp64
    probs = torch.empty(VOCAB ** LENGTH, dtype=torch.float64)
    for i, cont in enumerate(itertools.product(range(VOCAB), repeat=LENGTH)):
        row = prefixes.index(cont[: LENGTH - 1]) if LENGTH > 1 else 0  # the prefix row holding x1..x_{L-1}
        probs[i] = math.prod(float(steps[j][row, cont[j]]) for j in range(LENGTH))
    return probs


def cell(tokens: list[int]) -> int:
    return sum(t * VOCAB ** (LENGTH - 1 - j) for j, t in enumerate(tokens))


# --- chi-square goodness of fit (no scipy) ----------------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of counts [C] against cell probabilities probs [C].

    Cells expecting fewer than min_expected samples are pooled into one cell (merged into the smallest
    kept cell if the pool itself is still too small). Zero-probability cells must be empty: the caller
    checks them, as they would make the statistic infinite.
    """
    counts, probs = counts.double(), probs.double()
    n = float(counts.sum())
    expected = probs * n
    order = torch.argsort(expected, descending=True)
    obs, exp = counts[order], expected[order]
    keep = int((exp >= min_expected).sum())
    obs_k, exp_k = list(obs[:keep].tolist()), list(exp[:keep].tolist())
    pool_o, pool_e = float(obs[keep:].sum()), float(exp[keep:].sum())
    if pool_e >= min_expected:
        obs_k.append(pool_o)
        exp_k.append(pool_e)
    elif pool_e > 0 or pool_o > 0:
        obs_k[-1] += pool_o
        exp_k[-1] += pool_e
    o, e = torch.tensor(obs_k, dtype=torch.float64), torch.tensor(exp_k, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    df = len(obs_k) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


def test_chi_square_helper_matches_tables() -> None:
    # chi2 critical values: df=1 at 0.05 is 3.841; df=10 at 0.01 is 23.209
    def p_of(stat: float, df: int) -> float:
        return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                             torch.tensor(stat / 2, dtype=torch.float64)))

    assert p_of(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert p_of(23.209, 10) == pytest.approx(0.01, abs=1e-4)
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0])
    stat, df, p = chi_square(torch.tensor([50.0, 25.0, 25.0, 0.0]), probs)
    assert (stat, df, p) == (0.0, 2, 1.0)


# --- proposers -------------------------------------------------------------------------------------
class StubTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i)) for i in ids)


class FixedDistributionProposer:
    """Drafts GAMMA tokens from a fixed per-position distribution q (unrelated to the target, one
    token never drafted) and reports q as the draft distribution, so accept_sampled sees p_d != p_t."""

    max_drafts = GAMMA
    hidden_layers: tuple[int, ...] = ()

    def __init__(self, seed: int = 7):
        g = torch.Generator().manual_seed(seed)
        q = torch.softmax(2.0 * torch.randn(GAMMA, VOCAB, generator=g), -1)
        q[:, 0] = 0.0
        self.q = q / q.sum(-1, keepdim=True)  # [GAMMA, V]

    def propose(self, seqs, num_drafts=None):
        tokens = [[int(sample(self.q[k : k + 1], s.generator)[0]) for k in range(GAMMA)] for s in seqs]
        return Proposal(tokens=tokens, probs=[self.q.clone() for _ in seqs], confidences=None)

    def observe(self, seq, hidden, start):
        pass

    def release(self, seq):
        pass


class PointMassProposer(FixedDistributionProposer):
    """Deterministic drafts (probs None, like n-gram): the engine must treat them as point masses."""

    def propose(self, seqs, num_drafts=None):
        tokens = [[(s.tokens[-1] + 2 * k + 1) % VOCAB for k in range(GAMMA)] for s in seqs]
        return Proposal(tokens=tokens, probs=[None] * len(seqs), confidences=None)


def dspark_proposer(decoder) -> BlockDrafterProposer:
    """A random-weight DSpark drafter (Markov head + confidence head) over the full small vocabulary."""
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(dict(decoder.config.raw), num_layers=1, block_size=GAMMA + 1,
                                   target_layer_ids=(0, 2), markov_rank=16, confidence_head=True,
                                   draft_vocab_size=None, mask_token_id=VOCAB - 1)
    drafter = DSparkDrafter(cfg, decoder.embed_tokens.weight, decoder.lm_head.weight).eval()
    return BlockDrafterProposer(drafter, max_drafts=GAMMA)


# --- running the engine ----------------------------------------------------------------------------
def generate(decoder, proposer=None, planner=None, *, top_k: int = -1, seed0: int = 0, keyed: bool = False):
    """Counts [V**L] of NUM_SAMPLES continuations of PROMPT, and the engine (for its stats). keyed: request
    i has seed seed0 + i (keyed draws); otherwise no request has a seed (rejection sampling, with the global
    generator seeded by seed0)."""
    torch.manual_seed(seed0)
    config = EngineConfig(cache=CacheConfig(max_total_tokens=16 * (2 * BATCH + 8)),
                          scheduler=SchedulerConfig(max_num_seqs=BATCH, max_num_batched_tokens=len(PROMPT) * BATCH))
    engine = LLMEngine(decoder, StubTokenizer(), config, proposer=proposer, planner=planner)
    for i in range(NUM_SAMPLES):
        engine.add_request(PROMPT, SamplingParams(temperature=TEMPERATURE, top_k=top_k, max_tokens=LENGTH,
                                                  seed=seed0 + i if keyed else None, ignore_eos=True))
    counts = torch.zeros(VOCAB ** LENGTH, dtype=torch.float64)
    done = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert len(out.token_ids) == LENGTH and out.finish_reason == "length"
                counts[cell(out.token_ids)] += 1
                done += 1
    assert done == NUM_SAMPLES
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    return counts, engine


def fit(counts: torch.Tensor, exact: torch.Tensor) -> float:
    """p-value of the fit; also: nothing was ever generated where the target has zero probability."""
    assert float(counts[exact == 0].sum()) == 0.0, "generated a continuation the target cannot produce"
    return chi_square(counts, exact)[2]


@pytest.fixture(scope="module")
def exact(target):
    _, hf = target
    return {k: exact_distribution(hf, TEMPERATURE, k) for k in (-1, 4)}


def test_exact_distribution_is_nontrivial(exact) -> None:
    for probs in exact.values():
        assert float(probs.sum()) == pytest.approx(1.0, abs=1e-9)
        assert float(probs.max()) < 0.5  # not degenerate
        assert int((probs * NUM_SAMPLES >= 5).sum()) >= 20  # many cells carry the test
    assert int((exact[4] == 0).sum()) > 0  # top-k forbids some continuations


@pytest.mark.parametrize("keyed", [False, True], ids=["unseeded", "seeded"])
def test_plain_decoding_matches_exact(target, exact, keyed) -> None:
    counts, _ = generate(target[0], keyed=keyed)
    assert fit(counts, exact[-1]) > PASS_LEVEL


SPEC_CASES = {
    "dspark": dict(proposer="dspark", top_k=-1),
    "dspark-topk": dict(proposer="dspark", top_k=4),
    "dspark-threshold-planner": dict(proposer="dspark", top_k=-1, planner=0.5),
    "dspark-algorithm1-planner": dict(proposer="dspark", top_k=-1, planner="algorithm1"),
    "fixed-q": dict(proposer="fixed", top_k=-1),
    "fixed-q-topk": dict(proposer="fixed", top_k=4),
    "point-mass": dict(proposer="point", top_k=-1),
    # seeded: keyed draws, drafts coupled to the verification's noise (the peeking planner cannot bias them)
    "seeded-dspark-topk": dict(proposer="dspark", top_k=4, keyed=True),
    "seeded-fixed-q-peeking-planner": dict(proposer="peeking", top_k=-1, planner=0.5, keyed=True),
}


def make_case_planner(kind: float | str | None):
    """A threshold (a number), the throughput planner's algorithm1 variant, or none. Its table prices each
    token of a step at 1e-4 of a one-token step: in these steps of BATCH requests a draft then pays only
    if its survival is above ~0.1-0.3, so some are cut."""
    if kind is None:
        return None
    if kind == "algorithm1":
        sizes = range(1, BATCH * (1 + GAMMA) + 1)
        return ThroughputPlanner(SPSTable({n: 1.0 / (1.0 + 1e-4 * (n - 1)) for n in sizes}), variant="algorithm1")
    return ThresholdPlanner(kind)


def make_proposer(kind: str, decoder):
    return {"dspark": lambda: dspark_proposer(decoder), "fixed": FixedDistributionProposer,
            "point": PointMassProposer, "peeking": PeekingProposer}[kind]()


@pytest.mark.parametrize("name", list(SPEC_CASES))
def test_speculative_sampling_matches_exact(name, target, exact) -> None:
    case = SPEC_CASES[name]
    decoder = target[0]
    planner = make_case_planner(case.get("planner"))
    counts, engine = generate(decoder, make_proposer(case["proposer"], decoder), planner, top_k=case["top_k"],
                              seed0=10_000, keyed=case.get("keyed", False))
    st = engine.stats
    # not vacuous: drafts were verified, some accepted, some rejected (and the planner cut windows)
    assert st.verified > 0 and 0 < st.accepted < st.verified, st
    if planner is not None:
        assert st.verified < st.drafted, st
    p = fit(counts, exact[case["top_k"]])
    assert p > PASS_LEVEL, f"{name}: chi-square rejects the target distribution (p = {p:.3g})"


# --- negative controls: a broken acceptance rule must be caught -----------------------------------
def _always_accept(draft_tokens, draft_probs, target_probs, generator):
    """Broken: keep every draft, then the bonus token (no min(1, p_t/p_d) test at all)."""
    l = len(draft_tokens)
    bonus = int(sample(target_probs[l : l + 1].double(), generator)[0])
    return Acceptance(tokens=[int(t) for t in draft_tokens] + [bonus], num_accepted=l)


def _target_instead_of_residual(p_target, p_draft):
    """Broken: after a rejection resample p_t itself instead of normalize(max(p_t - p_d, 0))."""
    return p_target.double() / p_target.double().sum()


BROKEN = {
    "always-accept": (llm_engine, "accept_sampled", _always_accept),
    "no-residual": (rejection, "residual_probs", _target_instead_of_residual),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_acceptance_rule_is_detected(name, target, exact, monkeypatch) -> None:
    module, attr, broken = BROKEN[name]
    monkeypatch.setattr(module, attr, broken)
    counts, _ = generate(target[0], FixedDistributionProposer(), seed0=10_000)
    stat, df, p = chi_square(counts, exact[-1])
    assert p < FAIL_LEVEL, f"{name}: the broken rule went unnoticed (chi2 = {stat:.1f}, df = {df}, p = {p:.3g})"


class PeekingProposer(FixedDistributionProposer):
    """Broken: reports confidence 1 for drafts in {1, 2} and 0 otherwise, so a threshold planner decides
    whether x_k is verified from x_k itself (the losslessness rule in dspark/spec/planners.py)."""

    def propose(self, seqs, num_drafts=None):
        p = super().propose(seqs)
        conf = [[1.0 if x in (1, 2) else 0.0 for x in row] for row in p.tokens]
        return Proposal(tokens=p.tokens, probs=p.probs, confidences=conf)


@pytest.mark.parametrize("planner", [0.5, "algorithm1"], ids=["threshold", "algorithm1"])
def test_window_that_peeks_at_the_draft_is_detected(planner, target, exact) -> None:
    """The test also sees a bias introduced by the verify-length path rather than by acceptance."""
    counts, engine = generate(target[0], PeekingProposer(), make_case_planner(planner), seed0=10_000)
    assert engine.stats.verified < engine.stats.drafted
    stat, df, p = chi_square(counts, exact[-1])
    assert p < FAIL_LEVEL, f"a draft-dependent window went unnoticed (chi2 = {stat:.1f}, df = {df}, p = {p:.3g})"
