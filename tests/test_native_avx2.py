"""The AVX2 matmuls (models/native_avx2.py, csrc/avx2_mm.c): 4-bit and 8-bit grouped weights times fp32 rows
rounded to 8-bit groups. Each row's result equals the reference product of its rounded row and the
dequantised weight, is bit-identical whatever the other rows of the call or the threads, and matches the
AVX-512 kernels' bits where those run too; the embedded model runs on them in fp32, and speculative decoding
stays token-identical to plain decoding there."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark import LLM, SamplingParams
from dspark.models import int4, native, native_avx2, q8
from dspark.models.int4 import GROUP, Int4Linear
from dspark.models.loader import load_decoder
from dspark.models.q8 import Q8Linear
from drafter_for_kernels import kernel_drafter
from invariance import (assert_embedded_rows_invariant, assert_windows_step_in_one_call, hidden_of_a_window,
                        logits_by_chunks)
from rounding import rows_rounded_to_8bit

pytestmark = pytest.mark.skipif(native_avx2.library() is None, reason=f"no AVX2 kernels: {native_avx2.why()}")


def _q4(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [n, k] 0..15 (each group spanning 0..15), steps and minima [n, k / 32] as a GGUF Q4_1 holds them."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=gen)
    codes[..., 0], codes[..., 1] = 0, 15
    step = (torch.rand(n, k // GROUP, generator=gen) * 0.01 + 1e-4).half().float()
    lo = (-8 * step + torch.randn(n, k // GROUP, generator=gen) * 1e-3).half().float()
    return codes.reshape(n, k).int(), step, lo


def _dequantised_q4(codes, step, lo) -> torch.Tensor:
    """The weight the kernel multiplies: steps and centres lo + 8 step rounded to bf16 as packed."""
    n, k = codes.shape
    d = step.bfloat16().float()
    m = (lo + 8 * step).bfloat16().float() - 8 * d
    return (codes.float().view(n, k // GROUP, GROUP) * d[..., None] + m[..., None]).view(n, k)


def _q8(n: int, k: int, seed: int = 0, lowest: int = -128) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [n, k] in lowest..127, steps [n, k / 32]; by default with the code -128 in every row, whose |q| = 128
    must not saturate the 16-bit pair sums (a weight fitted by q8.fit_q8 has codes from -127 on)."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(lowest, 128, (n, k), generator=gen, dtype=torch.int32)
    codes[:, 0::GROUP], codes[:, 1::GROUP] = lowest, 127  # every group spans its full range
    return codes.to(torch.int8), torch.rand(n, k // GROUP, generator=gen) * 0.01


def _rows(count: int, k: int, seed: int = 1) -> torch.Tensor:
    x = torch.randn(count, k, generator=torch.Generator().manual_seed(seed))
    x[0, :GROUP] = 0  # a group of zeros: scale 0, codes 0
    x[1, :GROUP] = 127.0 * torch.arange(GROUP) / GROUP  # large values round without overflow
    return x


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 64)])
def test_matmul_is_the_rounded_rows_times_the_dequantised_weight(bits, shape):
    n, k = shape
    if bits == 4:
        fit = _q4(n, k)
        packed, weight = int4.pack_for_kernel(*fit, quads=True), _dequantised_q4(*fit)
    else:
        codes, step = _q8(n, k)
        packed, weight = q8.pack_for_vnni(codes, step), (codes.float().view(n, -1, GROUP) * step[..., None]).view(n, k)
    x = _rows(70, k)
    y = native_avx2.matmul(x, packed, n, bits)
    ref = rows_rounded_to_8bit(x).double() @ weight.double().T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_result_never_depends_on_the_other_rows_or_the_threads(bits):
    n, k = 576, 1536
    packed = int4.pack_for_kernel(*_q4(n, k), quads=True) if bits == 4 else q8.pack_for_vnni(*_q8(n, k))
    x = _rows(130, k)  # more than one chunk of 64 rows
    full = native_avx2.matmul(x, packed, n, bits)
    for rows in (1, 2, 7, 8, 9, 64, 65):
        assert torch.equal(native_avx2.matmul(x[:rows], packed, n, bits), full[:rows]), rows
    assert torch.equal(torch.cat([native_avx2.matmul(x[i:i + 5], packed, n, bits) for i in range(0, 130, 5)]), full)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native_avx2.matmul(x, packed, n, bits), full)
    finally:
        torch.set_num_threads(threads)
    assert native_avx2.matmul(x[:0], packed, n, bits).shape == (0, n)


@pytest.mark.skipif(native.library() is None, reason="the AVX-512 kernels do not run here")
def test_the_same_bits_as_the_avx512_kernels():
    """On bf16-representable rows, the AVX2 result rounded to bf16 is the AVX-512 8-bit route's output."""
    n, k = 960, 576
    fit = _q4(n, k)
    x = _rows(9, k).bfloat16()
    with native.route("int8_activations") as runs:
        assert runs
        y512 = native.int4_mm(native.loaded(), x, int4.pack_for_kernel(*fit, quads=True), n)
    assert torch.equal(native_avx2.matmul(x.float(), int4.pack_for_kernel(*fit, quads=True), n, 4).bfloat16(), y512)
    codes, step = _q8(n, k, lowest=-127)
    head = Q8Linear((codes.float().view(n, -1, GROUP) * step[..., None]).view(n, k), vnni=True)
    assert torch.equal(native_avx2.matmul(x.float(), head.packed, n, 8), head(x))


