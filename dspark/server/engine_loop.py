"""EngineLoop: one thread owns the LLMEngine and runs step() while there is work; HTTP handlers
talk to it only through a thread-safe inbox (add / abort) and per-request asyncio queues. That thread is
a ComputeThread (dspark/server/compute.py): `dspark serve` loads the model on the same one, so a step
runs with the OpenMP team that loading started and no second team beside it.

Admission is bounded: at most `capacity` requests are in flight (running + queued); past that
submit() raises QueueFull before anything is queued, so accepted work is never dropped."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from dataclasses import dataclass

from dspark.engine.llm_engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.server.compute import ComputeThread
from dspark.server.errors import APIError
from dspark.server.metrics import ServerMetrics

log = logging.getLogger("dspark.server")


class QueueFull(Exception):
    """The bounded queue is full; the client should retry later."""


class RequestHandle:
    """The handler's end of one request: the engine thread posts ("accepted" | "output" | "error", value)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, num_prompt_tokens: int):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.perf_counter()

    def post(self, kind: str, value=None) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
        except RuntimeError:
            pass  # the event loop is gone (shutdown): nobody is listening

    async def next(self) -> tuple[str, object]:
        """The newest news: outputs are snapshots, so queued older ones are skipped; errors win."""
        kind, value = await self.queue.get()
        while kind == "output" and not self.queue.empty():
            kind, value = self.queue.get_nowait()
        return kind, value


@dataclass
class _Live:
    handle: RequestHandle
    rounds_seen: int = 0
    tokens_seen: int = 0
    first_token: float | None = None


