"""Serving load generator against any OpenAI-compatible endpoint (dspark, SGLang, vLLM, ...).

Closed loop: N clients, each sending its next request when the last one finishes. Open loop: Poisson
arrivals at a fixed rate, whatever the server's state. Every level is bounded in request count and
time, and the target must be on loopback unless remote hosts are explicitly allowed.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from urllib.parse import urlparse

import httpx
from tqdm import tqdm

from dspark.bench.stats import latency_summary

FALLBACK_PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "A farmer has 17 sheep and buys 5 more, then sells 8. How many sheep are left? Think step by step.",
    "Summarise the plot of a detective story set on a night train.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a list and a tuple in Python?",
    "Write a short poem about a lighthouse in winter.",
    "Describe how a hash table handles collisions.",
]


@dataclass(frozen=True)
class ServeConfig:
    """One load-generation run: where, how (closed / open loop), how much, how long."""

    url: str
    mode: str = "closed"  # "closed": levels are concurrencies; "open": levels are rates (requests/s)
    levels: list[float] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    num_requests: int = 64  # per level
    duration_s: float = 120.0  # per level: no new request after this
    request_timeout_s: float = 300.0
    max_tokens: int = 256
    temperature: float = 0.0
    endpoint: str = "chat"  # "chat" (/v1/chat/completions) or "completions" (/v1/completions)
    model: str | None = None  # None: the first id from /v1/models
    api_key: str | None = None
    label: str = "server"
    seed: int = 0
    max_inflight: int = 512  # open loop: arrivals beyond this are counted as dropped, never queued here
    warmup: int = 1
    progress: bool = True


@dataclass
class RequestResult:
    """Timing of one request (perf_counter seconds) and how it ended."""

    start: float
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str | None = None
    usage_tokens: bool = False  # tokens came from the usage record, not from counting chunks


def check_loopback(url: str, allow_remote: bool = False) -> None:
    """ValueError unless `url` is http(s) on a loopback host (or remote hosts are allowed)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"--url must look like http://127.0.0.1:30000, got {url!r}")
    if allow_remote:
        return
    host = parsed.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ValueError(f"{host} is not a loopback address; pass --allow-remote to load a remote server")


