"""Packed bf16 linears (models/packing.py): same numbers as F.linear, row results independent of the
number of rows (what keeps speculative decoding token-identical), and a packed decoder that decodes
exactly like its unpacked self."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark.models import native, native_avx2
from dspark.models.loader import load_decoder, resolve_dtype
from dspark.models.packing import PackedLinear, pack_linears, packing_supported
from invariance import assert_embedded_rows_invariant, logits_by_chunks

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
    big = torch.randn(300, shape[1], dtype=torch.bfloat16)
    chunked = PackedLinear.from_linear(lin, row_chunk=32)  # what pack_linears does for an LM head
    rows = chunked(big)
    assert all(torch.equal(chunked(big[:m]), rows[:m]) for m in (1, 33, 64, 100, 256))
    assert packed(x[:0]).shape == (0, shape[0])
    assert packed(x.view(4, 4, -1)).shape == (4, 4, shape[0])


@needs_packing
def test_pack_linears_keeps_requested_weights():
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    m.lm_head = nn.Linear(8, 4, bias=False)
    m = m.to(torch.bfloat16)
    assert pack_linears(m, keep=("lm_head",)) == 2
    assert m[0].weight is None and m.lm_head.weight is not None


@needs_packing
def test_packed_bf16_decoder_is_window_invariant(tiny_llama_dir):
    """Packed equals unpacked, and a position's logits do not depend on the window it was computed
    in (decoded alone or inside a verify window): speculative == plain, token for token, in bf16."""
    plain = load_decoder(tiny_llama_dir, dtype=torch.bfloat16)
    packed = load_decoder(tiny_llama_dir, dtype=torch.bfloat16, pack=True)
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert packed.kv_dtype is torch.float32
    ids = torch.randint(1000, (20,), generator=torch.Generator().manual_seed(1))
    one_by_one = logits_by_chunks(packed, ids, [12] + [1] * 8)
    assert torch.equal(logits_by_chunks(plain, ids, [12, 1, 5, 2]), logits_by_chunks(packed, ids, [12, 1, 5, 2]))
    for chunks in ([12, 1, 5, 2], [12, 8], [12, 3, 3, 2]):
        assert torch.equal(logits_by_chunks(packed, ids, chunks), one_by_one), chunks


@needs_packing
def test_embedded_bf16_rows_do_not_depend_on_window_or_batch(embedded_dir):
    """The embedded model in bf16: a position's logits are bit-identical decoded alone, inside verify
    windows of any width, or next to other sequences with other windows (the invariant attention)."""
    dec = load_decoder(embedded_dir, dtype=torch.bfloat16, pack=True)
    assert_embedded_rows_invariant(dec)


# both routes of invariant_attention: dspark's kernel (where it runs) and PyTorch ops
ATTENTION_ROUTES = [pytest.param(False, id="torch"),
                    pytest.param(True, id="kernel", marks=pytest.mark.skipif(
                        native.library() is None, reason=f"dspark's kernels do not run here: {native.why()}"))]


@pytest.mark.parametrize("kernels,kv_dtype", [(route, torch.float32) for route in ATTENTION_ROUTES] + [
    pytest.param(True, torch.bfloat16, id="kernel-bf16-cache", marks=ATTENTION_ROUTES[1].marks)])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_invariant_attention_rows_do_not_depend_on_the_window(heads, kv_heads, kernels, kv_dtype):
    """A row's output is bit-identical alone or inside a window (MHA too, where one row would be a GEMV),
    and equals the reference attention up to fp32 rounding; on the kernel also over a bf16 cache, which it
    reads as the same values in fp32."""
    from dspark.models.attention import invariant_attention, sdpa_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, 8, 16, generator=gen)
    k, v = torch.randn(2, kv_heads, 1, 64, 16, generator=gen).to(kv_dtype)  # the cache's [Hkv, B, S, hd]
    mask = torch.ones(1, 1, 8, 64, dtype=torch.bool).tril(40)
    full = invariant_attention(q, k, v, mask, kernels=kernels)
    for row in range(8):
        alone = invariant_attention(q[:, :, row:row + 1], k, v, mask[:, :, row:row + 1], kernels=kernels)
        assert torch.equal(alone, full[:, :, row:row + 1]), row
    torch.testing.assert_close(full, sdpa_attention(q, k.float(), v.float(), mask), atol=1e-5, rtol=1e-5)
    if kv_dtype == torch.bfloat16:  # the same bits as the fp32 kernel on the widened values
        assert torch.equal(full, invariant_attention(q, k.float(), v.float(), mask, kernels=kernels))


@pytest.mark.parametrize("kernel", ["avx512", "avx2"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(9, 3, 64), (4, 2, 128), (2, 1, 32)])
def test_paged_attention_equals_attention_over_the_gathered_rows(heads, kv_heads, hd, kv_dtype, kernel):
    """native.attention_paged (and native_avx2's, on an fp32 cache) reads each sequence's keys where the cache
    holds them (scattered blocks, padding pointing at row 0): bit for bit what the kernel gives over the same rows
    gathered into [Hkv, B, S, hd] first, for sequences of different lengths and query rows (one and several a
    sequence), fp32 and bf16 caches."""
    if kernel == "avx512" and native.library() is None:
        pytest.skip(f"dspark's kernels do not run here: {native.why()}")
    if kernel == "avx2" and (native_avx2.library() is None or kv_dtype != torch.float32):
        pytest.skip("the AVX2 kernels do not run here" if native_avx2.library() is None else "an fp32 cache only")
    gen = torch.Generator().manual_seed(3)
    pool_rows, s_len, lengths, q_len = 512, 96, [96, 37, 64, 5], 3
    pool = torch.randn(2 * kv_heads, pool_rows, hd, generator=gen).to(kv_dtype)
    perm = torch.randperm(pool_rows // 16, generator=gen)  # each sequence's 16-row blocks scattered in the pool
    rows = torch.zeros(len(lengths), s_len, dtype=torch.long)
    for b, n in enumerate(lengths):
        blocks = perm[b * (s_len // 16):(b + 1) * (s_len // 16)]
        rows[b, :n] = (blocks.view(-1, 1) * 16 + torch.arange(16)).view(-1)[:n]
    mask = torch.arange(s_len).view(1, 1, 1, -1) < torch.tensor(lengths).view(-1, 1, 1, 1) - (q_len - 1) \
        + torch.arange(q_len).view(1, 1, -1, 1)
    q = torch.randn(len(lengths), q_len, heads, hd, generator=gen).transpose(1, 2)  # a strided [B, H, Q, hd] view
    gathered = pool.view(-1, hd).index_select(0, (torch.arange(2 * kv_heads).view(-1, 1) * pool_rows
                                                  + rows.view(1, -1)).view(-1)).view(2 * kv_heads, len(lengths), s_len, hd)
    if kernel == "avx2":
        want = native_avx2.attention(q, gathered[:kv_heads], gathered[kv_heads:], mask)
        assert torch.equal(native_avx2.attention_paged(q, pool, rows, mask), want)
        assert torch.equal(native_avx2.attention_paged(q[:, :, -1:], pool, rows, mask[:, :, -1:]), want[:, :, -1:])
        return
    lib = native.loaded() or native.library()
    for out_dtype in (torch.float32, torch.bfloat16):
        want = native.attention(lib, q, gathered[:kv_heads], gathered[kv_heads:], mask, out_dtype)
        got = native.attention_paged(lib, q, pool, rows, mask, out_dtype)
        assert torch.equal(got, want), out_dtype
        assert torch.equal(native.attention_paged(lib, q[:, :, -1:], pool, rows, mask[:, :, -1:], out_dtype),
                           want[:, :, -1:])


@pytest.mark.parametrize("kernels", ATTENTION_ROUTES)
@pytest.mark.parametrize("position", [100, 300, 383, 400, 500, 700, 1000])
def test_invariant_attention_rows_do_not_depend_on_the_key_padding(position, kernels):
    """A verify window can pad the key axis 64 further than decoding its first row alone would; the
    row's output must not change (long reductions are split where the kernel would split them)."""
    from dspark.models.attention import KV_ALIGN, invariant_attention

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 9, 8, 64, generator=gen)
    k, v = torch.randn(2, 3, 1, 1280, 64, generator=gen)  # the cache's [Hkv, B, S, hd]

    def rows(nq: int, keys: int) -> torch.Tensor:
        mask = torch.arange(keys)[None, :] <= (position + torch.arange(nq))[:, None]
        return invariant_attention(q[:, :, :nq], k[:, :, :keys], v[:, :, :keys], mask[None, None], kernels=kernels)

    start = -(-(position + 1) // KV_ALIGN) * KV_ALIGN  # what decoding the row alone pads to
    alone = rows(1, start)
    for keys in range(start, 1281, KV_ALIGN):
        for nq in (1, 8):
            assert torch.equal(rows(nq, keys)[:, :, :1], alone), (keys, nq)