class EngineLoop:
    """Continuous batching over every connection, in one thread: `compute`, the thread that loaded the
    model (the loop then keeps it), or else a thread of the loop's own."""

    def __init__(self, engine: LLMEngine, *, capacity: int, idle_wait_s: float = 0.5,
                 compute: ComputeThread | None = None):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.engine = engine
        self.capacity = capacity
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._inflight = 0
        self._live: dict[str, _Live] = {}  # engine thread only
        self._compute, self._owns_compute = compute, compute is None
        self._running: Future | None = None  # the loop's run on the compute thread
        self.metrics = ServerMetrics(
            max_drafts=engine.proposer.max_drafts, inflight=lambda: self._inflight,
            running=lambda: engine.num_running, queued=lambda: max(0, self._inflight - engine.num_running),
            kv_usage=lambda: engine.cache.usage)

    # --- handler side (event-loop thread) ------------------------------------------------------
    def start(self) -> None:
        if self._running is not None:
            raise RuntimeError("the engine loop was started already")
        if self._compute is None:
            self._compute = ComputeThread("dspark-engine-loop")
        self._running = self._compute.submit(self._run)
        log.info("engine loop started")  # here, not on the loop's thread: before the server says it is ready

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what is in flight (the server is going away) and end the loop (and its own thread)."""
        if self.alive:
            self._inbox.put(("stop",))
            self._wake.set()
            wait_for([self._running], timeout)
        if self._owns_compute and self._compute is not None:
            self._compute.close(timeout)

    @property
    def alive(self) -> bool:
        return self._running is not None and not self._running.done()

    @property
    def inflight(self) -> int:
        return self._inflight

    def submit(self, token_ids: list[int], params: SamplingParams, *, request_id: str,
               prompt: str | None = None) -> RequestHandle:
        """Admit a request (QueueFull past capacity); its outputs arrive on the returned handle."""
        if not self.alive:
            raise APIError(503, "the engine loop is not running", code="engine_unavailable")
        with self._lock:
            if self._inflight >= self.capacity:
                raise QueueFull(f"{self.capacity} requests in flight")
            self._inflight += 1
        handle = RequestHandle(request_id, asyncio.get_running_loop(), len(token_ids))
        self._inbox.put(("add", handle, token_ids, params, prompt))
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        """Abort a request (client gone); its cache is freed on the loop's next turn."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # --- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.clear()
            if not self._drain():
                break
            if not self.engine.has_unfinished():
                self._wake.wait(self.idle_wait_s)
                continue
            self._step()
        log.info("engine loop stopped")

    def _drain(self) -> bool:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if cmd[0] == "add":
                self._add(*cmd[1:])
            elif cmd[0] == "abort":
                self._abort(cmd[1])
            else:
                self._fail_all(APIError(503, "the server is shutting down", code="shutting_down"))
                return False

    def _add(self, handle: RequestHandle, token_ids: list[int], params: SamplingParams, prompt: str | None) -> None:
        try:
            self.engine.add_request(token_ids, params, prompt=prompt, request_id=handle.request_id)
        except ValueError as e:  # the client's request does not fit (the handler checks most of this first)
            self._end(handle, "error", APIError(400, str(e), param="prompt", code="invalid_value"))
            return
        except Exception as e:  # noqa: BLE001 - the loop must survive anything one request does
            log.exception("add_request failed for %s", handle.request_id)
            self._end(handle, "error", APIError(500, f"internal error: {type(e).__name__}", code="internal_error"))
            return
        self._live[handle.request_id] = _Live(handle)
        self.metrics.prompt_tokens.inc(handle.num_prompt_tokens)
        handle.post("accepted")

    def _abort(self, request_id: str) -> None:
        live = self._live.pop(request_id, None)
        if live is None:
            return  # already finished, or never admitted
        self.engine.abort(request_id)
        self._end(live.handle, "abort")

    def _end(self, handle: RequestHandle, reason: str, error: APIError | None = None) -> None:
        with self._lock:
            self._inflight -= 1
        self.metrics.finished.inc(finish_reason=reason)
        if error is not None:
            handle.post("error", error)

    def _step(self) -> None:
        before = self._forward_tokens()
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001 - outside any one request (the engine isolates those): fail all
            log.exception("engine step failed; failing the %d requests in flight", len(self._live))
            self.metrics.engine_errors.inc()
            self._fail_all(APIError(500, "internal error in the engine step; the request was dropped",
                                    code="internal_error"))
            return
        after = self._forward_tokens()
        if after > before:
            self.metrics.verify_tokens.observe(after - before)
        for out in outputs:
            self._deliver(out)

    def _forward_tokens(self) -> int:
        """Tokens through the target so far: prefill chunks, plus anchor and verified drafts per round."""
        st = self.engine.stats
        return st.prefill_tokens + st.rounds + (st.drafted if self.engine.verify_mode == "cap-accept" else st.verified)

    def _deliver(self, out: RequestOutput) -> None:
        live = self._live.get(out.request_id)
        if live is None:
            return
        now, m = time.perf_counter(), self.metrics
        m.observe_rounds(out.accept_lengths[live.rounds_seen:])
        live.rounds_seen = len(out.accept_lengths)
        m.generation_tokens.inc(len(out.token_ids) - live.tokens_seen)
        live.tokens_seen = len(out.token_ids)
        if live.first_token is None and out.token_ids:
            live.first_token = now
            m.ttft.observe(now - live.handle.arrival)
        if out.finish_reason == "error":  # the engine failed this request alone (and logged why)
            del self._live[out.request_id]
            m.engine_errors.inc()
            self._end(live.handle, "error", APIError(500, "internal error while generating this request; it was "
                                                          "stopped (other requests were not affected)",
                                                     code="internal_error"))
            return
        if out.finished:
            del self._live[out.request_id]
            m.e2e.observe(now - live.handle.arrival)
            if len(out.token_ids) > 1:
                m.tpot.observe((now - live.first_token) / (len(out.token_ids) - 1))
            self._end(live.handle, out.finish_reason or "stop")
        live.handle.post("output", out)

    def _fail_all(self, error: APIError) -> None:
        for request_id, live in list(self._live.items()):
            del self._live[request_id]
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", request_id)
            self._end(live.handle, "error", error)
        sched = self.engine.scheduler  # anything left that no handler owns
        for seq in list(sched.waiting) + list(sched.running):
            try:
                self.engine.abort(seq.request_id)
            except Exception:  # noqa: BLE001
                log.exception("abort of %s failed", seq.request_id)