def base_url(url: str) -> str:
    """http://host:port[/prefix], without a trailing /v1."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _body(cfg: ServeConfig, model: str, prompt: str) -> dict:
    body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}, "seed": cfg.seed}
    if cfg.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _delta_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    return (c.get("delta") or {}).get("content") or c.get("text") or ""


async def one_request(client: httpx.AsyncClient, cfg: ServeConfig, model: str, prompt: str) -> RequestResult:
    """Send one streaming request; time the first token, every chunk and the end."""
    path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"
    r = RequestResult(start=time.perf_counter())
    chunks, done = 0, False
    try:
        async with client.stream("POST", path, json=_body(cfg, model, prompt)) as resp:
            if resp.status_code != 200:
                await resp.aread()
                r.error = f"http {resp.status_code}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    r.error = "error event"
                    return r
                now = time.perf_counter()
                if _delta_text(chunk):
                    r.first = r.first or now
                    r.chunk_times.append(now)
                    chunks += 1
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    r.tokens, r.usage_tokens = int(usage["completion_tokens"]), True
        if not done:
            r.error = "stream ended without [DONE]"
    except httpx.TimeoutException:
        r.error = "timeout"
    except httpx.HTTPError as e:
        r.error = type(e).__name__
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        r.error = "malformed stream"
    finally:
        r.end = time.perf_counter()
    if not r.usage_tokens:
        r.tokens = chunks
    return r


async def _closed(client, cfg, model, prompts, concurrency: int, bar) -> list[RequestResult]:
    results: list[RequestResult] = []
    deadline = time.perf_counter() + cfg.duration_s
    counter = iter(range(cfg.num_requests))

    async def client_loop():
        for i in counter:
            if time.perf_counter() >= deadline:
                return
            results.append(await one_request(client, cfg, model, prompts[i % len(prompts)]))
            bar.update()

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return results


async def _open(client, cfg, model, prompts, rate: float, bar) -> list[RequestResult]:
    rng = random.Random(cfg.seed)
    start = time.perf_counter()
    tasks, dropped = [], []

    async def send(i):
        r = await one_request(client, cfg, model, prompts[i % len(prompts)])
        bar.update()
        return r

    at = 0.0
    for i in range(cfg.num_requests):
        at += rng.expovariate(rate)
        if at > cfg.duration_s:
            break
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if sum(not t.done() for t in tasks) >= cfg.max_inflight:
            dropped.append(RequestResult(start=time.perf_counter(), end=time.perf_counter(), error="dropped"))
            bar.update()
            continue
        tasks.append(asyncio.create_task(send(i)))
    return list(await asyncio.gather(*tasks)) + dropped


def summarize(results: list[RequestResult], seconds: float) -> dict:
    """Throughput, per-user speed, TTFT / per-token / inter-chunk latency percentiles, errors."""
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    tpot = [(r.end - r.first) / (r.tokens - 1) for r in ok if r.first and r.tokens > 1]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {"requests": len(results), "ok": len(ok), "errors": dict(Counter(r.error for r in results if r.error)),
            "duration_s": seconds, "output_tokens": tokens,
            "throughput_tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "requests_per_s": len(ok) / seconds if seconds > 0 else 0.0,
            "per_user_tokens_per_s": latency_summary([r.tokens / (r.end - r.start) for r in ok if r.end > r.start]),
            "ttft_s": latency_summary([r.first - r.start for r in ok if r.first]),
            "tpot_s": latency_summary(tpot), "itl_s": latency_summary(itl),
            "e2e_s": latency_summary([r.end - r.start for r in ok]),
            "tokens_from_usage": all(r.usage_tokens for r in ok) if ok else None}


async def _discover_model(client: httpx.AsyncClient) -> str:
    try:
        resp = await client.get("/v1/models")
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
        return "default"


async def run_serve_async(cfg: ServeConfig, prompts: list[str]) -> dict:
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=int(max(cfg.levels)) + 8 if cfg.mode == "closed" else cfg.max_inflight + 8)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url(cfg.url), headers=headers, timeout=timeout, limits=limits,
                                 trust_env=False) as client:
        model = cfg.model or await _discover_model(client)
        for k in range(cfg.warmup):
            await one_request(client, cfg, model, prompts[k % len(prompts)])
        levels = []
        bar = tqdm(total=cfg.num_requests * len(cfg.levels), desc=f"serve {cfg.label}", disable=not cfg.progress,
                   file=sys.stderr)
        for level in cfg.levels:
            bar.set_postfix_str(f"{cfg.mode} {level:g}")
            t = time.perf_counter()
            if cfg.mode == "closed":
                results = await _closed(client, cfg, model, prompts, int(level), bar)
            else:
                results = await _open(client, cfg, model, prompts, float(level), bar)
            levels.append({"level": level, **summarize(results, time.perf_counter() - t)})
        bar.close()
    return {"label": cfg.label, "url": cfg.url, "model": model, "mode": cfg.mode,
            "config": {k: v for k, v in asdict(cfg).items() if k not in ("api_key", "progress")}, "levels": levels}


def run_serve(cfg: ServeConfig, prompts: list[str] | None = None, allow_remote: bool = False) -> dict:
    """Run every level; return one entry of the 'serve' section of results.json."""
    check_loopback(cfg.url, allow_remote)
    if cfg.mode not in ("closed", "open"):
        raise ValueError(f"mode must be closed or open, got {cfg.mode!r}")
    if cfg.endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be chat or completions, got {cfg.endpoint!r}")
    if not cfg.levels or any(x <= 0 for x in cfg.levels):
        raise ValueError("levels (concurrencies or rates) must be positive")
    return asyncio.run(run_serve_async(cfg, prompts or FALLBACK_PROMPTS))
