"""ComputeThread: the one thread of a server process that runs the model: loading, warm-up, then the engine loop.

Why one thread: PyTorch and dspark's kernels parallelise with OpenMP, and OpenMP (libgomp, which the PyTorch
wheels ship) keeps a team of worker threads for every thread that starts parallel work. A model loaded on the
main thread and stepped on an engine thread leaves two teams, more OpenMP threads than cores; libgomp then cuts
its busy-wait to 100 spins (its GOMP_SPINCOUNT rule for oversubscribed CPUs), so the workers sleep between the
few hundred parallel regions of every step and each region waits for a wake-up. A batch-1 step of the embedded
model on a 2-core Zen 4 took ~3x as long on a second thread as on the thread that loaded the model, and as
little as there when one non-main thread did both (`python bench/engine_thread.py`; docs/speed.md, session 60).
"""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, in order (a one-worker executor whose thread
    never blocks interpreter exit: a server stopped while it loads does not wait for the load)."""

    def __init__(self, name: str = "dspark-engine"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue fn(*args); its result or exception arrives on the returned Future."""
        if not self._thread.is_alive():
            raise RuntimeError("the compute thread has stopped")
        fut: Future = Future()
        self._jobs.put((fn, args, fut))
        return fut

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on this thread; waits, returns its result or raises its exception here."""
        return self.submit(fn, *args).result()

    def close(self, timeout: float | None = None) -> None:
        """End the thread once the calls queued before this one are done (waits up to `timeout` seconds)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - delivered to whoever waits on the future
                fut.set_exception(e)
