"""Prometheus metrics in the text exposition format (version 0.0.4), written by hand: counters,
gauges read at scrape time, and histograms. Thread-safe: the engine loop and handlers both record."""
from __future__ import annotations

import math
import threading
from typing import Callable

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def _labels(names: tuple[str, ...], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)] + ([extra] if extra else [])
    return "{" + ",".join(parts) + "}" if parts else ""


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _num(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if isinstance(x, float) and not float(x).is_integer() else str(int(x))


class Metric:
    """One metric family: a name, a help line, a type, and samples keyed by label values."""

    kind = "untyped"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()):
        self.name, self.help, self.labelnames = name, help, tuple(labelnames)
        self._lock = threading.Lock()

    def _key(self, labels: dict) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {tuple(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}", *self.samples()]

    def samples(self) -> list[str]:
        raise NotImplementedError


class Counter(Metric):
    """A monotonically increasing total."""

    kind = "counter"

    def __init__(self, name: str, help: str, labelnames: tuple[str, ...] = ()):
        super().__init__(name, help, labelnames)
        self._values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0}

    def inc(self, amount: float = 1, **labels) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels) -> float:
        return self._values.get(self._key(labels), 0)

    def samples(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_labels(self.labelnames, k)} {_num(v)}" for k, v in items]


class Gauge(Metric):
    """A value read from `read()` at scrape time."""

    kind = "gauge"

    def __init__(self, name: str, help: str, read: Callable[[], float]):
        super().__init__(name, help)
        self.read = read

    def samples(self) -> list[str]:
        return [f"{self.name} {_num(self.read())}"]


class Histogram(Metric):
    """Observations counted into cumulative `le` buckets, with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...]):
        super().__init__(name, help)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._counts = [0] * len(self.buckets)
        self._sum = 0.0
        self._count = 0

    def observe(self, value: float) -> None:
        with self._lock:
            for i, bound in enumerate(self.buckets):
                if value <= bound:
                    self._counts[i] += 1
                    break
            self._sum += value
            self._count += 1

    @property
    def count(self) -> int:
        return self._count

    def samples(self) -> list[str]:
        with self._lock:
            counts, total, n = list(self._counts), self._sum, self._count
        lines, cumulative = [], 0
        for bound, c in zip(self.buckets, counts):
            cumulative += c
            lines.append(f'{self.name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        return lines + [f"{self.name}_sum {_num(total)}", f"{self.name}_count {n}"]


class ServerMetrics:
    """Everything /metrics reports. Gauges read live engine state through the callables given."""

    def __init__(self, *, max_drafts: int, queued: Callable[[], float], running: Callable[[], float],
                 kv_usage: Callable[[], float], inflight: Callable[[], float]):
        self.http_requests = Counter("dspark_http_requests_total", "HTTP requests by endpoint and status code.",
                                     ("endpoint", "status"))
        self.finished = Counter("dspark_requests_finished_total",
                                "Generation requests that ended, by finish reason (stop, length, abort, error).",
                                ("finish_reason",))
        self.prompt_tokens = Counter("dspark_prompt_tokens_total", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter("dspark_generation_tokens_total", "Generated (committed) tokens.")
        self.rounds = Counter("dspark_spec_rounds_total", "Verify rounds (decode steps of one request).")
        self.position_accepted = Counter("dspark_spec_accepted_per_position_total",
                                         "Rounds whose draft at this position (1-based) was accepted; "
                                         "divide by dspark_spec_rounds_total for the per-position acceptance.",
                                         ("position",))
        self.engine_errors = Counter("dspark_engine_errors_total",
                                     "Engine failures: steps that raised, and requests the engine failed alone.")
        self.accept_length = Histogram("dspark_spec_accept_length",
                                       "Tokens committed per verify round (accepted drafts + 1).",
                                       tuple(range(1, max_drafts + 2)))
        self.verify_tokens = Histogram("dspark_verify_batch_tokens",
                                       "Tokens in one engine forward (prefill chunks + verify windows).", TOKEN_BUCKETS)
        self.ttft = Histogram("dspark_time_to_first_token_seconds", "Admission to first generated token.",
                              LATENCY_BUCKETS)
        self.tpot = Histogram("dspark_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", LATENCY_BUCKETS)
        self.e2e = Histogram("dspark_e2e_request_latency_seconds", "Admission to finish.", LATENCY_BUCKETS)
        self._metrics: list[Metric] = [
            self.http_requests, self.finished, self.prompt_tokens, self.generation_tokens,
            Gauge("dspark_num_queued_requests", "Admitted requests waiting for a running slot.", queued),
            Gauge("dspark_num_running_requests", "Requests in the running batch.", running),
            Gauge("dspark_num_inflight_requests", "Admitted requests not yet finished (queued + running).", inflight),
            Gauge("dspark_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", kv_usage),
            self.rounds, self.position_accepted, self.accept_length, self.verify_tokens,
            self.ttft, self.tpot, self.e2e, self.engine_errors,
        ]

    def observe_rounds(self, accept_lengths: list[int]) -> None:
        """Record new verify rounds of one request by their committed lengths."""
        for length in accept_lengths:
            self.rounds.inc()
            self.accept_length.observe(length)
            for position in range(1, length):
                self.position_accepted.inc(position=position)

    def render(self) -> str:
        return "\n".join(line for m in self._metrics for line in m.render()) + "\n"
