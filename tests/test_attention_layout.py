"""A lone sequence in consecutive blocks reads its keys through a view of the pool (kv_start):
the decoder's logits must equal the gathered path's bit for bit, at every window size."""
from dataclasses import replace

import pytest
import torch

from dspark.cache import KVCache
from dspark.models.loader import load_decoder


def test_lone_sequence_gets_consecutive_blocks_and_a_view():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_blocks=8, block_size=4)
    cache.reserve("a", 9)
    cache.reserve("b", 4)
    cache.free("a")  # blocks 0-2 come back; the lowest go first
    cache.reserve("c", 8)
    meta = cache.prepare(["c"], [8])
    assert cache._tables["c"] == [0, 1] and meta.groups[0].kv_start == 0
    cache.truncate("c", 2)  # block 1 comes back
    cache.reserve("c", 14)  # 1 and 2, then past b's block 3: not consecutive any more, gathered
    assert cache._tables["c"] == [0, 1, 2, 4] and cache.prepare(["c"], [12]).groups[0].kv_start is None
    cache.reserve("b", 2)
    assert cache.prepare(["b"], [1]).groups[0].kv_start == 12  # b alone: consecutive (block 3)
    cache.reserve("b", 2)
    cache.reserve("c", 15)
    assert cache.prepare(["b", "c"], [1, 1]).groups[0].kv_start is None  # batches gather


@pytest.mark.parametrize("kv_align", [1, 16])
def test_the_lone_sequence_shortcut_builds_the_general_metadata(kv_align, monkeypatch):
    """prepare() for one sequence in consecutive blocks (KVCache._prepare_consecutive) returns the slots, mask
    and view the general path builds, step after step (prefill, decodes, windows, truncation); out of
    consecutive blocks it leaves the sequence to the general path, which gathers."""
    def steps(shortcut: bool):
        cache = KVCache(num_layers=1, num_kv_heads=2, head_dim=4, num_blocks=16, block_size=4, kv_align=kv_align)
        if not shortcut:
            monkeypatch.setattr(cache, "_prepare_consecutive", lambda seq, q: None)
        cache.reserve("other", 4)  # block 0
        got = []
        for n, keep in [(13, None), (1, None), (8, None), (1, 16), (3, None), (6, 17)]:
            if keep is not None:
                cache.truncate("s", keep)
            cache.reserve("s", cache.length("s") + n)
            got.append(cache.prepare(["s"], [n]))
        cache.reserve("other", 20)  # its new blocks follow s's: s grows past them, not consecutive any more
        cache.reserve("s", cache.length("s") + 20)
        got.append(cache.prepare(["s"], [20]))
        return got
    for fast, slow in zip(steps(True), steps(False), strict=True):
        a, b = fast.groups[0], slow.groups[0]
        assert torch.equal(fast.slot_mapping, slow.slot_mapping) and torch.equal(a.mask, b.mask)
        assert (a.kv_start, a.rows, a.q_index, a.max_q) == (b.kv_start, b.rows, b.q_index, b.max_q)
        assert (a.kv_rows is None) == (a.kv_start is not None)
    assert fast.groups[0].kv_start is None  # the last step gathers


def test_view_and_gather_give_identical_logits(tiny_llama_dir):
    model = load_decoder(tiny_llama_dir, dtype=torch.bfloat16)  # the window-invariant CPU path
    ids = torch.randint(0, 1000, (600,), generator=torch.Generator().manual_seed(0))
    outs = {}
    for name, force_gather in (("view", False), ("gather", True)):
        cache = model.new_cache(num_blocks=64, block_size=16)
        if force_gather:  # the general path's metadata, which has the rows to gather too
            cache._prepare_consecutive = lambda seq, q: None
        got, done = [], 0
        with torch.inference_mode():
            for n in [300, 1, 8, 3, 1, 200, 7, 1, 79]:  # prefill, decodes and windows, past 512 keys
                cache.reserve(0, done + n)
                meta = cache.prepare([0], [n])
                assert meta.groups[0].kv_start == 0  # alone in a fresh pool
                if force_gather:
                    meta = replace(meta, groups=(replace(meta.groups[0], kv_start=None),))
                out = model(ids[done:done + n], torch.arange(done, done + n), cache, meta,
                            logits_rows=torch.arange(n))
                got.append(out.logits)
                done += n
        outs[name] = torch.cat(got)
    assert torch.equal(outs["view"], outs["gather"])


def test_prefill_chunks_get_their_own_attention_group(tiny_llama_dir):
    """A ragged batch of a 40-token prefill chunk, decodes and a verify window: three groups, and
    every row bit-identical to the same sequence run alone."""
    model = load_decoder(tiny_llama_dir, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(1)
    prompts = {name: torch.randint(0, 1000, (n,), generator=gen) for name, n in
               (("p", 40), ("d1", 9), ("d2", 30), ("w", 12))}
    new = {"p": 40, "d1": 1, "d2": 1, "w": 5}  # tokens each appends in the mixed step

    def prime(cache, name):  # everything before the mixed step
        done = len(prompts[name]) - new[name]
        if done:
            cache.reserve(name, done)
            model(prompts[name][:done], torch.arange(done), cache, cache.prepare([name], [done]))

    alone = {}
    with torch.inference_mode():
        for name in prompts:
            cache = model.new_cache(num_blocks=32, block_size=4)
            prime(cache, name)
            n, total = new[name], len(prompts[name])
            cache.reserve(name, total)
            out = model(prompts[name][total - n:], torch.arange(total - n, total), cache,
                        cache.prepare([name], [n]), logits_rows=torch.arange(n))
            alone[name] = out.logits
        cache = model.new_cache(num_blocks=64, block_size=4)
        names = ["d1", "p", "w", "d2"]
        for name in names:
            prime(cache, name)
            cache.reserve(name, len(prompts[name]))
        meta = cache.prepare(names, [new[n] for n in names])
        assert len(meta.groups) == 3  # the two decodes, the window, the prefill chunk
        ids = torch.cat([prompts[n][-new[n]:] for n in names])
        pos = torch.cat([torch.arange(len(prompts[n]) - new[n], len(prompts[n])) for n in names])
        out = model(ids, pos, cache, meta, logits_rows=torch.arange(len(ids)))
    for name, logits in zip(names, out.logits.split([new[n] for n in names])):
        assert torch.equal(logits, alone[name]), name
