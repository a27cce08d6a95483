"""A lone sequence in consecutive blocks reads its keys through a view of the pool (kv_start):
the decoder's logits must equal the gathered path's bit for bit, at every window size."""
from dataclasses import replace

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


def test_view_and_gather_give_identical_logits(tiny_llama_dir):
    model = load_decoder(tiny_llama_dir, dtype=torch.bfloat16)  # the window-invariant CPU path
    ids = torch.randint(0, 1000, (600,), generator=torch.Generator().manual_seed(0))
    outs = {}
    for name, force_gather in (("view", False), ("gather", True)):
        cache = model.new_cache(num_blocks=64, block_size=16)
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
