"""Helpers for the row-invariance tests (test_packing.py, test_int4.py): feed the same tokens in
different windows and batches, and collect the logits of every position, so a test can check that a
position's result does not depend on how it was computed."""
from __future__ import annotations

import torch


def logits_by_chunks(dec, ids, chunks):
    """Logits of every position after the first chunk, fed in the given chunk sizes."""
    cache, got, start = dec.new_cache(4), [], 0
    with torch.inference_mode():
        for n in chunks:
            cache.reserve("s", start + n)
            meta = cache.prepare(["s"], [n])
            out = dec(ids[start:start + n], torch.arange(start, start + n), cache, meta,
                      logits_rows=torch.arange(n))
            got.append(out.logits)
            start += n
    return torch.cat(got[1:])


def batched_logits(dec, streams, plan):
    """Feed several sequences together: plan is a list of steps, each {seq index: new tokens}.
    Returns each sequence's logits for every position after its first step, in order."""
    cache = dec.new_cache(64)
    starts, got = [0] * len(streams), [[] for _ in streams]
    with torch.inference_mode():
        for step_no, step in enumerate(plan):
            names = sorted(step)
            for i in names:
                cache.reserve(i, starts[i] + step[i])
            meta = cache.prepare(names, [step[i] for i in names])
            ids = torch.cat([streams[i][starts[i]:starts[i] + step[i]] for i in names])
            pos = torch.cat([torch.arange(starts[i], starts[i] + step[i]) for i in names])
            out = dec(ids, pos, cache, meta, logits_rows=torch.arange(len(ids)))
            rows = out.logits.split([step[i] for i in names])
            for i, r in zip(names, rows):
                if starts[i] > 0:
                    got[i].append(r)
                starts[i] += step[i]
    return [torch.cat(g) if g else torch.empty(0) for g in got]


def assert_embedded_rows_invariant(dec) -> None:
    """On the embedded model: a position's logits are bit-identical decoded alone, inside verify
    windows of any width, or next to another sequence with other windows."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randint(1000, (90,), generator=gen), torch.randint(1000, (70,), generator=gen)
    alone_a = batched_logits(dec, [a], [{0: 60}] + [{0: 1}] * 30)[0]
    alone_b = batched_logits(dec, [b], [{0: 45}] + [{0: 1}] * 25)[0]
    mixed = batched_logits(dec, [a, b], [{0: 60}, {0: 8, 1: 45}, {0: 3, 1: 7}, {0: 1, 1: 1}, {0: 5, 1: 8},
                                         {0: 13, 1: 2}, {1: 7}])
    assert torch.equal(mixed[0], alone_a) and torch.equal(mixed[1], alone_b)
