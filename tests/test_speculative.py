"""Every proposer and every planner is lossless: greedy output equals plain decoding token for token,
stops inside an accepted prefix land exactly where plain decoding puts them."""
from __future__ import annotations

import json

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.config import EngineConfig
from dspark.drafters import DrafterConfig, DSparkDrafter
from dspark.models.loader import load_decoder
from dspark.speculative.cost_table import SPSTable

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7],  # repetitive: n-gram drafts get accepted
    [8, 8, 4000, 12, 13],
    [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87],
]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def save_random_drafter(target_dir, out_dir, *, dspark: bool, seed: int = 0):
    """A random-weight drafter for the tiny target (acceptance is low, the plumbing is exercised)."""
    dec = load_decoder(target_dir)
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(json.loads((target_dir / "config.json").read_text()), num_layers=1,
                                   block_size=4, target_layer_ids=(0, 2), markov_rank=16 if dspark else 0,
                                   confidence_head=dspark)
    DSparkDrafter(cfg, dec.embed_tokens.weight, dec.lm_head.weight).save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def drafters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    return {"DSPARK": save_random_drafter(tiny_llama_dir, root / "dspark", dspark=True),
            "DFLASH": save_random_drafter(tiny_llama_dir, root / "dflash", dspark=False)}


@pytest.fixture(scope="module")
def sps_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("sps") / "sps.json"
    # a jagged curve with a cliff after 2 tokens, like the LM-head kernel switch on this CPU
    sps = {str(b): (100.0 if b == 1 else 60.0 if b == 2 else 55.0 - b) for b in range(1, 40)}
    path.write_text(json.dumps({"version": 1, "model": "tiny", "dtype": "float32", "threads": 1,
                                "torch": torch.__version__, "device": "cpu", "sps": sps}))
    return path


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_mb=8)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


CASES = [
    dict(speculative_algorithm="NGRAM"),
    dict(speculative_algorithm="NGRAM", num_speculative_tokens=2),
    dict(speculative_algorithm="DFLASH"),
    dict(speculative_algorithm="DSPARK", planner="fixed"),
    dict(speculative_algorithm="DSPARK", planner="threshold", threshold=0.5),
    dict(speculative_algorithm="DSPARK", planner="throughput"),
    dict(speculative_algorithm="DSPARK", planner="throughput", throughput_variant="algorithm1"),
    dict(speculative_algorithm="DSPARK", planner="throughput", throughput_variant="lagged"),
    dict(speculative_algorithm="DSPARK", verify_mode="static"),
    dict(speculative_algorithm="DSPARK", verify_mode="cap-accept"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()))
def test_greedy_is_lossless(case, tiny_llama_dir, drafters, sps_file, plain):
    kw = dict(case)
    algo = kw["speculative_algorithm"]
    if algo in drafters:
        kw["draft_model"] = drafters[algo]
    if EngineConfig.from_kwargs(**kw).speculative.plans_throughput:
        kw["sps_table"] = sps_file  # read only by the throughput planner
    llm = LLM(tiny_llama_dir, kv_cache_mb=8, **kw)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    for o in outs:
        assert sum(o.accept_lengths) == len(o.token_ids) - 1  # the first token comes from prefill
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks


def test_skipped_drafting_is_lossless(tiny_llama_dir, drafters, sps_file, plain):
    """A drafting pass that (by its recorded time) never pays: the planner skips the drafter, except
    every probe_every-th round, and the output is still plain decoding's."""
    llm = LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="DSPARK", draft_model=drafters["DSPARK"],
              sps_table=sps_file)
    llm.engine.planner.draft_table = {1: 10.0}  # far slower than any target step
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    st = llm.engine.stats
    assert st.skipped_drafting > 0 and 0 < st.drafted < st.rounds * 4
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks


def test_ngram_accepts_on_repetitive_text(tiny_llama_dir, plain):
    llm = LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="NGRAM")
    out = llm.generate([PROMPTS[0]], GREEDY)[0]
    assert out.token_ids == plain[0]
    assert llm.engine.stats.accepted > 0


