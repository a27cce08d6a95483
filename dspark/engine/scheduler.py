"""Scheduler: which requests run this step, how many prompt tokens each prefills, KV reservation
for the widest verify window, and preemption (never dropping a request) when the cache runs short."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from dspark.cache import KVCache
from dspark.config import SchedulerConfig
from dspark.engine.sequence import Sequence, Status


@dataclass(frozen=True)
class ScheduledBatch:
    """One step's work: prompt chunks to prefill and requests to decode (verify)."""

    prefills: list[tuple[Sequence, int]]  # (request, number of tokens to prefill now)
    decodes: list[Sequence]
    preempted: list[Sequence]


class Scheduler:
    """FCFS admission with chunked prefill and LIFO preemption."""

    def __init__(self, config: SchedulerConfig, cache: KVCache):
        self.config = config
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted request and free its cache."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.cache.free(seq.request_id)

    def schedule(self, window: int) -> ScheduledBatch:
        """Plan a step in which each decoding request verifies up to `window` tokens."""
        preempted: list[Sequence] = []
        decodes: list[Sequence] = []
        for seq in list(self.running):
            if seq.in_prefill or seq not in self.running:
                continue
            while not self.cache.can_reserve(seq.request_id, seq.num_cached + window):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq in self.running:
                self.cache.reserve(seq.request_id, seq.num_cached + window)
                decodes.append(seq)
        budget = self.config.max_num_batched_tokens
        prefills: list[tuple[Sequence, int]] = []
        for seq in [s for s in self.running if s.in_prefill]:
            budget = self._admit_chunk(seq, budget, prefills)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            before = len(prefills)
            budget = self._admit_chunk(seq, budget, prefills)
            if len(prefills) == before:
                break  # no room in the cache: wait for running requests to finish
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
        if not prefills and not decodes and len(self.running) > 1:
            # every running request is mid-prefill and the cache is full: make room by preempting one
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            return self.schedule(window)
        return ScheduledBatch(prefills=prefills, decodes=decodes, preempted=preempted)

    def _admit_chunk(self, seq: Sequence, budget: int, out: list) -> int:
        n = min(budget, seq.prefill_target - seq.num_cached)
        if n <= 0 or not self.cache.can_reserve(seq.request_id, seq.num_cached + n):
            return budget
        self.cache.reserve(seq.request_id, seq.num_cached + n)
        out.append((seq, n))
        return budget - n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.request_id)
        seq.num_cached = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
