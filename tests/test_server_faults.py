"""Faults and abuse over real HTTP: one bad request never hurts another. Poison sampling values are
served or answered 400, a request the engine fails is failed alone inside a loaded run, undecodable
bodies are 400s without a traceback, a client that hangs up during its upload is a quiet abort,
unsupported OpenAI fields are refused, slow clients are cut off, and heavy prompts do not stall the
event loop."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from dspark import LLM
from dspark.server import ServerConfig, ServerThread
from test_server import AUTH, PROMPTS, chat_messages, scrape, wait_idle
from test_server import drafter_files, offline, server  # noqa: F401 - fixtures: the same DSpark server setup

ERROR_KEYS = {"message", "type", "param", "code"}


def post(url: str, path: str, body, headers=None, timeout: float = 30) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=timeout,
                      headers={**AUTH, "Content-Type": "application/json", **(headers or {})})


def server_errors(url: str) -> float:
    """5xx responses counted so far."""
    return sum(v for k, v in scrape(url).items() if k.startswith("dspark_http_requests_total") and 'status="5' in k)


def tracebacks(caplog) -> list[str]:
    """Logged exceptions (caplog sees the server thread's records through the root logger)."""
    return [f"{r.name}: {r.getMessage()} {r.exc_info[1]!r}" for r in caplog.records if r.exc_info]


# --- sampling values at their extremes -------------------------------------------------------
def test_poison_sampling_values_are_served_exactly(server, offline):
    """top_p 1e-46 is 0 in float32; it used to fail the whole engine step. It means greedy."""
    body = {"prompt": PROMPTS[2], "max_tokens": 6, "temperature": 1, "top_p": 1e-46, "seed": 0}
    r = post(server.url, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline("completion", PROMPTS[2], 6)
    r = post(server.url, "/v1/chat/completions", {"messages": chat_messages(PROMPTS[0]), "max_tokens": 4,
                                                  "temperature": 100, "top_k": 1, "top_p": 5e-324})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == offline(
        "chat", chat_messages(PROMPTS[0]), 4)


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "x", "temperature": 1e999}', None),  # inf from JSON
    (b'{"prompt": "x", "top_p": -1e999}', None),
    (b'{"prompt": "x", "top_p": 1e-400}', "top_p"),  # underflows to 0.0 when parsed
    (b'{"prompt": "x", "temperature": 101}', "temperature"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None),  # past Python's int digits limit
    (b'{"prompt": "x", "min_p": 0.1}', "min_p"),
    (b'{"prompt": "x", "min_tokens": 5}', "min_tokens"),
    (b'{"prompt": "x", "presence_penalty": 1e300}', "presence_penalty"),
    (b'{"prompt": "x", "seed": 18446744073709551616}', "seed"),
])
def test_unusable_sampling_values_are_400(server, raw, param):
    r = post(server.url, "/v1/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_seeded_request_gives_the_same_text_alone_and_in_a_batch_of_8(server):
    body = {"prompt": PROMPTS[4], "max_tokens": 12, "temperature": 0.9, "top_k": 50, "seed": 11, "ignore_eos": True}
    alone = post(server.url, "/v1/completions", body).json()["choices"][0]["text"]
    others = [{"prompt": PROMPTS[i], "max_tokens": 6 + i, "temperature": 0.5 + i / 10, "seed": i} for i in range(7)]

    async def batch() -> str:
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(server.url + "/v1/completions", json=b, headers=AUTH)
                                        for b in [*others[:3], body, *others[3:]]))
        return rs[3].json()["choices"][0]["text"]

    assert [asyncio.run(batch()) for _ in range(3)] == [alone] * 3