def test_linears_take_fp32_rows_on_the_avx2_kernel():
    n, k = 96, 128
    fit = _q4(n, k)
    bias = torch.randn(n)
    lin = Int4Linear(_dequantised_q4(*fit), bias, dtype=torch.float32)
    assert "avx2 kernel" in repr(lin)
    x = _rows(5, k)
    torch.testing.assert_close(lin(x), F.linear(rows_rounded_to_8bit(x), _dequantised_q4(*fit), bias),
                               rtol=1e-5, atol=1e-5)
    assert lin(x.view(5, 1, k)).shape == (5, 1, n)
    codes, step = _q8(40, k, lowest=-127)  # 40 outputs: padded to 48 inside, not outside
    weight = (codes.float().view(40, -1, GROUP) * step[..., None]).view(40, k)
    head = Q8Linear(weight, avx2=True)
    assert "AVX2" in repr(head) and head(x).shape == (5, 40) and head(x).dtype == torch.float32
    torch.testing.assert_close(head(x), rows_rounded_to_8bit(x) @ weight.T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="no 4-bit kernel takes float16 rows"):
        Int4Linear(_dequantised_q4(*fit), dtype=torch.float16)


def test_embedded_model_in_fp32_keeps_its_4bit_layers_and_8bit_head(embedded_dir):
    dec = load_decoder(embedded_dir, dtype=torch.float32, quantization="auto")
    assert dec.weight_format == "float32/int4+q8-head"
    assert all(m._kernel == "avx2" for m in dec.modules() if isinstance(m, Int4Linear))
    assert all(layer.fusable() for layer in dec.layers)  # one sequence: a layer is one call (csrc/avx2_layer.c)
    assert_embedded_rows_invariant(dec)  # ... with the bits of the per-op path that steps of two sequences take
    dense = load_decoder(embedded_dir, dtype=torch.float32, quantization="none")
    assert dense.weight_format == "float32"


def test_a_step_in_one_call_has_the_bits_of_the_calls_one_by_one(embedded_dir, monkeypatch):
    """The fp32 model on the AVX2 kernels runs a step as one call (csrc/avx2_step.c: the embedding, every layer,
    the final norm and the 8-bit head), for one sequence and for several sequences' windows, with the bits of a
    call per layer (csrc/avx2_layer.c) and of the per-op path, taps included; ids outside the vocabulary are an
    IndexError from the call itself."""
    dec = load_decoder(embedded_dir, dtype=torch.float32, quantization="auto")
    lib, calls = native_avx2.loaded(), []
    step = lib.dspark_avx2_step
    monkeypatch.setattr(lib, "dspark_avx2_step", lambda *args: calls.append(args[3]) or step(*args))
    ids = torch.randint(1000, (48,), generator=torch.Generator().manual_seed(7))
    one = logits_by_chunks(dec, ids, [32] + [1] * 16)
    hidden = hidden_of_a_window(dec, ids, (28, 1, 8))
    assert calls == [32] + [1] * 16 + [40, 8]  # every step one call
    assert torch.equal(logits_by_chunks(dec, ids, [32, 8, 3, 5]), one)
    weights, dec._weights = dec._weights, False  # a call per layer ...
    assert torch.equal(logits_by_chunks(dec, ids, [32, 8, 3, 5]), one)
    assert torch.equal(hidden_of_a_window(dec, ids, (28, 1, 8)), hidden)
    dec._fused = False  # ... and the per-op path
    assert torch.equal(logits_by_chunks(dec, ids, [32, 8, 3, 5]), one)
    assert torch.equal(hidden_of_a_window(dec, ids, (28, 1, 8)), hidden)
    assert len(calls) == 19 + 4  # none past the [32, 8, 3, 5] check
    dec._fused, dec._weights = None, weights
    cache = dec.new_cache(4)
    cache.reserve("s", 2)
    with torch.inference_mode(), pytest.raises(IndexError, match="token ids"):
        dec(torch.tensor([5, dec.config.vocab_size]), torch.arange(2), cache, cache.prepare(["s"], [2]),
            logits_rows=torch.arange(2))
    assert len(calls) == 24  # the step itself refused them
    monkeypatch.undo()
    assert_windows_step_in_one_call(dec, lib, "dspark_avx2_step", monkeypatch)


