"""A loaded server under abuse: N requests from C concurrent clients, a share of them bad or aborted,
plus one poison request of every kind, against `dspark serve` started here (its log captured).

Passes when every good request succeeds with text, no response is a 5xx, the server's log holds no
traceback, /metrics comes back to zero running / queued / in-flight requests and zero KV use, a seeded
sampled request gives the same text alone and inside a batch of 8 (--seed-checks times), and while
eight ~1 MB prompts are tokenized and rejected a stream and /health never wait a second.

    .venv/bin/python -m dspark.bench.abuse                        # 200 requests, 32 clients, DSPARK
    .venv/bin/python -m dspark.bench.abuse --requests 60 --clients 8 -- --speculative-algorithm NONE

Arguments after `--` go to `dspark serve`. Prints one JSON summary line; exit 0 when it passed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPTS = ["Why is the sky blue?", "Write a haiku about rain.", "What is 17 * 23?", "Name three prime numbers.",
           "def fibonacci(n):", "Explain recursion in one sentence.", "List the planets.", "Say hello in French."]
BAD = [  # (path, body bytes, status the server must answer): client errors a real client sends; wrong
    # JSON types are 422 (the body does not fit the schema), unusable values 400
    ("/v1/completions", b'{"prompt": "x", "max_tokens": -3}', 400),
    ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', 422),
    ("/v1/chat/completions", b'{"messages": "not a list"}', 422),
    ("/v1/completions", b'{"prompt": "x"', 400),
    ("/v1/completions", b'{"prompt": "x", "top_p": 2.0}', 400),
]
POISON = [  # (kind, path, body bytes, acceptable statuses): one of each
    ("top_p underflowing float32", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"temperature":1,"top_p":1e-46}', {200}),
    ("lone surrogate in a message", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi \\ud800"}]}', {400}),
    ("lone surrogate in a prompt", "/v1/completions", b'{"prompt": "hi \\udfff", "max_tokens": 2}', {400}),
    ("100k nested arrays", "/v1/completions", b"[" * 100_000, {400, 413}),
    ("1e999", "/v1/completions", b'{"prompt": "x", "max_tokens": 1e999}', {400}),
    ("legacy functions", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi"}],"functions":[{"name":"f"}]}', {400}),
    ("tool_choice without tools", "/v1/chat/completions",
     b'{"messages":[{"role":"user","content":"hi"}],"tool_choice":"auto"}', {400}),
    ("1 MB prompt", "/v1/completions", json.dumps({"prompt": "word " * 200_000, "max_tokens": 2}).encode(),
     {400, 413}),
    ("10 MB body", "/v1/completions", b'{"prompt": "' + b"a" * 10_000_000 + b'"}', {413}),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    series = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            series[name] = float(value)
    return series


async def good(c: httpx.AsyncClient, url: str, i: int, max_tokens: int) -> tuple[str, int, bool]:
    """A well-formed request (chat or completion, streamed or not); (kind, status, got text)."""
    prompt, chat, stream = PROMPTS[i % len(PROMPTS)], i % 2 == 0, i % 3 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"max_tokens": max_tokens, "temperature": 0 if i % 4 else 0.8, "seed": i, "stream": stream,
            **({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})}
    if not stream:
        r = await c.post(url + path, json=body)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        return "good", r.status_code, bool(choice.get("message", {}).get("content") or choice.get("text"))
    text, status = "", 0
    async with c.stream("POST", url + path, json=body) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    return "good", 500, False
                delta = event["choices"][0]
                text += (delta.get("delta", {}).get("content") or delta.get("text") or "")
    return "good", status, bool(text)


async def aborted(c: httpx.AsyncClient, url: str, i: int) -> tuple[str, int, bool]:
    """A stream the client hangs up on after its first event."""
    body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 64, "stream": True}
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    return "aborted", r.status_code, True


async def bad(c: httpx.AsyncClient, url: str, i: int) -> tuple[str, int, bool]:
    path, raw, want = BAD[i % len(BAD)]
    r = await c.post(url + path, content=raw, headers={"Content-Type": "application/json"})
    return "bad", r.status_code, r.status_code == want


async def poison(c: httpx.AsyncClient, url: str, kind: str, path: str, raw: bytes, ok: set[int]):
    r = await c.post(url + path, content=raw, headers={"Content-Type": "application/json"})
    return f"poison: {kind}", r.status_code, r.status_code in ok


def upload_disconnect(port: int) -> tuple[str, int, bool]:
    """Headers announce a 1000-byte body; the client sends 10 bytes and hangs up."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"prompt\":")
    return "poison: disconnect during upload", 0, True


