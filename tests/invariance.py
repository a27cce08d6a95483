"""Helpers for the row-invariance tests (test_packing.py, test_int4.py, test_native*.py): feed the same tokens in
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


def hidden_of_a_window(dec, ids, layers):
    """The outputs of `layers` (side by side) for a window of 8 tokens after 40 cached ones."""
    cache = dec.new_cache(4)
    with torch.inference_mode():
        for start, n in ((0, 40), (40, 8)):
            cache.reserve("s", start + n)
            out = dec(ids[start:start + n], torch.arange(start, start + n), cache, cache.prepare(["s"], [n]),
                      hidden_layers=layers)
    assert out.hidden.shape == (8, len(layers) * dec.config.hidden_size)
    return out.hidden


def assert_windows_step_in_one_call(dec, lib, step_name, monkeypatch) -> None:
    """Decodes and verify windows of several sequences (a token each, windows of one length, of mixed lengths)
    run as one call of lib's step (`step_name`: csrc/step.c's or csrc/avx2_step.c's), attention reading the cache
    in place (their blocks interleaved in the pool), with the same bits as the layer-by-layer path and as each
    sequence decoded alone; a step with a prefill chunk longer than a window keeps the layer-by-layer path."""
    gen = torch.Generator().manual_seed(5)
    streams = [torch.randint(1000, (n,), generator=gen) for n in (50, 41, 60, 25)]
    plan = [{0: 30}, {1: 25}, {2: 33}, {0: 1, 1: 1, 2: 1}, {0: 4, 1: 4, 2: 4}, {0: 1, 1: 1, 2: 1}, {0: 3, 2: 3},
            {0: 2, 1: 5, 2: 1}, {0: 1, 1: 1, 3: 20}]
    b_lens = []
    step = getattr(lib, step_name)

    def spy(*args):
        b_lens.append(args[24])  # b_len: how many sequences the call ran
        return step(*args)

    monkeypatch.setattr(lib, step_name, spy)
    one_call = batched_logits(dec, streams, plan)
    assert b_lens == [1, 1, 1, 3, 3, 3, 2, 3]  # the last step (a 20-token prefill beside decodes): by layers
    weights, dec._weights = dec._weights, False  # the layer-by-layer path, attention on the same kernel
    by_layers = batched_logits(dec, streams, plan)
    dec._weights = weights
    assert len(b_lens) == 8
    for seq, (got, want) in enumerate(zip(one_call, by_layers)):
        assert torch.equal(got, want), seq
        firsts = [step[seq] for step in plan if seq in step]
        alone = batched_logits(dec, [streams[seq]], [{0: n} for n in firsts])[0]
        assert torch.equal(got, alone), seq