@pytest.mark.parametrize("head_dim", [16, 32])
def test_fp32_drafter_runs_its_layers_and_context_in_one_call_each(head_dim):
    """A packed fp32 drafter on the AVX2 kernels: its context projection and each layer of the block pass one call
    (csrc/avx2_drafter.c), against the same packed weights op by op, both measured against the unpacked fp32
    drafter, for requests of different lengths and then one (the context buffer reused). Both round rows to 8-bit
    groups, so neither is exact; the calls' drafts must be no further off (a wrong layout or argument would be far
    off)."""
    from dspark.drafters.runner import DraftRunner

    model, exact = kernel_drafter(torch.float32, head_dim=head_dim), kernel_drafter(torch.float32, pack=False,
                                                                                   head_dim=head_dim)
    calls = model.runner()
    assert calls._avx2_layers and calls._avx2_context and calls._kernel_ctx and not calls._native
    by_ops = DraftRunner(model, pack=True)
    by_ops._avx2_layers = by_ops._avx2_context = False  # the op-by-op route, context layout included
    assert not by_ops._kernel_ctx
    feats = torch.randn(40, 2 * 64, generator=torch.Generator().manual_seed(4))
    # the context projection: the same kernels as op by op but RoPE and the keys' norm, so all but equal
    torch.testing.assert_close(calls.context_kv(feats, torch.arange(40)), by_ops.context_kv(feats, torch.arange(40)),
                               rtol=1e-5, atol=1e-5)
    for lengths in ([31, 9, 20], [6]):
        anchors = [11, 200, 3][:len(lengths)]
        out = {}
        for name, m, runner in (("calls", model, calls), ("ops", model, by_ops), ("fp32", exact, None)):
            m._runner = runner if runner is not None else m._runner
            caches = [m.new_cache() for _ in lengths]
            m.extend_many(caches, [feats[:n] for n in lengths], [0] * len(lengths))
            out[name] = m.draft(caches, anchors, lengths)
        model._runner = calls

        def err(name):
            return (out[name].logits.float() - out["fp32"].logits).abs().mean()

        assert err("calls") <= 1.25 * err("ops"), (err("calls"), err("ops"))
        assert (out["calls"].tokens == out["ops"].tokens).float().mean() >= 0.8


def test_fp32_drafter_picks_greedy_drafts_in_one_call():
    """Greedy drafts through the vanilla Markov head in one call on fp32 rows (csrc/avx2_drafter.c): the same picks
    and confidence logits as step() op by op (the same 8-bit matmul for the bias), for requests of different
    lengths and fewer drafts than the block; anchor ids outside the vocabulary are a ValueError."""
    model = kernel_drafter(torch.float32, head_dim=32, markov_rank=32)
    runner = model.runner()
    assert runner._avx2_chain
    feats = torch.randn(60, 2 * 64, generator=torch.Generator().manual_seed(5))
    for lengths, anchors, n in (([31], [7], 5), ([31, 9, 50], [11, 200, 3], 5), ([12, 40], [5, 6], 2)):
        caches = [model.new_cache() for _ in lengths]
        model.extend_many(caches, [feats[:k] for k in lengths], [0] * len(lengths))
        one_call = model.draft(caches, anchors, lengths, num_drafts=n, return_logits=False)
        runner._avx2_chain = False  # step() per position
        try:
            by_ops = model.draft(caches, anchors, lengths, num_drafts=n, return_logits=False)
        finally:
            runner._avx2_chain = True
        assert one_call.tokens.shape == (len(lengths), n)
        assert torch.equal(one_call.tokens, by_ops.tokens)
        assert torch.equal(one_call.conf_logits, by_ops.conf_logits)
    with pytest.raises(ValueError, match="anchor ids"):  # W1 is read by id: nothing past it
        runner.greedy_picks(torch.tensor([400]), torch.zeros(1, 2, runner.vd), None, None)