async def run_load(url: str, port: int, n: int, clients: int, bad_share: float, max_tokens: int) -> list:
    rng = random.Random(0)
    kinds = ["good"] * n
    for i in rng.sample(range(n), int(round(n * bad_share))):
        kinds[i] = "bad" if i % 2 else "aborted"
    gate = asyncio.Semaphore(clients)
    limits = httpx.Limits(max_connections=clients + len(POISON) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as c:
        async def one(i: int):
            async with gate:
                if kinds[i] == "bad":
                    return await bad(c, url, i)
                if kinds[i] == "aborted":
                    return await aborted(c, url, i)
                return await good(c, url, i, max_tokens)

        async def poisons():
            await asyncio.sleep(1.0)  # inside the loaded run
            out = [await asyncio.to_thread(upload_disconnect, port)]
            for kind, path, raw, ok in POISON:
                out.append(await poison(c, url, kind, path, raw, ok))
            return out

        results = await asyncio.gather(*(one(i) for i in range(n)), poisons())
    return [*results[:-1], *results[-1]]


async def seeded_check(url: str, times: int, max_tokens: int) -> list[bool]:
    """The same seeded sampled request alone and inside a batch of 8 others, `times` times: same text?"""
    body = {"messages": [{"role": "user", "content": "Tell me a short story about a fox."}], "temperature": 1.0,
            "seed": 1234, "max_tokens": max_tokens}
    async with httpx.AsyncClient(timeout=600) as c:
        async def text(b):
            r = await c.post(url + "/v1/chat/completions", json=b)
            return r.json()["choices"][0]["message"]["content"]

        alone = await text(body)
        out = []
        for t in range(times):
            others = [{**body, "seed": 100 * t + k, "messages": [{"role": "user", "content": PROMPTS[k]}]}
                      for k in range(8)]
            got = await asyncio.gather(text(body), *(text(o) for o in others))
            out.append(got[0] == alone)
    return out


async def stall_check(url: str, heavy: int, repeats: int = 40_000, stream_tokens: int = 200,
                      headers: dict | None = None) -> dict[str, float]:
    """`heavy` prompts of `repeats` x 26 characters (~1 MB: tokenized, then rejected as too long) while
    a stream runs and /health is polled: the longest wait of each, in seconds."""
    big = {"prompt": "hello world, this is text " * repeats, "max_tokens": 2}
    stream_body = {"prompt": "Hello", "max_tokens": stream_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True}
    async with httpx.AsyncClient(timeout=600, headers=headers) as c:
        started, stop = asyncio.Event(), asyncio.Event()

        async def health() -> list[float]:
            waits = []
            while not stop.is_set():
                t = time.perf_counter()
                await c.get(url + "/health")
                waits.append(time.perf_counter() - t)
                await asyncio.sleep(0.05)
            return waits

        async def stream() -> list[float]:
            gaps, last = [], None
            async with c.stream("POST", url + "/v1/completions", json=stream_body) as r:
                async for line in r.aiter_lines():
                    now = time.perf_counter()
                    if line.startswith("data: "):
                        started.set()
                        if last is not None and not stop.is_set():
                            gaps.append(now - last)
                        last = now
            return gaps

        streaming = asyncio.create_task(stream())
        await started.wait()
        polling = asyncio.create_task(health())
        t = time.perf_counter()
        answers = await asyncio.gather(*(c.post(url + "/v1/completions", json=big) for _ in range(heavy)))
        busy = time.perf_counter() - t
        stop.set()
        codes = [r.status_code for r in answers]
        too_long = sum(r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
                       for r in answers)
        waits, gaps = await polling, await streaming
    return {"heavy_prompts": heavy, "rejected_400": codes.count(400), "context_length_exceeded": too_long,
            "busy_s": round(busy, 2), "health_polls": len(waits), "max_health_s": round(max(waits, default=0.0), 3),
            "max_stream_gap_s": round(max(gaps, default=0.0), 3)}


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, float]:
    deadline, keys = time.monotonic() + timeout, ("dspark_num_running_requests", "dspark_num_queued_requests",
                                                  "dspark_num_inflight_requests", "dspark_kv_cache_usage_ratio")
    while True:
        m = scrape(url)
        if all(m.get(k, 0) == 0 for k in keys) or time.monotonic() > deadline:
            return {k: m.get(k, 0) for k in keys} | {"5xx": sum(v for k, v in m.items()
                                                           if k.startswith("dspark_http_requests_total")
                                                           and 'status="5' in k)}
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else ["--speculative-algorithm", "DSPARK"]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--bad-share", type=float, default=0.10, help="share of requests that are bad or aborted")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "dspark-abuse-server.log"),
                   help="where the server's log goes (default: %(default)s)")
    p.add_argument("--heavy-prompts", type=int, default=8,
                   help="afterwards: this many ~1 MB prompts while a stream runs and /health is polled")
    p.add_argument("--seed-checks", type=int, default=5,
                   help="afterwards: a seeded request alone vs inside a batch of 8, this many times")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    dspark = Path(sys.executable).with_name("dspark")
    with open(args.log, "w") as log:
        server = subprocess.Popen([str(dspark), "serve", "--port", str(port), "--max-running-requests", "32",
                                   *serve_args], stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() - t0 > 600:
                print(json.dumps({"passed": False, "error": "server did not start", "log": args.log}))
                return 1
            time.sleep(0.5)
        started = time.monotonic() - t0
        t1 = time.monotonic()
        results = asyncio.run(run_load(url, port, args.requests, args.clients, args.bad_share, args.max_tokens))
        seconds = time.monotonic() - t1
        idle = wait_idle(url)
        seeded = asyncio.run(seeded_check(url, args.seed_checks, 32)) if args.seed_checks else []
        stall = asyncio.run(stall_check(url, args.heavy_prompts)) if args.heavy_prompts else {}
    finally:
        server.terminate()
        server.wait(timeout=30)
    log_text = Path(args.log).read_text(errors="replace")
    goods = [r for r in results if r[0] == "good"]
    failed = [r for r in results if not r[2] or r[1] >= 500]
    summary = {
        "requests": args.requests, "clients": args.clients, "good": len(goods),
        "good_ok": sum(1 for _, s, ok in goods if s == 200 and ok),
        "bad": sum(1 for r in results if r[0] == "bad"), "aborted": sum(1 for r in results if r[0] == "aborted"),
        "poison": {r[0][8:]: r[1] for r in results if r[0].startswith("poison")},
        "failed": failed, "tracebacks_in_log": log_text.count("Traceback"), "metrics_after": idle,
        "startup_s": round(started, 1), "load_s": round(seconds, 1), "server": serve_args,
        "seeded_same_text": f"{sum(seeded)}/{len(seeded)}", "stall": stall,
    }
    calm = not stall or (stall["rejected_400"] == stall["heavy_prompts"] and stall["max_health_s"] < 1.0
                         and stall["max_stream_gap_s"] < 1.0)
    summary["passed"] = (not failed and summary["tracebacks_in_log"] == 0 and idle["5xx"] == 0
                         and all(v == 0 for k, v in idle.items() if k != "5xx") and all(seeded) and calm)
    print(json.dumps(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