# --- one failing request inside a loaded run --------------------------------------------------
def test_a_request_the_engine_fails_is_failed_alone(server, offline, monkeypatch, caplog):
    """16 good requests (plain and streamed) beside poison values and one request that raises inside the
    engine: the good ones all get their exact text, the victim a 500 or an error event."""
    engine = server.app.state.server.engine
    victim_ids = [7, 7, 7, 7, 7, 7, 7]
    real_commit = engine._commit

    def commit(seq, tokens):
        if seq.prompt_token_ids == victim_ids and seq.output_token_ids:
            raise RuntimeError("injected fault")
        return real_commit(seq, tokens)

    monkeypatch.setattr(engine, "_commit", commit)
    errors_before = scrape(server.url).get("dspark_engine_errors_total", 0)

    async def good(c, i):
        prompt, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 0
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}
        if not stream:
            r = await c.post(server.url + "/v1/completions", json=body, headers=AUTH)
            return r.status_code, r.json()["choices"][0]["text"], offline("completion", prompt, 8)
        async with c.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
        return r.status_code, text, offline("completion", prompt, 8)

    async def poison(c, i):
        body = {"prompt": PROMPTS[i], "max_tokens": 8, "temperature": 1, "top_p": 1e-46}
        return (await c.post(server.url + "/v1/completions", json=body, headers=AUTH)).status_code

    async def victim(c, stream):
        body = {"prompt": victim_ids, "max_tokens": 8, "temperature": 0, "stream": stream}
        if not stream:
            r = await c.post(server.url + "/v1/completions", json=body, headers=AUTH)
            return r.status_code, r.json()["error"]["code"]
        async with c.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            events = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                      if line.startswith("data: ") and line != "data: [DONE]"]
        return r.status_code, events[-1]["error"]["code"]

    async def main():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(good(c, i) for i in range(16)), *(poison(c, i) for i in range(4)),
                                        victim(c, False), victim(c, True))

    results = asyncio.run(main())
    goods, poisons, victims = results[:16], results[16:20], results[20:]
    assert all(status == 200 and text == want for status, text, want in goods)
    assert poisons == [200] * 4
    assert victims == [(500, "internal_error"), (200, "internal_error")]  # the stream had begun
    m = wait_idle(server.url)
    assert m["dspark_engine_errors_total"] == errors_before + 2
    assert all("injected fault" in t for t in tracebacks(caplog))  # only the engine's own report


# --- bodies a client can send that are not requests ------------------------------------------
BAD_BODIES = [
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\udfff"}]}', "messages[0].content"),
    ("lone surrogate in a stop string", "/v1/completions", b'{"prompt": "x", "stop": ["\\udabc"]}', "stop[0]"),
    ("lone surrogate in a key", "/v1/completions", b'{"prompt": "x", "\\ud800": 1}', "body"),
    ("deep array", "/v1/completions", b"[" * 60_000, None),  # under the test server's 64 KB limit
    ("deep object", "/v1/completions", b'{"a":' * 12_000, None),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', None),
]


@pytest.mark.parametrize("path,raw,param", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_undecodable_bodies_are_400_without_traceback(server, caplog, path, raw, param):
    before = server_errors(server.url)
    r = post(server.url, path, raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["param"] == param and err["type"] == "invalid_request_error"
    assert server_errors(server.url) == before and not tracebacks(caplog)


def test_a_paired_surrogate_escape_is_text(server):
    r = post(server.url, "/v1/completions", b'{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


def _raw_request(url: str, head: bytes, body: bytes = b"") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(head + body)
    return sock


def test_disconnect_during_upload_is_a_quiet_abort(server, caplog):
    before = server_errors(server.url)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n"
            b"Content-Type: application/json\r\nContent-Length: 5000\r\n\r\n")
    _raw_request(server.url, head, b'{"prompt": "hel').close()
    deadline = time.monotonic() + 5
    while 'dspark_http_requests_total{endpoint="/v1/completions",status="499"}' not in scrape(server.url):
        assert time.monotonic() < deadline, "the aborted upload was never answered"
        time.sleep(0.05)
    assert server_errors(server.url) == before and not tracebacks(caplog)
    wait_idle(server.url)


# --- refused OpenAI fields, models, auth, health -------------------------------------------
HISTORY = [{"role": "user", "content": "weather?"},
           {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                  "function": {"name": "w", "arguments": "{}"}}]},
           {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


@pytest.mark.parametrize("extra,param", [
    ({"functions": [{"name": "w", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "w"}}}, "tool_choice"),
    ({"messages": HISTORY}, "messages[1].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "function_call": {"name": "w"}}]},
     "messages[0].function_call"),
])
def test_unsupported_openai_fields_are_refused(server, extra, param):
    r = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **extra})
    assert r.status_code == 400 and r.json()["error"] == {**r.json()["error"], "param": param,
                                                          "code": "unsupported_parameter"}, r.text
    ok = post(server.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                   "tool_choice": "none"})
    assert ok.status_code == 200