def test_stops_inside_an_accepted_prefix(tiny_llama_dir, plain):
    ngram = LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="NGRAM")
    base = LLM(tiny_llama_dir, kv_cache_mb=8)
    for n in range(1, 10):  # every truncation point inside multi-token rounds
        p = SamplingParams(max_tokens=n, ignore_eos=True)
        assert ngram.generate([PROMPTS[0]], p)[0].token_ids == plain[0][:n]
    stop_tok = plain[0][6]
    p = SamplingParams(max_tokens=24, stop_token_ids=[stop_tok], ignore_eos=True)
    got, want = ngram.generate([PROMPTS[0]], p)[0], base.generate([PROMPTS[0]], p)[0]
    assert (got.token_ids, got.finish_reason) == (want.token_ids, "stop")


def test_seeded_sampling_reproducible(tiny_llama_dir, drafters, sps_file):
    llm = LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="DSPARK", draft_model=drafters["DSPARK"],
              sps_table=sps_file)
    p = SamplingParams(max_tokens=16, temperature=0.8, top_k=40, top_p=0.95, seed=3, ignore_eos=True)
    a = llm.generate(PROMPTS, p)
    b = llm.generate(PROMPTS, p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]


@pytest.mark.parametrize("kw,match", [
    (dict(speculative_algorithm="EAGLE"), "speculative_algorithm"),
    (dict(speculative_algorithm="DSPARK", planner="magic"), "planner"),
    (dict(speculative_algorithm="DSPARK", verify_mode="loose"), "verify_mode"),
    (dict(speculative_algorithm="NGRAM", num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(speculative_algorithm="NONE", num_speculative_tokens=3), "needs speculative_algorithm"),
    (dict(speculative_algorithm="NGRAM", sps_table="t.json"), "only used with speculative_algorithm DSPARK"),
    (dict(speculative_algorithm="DSPARK", planner="fixed", sps_table="t.json"), "only read by the throughput"),
    (dict(speculative_algorithm="DSPARK", throughput_variant="eager"), "throughput_variant"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1"),
    (dict(kv_block_size=16, max_total_tokens=8), "max_total_tokens must be an integer >= 16"),
    (dict(dtype="float8"), "dtype must be one of"),
    (dict(block_size=4), "unknown engine option 'block_size'"),
    (dict(speculative_algorithm="NGRAM", draft_model="x"), "draft_model"),
    (dict(speculative_algorithm="NGRAM", draft_quantization="int4"), "draft_quantization is only used by DSPARK"),
    (dict(speculative_algorithm="DSPARK", draft_quantization="int2"), "draft_quantization must be one of"),
])
def test_bad_speculative_options(tiny_llama_dir, kw, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_llama_dir, **kw)


def test_int4_drafter_is_lossless_and_needs_the_kernels(tiny_llama_dir, drafters, sps_file):
    """draft_quantization="int4": the drafter's projections and head on the 4-bit kernel, greedy output still
    plain decoding's (bf16 target, both planners that verify); where the kernel cannot run, a clear error."""
    from dspark.models import native
    from dspark.models.int4 import Int4Linear

    with pytest.raises(ValueError, match="int4 needs dspark's AVX-512 kernels and a bf16 target"):
        LLM(tiny_llama_dir, dtype="float32", speculative_algorithm="DSPARK", draft_model=drafters["DSPARK"],
            planner="fixed", draft_quantization="int4")
    if native.library() is None:
        pytest.skip(f"dspark's kernels do not run here: {native.why()}")
    plain = [o.token_ids for o in LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_mb=8).generate(PROMPTS, GREEDY)]
    for kw in (dict(planner="fixed"), dict(sps_table=sps_file)):
        llm = LLM(tiny_llama_dir, dtype="bfloat16", kv_cache_mb=8, speculative_algorithm="DSPARK",
                  draft_model=drafters["DSPARK"], draft_quantization="int4", **kw)
        runner = llm.engine.proposer.drafter.runner()
        assert runner._w4 and isinstance(runner.head, Int4Linear) and isinstance(runner.fc, Int4Linear)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain


def test_drafter_mismatch_and_missing(tiny_llama_dir, drafters, tmp_path):
    with pytest.raises(ValueError, match="needs draft_model"):
        LLM(tiny_llama_dir, speculative_algorithm="DSPARK")
    with pytest.raises(FileNotFoundError, match="not a drafter directory"):
        LLM(tiny_llama_dir, speculative_algorithm="DSPARK", draft_model=tmp_path)
    with pytest.raises(ValueError, match="DSpark drafter"):
        LLM(tiny_llama_dir, speculative_algorithm="DFLASH", draft_model=drafters["DSPARK"])
    from dspark.drafters import DSparkDrafter as D

    dec = load_decoder(tiny_llama_dir)
    wrong = D.from_pretrained(drafters["DSPARK"], dec.embed_tokens.weight, dec.lm_head.weight)
    wrong.save_pretrained(tmp_path / "wrong", metadata={"trained_for": {"num_hidden_layers": 30}})
    with pytest.raises(ValueError, match="trained for a 30-layer target"):
        LLM(tiny_llama_dir, speculative_algorithm="DSPARK", draft_model=tmp_path / "wrong", planner="fixed")
    with pytest.raises(ValueError, match="exceeds"):
        LLM(tiny_llama_dir, speculative_algorithm="DSPARK", draft_model=drafters["DSPARK"], num_speculative_tokens=9,
            planner="fixed")


def test_profile_writes_a_usable_table(tiny_llama_dir):
    from dspark.speculative.profile import profile_sps

    # context 16 = one full block: every timed window crosses into a block that truncate() hands back
    table = profile_sps(load_decoder(tiny_llama_dir), [1, 2, 4], context=16, repeats=2, progress=False)
    assert table.max_tokens == 4 and all(table.sps(b) > 0 for b in (1, 2, 3, 4, 8))
    assert table.points_by_seqs == {} and table.context == 16


def test_profile_measures_loaded_steps(tiny_llama_dir, tmp_path):
    from dspark.speculative.profile import EXTRA_TOKENS, default_seq_counts, profile_sps

    assert default_seq_counts(1) == [] and default_seq_counts(8) == [2, 4, 8] and default_seq_counts(12) == [2, 4, 8, 12]
    table = profile_sps(load_decoder(tiny_llama_dir), [1, 2], seq_counts=[2, 3], window=3, context=16, repeats=1,
                        progress=False)
    pts = table.points_by_seqs
    assert sorted(pts) == [2, 3]
    assert sorted(pts[2]) == [2 + e for e in EXTRA_TOKENS if e <= 4] and sorted(pts[3]) == [3 + e for e in EXTRA_TOKENS if e <= 6]
    for curve in pts.values():  # monotone: more tokens never read as faster
        values = [curve[k] for k in sorted(curve)]
        assert all(a >= b for a, b in zip(values, values[1:]))
    assert table.kv_seconds >= 0 and table.context == 16
    path = tmp_path / "sps.json"
    table.save(path)
    assert SPSTable.load(path).points_by_seqs == pts


def test_cached_table_belongs_to_its_cpu(tiny_llama_dir, tmp_path, monkeypatch):
    """Two hosts sharing a $DSPARK_HOME (another CPU model or core count) keep separate SPS tables."""
    import dspark.speculative.profile as prof

    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    decoder = load_decoder(tiny_llama_dir)
    here = prof.table_cache_path(tiny_llama_dir, decoder, 8)
    assert prof.table_cache_path(tiny_llama_dir, decoder, 8) == here
    monkeypatch.setattr(prof, "cpu_identity", lambda: "Another CPU|cores=64|isa=AVX2")
    assert prof.table_cache_path(tiny_llama_dir, decoder, 8) != here


def test_quick_profile_is_a_coarser_grid_and_a_cached_full_table_wins(tiny_llama_dir, tmp_path, monkeypatch):
    """A first start with sps_profile "quick" measures the coarse grid (cached apart from the full
    table); once a full table is cached, quick starts use it."""
    import dspark.speculative.profile as prof

    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    assert prof.quick_sizes(40) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32] and prof.quick_sizes(12) == [*range(1, 9)]
    assert prof.quick_seq_counts(32) == [2, 8, 32]
    decoder = load_decoder(tiny_llama_dir)
    calls = []
    real = prof.profile_sps
    monkeypatch.setattr(prof, "profile_sps", lambda *a, **k: calls.append((a[1], k)) or real(*a, **{**k, "context": 16}))
    quick = prof.load_or_profile(tiny_llama_dir, decoder, 12, max_seqs=4, window=3, progress=False, profile="quick")
    sizes, kw = calls[-1]
    assert sizes == prof.quick_sizes(12) and kw["seq_counts"] == [2, 4] and kw["repeats"] == 1 and kw["light_warmup"]
    assert kw["extra_tokens"] == prof.QUICK_EXTRA_TOKENS and sorted(quick.points_by_seqs) == [2, 4]
    assert prof.load_or_profile(tiny_llama_dir, decoder, 12, max_seqs=4, window=3, profile="quick") is not None
    assert len(calls) == 1  # cached
    full = prof.load_or_profile(tiny_llama_dir, decoder, 12, max_seqs=4, window=3, progress=False)
    assert len(calls) == 2 and calls[-1][0] == prof.default_sizes(12)  # "full" never settles for the quick table
    again = prof.load_or_profile(tiny_llama_dir, decoder, 12, max_seqs=4, window=3, profile="quick")
    assert len(calls) == 2 and again.points == full.points  # the cached full table wins
    with pytest.raises(ValueError, match="sps profile"):
        prof.load_or_profile(tiny_llama_dir, decoder, 12, profile="fast")
    steps = []
    timer = prof._time_step
    monkeypatch.setattr(prof, "_time_step", lambda *a: steps.append(a[2]) or timer(*a))
    for light in (False, True):
        real(decoder, [1, 2, 4], seq_counts=[2], window=3, context=16, repeats=1, progress=False, light_warmup=light)
    jobs = 3 + 4 + 2  # sizes, loaded steps of 2 sequences (0, 1, 2, 4 drafts), the two kv_seconds steps
    assert len(steps) == 2 * jobs + jobs + 3  # full warm-up; light: one step per sequence count + the biggest


