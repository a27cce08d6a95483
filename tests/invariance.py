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
