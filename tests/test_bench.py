"""dspark bench plumbing on a tiny random model: offline suite, race (and its lossy-method verdict),
roofline, datasets, acceptance bookkeeping and report writing. Numbers are not asserted."""
from __future__ import annotations

import gzip
import hashlib
import importlib.machinery
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from dspark.bench.acceptance import AcceptanceCounter
from dspark.bench.calibration import load_calibration
from dspark.bench.datasets import load_datasets
from dspark.bench.methods import EngineMethod, LlamaCppMethod, Setup, expand_methods, shared_target
from dspark.bench.offline import OfflineConfig, run_offline
from dspark.bench.race import first_divergence, format_race, run_race
from dspark.bench.report import load_results, merge, write_report
from dspark.bench.roofline import method_fractions, run_roofline
from dspark.cli import main
from dspark.speculative.cost_table import SPSTable
from test_speculative import save_random_drafter

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def drafters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-drafters")
    return (save_random_drafter(tiny_llama_dir, root / "dspark", dspark=True),
            save_random_drafter(tiny_llama_dir, root / "dflash", dspark=False))


@pytest.fixture(scope="module")
def sps_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-sps") / "sps.json"
    sps = {str(b): 100.0 / (1 + 0.1 * b) for b in range(1, 40)}
    path.write_text(json.dumps({"version": 1, "model": "tiny", "dtype": "float32", "threads": 1,
                                "torch": "x", "device": "cpu", "sps": sps}))
    return path


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "tiny-set.jsonl"
    rows = [{"turns": ["count: one two three one two three one two", "and again?"]},
            {"turns": ["Say hello hello hello."]}, {"turns": ["abc abc abc abc"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_datasets_formats(tmp_path, eval_file):
    gz = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(json.dumps({"task_id": "x", "prompt": "def f():\n"}) + "\n")
    sets = load_datasets([str(eval_file), str(gz)], limit=2)
    assert [d.name for d in sets] == ["tiny-set", "HumanEval"]
    assert sets[0].prompts == ["count: one two three one two three one two", "Say hello hello hello."]
    assert sets[1].prompts == ["def f():\n"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"nothing": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_datasets([str(bad)])
    with pytest.raises(FileNotFoundError):
        load_datasets([str(tmp_path / "missing.jsonl")])


def test_acceptance_counter():
    acc = AcceptanceCounter()
    # windows of 3 drafts: kept 2, kept 0, kept 3 (then a last round that is ignored: it may be cut short)
    acc.add([3, 1, 4, 2], [3, 3, 3, 3])
    assert acc.rounds == 4 and acc.tau == 10 / 4
    assert acc.attempts == [3, 2, 2] and acc.accepts == [2, 2, 1]
    assert acc.conditional() == [2 / 3, 1.0, 0.5]
    assert acc.calibration() is None  # no confidences given
    assert expand_methods("ar,dspark,hf") == ["ar", "dspark-fixed", "dspark-threshold", "dspark-throughput", "hf"]
    with pytest.raises(ValueError, match="unknown method"):
        expand_methods("ar,warp")


def test_acceptance_counter_scores_the_confidences_against_the_rounds():
    acc = AcceptanceCounter()
    # rounds of 2 drafts with c = (0.9, 0.5): forecasts a_1 = 0.9, a_2 = 0.45; kept 2, 1, 0, 2, then a cut last round
    acc.add([3, 2, 1, 3, 1], [2, 2, 2, 2, 2], [[0.9, 0.5]] * 5)
    cal = acc.calibration()
    assert cal["count"] == [4, 4]  # every window verified both drafts; the last round is left out
    assert cal["forecast"] == pytest.approx([0.9, 0.45])
    assert cal["survived"] == pytest.approx([3 / 4, 2 / 4])  # position k survives when drafts 1..k were kept
    assert cal["ece"] == pytest.approx([0.15, 0.05])  # one bin each: |forecast - survived|
    acc.add([2, 1], [1, 0], [[0.2, 0.9], []])  # a round that verified 1 of 2 drafts scores position 1 only
    assert acc.calibration()["count"] == [5, 4]


def test_offline_suite_and_report(tiny_llama_dir, drafters, sps_file, eval_file, tmp_path):
    setup = Setup(model=str(tiny_llama_dir), dspark_draft=str(drafters[0]), dflash_draft=str(drafters[1]),
                  sps_table=str(sps_file))
    cfg = OfflineConfig(methods=expand_methods("ar,ngram,dspark-fixed,dspark-throughput,hf-pld,llama.cpp"),
                        max_tokens=5, concurrency=[1, 2], repeats=2, progress=False)
    sets = load_datasets([str(eval_file)], limit=2)
    result = run_offline(sets, cfg, setup)
    cells = {(c["label"], c["concurrency"]): c for c in result["cells"]}
    for label in ("ar", "ngram", "dspark-fixed", "dspark-throughput"):
        for conc in (1, 2):
            c = cells[(label, conc)]
            assert c["matches_ar"] is True, (label, conc)  # every engine method is lossless
            assert len(c["tokens_per_s"]["runs"]) == 2 and c["tau"] >= 1.0
            assert set(c["time_split"]) == {"draft", "plan", "verify", "other"}
    assert ("hf-pld", 1) in cells and ("hf-pld", 2) not in cells
    assert cells[("ar", 1)]["speedup"] == pytest.approx(1.0)
    assert cells[("dspark-fixed", 1)]["accept_by_position"]  # the random drafter drafts 4 per round
    cal = cells[("dspark-fixed", 1)]["confidence_calibration"]  # its confidence head scored on these rounds
    assert len(cal["ece"]) == 4 and all(0 <= e <= 1 for e in cal["ece"]) and cal["count"][0] > 0
    assert cells[("ngram", 1)]["confidence_calibration"] is None  # no confidence head
    if "llama.cpp" not in {c["method"] for c in result["cells"]}:
        assert any(s["method"] == "llama.cpp" for s in result["skipped"])

    results = merge({}, "offline", result)
    results["calibration"] = {"source": "x", "ece_before": [0.1, 0.2], "ece_after": [0.01, 0.02],
                              "reliability_before": None,
                              "reliability_after": [{"confidence": [0.2, 0.8], "accuracy": [0.25, 0.7], "count": [5, 5]}]}
    files = write_report(tmp_path, results)
    for name in ("results.json", "results.md", "tau_by_dataset.png", "acceptance_by_position.png",
                 "tokens_per_s.png", "throughput_vs_concurrency.png", "latency_vs_concurrency.png", "calibration.png"):
        assert name in files and (tmp_path / name).stat().st_size > 0
    md = (tmp_path / "results.md").read_text()
    assert "dspark-throughput" in md and "Per-position conditional acceptance" in md
    assert "Confidence calibration on these rounds" in md  # the dspark cells carry their confidences
    assert load_results(tmp_path)["offline"]["cells"]


def test_offline_cli_quick(tiny_llama_dir, eval_file, tmp_path):
    out = tmp_path / "out"
    rc = main(["bench", "offline", "--model", str(tiny_llama_dir), "--dataset", str(eval_file), "--methods",
               "ar,ngram", "--quick", "--num-prompts", "1", "--max-tokens", "6", "--out", str(out), "--no-progress"])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert {c["label"] for c in data["offline"]["cells"]} == {"ar", "ngram"}
    assert (out / "results.md").is_file() and (out / "tokens_per_s.png").is_file()


def test_offline_defaults_to_the_shipped_eval_sets(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """`dspark bench offline --quick` needs no other argument: the eval sets of bench/data/eval."""
    import dspark.bench.datasets as datasets
    from dspark.bench.cli import QUICK
    from dspark.cli import build_parser

    args = build_parser().parse_args(["bench", "offline", "--quick"])
    assert args.dataset is None and args.quick and args.model is None  # None: the embedded model
    assert [Path(p).name for p in datasets.shipped_eval_sets()] == ["gsm8k.jsonl", "humaneval.jsonl", "mt-bench.jsonl"]
    # a few prompts, few tokens, one repeat, plain decoding against DSpark's default planner
    assert QUICK == {"num_prompts": 2, "max_tokens": 32, "repeats": 1, "methods": "ar,dspark-throughput"}
    out = tmp_path / "out"  # the same command on the tiny model, one method, shorter still
    rc = main(["bench", "offline", "--quick", "--model", str(tiny_llama_dir), "--methods", "ar", "--num-prompts", "1",
               "--max-tokens", "4", "--out", str(out), "--no-progress"])
    assert rc == 0
    cells = json.loads((out / "results.json").read_text())["offline"]["cells"]
    assert {c["dataset"] for c in cells} == {"gsm8k", "humaneval", "mt-bench"}
    monkeypatch.setattr(datasets, "SHIPPED_EVAL", tmp_path / "nowhere")
    assert main(["bench", "offline", "--quick", "--model", str(tiny_llama_dir), "--out", str(out)]) == 2
    assert "pass --dataset" in capsys.readouterr().err


def test_race_identical_then_lossy_diverges(tiny_llama_dir, drafters, monkeypatch):
    import dspark.engine.llm_engine as engine_module
    from dspark.sampling.rejection import Acceptance

    setup = Setup(model=str(tiny_llama_dir), kv_cache_mb=8, dflash_draft=str(drafters[1]))
    with shared_target():
        plain = EngineMethod("ar", setup)
        dflash = EngineMethod("dflash", setup)
    prompts = [("rep", [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]), ("mix", [8, 8, 4000, 12, 13, 8, 8, 4000])]
    race = run_race(plain, dflash, prompts, 10, plain.tokenizer, progress=False)
    assert race["identical"] and race["speedup"] > 0
    assert "LOSSLESS: 2/2" in format_race(race)

    def accept_everything(drafts, logits):  # deliberately lossy: keep every draft
        return Acceptance(tokens=[int(t) for t in drafts] + [int(logits[len(drafts)].argmax())],
                          num_accepted=len(drafts))

    monkeypatch.setattr(engine_module, "accept_greedy", accept_everything)
    race = run_race(plain, dflash, prompts, 10, plain.tokenizer, progress=False)
    assert not race["identical"]
    bad = [r for r in race["prompts"] if not r["identical"]]
    assert bad and bad[0]["divergence"]["plain"] != bad[0]["divergence"]["method"]
    text = format_race(race)
    assert "DIVERGED" in text and "NOT LOSSLESS" in text
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 2], [1, 3]) == 1


def test_race_cli(tiny_llama_dir, tmp_path, capsys):
    rc = main(["bench", "race", "--model", str(tiny_llama_dir), "--speculative-algorithm", "NGRAM", "--prompt",
               "one two one two one two", "--max-tokens", "8", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0 and "LOSSLESS" in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["race"]["identical"]


def test_roofline_and_calibration(tiny_llama_dir, tmp_path):
    # context 8: profile_sps needs context + size to fit the context's last KV block (see the lead's notes)
    roof = run_roofline(str(tiny_llama_dir), max_tokens=3, repeats=1, bandwidth_mb=8, context=8, max_seqs=2,
                        window=2, save_sps=str(tmp_path / "sps.json"), progress=False)
    table = SPSTable.load(tmp_path / "sps.json")  # the planner's table: loaded steps of 2 sequences too
    assert table.points.keys() == {1, 2, 3} and set(table.points_by_seqs) == {2} and table.points_by_seqs[2]
    assert roof["bandwidth_gb_s"] > 0 and roof["weight_bytes"] > 0 and set(roof["sps"]) == {"1", "2", "3"}
    cell = {"label": "ar", "dataset": "d", "temperature": 0.0, "concurrency": 1, "tokens_per_s": {"median": 5.0}}
    assert method_fractions(roof, [cell])[0]["fraction"] == pytest.approx(5.0 / roof["ceiling_tokens_per_s"])
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [1.2, 1.1], "ece": {"before": [0.08, 0.1], "after": [0.02, 0.03]}}))
    (tmp_path / "reliability.png").write_bytes(b"png")  # the diagram `dspark train calibrate` draws
    cal = load_calibration(sts)
    assert cal["ece_after"] == [0.02, 0.03]
    only_temps = tmp_path / "t.json"
    only_temps.write_text(json.dumps({"temperatures": [1.0]}))
    assert load_calibration(only_temps) is None
    out = tmp_path / "report"
    files = write_report(out, {**merge({}, "roofline", roof), "calibration": cal})
    assert {"sps_curve.png", "calibration.png", "reliability.png"} <= set(files)
    assert "Roofline" in (out / "results.md").read_text()


def test_llama_cpp_when_installed(tmp_path, monkeypatch):
    """The llama.cpp adapter, against a stand-in module (the real one is optional)."""
    class FakeLlama:
        def __init__(self, model_path, **kw):
            self.path = model_path

        def token_eos(self):
            return 2

        def set_seed(self, seed):
            pass

        def generate(self, tokens, reset=True, **kw):
            assert kw["temp"] == 0.0
            yield from [7, 8, 9, 2, 5]

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    from dspark.sampling_params import SamplingParams

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    m = LlamaCppMethod("llama.cpp", Setup(model="x", gguf=str(gguf)))
    run = m.run([[1, 2, 3]], [SamplingParams(max_tokens=10)])
    assert run.completions[0].token_ids == [7, 8, 9, 2]
    run = m.run([[1, 2, 3]], [SamplingParams(max_tokens=2)])
    assert run.completions[0].token_ids == [7, 8]


def test_results_page_links_figures_from_docs(tmp_path):
    spec = importlib.util.spec_from_file_location("results_page", ROOT / "bench" / "results_page.py")
    page_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page_module)
    out = tmp_path / "bench" / "results"
    out.mkdir(parents=True)
    (out / "results.md").write_text("# title\n\n| a |\n|---|\n\n![tau by dataset](tau_by_dataset.png)\n")
    page = tmp_path / "docs" / "results.md"
    page.parent.mkdir()
    ckpt = tmp_path / "ckpt-dspark"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    val = '"val": {"greedy_tau": 2.0, "greedy_match": [0.5]}'
    (ckpt / "run_log.jsonl").write_text(f'{{"tokens": 10, {val}}}\n{{"tokens": 47333087, {val}}}\n')
    page_module.write_page(out, page, ["--eval-dir", "E", "--num-prompts", "3"],
                           {"DSPARK": ckpt, "DFLASH": tmp_path / "missing"})
    text = page.read_text()
    assert "bench/results_page.py" in text and "![tau by dataset](../bench/results/tau_by_dataset.png)" in text
    assert "This page: `.venv/bin/python bench/results_page.py --eval-dir E --num-prompts 3`" in text
    digest = hashlib.sha256(b"weights").hexdigest()[:12]
    assert f"Drafters: DSPARK `ckpt-dspark` (47.33M training tokens, weights sha256 {digest}); " \
           "DFLASH not installed." in text


def test_demo_is_a_one_prompt_race(tiny_llama_dir, capsys):
    rc = main(["demo", "--model", str(tiny_llama_dir), "--speculative-algorithm", "NGRAM", "--prompt",
               "one two one two one two", "--max-tokens", "8"])
    out = capsys.readouterr().out
    assert rc == 0 and "--- plain decoding ---" in out and "--- ngram ---" in out
    assert "LOSSLESS: 1/1 prompts identical" in out and "speedup" in out


def test_calibration_source_is_shown_relative_to_the_working_directory(tmp_path, monkeypatch):
    from dspark.bench.calibration import _shown

    monkeypatch.chdir(tmp_path)
    assert _shown(tmp_path / "ckpt" / "sts.json") == "ckpt/sts.json"
    assert _shown("/elsewhere/sts.json") == "/elsewhere/sts.json"


@pytest.mark.parametrize("argv, flag", [
    (["bench", "offline", "--num-prompts", "-3"], "--num-prompts"),  # was read as "all but the last 3"
    (["bench", "offline", "--max-tokens", "0"], "--max-tokens"),
    (["bench", "offline", "--repeats", "0"], "--repeats"),
    (["bench", "serve", "--num-requests", "0"], "--num-requests"),
    (["bench", "serve", "--duration", "-1"], "--duration"),
    (["bench", "race", "--max-tokens", "x"], "--max-tokens"),
    (["bench", "roofline", "--context", "0"], "--context"),
    (["generate", "hi", "--speculative-dspark-block-size", "0"], "--speculative-dspark-block-size"),
])
def test_bench_and_generate_reject_non_positive_sizes(argv, flag, capsys):
    """Sizes, counts and durations below 1 (or not numbers) stop at the parser with a usage error, exit 2."""
    from dspark.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err