def test_drafting_rounds_are_priced_in_the_tables_step_time(tiny_llama_dir, drafters, monkeypatch):
    import types

    from dspark.speculative import profile
    from dspark.speculative.profile import profile_drafting

    decoder = load_decoder(tiny_llama_dir)
    drafter = DSparkDrafter.from_pretrained(drafters["DSPARK"], decoder.embed_tokens.weight, decoder.lm_head.weight)
    alone = profile_drafting(drafter, [1, 2], context=16, repeats=2)
    assert sorted(alone) == [1, 2] and all(t > 0 for t in alone.values())
    # paired with target steps: the round's cost as a fraction of a step, in the table's step time. On a
    # clock where a drafting round takes 3 ticks per request and a target step 2, a round of r requests is
    # 1.5 r steps of whatever the table says a step takes
    clock = types.SimpleNamespace(now=0.0, tick=1.0)

    def perf_counter() -> float:
        clock.now += clock.tick
        return clock.now

    real_draft = type(drafter).draft

    def draft(self, caches, *args, **kw):
        clock.now += 3.0 * len(caches) - clock.tick  # the timer's closing read adds the last tick
        return real_draft(self, caches, *args, **kw)

    monkeypatch.setattr(profile, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(profile, "_time_step", lambda *args, **kw: 2.0)
    monkeypatch.setattr(type(drafter), "draft", draft)
    for table in (SPSTable({1: 1000.0, 2: 900.0}), SPSTable({1: 1.0, 2: 0.9})):
        got = profile_drafting(drafter, [1, 2], decoder=decoder, table=table, context=16, repeats=3)
        assert got == pytest.approx({1: 1.5 / table.sps(1), 2: 3.0 / table.sps(1)})


def test_profile_command_rejects_bad_sizes(capsys):
    from dspark.cli import main

    with pytest.raises(SystemExit) as e:
        main(["profile", "--max-seqs", "0"])
    assert e.value.code == 2 and "argument --max-seqs: must be at least 1, got 0" in capsys.readouterr().err


def test_accepted_drafts_feed_the_drafter_context(tiny_llama_dir, drafters, sps_file, plain):
    """Drafts that are partly right (the plain continuation, then junk): outputs stay lossless, drafts get
    accepted, and the drafter's context always covers exactly the committed positions."""
    llm = LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="DSPARK", draft_model=drafters["DSPARK"],
              planner="fixed")
    proposer = llm.engine.proposer
    real_propose = proposer.propose
    truth = {tuple(p): p + out for p, out in zip(PROMPTS, plain)}

    def oracle(seqs, num_drafts=None):
        proposal = real_propose(seqs, num_drafts)
        for seq, toks in zip(seqs, proposal.tokens):
            assert proposer._caches[seq.request_id].length == seq.num_cached == seq.num_tokens - 1
            full = truth[tuple(seq.prompt_token_ids)]
            right = full[seq.num_tokens : seq.num_tokens + 2]
            toks[: len(right)] = right
        return proposal

    proposer.propose = oracle
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert llm.engine.stats.accepted >= len(PROMPTS) * 2


