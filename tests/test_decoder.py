"""Decoder parity with transformers (fp32, 1e-4) for prefill, decode and ragged batches."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark.models.loader import load_decoder

ATOL = 1e-4


def reference_logits(model_dir, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def run(decoder, cache, windows):
    """windows: list of (seq_id, tokens) appended in one ragged forward -> per-seq logits."""
    ids, pos, lens = [], [], []
    for sid, toks in windows:
        start = cache.length(sid)
        cache.reserve(sid, start + len(toks))
        ids += toks
        pos += range(start, start + len(toks))
        lens.append(len(toks))
    meta = cache.prepare([s for s, _ in windows], lens)
    with torch.no_grad():
        out = decoder(torch.tensor(ids), torch.tensor(pos), cache, meta, logits_rows=torch.arange(len(ids)))
    return list(out.logits.split(lens))


def test_prefill_decode_and_ragged_match_transformers(tiny_model_dir):
    dec = load_decoder(tiny_model_dir)
    a = [5, 17, 300, 42, 7, 99, 1000, 3, 12]
    b = [8, 8, 4000, 12]
    ref_a, ref_b = reference_logits(tiny_model_dir, a), reference_logits(tiny_model_dir, b)
    cache = dec.new_cache(16, block_size=4)
    # a: prefill 5 tokens alone; b: prefill 2 tokens alone
    (la,) = run(dec, cache, [("a", a[:5])])
    (lb,) = run(dec, cache, [("b", b[:2])])
    torch.testing.assert_close(la, ref_a[:5], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[:2], atol=ATOL, rtol=0)
    # one ragged batch: a decodes 1 token, b appends a 2-token window
    la, lb = run(dec, cache, [("a", a[5:6]), ("b", b[2:4])])
    torch.testing.assert_close(la, ref_a[5:6], atol=ATOL, rtol=0)
    torch.testing.assert_close(lb, ref_b[2:4], atol=ATOL, rtol=0)
    # a appends a 3-token verify window alone, crossing a block boundary
    (la,) = run(dec, cache, [("a", a[6:9])])
    torch.testing.assert_close(la, ref_a[6:9], atol=ATOL, rtol=0)


def test_truncate_then_redecode_reproduces_logits(tiny_llama_dir):
    dec = load_decoder(tiny_llama_dir)
    cache = dec.new_cache(8, block_size=4)
    toks = [11, 22, 33, 44, 55, 66]
    (first,) = run(dec, cache, [("s", toks)])
    (junk,) = run(dec, cache, [("s", [77, 88, 99])])  # a rejected draft tail
    cache.truncate("s", 4)
    (again,) = run(dec, cache, [("s", toks[4:])])
    torch.testing.assert_close(again, first[4:], atol=1e-5, rtol=0)
    assert cache.length("s") == 6


def test_hidden_states_of_chosen_layers(tiny_llama_dir):
    dec = load_decoder(tiny_llama_dir)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    ids = [3, 4, 5, 6, 7]
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    cache = dec.new_cache(4, block_size=4)
    cache.reserve("s", 5)
    meta = cache.prepare(["s"], [5])
    with torch.no_grad():
        out = dec(torch.tensor(ids), torch.arange(5), cache, meta, hidden_layers=(0, 1))
    assert out.logits is None
    torch.testing.assert_close(out.hidden, torch.cat([ref[1][0], ref[2][0]], -1), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_embedded_model_matches_transformers(embedded_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(embedded_dir))
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Once upon a time, there")
    hf = AutoModelForCausalLM.from_pretrained(str(embedded_dir), dtype=torch.float32).eval()
    dec = load_decoder(embedded_dir)
    cache = dec.new_cache(8)
    n = len(ids) - 4
    (pre,) = run(dec, cache, [("s", ids[:n])])
    with torch.no_grad():  # the reference sees exactly the same tokens, so GEMM shapes match too
        torch.testing.assert_close(pre, hf(torch.tensor([ids[:n]])).logits[0], atol=ATOL, rtol=0)
        for i in range(n, len(ids)):
            (step,) = run(dec, cache, [("s", [ids[i]])])
            ref = hf(torch.tensor([ids[: i + 1]])).logits[0, -1:]
            torch.testing.assert_close(step, ref, atol=ATOL, rtol=0)
