"""Bad input gets a clear error naming what is wrong."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dspark import LLM, SamplingParams


@pytest.mark.parametrize("kw,name", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"stop": [""]}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": "x"}, "seed"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"), ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
])
def test_bad_sampling_values(kw, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kw)


def test_tiny_temperatures_are_greedy():
    for t in (1e-300, 5e-324, 9.9e-6):
        p = SamplingParams(temperature=t)
        assert p.temperature == 0.0 and p.greedy  # the engine and the drafter both see plain 0
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1


def test_unknown_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        LLM(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(tmp_path)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        LLM(tmp_path)


def test_over_long_and_invalid_prompts(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, kv_cache_mb=4)
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5] * 600])  # the tiny model's context is 512
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([[10**9]])
    with pytest.raises(ValueError, match="context"):
        llm.generate([[5, 6], [5] * 600])
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert llm.engine.num_waiting == 0  # nothing half-queued after a rejected batch


def test_cli_reports_errors_without_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dspark.cli", "generate", "--model", str(tmp_path / "x"), "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "error" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("flags,message", [(["--quantization", "int3"], "invalid choice"),
                                           (["--quantization", "int4", "--dtype", "float16"], "needs dtype bfloat16")])
def test_cli_rejects_bad_quantization(flags, message):
    r = subprocess.run([sys.executable, "-m", "dspark.cli", "generate", *flags, "hi"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr
