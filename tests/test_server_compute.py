"""The server runs its model on one thread: `dspark serve` loads, warms up and steps on the same ComputeThread,
and the engine loop runs on the thread it is given (a second OpenMP team made steps ~3x slower)."""
from __future__ import annotations

import socket
import threading
import time
from types import SimpleNamespace

import pytest

from dspark.cli import main
from dspark.server.compute import ComputeThread
from dspark.server.engine_loop import EngineLoop


def test_compute_thread_runs_calls_in_order_on_one_thread():
    compute = ComputeThread("test-compute")
    try:
        seen: list[tuple[int, int]] = []
        futures = [compute.submit(lambda i=i: seen.append((i, threading.get_ident())) or i * i) for i in range(5)]
        assert [f.result(timeout=10) for f in futures] == [0, 1, 4, 9, 16]
        assert [i for i, _ in seen] == list(range(5))
        assert {ident for _, ident in seen} == {compute.ident} != {threading.get_ident()}
        with pytest.raises(ZeroDivisionError):
            compute.call(lambda: 1 / 0)
        assert compute.call(lambda: "still serving") == "still serving"  # a failed call does not end the thread
    finally:
        compute.close(timeout=10)
    with pytest.raises(RuntimeError, match="stopped"):
        compute.submit(lambda: None)


def _stub_engine(record: list[int]):
    """What EngineLoop reads of an engine, with no work: has_unfinished() notes the thread that asks."""
    def has_unfinished() -> bool:
        record.append(threading.get_ident())
        return False

    return SimpleNamespace(proposer=SimpleNamespace(max_drafts=0), num_running=0, cache=SimpleNamespace(usage=0.0),
                           has_unfinished=has_unfinished)


@pytest.mark.parametrize("given", [True, False])
def test_engine_loop_runs_on_the_thread_it_is_given(given):
    record: list[int] = []
    compute = ComputeThread("test-loop") if given else None
    loop = EngineLoop(_stub_engine(record), capacity=1, idle_wait_s=0.01, compute=compute)
    loop.start()
    try:
        with pytest.raises(RuntimeError, match="started already"):
            loop.start()
        deadline = time.monotonic() + 10
        while not record and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.alive
    finally:
        loop.stop(timeout=10)
    assert not loop.alive and record
    if given:
        assert set(record) == {compute.ident}
        assert compute.call(threading.get_ident) == compute.ident  # the given thread outlives the loop
        compute.close(timeout=10)
    else:
        assert threading.get_ident() not in record and len(set(record)) == 1


def test_serve_loads_warms_up_and_serves_on_one_thread(tiny_llama_dir, monkeypatch):
    """`dspark serve`: the model's loading, its warm-up and the engine loop (run_server's compute) share a thread
    that is not the main one."""
    import dspark.server.cli as server_cli
    import dspark.server.launch as launch

    seen: dict[str, object] = {}
    monkeypatch.setattr(server_cli, "load_llm", lambda config: seen.setdefault("load", threading.get_ident()))
    monkeypatch.setattr(server_cli, "warm_up", lambda llm: seen.setdefault("warm_up", threading.get_ident()))
    monkeypatch.setattr(launch, "run_server", lambda llm, config, sock, log_level, compute: seen.update(
        serve=threading.get_ident(), compute=compute.ident))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert main(["serve", "--model", str(tiny_llama_dir), "--port", str(port), "--speculative-algorithm",
                 "NONE"]) == 0
    assert seen["load"] == seen["warm_up"] == seen["compute"] != seen["serve"] == threading.get_ident()
