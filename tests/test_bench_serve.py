"""The serving load generator against a stub OpenAI-compatible server on 127.0.0.1 (real HTTP, SSE)."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dspark.bench.report import merge, write_report
from dspark.bench.serve import ServeConfig, check_loopback, run_serve
from dspark.cli import main


class StubOpenAI(BaseHTTPRequestHandler):
    """Streams five word chunks then a usage record; every request whose prompt says 'fail' gets a 500."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "stub-model", "object": "model"}]}).encode()
        self._send(200, body, "application/json")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        StubOpenAI.seen.append((self.path, req))
        prompt = req["messages"][0]["content"] if "messages" in req else req["prompt"]
        if "fail" in prompt:
            self._send(500, b'{"error": {"message": "boom"}}', "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = min(5, req["max_tokens"])
        for i in range(n):
            time.sleep(0.002)
            delta = {"delta": {"content": f"w{i} "}} if "messages" in req else {"text": f"w{i} "}
            self.wfile.write(f"data: {json.dumps({'choices': [{'index': 0, **delta}]})}\n\n".encode())
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2 * n, "total_tokens": 3 + 2 * n}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        self.wfile.flush()
        self.close_connection = True

    def _send(self, status, body, ctype):
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="module")
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_closed_loop_counts_tokens_latency_and_errors(stub_url):
    cfg = ServeConfig(url=stub_url + "/v1", levels=[1, 3], num_requests=6, max_tokens=8, label="stub",
                      warmup=0, progress=False)
    run = run_serve(cfg, ["hello", "hello again", "please fail"])
    assert run["model"] == "stub-model" and [lv["level"] for lv in run["levels"]] == [1, 3]
    for lv in run["levels"]:
        assert lv["requests"] == 6 and lv["ok"] == 4 and lv["errors"] == {"http 500": 2}
        assert lv["output_tokens"] == 4 * 10 and lv["tokens_from_usage"]  # the usage record wins over chunks
        assert lv["ttft_s"]["p50"] > 0 and lv["tpot_s"]["p99"] >= lv["tpot_s"]["p50"] > 0
        assert lv["throughput_tokens_per_s"] > 0 and lv["per_user_tokens_per_s"]["p50"] > 0
    path, body = StubOpenAI.seen[-1]
    assert path == "/v1/chat/completions" and body["stream"] and body["model"] == "stub-model"


def test_open_loop_and_completions_endpoint(stub_url):
    cfg = ServeConfig(url=stub_url, mode="open", levels=[50.0], num_requests=5, endpoint="completions",
                      model="m", max_tokens=3, warmup=0, progress=False)
    run = run_serve(cfg, ["x"])
    lv = run["levels"][0]
    assert lv["ok"] == 5 and not lv["errors"] and lv["output_tokens"] == 5 * 6
    assert StubOpenAI.seen[-1][0] == "/v1/completions" and StubOpenAI.seen[-1][1]["model"] == "m"


def test_unreachable_server_is_an_error_not_a_crash():
    cfg = ServeConfig(url="http://127.0.0.1:9", levels=[2], num_requests=2, warmup=0, model="m", progress=False)
    lv = run_serve(cfg)["levels"][0]
    assert lv["ok"] == 0 and sum(lv["errors"].values()) == 2


def test_loopback_only_by_default():
    check_loopback("http://127.0.0.1:30000")
    check_loopback("http://localhost:8000/v1")
    check_loopback("http://[::1]:8000")
    with pytest.raises(ValueError, match="loopback"):
        check_loopback("http://10.1.2.3:30000")
    check_loopback("http://10.1.2.3:30000", allow_remote=True)
    with pytest.raises(ValueError):
        check_loopback("ftp://127.0.0.1")


def test_serve_cli_merges_runs_into_one_report(stub_url, tmp_path):
    for label in ("plain", "dspark"):
        rc = main(["bench", "serve", "--url", stub_url, "--label", label, "--quick", "--out", str(tmp_path),
                   "--no-progress"])
        assert rc == 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert [r["label"] for r in data["serve"]] == ["plain", "dspark"]
    assert [lv["level"] for lv in data["serve"][0]["levels"]] == [1, 2]
    for name in ("throughput_vs_concurrency.png", "latency_vs_concurrency.png", "results.md"):
        assert (tmp_path / name).stat().st_size > 0
    assert "| dspark | closed | 2 |" in (tmp_path / "results.md").read_text()
    # a second run with the same label replaces the first
    files = write_report(tmp_path, merge(data, "serve", {**data["serve"][0], "levels": data["serve"][0]["levels"][:1]}))
    assert "results.json" in files
    assert len(json.loads((tmp_path / "results.json").read_text())["serve"]) == 2