def test_speculative_decoding_is_lossless_on_the_avx2_kernels():
    """fp32 target and drafter on the AVX2 kernels: greedy DSpark output equals plain decoding's."""
    plain = LLM(dtype="float32", profile_progress=False)
    assert plain.decoder.weight_format == "float32/int4+q8-head"
    spec = LLM(dtype="float32", speculative_algorithm="DSPARK", planner="fixed", profile_progress=False)
    runner = spec.engine.proposer.drafter.runner()  # the drafter's projections on the 8-bit AVX2 kernel too
    assert all(isinstance(lin, Q8Linear) and lin.avx2 for lin in (runner.head, runner.fc, runner.layers[0].gate_up))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    fast = spec.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain.generate(prompts, params)]
    assert any(max(o.accept_lengths) > 1 for o in fast)


def test_attention_matches_sdpa_and_a_row_never_depends_on_padding_or_other_rows():
    from dspark.models.attention import sdpa_attention

    gen = torch.Generator().manual_seed(4)
    b, h, hkv, nq, s, hd = 2, 9, 3, 8, 150, 64
    q = torch.randn(b, h, nq, hd, generator=gen) * hd ** -0.5
    k, v = torch.randn(hkv, b, s + 42, hd, generator=gen), torch.randn(hkv, b, s + 42, hd, generator=gen)
    seen = torch.arange(s + 42)[None, None, None, :] < (torch.tensor([[120], [150]]) + torch.arange(nq))[:, None, :, None] - 7
    seen[1, :, 3] = False  # a row that sees no key
    out = native_avx2.attention(q, k, v, seen)
    ref = sdpa_attention(q, k, v, seen)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1, :, 3], torch.zeros(h, hd))
    torch.testing.assert_close(out[1][:, [0, 1, 2, 4, 5, 6, 7]], ref[1][:, [0, 1, 2, 4, 5, 6, 7]], rtol=1e-5, atol=1e-5)
    for i in (0, 5, 7):  # one query row alone, over keys cut at another length: the same bits
        cut = int(seen[0, 0, i].nonzero().max()) + 1 + i
        alone = native_avx2.attention(q[:1, :, i:i + 1], k[:, :1, :cut], v[:, :1, :cut], seen[:1, :, i:i + 1, :cut])
        assert torch.equal(alone[0, :, 0], out[0, :, i]), i


def test_layer_ops_match_pytorch_and_never_depend_on_the_other_rows():
    from dspark.models.layers import Rotary, apply_rotary

    gen = torch.Generator().manual_seed(5)
    x, res, w = torch.randn(33, 576, generator=gen), torch.randn(33, 576, generator=gen), torch.rand(576, generator=gen)
    total, normed = native_avx2.rms_norm(x, w, 1e-5, res)
    assert torch.equal(total, x + res)
    torch.testing.assert_close(normed, F.rms_norm(x + res, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(native_avx2.rms_norm(x[5:6], w, 1e-5, res[5:6])[1], normed[5:6])
    gu = torch.randn(9, 2 * 1536, generator=gen)
    torch.testing.assert_close(native_avx2.silu_mul(gu), F.silu(gu[:, :1536]) * gu[:, 1536:], rtol=1e-5, atol=1e-6)
    h, hkv, hd, t = 9, 3, 64, 5
    qkv = torch.randn(t, h + 2 * hkv, hd, generator=gen)
    rotary = Rotary(1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))
    positions = torch.tensor([3, 4, 5, 6, 7])
    pool, slots = torch.zeros(2 * hkv, 16, hd), torch.tensor([8, 9, 10, 11, 12])
    q = native_avx2.rope_store(qkv, positions, *rotary.tables(positions), 0.125, h, hkv, pool, slots)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    ref = apply_rotary(qkv[:, :h + hkv], cos, sin)
    torch.testing.assert_close(q, ref[:, :h] * 0.125, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[:hkv, slots].transpose(0, 1), ref[:, h:], rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[hkv:, slots].transpose(0, 1), qkv[:, h + hkv:])
