"""llama.cpp's llama-server as a measured peer, on the same GGUF and cores as dspark's own methods.

  llama.cpp-server        plain decoding of the target GGUF
  llama.cpp-dspark        + dspark's DSpark drafter as a draft GGUF (`--spec-type draft-dspark`, fixed
                          `--spec-draft-n-max` = the drafter's gamma: every draft verified, like dspark-fixed)
  llama.cpp-dspark-pmin   the same with `--spec-draft-p-min P`: llama.cpp stops a draft where the confidence
                          head's sigmoid falls below P (its own, simpler cut of the window)

The binary comes from `make llamacpp` ($DSPARK_HOME/llama.cpp/bin/llama-server), $DSPARK_LLAMA_SERVER or
PATH. The server runs one slot (`--parallel 1`), greedy or sampled like each request asks, with no prompt
cache between requests, and `--metrics`: its speculative counters give the drafts made, accepted and
verified (mean accepted length = 1 + accepted / verification steps, the engine's tau).
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from dspark.sampling_params import SamplingParams

LLAMA_SERVER_METHODS = ("llama.cpp-server", "llama.cpp-dspark", "llama.cpp-dspark-pmin")
DEFAULT_P_MIN = 0.5
_STEPS = "spec_decode_num_drafts_total"  # verification steps; drafts made / accepted come with each answer
_COUNTERS = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total", _STEPS)


def find_llama_server() -> Path | None:
    """$DSPARK_LLAMA_SERVER, else the `make llamacpp` build under $DSPARK_HOME, else llama-server on PATH."""
    from dspark.models.embedded import dspark_home

    for candidate in (os.environ.get("DSPARK_LLAMA_SERVER"), dspark_home() / "llama.cpp" / "bin" / "llama-server",
                      shutil.which("llama-server")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def server_command(binary: Path, gguf: Path, port: int, threads: int, *, draft: Path | None = None,
                   n_max: int = 7, p_min: float | None = None, ctx: int = 4096) -> list[str]:
    """llama-server's command line for one method."""
    cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-tb", str(threads), "-c", str(ctx), "--parallel", "1", "--metrics", "--no-webui"]
    if draft is not None:
        cmd += ["-md", str(draft), "--spec-type", "draft-dspark", "--spec-draft-n-max", str(n_max),
                "-td", str(threads), "-tbd", str(threads)]
        if p_min is not None:  # llama.cpp's default, 0, drafts all n_max tokens
            cmd += ["--spec-draft-p-min", str(p_min)]
    return cmd


def completion_request(ids: list[int], p: SamplingParams) -> dict:
    """The /completion body for one prompt (token ids in, token ids out), sampling as `p` asks."""
    body = {"prompt": ids, "n_predict": p.max_tokens, "cache_prompt": False, "return_tokens": True,
            "stream": False, "ignore_eos": p.ignore_eos, "repeat_penalty": 1.0, "min_p": 0.0}
    if p.greedy:
        body.update(temperature=0.0, top_k=1)
    else:
        body.update(temperature=p.temperature, top_k=p.top_k if p.top_k > 0 else 0, top_p=p.top_p,
                    seed=p.seed if p.seed is not None else -1)
    return body


def parse_metrics(text: str) -> dict[str, float]:
    """The speculative counters of a Prometheus /metrics page (absent ones read 0)."""
    out = dict.fromkeys(_COUNTERS, 0.0)
    for line in text.splitlines():
        m = re.match(r"^llamacpp:(\w+)\s+([0-9.eE+-]+)$", line.strip())
        if m and m.group(1) in out:
            out[m.group(1)] = float(m.group(2))
    return out


class LlamaServer:
    """One llama-server process on a free loopback port, stopped at exit."""

    def __init__(self, cmd_for_port, log_path: Path, timeout: float = 300.0):
        import httpx

        self.port = _free_port()
        self.log_path = log_path
        self.cmd = cmd_for_port(self.port)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        atexit.register(self.close)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600.0, trust_env=False)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}: {self._tail()}")
            try:
                if self.client.get("/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"llama-server was not ready after {timeout:.0f} s: {self._tail()}")
            time.sleep(0.25)

    def complete(self, body: dict) -> dict:
        r = self.client.post("/completion", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"llama-server answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def counters(self) -> dict[str, float]:
        return parse_metrics(self.client.get("/metrics").text)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.client.close()
        self._log.close()

    def _tail(self) -> str:
        self._log.flush()
        return " | ".join(self.log_path.read_text(errors="replace").strip().splitlines()[-5:])


class LlamaServerMethod:
    """A llama.cpp method behind the bench's interface: run() answers prompts one at a time."""

    def __init__(self, name: str, setup, block_size: int | None = None):
        import torch

        from dspark.bench.methods import target_gguf

        binary = find_llama_server()
        if binary is None:
            raise FileNotFoundError("llama-server not found: run `make llamacpp` (or set $DSPARK_LLAMA_SERVER)")
        self.name = name
        self.workdir = Path(tempfile.mkdtemp(prefix="dspark-llama-server-"))
        gguf = target_gguf(setup)
        draft = None
        n_max = block_size or 7
        if name != "llama.cpp-server":
            draft = self._draft_gguf(setup, gguf)
        p_min = None
        if name == "llama.cpp-dspark-pmin":
            p_min = setup.llama_p_min if setup.llama_p_min is not None else DEFAULT_P_MIN
            if not 0.0 <= p_min <= 1.0:
                raise ValueError(f"--llama-p-min must be in [0, 1], got {p_min}")
        threads = torch.get_num_threads()
        self.server = LlamaServer(lambda port: server_command(binary, gguf, port, threads, draft=draft, n_max=n_max,
                                                              p_min=p_min),
                                  self.workdir / "llama-server.log")

    def _draft_gguf(self, setup, target_gguf: Path) -> Path:
        """dspark's DSpark drafter (setup.dspark_draft, else the shipped one) as a draft GGUF."""
        from dspark.interop.convert import convert

        src = setup.dspark_draft or "embedded"
        if setup.dspark_draft is None and setup.model not in (None, "", "embedded"):
            raise ValueError("llama.cpp-dspark needs --dspark-draft-model for a model other than the embedded one")
        target = None if setup.model in (None, "", "embedded") else setup.model
        out = self.workdir / "draft.gguf"
        convert(src, out, to="gguf", target=target, target_gguf=target_gguf)
        return out

    def run(self, prompts: list[list[int]], params: list[SamplingParams], concurrency: int = 1):
        from dspark.bench.methods import BatchRun, Completion

        before = self.server.counters()
        comps, t0 = [], time.perf_counter()
        for ids, p in zip(prompts, params):
            out = self.server.complete(completion_request(ids, p))
            timings = out.get("timings", {})
            n = len(out.get("tokens", []))
            ttft = timings.get("prompt_ms")
            tpot = timings.get("predicted_per_token_ms")
            comps.append(Completion([int(t) for t in out.get("tokens", [])],
                                    ttft=ttft / 1000 if ttft is not None else None,
                                    tpot=tpot / 1000 if tpot is not None and n > 1 else None,
                                    drafted=timings.get("draft_n", 0), accepted=timings.get("draft_n_accepted", 0)))
        seconds = time.perf_counter() - t0
        steps = self.server.counters()[_STEPS] - before[_STEPS]
        return BatchRun(comps, seconds, verify_steps=int(steps))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