def test_sts_path_offset_replaces_the_checkpoints_own(tiny_llama_dir, drafters, tmp_path):
    import shutil

    from safetensors.torch import load_file

    src = tmp_path / "d"
    shutil.copytree(drafters["DSPARK"], src)
    base = load_file(str(src / "model.safetensors"))["confidence_head.proj.bias"]
    (src / "sts.json").write_text(json.dumps({"temperatures": [1.0] * 4, "logit_offset": 0.5}))
    (tmp_path / "other.json").write_text(json.dumps({"temperatures": [2.0] * 4, "logit_offset": -0.25}))

    def bias(**kw):
        llm = LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="DSPARK", draft_model=src, planner="fixed", **kw)
        return llm.engine.proposer.drafter.confidence_head.proj.bias.detach().float()  # the engine's dtype (bf16 here)

    torch.testing.assert_close(bias(), base + 0.5, atol=1e-2, rtol=0)
    torch.testing.assert_close(bias(sts_path=tmp_path / "other.json"), base - 0.25, atol=1e-2, rtol=0)


def test_fewer_drafts_than_the_block_with_sts(tiny_llama_dir, drafters, sps_file, plain, tmp_path):
    """A drafter calibrated for its whole block (one STS temperature per slot) making fewer drafts per
    round (`--block-size` below gamma, or a throughput budget below it): only the drafted slots are scored."""
    import shutil

    src = tmp_path / "d"
    shutil.copytree(drafters["DSPARK"], src)
    (src / "sts.json").write_text(json.dumps({"temperatures": [0.9, 1.1, 1.3, 1.5]}))
    for kw in (dict(planner="fixed", num_speculative_tokens=2),
               dict(planner="throughput", sps_table=sps_file, num_speculative_tokens=2),
               dict(planner="throughput", sps_table=sps_file, throughput_variant="lagged")):  # budgets below the block
        llm = LLM(tiny_llama_dir, kv_cache_mb=8, speculative_algorithm="DSPARK", draft_model=src, **kw)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == plain
        assert llm.engine.stats.drafted > 0