def test_models_hide_the_local_path(server, tiny_llama_dir):
    for path in ("/v1/models", "/v1/models/tiny"):
        r = httpx.get(server.url + path, headers=AUTH)
        assert r.status_code == 200 and str(tiny_llama_dir) not in r.text and tiny_llama_dir.name not in r.text
    assert httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"][0]["root"] == "tiny"


def test_401_names_the_scheme_and_health_answers_head(server):
    r = httpx.get(server.url + "/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
    h = httpx.head(server.url + "/health")
    assert h.status_code == 200 and h.content == b""


# --- slow and heavy clients ---------------------------------------------------------------
@pytest.fixture(scope="module")
def strict_server(tiny_llama_dir):
    """Plain decoding, a 1 s read timeout and room for 1 MB prompts."""
    llm = LLM(tiny_llama_dir, kv_cache_mb=8)
    with ServerThread(llm, ServerConfig(port=0, read_timeout_s=1.0, max_request_bytes=2 << 20)) as s:
        yield s


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closed the socket within `seconds`, and what it sent before."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(4096):
            got += chunk
        return True, got
    except socket.timeout:
        return False, got
    finally:
        sock.close()


def test_slowloris_headers_and_idle_sockets_are_closed(strict_server):
    partial = _raw_request(strict_server.url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    idle = _raw_request(strict_server.url, b"")
    assert _closed_within(partial, 4) == (True, b"")
    assert _closed_within(idle, 4) == (True, b"")


def test_a_body_that_never_arrives_gets_408_and_is_closed(strict_server, caplog):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    closed, got = _closed_within(_raw_request(strict_server.url, head, b'{"prompt": '), 4)
    assert closed and got.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in got
    assert not tracebacks(caplog)


def test_heavy_prompts_do_not_stall_health_or_streams(strict_server):
    """Four ~1 MB prompts, each tokenized for about a second and then rejected as too long, while a
    stream runs and /health is polled: neither waits as long as one tokenization."""
    from dspark.bench.abuse import stall_check

    st = asyncio.run(stall_check(strict_server.url, 4, repeats=38_000, stream_tokens=400))
    assert st["context_length_exceeded"] == 4, st
    assert st["busy_s"] > 1.0 and st["health_polls"] >= 5, st  # the prompts did take their time
    assert st["max_health_s"] < 1.0 and st["max_stream_gap_s"] < 1.0, st


def test_prompts_waiting_to_be_tokenized_are_bounded(strict_server, monkeypatch):
    monkeypatch.setattr(strict_server.app.state.server.prompts, "max_pending", 1)
    big = {"prompt": "hello world, this is text " * 20_000, "max_tokens": 2}

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(strict_server.url + "/v1/completions", json=big) for _ in range(3)))

    rs = asyncio.run(main())
    codes = sorted(r.status_code for r in rs)
    assert codes[0] == 400 and codes[-1] == 429, codes  # one tokenized (too long); later ones turned away
    assert all(int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "queue_full"
               for r in rs if r.status_code == 429)
