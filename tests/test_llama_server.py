"""llama-server as a bench method: the command line each llama.cpp method starts, the requests it sends,
and how its counters become tau and draft acceptance, against a stand-in server that speaks the same
endpoints. With a real llama-server installed (`make llamacpp`), an opt-in test serves prompts through it
with the shipped drafter as its draft GGUF."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from dspark.bench.llama_server import (LlamaServerMethod, completion_request, find_llama_server, parse_metrics,
                                       server_command)
from dspark.bench.methods import Setup, build_method
from dspark.sampling_params import SamplingParams

FAKE = textwrap.dedent('''\
    import json, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    argv = sys.argv[1:]
    open(ARGV_FILE, "w").write(json.dumps(argv))
    port = int(argv[argv.index("--port") + 1])
    drafting = "-md" in argv
    counters = {"drafts": 0, "accepted": 0, "steps": 0}

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body, kind="application/json"):
            data = body.encode()
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, "{}")
            if self.path == "/metrics":
                return self._send(200, "\\n".join([
                    "# HELP llamacpp:spec_decode_num_drafts_total steps",
                    f"llamacpp:spec_decode_num_draft_tokens_total {counters['drafts']}",
                    f"llamacpp:spec_decode_num_accepted_tokens_total {counters['accepted']}",
                    f"llamacpp:spec_decode_num_drafts_total {counters['steps']}"]), "text/plain")
            self._send(404, "{}")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            open(REQUESTS_FILE, "a").write(json.dumps(body) + "\\n")
            n = body["n_predict"]
            tokens = [(body["prompt"][-1] + 1 + i) % 1000 for i in range(n)]
            timings = {"prompt_ms": 12.0, "predicted_per_token_ms": 5.0, "predicted_n": n}
            if drafting:  # 2 verification steps of 7 drafts, 3 accepted in all
                timings.update(draft_n=14, draft_n_accepted=3)
                counters["drafts"] += 14; counters["accepted"] += 3; counters["steps"] += 2
            self._send(200, json.dumps({"tokens": tokens, "content": "x", "timings": timings}))

    HTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """A stand-in llama-server on PATH's place ($DSPARK_LLAMA_SERVER) that records its argv and requests."""
    script = tmp_path / "llama-server"
    argv, requests = tmp_path / "argv.json", tmp_path / "requests.jsonl"
    script.write_text(f"#!{sys.executable}\nARGV_FILE = {str(argv)!r}\nREQUESTS_FILE = {str(requests)!r}\n" + FAKE)
    script.chmod(0o755)
    monkeypatch.setenv("DSPARK_LLAMA_SERVER", str(script))
    return argv, requests


def test_command_line_of_each_method(tmp_path):
    plain = server_command(tmp_path / "bin", tmp_path / "t.gguf", 8080, 2)
    assert "-md" not in plain and plain[plain.index("--parallel") + 1] == "1" and "--metrics" in plain
    draft = server_command(tmp_path / "bin", tmp_path / "t.gguf", 8080, 2, draft=tmp_path / "d.gguf", n_max=5)
    assert draft[draft.index("--spec-type") + 1] == "draft-dspark"
    assert draft[draft.index("--spec-draft-n-max") + 1] == "5" and "--spec-draft-p-min" not in draft
    pmin = server_command(tmp_path / "bin", tmp_path / "t.gguf", 8080, 2, draft=tmp_path / "d.gguf", p_min=0.3)
    assert pmin[pmin.index("--spec-draft-p-min") + 1] == "0.3"


def test_requests_and_metrics_parsing():
    greedy = completion_request([1, 2], SamplingParams(max_tokens=9))
    assert greedy["temperature"] == 0.0 and greedy["top_k"] == 1 and greedy["n_predict"] == 9
    assert greedy["cache_prompt"] is False and greedy["return_tokens"] is True
    sampled = completion_request([1], SamplingParams(temperature=0.7, top_p=0.8, top_k=20, seed=4))
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"], sampled["seed"]) == (0.7, 0.8, 20, 4)
    counts = parse_metrics("# HELP x\nllamacpp:spec_decode_num_drafts_total 4\nllamacpp:other 9\n")
    assert counts["spec_decode_num_drafts_total"] == 4 and counts["spec_decode_num_draft_tokens_total"] == 0


def test_missing_binary_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("DSPARK_LLAMA_SERVER", str(tmp_path / "nope"))
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_llama_server() is None
    with pytest.raises(FileNotFoundError, match="make llamacpp"):
        LlamaServerMethod("llama.cpp-server", Setup())


def test_draft_method_serves_the_shipped_drafter_as_gguf(fake_server):
    """llama.cpp-dspark converts the shipped drafter to a draft GGUF, starts the server with it, and its
    counters give tau = 1 + accepted / verification steps and the draft acceptance."""
    from dspark.bench.offline import OfflineConfig, Variant, _cell
    from dspark.bench.datasets import Dataset

    argv_file, requests = fake_server
    method = build_method("llama.cpp-dspark-pmin", Setup(llama_p_min=0.25))
    try:
        argv = json.loads(argv_file.read_text())
        draft = argv[argv.index("-md") + 1]
        assert draft.endswith(".gguf") and os.path.getsize(draft) > 1_000_000
        assert argv[argv.index("--spec-draft-p-min") + 1] == "0.25"
        run = method.run([[5, 6], [7]], [SamplingParams(max_tokens=4), SamplingParams(max_tokens=3)])
    finally:
        method.server.close()
    assert [c.token_ids for c in run.completions] == [[7, 8, 9, 10], [8, 9, 10]]
    assert [json.loads(line)["prompt"] for line in requests.read_text().splitlines()] == [[5, 6], [7]]
    assert run.verify_steps == 4 and run.completions[0].ttft == pytest.approx(0.012)
    v = Variant("llama.cpp-dspark-pmin", None)
    cell = _cell(v, 0.0, 1, Dataset("d", ["a", "b"], "test"), {(v, "d", 0.0, 1, 0): [run]},
                 OfflineConfig(methods=[v.method]))
    assert cell["tau"] == pytest.approx(1 + 6 / 4) and cell["draft_acceptance"] == pytest.approx(6 / 28)


@pytest.mark.skipif(os.environ.get("DSPARK_LLAMA_SERVER") is None and find_llama_server() is None,
                    reason="llama-server not installed (make llamacpp)")
def test_real_llama_server_accepts_the_shipped_drafter():
    """Opt-in (needs `make llamacpp`): the embedded GGUF with the shipped DSpark drafter in draft-dspark,
    greedy: it answers, drafts, and accepts some drafts."""
    from transformers import AutoTokenizer

    from dspark.models.embedded import ensure_embedded_model

    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
               for q in ("What is 12 times 7?", "Name three colors.")]
    prompts = [list(getattr(p, "input_ids", p)) for p in prompts]
    method = build_method("llama.cpp-dspark", Setup())
    try:
        run = method.run(prompts, [SamplingParams(max_tokens=32)] * 2)
    finally:
        method.server.close()
    assert all(c.token_ids for c in run.completions)
    assert run.verify_steps > 0 and sum(c.accepted for c in run.completions) > 0
