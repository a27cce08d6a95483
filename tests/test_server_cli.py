"""`dspark serve` / `python -m dspark.serve`: bad flag combinations fail before the model loads, with
exit code 2 and a message naming the flag; good flags start a server that logs each startup stage."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from dspark.cli import main


@pytest.fixture
def no_model_loading(monkeypatch):
    """A flag combination that slips through validation would load the model: fail loudly instead."""
    import dspark.server.cli as server_cli

    def refuse(config):
        raise AssertionError(f"flags passed validation: {config}")

    monkeypatch.setattr(server_cli, "load_llm", refuse)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "sps.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    return tmp_path


def _cases(tiny: str, files) -> list[tuple[list[str], str]]:
    sps, empty = str(files / "sps.json"), str(files / "empty")
    return [
        (["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "3",
          "--speculative-num-draft-tokens", "5"], "must equal --speculative-dspark-block-size + 1 (4)"),
        (["--speculative-algorithm", "NONE", "--speculative-draft-model-path", empty], "only used by DSPARK"),
        (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", empty], "only used by DSPARK"),
        (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-quantization", "int4"],
         "--speculative-draft-model-quantization: draft_quantization is only used by DSPARK"),
        (["--speculative-algorithm", "NONE", "--speculative-num-draft-tokens", "4"], "needs speculative_algorithm NGRAM"),
        (["--speculative-algorithm", "NGRAM", "--speculative-dspark-sps-table-path", sps], "only used with"),
        (["--speculative-algorithm", "DFLASH", "--speculative-dspark-confidence-sts-path", sps], "only used with"),
        (["--speculative-algorithm", "DSPARK", "--speculative-dspark-planner", "fixed",
          "--speculative-dspark-sps-table-path", sps], "only read by the throughput planner"),
        (["--speculative-algorithm", "DSPARK", "--speculative-dspark-block-size", "100"],
         "--speculative-dspark-block-size / --speculative-num-draft-tokens: num_speculative_tokens"),
        (["--speculative-algorithm", "DSPARK", "--speculative-dspark-min-gain", "1.5"], "min_gain must be"),
        (["--model", tiny, "--speculative-algorithm", "DSPARK"], "--speculative-draft-model-path: DSPARK on"),
        (["--model", tiny, "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", empty],
         "not a drafter directory"),
        (["--model", tiny, "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", tiny,
          "--speculative-dspark-sps-table-path", str(files / "missing.json")], "is not a file"),
        (["--model", str(files / "nope")], "not a local directory"),
        (["--model", empty], "config.json"),
        (["--model", tiny, "--port", "70000"], "--port must be in [0, 65535]"),
        (["--model", tiny, "--max-running-requests", "0"], "--max-running-requests: max_num_seqs must be an integer >= 1"),
        (["--model", tiny, "--max-queued-requests", "-1"], "--max-queued-requests must be >= 0"),
        (["--model", tiny, "--api-key", " "], "--api-key must not be empty"),
        (["--model", tiny, "--read-timeout", "0"], "--read-timeout must be > 0 seconds"),
        (["--model", tiny, "--context-length", "1"], "--context-length: max_model_len must be an integer >= 2"),
    ]


def test_invalid_flag_combinations_fail_fast(tiny_llama_dir, files, capsys, no_model_loading):
    for argv, message in _cases(str(tiny_llama_dir), files):
        t = time.monotonic()
        assert main(["serve", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("dspark: error:") and message in err, (argv, err)
        assert time.monotonic() - t < 5, argv


def test_verify_mode_from_the_sglang_environment_variable(tiny_llama_dir, capsys, monkeypatch, no_model_loading):
    monkeypatch.setenv("SGLANG_RAGGED_VERIFY_MODE", "loose")
    assert main(["serve", "--model", str(tiny_llama_dir)]) == 2
    assert "SGLANG_RAGGED_VERIFY_MODE must be one of static, compact, cap-accept" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # argparse: bad choices exit 2 as well
        main(["serve", "--ragged-verify-mode", "loose"])
    assert e.value.code == 2


def test_serve_profiles_quick_unless_told(tiny_llama_dir, monkeypatch):
    """A first `dspark serve` profiles the quick SPS grid (seconds); the flag asks for the full one."""
    import dspark.server.cli as server_cli
    from dspark.cli import build_parser

    def config(*flags):
        args = build_parser().parse_args(["serve", "--model", str(tiny_llama_dir), *flags])
        return server_cli.engine_config_from_flags(args)

    assert config().speculative.sps_profile == "quick"
    assert config("--speculative-dspark-sps-profile", "full").speculative.sps_profile == "full"


def test_taken_port_fails_before_loading(tiny_llama_dir, capsys, no_model_loading):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", str(tiny_llama_dir), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_dspark_serve_starts_and_serves(tiny_llama_dir, tmp_path):
    """The real entry point in a subprocess: a bad flag exits 2; good SGLang-style flags log each startup
    stage, then answer (with the API key) on loopback; SIGTERM stops it."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    bad = subprocess.run([sys.executable, "-m", "dspark.serve", "--model", str(tiny_llama_dir),
                          "--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
                          "--speculative-dspark-block-size", "4"], capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2 and "--speculative-num-draft-tokens (4) must equal" in bad.stderr

    port = _free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "dspark.serve", "--model-path", str(tiny_llama_dir),
                                 "--port", str(port), "--speculative-algorithm", "NGRAM",
                                 "--speculative-num-draft-tokens", "4", "--max-running-requests", "4",
                                 "--max-queued-requests", "4", "--api-key", "k", "--served-model-name", "tiny",
                                 "--max-total-tokens", "4096"], stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while "ready: accepting requests" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"}, timeout=30,
                       json={"model": "tiny", "prompt": "1 2 3 1 2 3 1 2", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["dspark"]["speculative_algorithm"] == "NGRAM"
    finally:
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    stages = ["flags checked", "loading model", "model loaded", "warm-up done", "engine loop started",
              "ready: accepting requests"]
    positions = [text.find(s) for s in stages]
    assert -1 not in positions and positions == sorted(positions), text
    assert "KV cache 4096 tokens" in text


def test_throughput_variant_flag_reaches_the_engine_config() -> None:
    import argparse

    from dspark.cli_args import add_speculative_args, engine_config, speculative_options
    from dspark.speculative.config import ThroughputVariant

    p = argparse.ArgumentParser()
    add_speculative_args(p)
    for argv, want in (([], ThroughputVariant.AUTO),
                       (["--speculative-dspark-throughput-variant", "algorithm1"], ThroughputVariant.ALGORITHM1)):
        args = p.parse_args(["--speculative-algorithm", "DSPARK", *argv])
        assert engine_config(speculative_options(args)).speculative.throughput_variant == want
    with pytest.raises(SystemExit):  # argparse names the choices
        p.parse_args(["--speculative-dspark-throughput-variant", "best"])
