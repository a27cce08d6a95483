"""Packed bf16 linears (models/packing.py): same numbers as F.linear, row results independent of the
number of rows (what keeps speculative decoding token-identical), and a packed decoder that decodes
exactly like its unpacked self."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.loader import load_decoder, resolve_dtype
from dspark.models.packing import PackedLinear, pack_linears, packing_supported

needs_packing = pytest.mark.skipif(not packing_supported(torch.bfloat16, "cpu"),
                                   reason="this CPU has no oneDNN bf16 support")


def test_packing_is_only_for_bf16_on_cpu():
    assert not packing_supported(torch.float32, "cpu")
    assert not packing_supported(torch.bfloat16, "cuda")


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("auto", "cpu") is (torch.bfloat16 if packing_supported(torch.bfloat16, "cpu")
                                            else torch.float32)
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int3")


@needs_packing
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (8192, 576)])
def test_packed_linear_matches_and_is_row_invariant(shape):
    torch.manual_seed(0)
    lin = nn.Linear(shape[1], shape[0], bias=True).to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    x = torch.randn(16, shape[1], dtype=torch.bfloat16)
    full = packed(x)
    torch.testing.assert_close(full, F.linear(x, lin.weight, lin.bias), rtol=0, atol=0)
    for rows in (1, 2, 3, 7, 8, 9, 15):  # every verify-window width the engine uses
        assert torch.equal(packed(x[:rows]), full[:rows]), rows
    assert packed(x[:0]).shape == (0, shape[0])
    assert packed(x.view(4, 4, -1)).shape == (4, 4, shape[0])


@needs_packing
def test_pack_linears_keeps_requested_weights():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    m.lm_head = nn.Linear(8, 4, bias=False)
    m = m.to(torch.bfloat16)
    assert pack_linears(m, keep=("lm_head",)) == 2
    assert m[0].weight is None and m.lm_head.weight is not None


def _logits(dec, ids, chunks):
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


@needs_packing
def test_packed_bf16_decoder_is_window_invariant(tiny_llama_dir):
    """Packed equals unpacked, and a position's logits do not depend on the window it was computed
    in (decoded alone or inside a verify window): speculative == plain, token for token, in bf16."""
    plain = load_decoder(tiny_llama_dir, dtype=torch.bfloat16)
    packed = load_decoder(tiny_llama_dir, dtype=torch.bfloat16, pack=True)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert packed.kv_dtype is torch.float32
    ids = torch.randint(1000, (20,), generator=torch.Generator().manual_seed(1))
    one_by_one = _logits(packed, ids, [12] + [1] * 8)
    assert torch.equal(_logits(plain, ids, [12, 1, 5, 2]), _logits(packed, ids, [12, 1, 5, 2]))
    for chunks in ([12, 1, 5, 2], [12, 8], [12, 3, 3, 2]):
        assert torch.equal(_logits(packed, ids, chunks), one_by_one), chunks
