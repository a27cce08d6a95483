"""dspark's own CPU kernels (models/native.py, csrc/): each matches its PyTorch reference to rounding, and
gives a row the same bits whatever the other rows of the call; a decoder on them matches one on PyTorch
ops alone; the library is built once and can be switched off."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from dspark.models import native
from dspark.models.int4 import GROUP, Int4Linear, fit_int4, pack_for_kernel
from dspark.models.layers import RMSNorm, Rotary, SwiGLU, apply_rotary
from dspark.models.loader import load_decoder
from drafter_for_kernels import kernel_drafter
from invariance import assert_windows_step_in_one_call, hidden_of_a_window, logits_by_chunks
from rounding import rows_rounded_to_8bit

lib = native.library()
pytestmark = pytest.mark.skipif(lib is None, reason=f"dspark's kernels do not run here: {native.why()}")


@pytest.fixture(params=list(native.ROUTES))
def matmul_path(request):
    """The 4-bit and 8-bit matmuls on AVX-512 with bf16 activations, where the CPU has it on AMX tiles
    (DSPARK_AMX=1), and the 4-bit ones on 8-bit activations (the default); the process's own paths afterwards."""
    with native.route(request.param) as runs:
        if not runs:
            pytest.skip("no AMX here")
        yield request.param


def _rows(n: int, d: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, d, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def _each_row_alone_is_the_same(fn, x: torch.Tensor) -> None:
    full = fn(x)
    for r in range(x.shape[0]):
        assert torch.equal(fn(x[r:r + 1]), full[r:r + 1]), r


@pytest.mark.parametrize("shape", [(64, 96), (960, 576), (576, 1536)])
def test_int4_kernel_matches_the_dequantized_weight(shape, matmul_path):
    n, k = shape
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    codes, step, lo, _ = fit_int4(w)
    packed = pack_for_kernel(codes, step, lo)
    # the weight the kernel represents: bf16 step and bf16 centre lo + 8 step
    d = step.bfloat16().float()[..., None]
    m = (lo + 8 * step).bfloat16().float()[..., None] - 8 * d
    wq = (codes.float().view(n, k // GROUP, GROUP) * d + m).view(n, k)
    x = _rows(37, k, seed=1)
    y = native.int4_mm(lib, x, packed, n)
    ref = x.float() @ wq.t()
    torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())
    if matmul_path == "int8_activations":  # exactly the rows rounded to 8-bit groups, up to fp32 scaling and the bf16 output
        ref8 = rows_rounded_to_8bit(x) @ wq.t()
        torch.testing.assert_close(y.float(), ref8, rtol=1e-2, atol=1e-3 * ref8.abs().max().item())
        assert (y.float() - ref8).abs().max() < (y.float() - ref).abs().max()
    _each_row_alone_is_the_same(lambda rows: native.int4_mm(lib, rows.contiguous(), packed, n), x)  # 37: padded tiles
    assert native.int4_mm(lib, x[:0], packed, n).shape == (0, n)


def test_int4_linear_uses_the_kernel():
    lin = Int4Linear(torch.randn(64, 64) * 0.02)
    assert "dspark kernel" in repr(lin) and lin.scale_zero is None


def test_int4_linear_takes_any_out_features_on_the_kernel():
    """40 outputs (not a multiple of 16, as a drafter's head with its confidence row): the rows are padded
    inside, the output is the first 40 of the same weight padded by hand."""
    w = torch.randn(40, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    x = _rows(5, 64).to(torch.bfloat16)
    y = Int4Linear(w)(x)
    padded = Int4Linear(torch.cat([w, w.new_zeros(8, 64)]))(x)
    assert y.shape == (5, 40) and torch.equal(y, padded[:, :40])


def test_rms_norm_kernel_matches_reference_and_adds_the_residual():
    norm = RMSNorm(576, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) * 2)
    x, res = _rows(7, 576, seed=2, scale=3.0), _rows(7, 576, seed=3)
    with torch.inference_mode():
        ref = F.rms_norm(x.float(), (576,), norm.weight.float(), 1e-5)
        torch.testing.assert_close(norm(x).float(), ref, rtol=1e-2, atol=1e-2)
        total, normed = norm.add_forward(x, res)
        assert torch.equal(total, x + res)
        assert torch.equal(normed, norm(x + res))
        _each_row_alone_is_the_same(norm, x)


def test_silu_mul_kernel_matches_reference():
    mlp = SwiGLU(64, 96).bfloat16()
    x = _rows(5, 64, seed=4, scale=4.0)
    with torch.inference_mode():
        gate, up = mlp.gate_up(x).float().split(96, dim=-1)
        ref = mlp.down((F.silu(gate) * up).bfloat16())
        torch.testing.assert_close(mlp(x).float(), ref.float(), rtol=2e-2, atol=2e-2)
        gu = mlp.gate_up(x)
        _each_row_alone_is_the_same(lambda r: native.silu_mul(lib, r.contiguous()), gu)


def test_rope_store_matches_apply_rotary_and_the_cache_write():
    t, h, hkv, hd = 5, 6, 2, 64
    rot = Rotary(1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd)))
    qkv = _rows(t, (h + 2 * hkv) * hd, seed=5).view(t, h + 2 * hkv, hd)
    pos = torch.tensor([3, 4, 5, 17, 40])
    slots = torch.tensor([9, 2, 7, 0, 11])
    pool = torch.zeros(2 * hkv, 12, hd)
    cos, sin = rot.tables(pos)
    q = native.rope_store(lib, qkv, pos, cos, sin, hd ** -0.5, h, hkv, pool, slots)
    c, s = rot.cos_sin(pos, torch.float32)
    ref = apply_rotary(qkv.float(), c, s)
    torch.testing.assert_close(q, ref[:, :h] * hd ** -0.5, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(pool[:hkv, slots].transpose(0, 1), ref[:, h:h + hkv], rtol=1e-6, atol=1e-6)
    assert torch.equal(pool[hkv:, slots].transpose(0, 1), qkv[:, h + hkv:].float())
    assert pool[:, [1, 3]].abs().sum() == 0  # no other row written
    pool16 = torch.zeros(2 * hkv, 12, hd, dtype=torch.bfloat16)  # a bf16 cache: keys rounded once, values as they are
    assert torch.equal(native.rope_store(lib, qkv, pos, cos, sin, hd ** -0.5, h, hkv, pool16, slots), q)
    assert torch.equal(pool16[:hkv, slots], pool[:hkv, slots].bfloat16())
    assert torch.equal(pool16[hkv:, slots].transpose(0, 1), qkv[:, h + hkv:])
    assert pool16[:, [1, 3]].abs().sum() == 0


def test_decoder_on_kernels_matches_pytorch_ops_and_windows_do_not_matter(embedded_dir, monkeypatch, matmul_path):
    """The embedded model (int4 weights, fp32 cache) on dspark's kernels against the same model on PyTorch
    ops alone: the same logits up to bf16 rounding, and on the kernels a position's logits do not depend
    on the window it was verified in."""
    ids = torch.randint(1000, (48,), generator=torch.Generator().manual_seed(7))
    dec = load_decoder(embedded_dir, dtype=torch.bfloat16, quantization="auto")
    monkeypatch.setenv(native.ENV, "torch")
    ref = load_decoder(embedded_dir, dtype=torch.bfloat16, quantization="auto")
    monkeypatch.delenv(native.ENV)
    assert "dspark kernel" in repr(dec.layers[0].self_attn.qkv_proj) and dec.kv_dtype == torch.bfloat16
    assert "torch kernel" in repr(ref.layers[0].self_attn.qkv_proj)
    one = logits_by_chunks(dec, ids, [32] + [1] * 16)
    torch.testing.assert_close(one, logits_by_chunks(ref, ids, [32] + [1] * 16), rtol=0.05, atol=1.0)  # bf16 roundings through 30 layers
    assert (one.argmax(-1) == logits_by_chunks(ref, ids, [32] + [1] * 16).argmax(-1)).float().mean() >= 0.9
    assert torch.equal(logits_by_chunks(dec, ids, [32, 8, 3, 5]), one)
    assert dec._fused  # one sequence: every layer ran fused (csrc/layer.c), the whole step in one call ...
    hidden = hidden_of_a_window(dec, ids, (28, 1, 8))
    assert dec._weights  # (dspark_step ran)
    dec._weights = False  # ... with the same bits, taps included, as one call per layer ...
    assert torch.equal(logits_by_chunks(dec, ids, [32, 8, 3, 5]), one)
    assert torch.equal(hidden_of_a_window(dec, ids, (28, 1, 8)), hidden)
    dec._fused = False  # ... and as the layer-by-layer path that batches take
    assert torch.equal(logits_by_chunks(dec, ids, [32, 8, 3, 5]), one)
    assert torch.equal(hidden_of_a_window(dec, ids, (28, 1, 8)), hidden)


def test_several_sequences_windows_step_in_one_call(embedded_dir, monkeypatch):
    """Decodes and verify windows of several sequences: csrc/step.c runs them in one call (attention reading the
    cache in place), with the bits of the layer-by-layer path and of each sequence alone (invariance.py)."""
    dec = load_decoder(embedded_dir, dtype=torch.bfloat16, quantization="auto")
    assert_windows_step_in_one_call(dec, native.loaded(), "dspark_step", monkeypatch)


def test_the_one_call_step_refuses_ids_outside_the_vocabulary(embedded_dir):
    """csrc/step.c reads embedding rows by id: an id outside the vocabulary is an IndexError, as the embedding
    module's would be, and nothing is read past the table."""
    dec = load_decoder(embedded_dir, dtype=torch.bfloat16, quantization="auto")
    cache = dec.new_cache(4)
    cache.reserve("s", 2)
    with torch.inference_mode(), pytest.raises(IndexError, match="token ids"):
        dec(torch.tensor([5, dec.config.vocab_size]), torch.arange(2), cache, cache.prepare(["s"], [2]),
            logits_rows=torch.arange(2))
    assert dec._weights  # the step itself refused them


@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_attention_bf16_matches_sdpa_per_slot(head_dim):
    """The generator's decode attention: each row over its own cache slot's first lengths[r] keys (GQA),
    as masked SDPA computes it; a subset of rows gets the same values; a row with no keys gets zeros."""
    g = torch.Generator().manual_seed(0)
    slots_n, h, hkv, cap = 6, 6, 2, 70
    kv = torch.randn(2, slots_n, hkv, cap, head_dim, generator=g).bfloat16()
    q = torch.randn(4, h, head_dim, generator=g).bfloat16()
    slots, lengths = torch.tensor([5, 0, 3, 2]), torch.tensor([70, 1, 33, 0])
    got = native.decode_attention_bf16(lib, q, kv[0], kv[1], slots, lengths)
    for r in range(3):
        n = int(lengths[r])
        k, v = kv[0, slots[r], :, :n].float(), kv[1, slots[r], :, :n].float()
        want = F.scaled_dot_product_attention(q[r].float().unsqueeze(1), k, v, enable_gqa=True)[:, 0]
        torch.testing.assert_close(got[r].float(), want, atol=1e-2, rtol=1e-2)
    assert got[3].abs().max() == 0
    alone = native.decode_attention_bf16(lib, q[2:3], kv[0], kv[1], slots[2:3], lengths[2:3])
    assert torch.equal(alone, got[2:3])


def test_switched_off_by_environment(monkeypatch):
    monkeypatch.setenv(native.ENV, "torch")
    assert native.library() is None
    assert "torch kernel" in repr(Int4Linear(torch.randn(64, 64) * 0.02))
    monkeypatch.delenv(native.ENV)
    assert native.library() is lib


@pytest.mark.parametrize("env", [native.AMX_ENV, native.ACT8_ENV])
def test_matmul_settings_are_checked(monkeypatch, env):
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setenv(env, "yes")
    with pytest.raises(ValueError, match=f"{env} must be 0 or 1"):
        native.library()


def test_q8_head_matches_its_weight_and_rows_do_not_matter(matmul_path):
    from dspark.models.q8 import Q8Linear, fit_q8, native_q8

    gen = torch.Generator().manual_seed(8)
    d = (torch.rand(160, 4, 1, generator=gen) * 0.01 + 1e-3).half().float()
    q = torch.randint(-127, 128, (160, 4, 32), generator=gen).float()
    q[..., 0] = 127  # the group's largest magnitude, as llama.cpp's Q8_0 quantizer makes it
    w = (q * d).view(160, 128)
    assert native_q8(w) and not native_q8(w + 1e-4 * torch.randn(160, 128, generator=gen))
    assert torch.equal(fit_q8(w)[0].float().view(160, 4, 32), q)
    head = Q8Linear(w)
    x = _rows(37, 128, seed=9)  # 37: tiles of 16 rows and a padded one
    y = head(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x.float() @ w.t(), rtol=1e-5, atol=1e-5)  # exact products, fp32 sums
    _each_row_alone_is_the_same(head, x)


@pytest.mark.parametrize("rows", [1, 7, 70])
def test_q8_vnni_rounds_the_rows_to_8_bits_and_rows_do_not_matter(rows):
    """The drafter's route: rows rounded to 8-bit groups (scale max|x| / 127) times the 8-bit weights,
    the integer sums exact. Against the same rounding done in fp32 it is exact up to fp32 sums."""
    from dspark.models.q8 import GROUP as G, Q8Linear, fit_q8

    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 96, generator=gen) * 0.05  # 100 outputs: padded to 112 inside, cut back outside
    x = _rows(rows, 96, seed=rows, scale=3.0)
    x[0, :G] = 0  # a group of zeros (scale 0)
    lin = Q8Linear(w, torch.randn(100, generator=gen), vnni=True)
    codes, step, _ = fit_q8(w)
    wq = (codes.float().view(100, -1, G) * step[..., None]).view(100, 96)
    g = x.float().view(rows, -1, G)
    mx = g.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.full_like(mx, 127) / torch.where(mx > 0, mx, 1), 0)  # as the kernel does
    # (127 / mx would be reciprocal(mx) * 127 in PyTorch, an ulp off and enough to move a tie)
    xq = ((g * inv).round() * (mx / 127)).view(rows, 96)
    torch.testing.assert_close(lin(x), xq @ wq.t() + lin.bias, rtol=1e-5, atol=1e-5)
    _each_row_alone_is_the_same(lin, x)
    with_8bit_rows = (lin(x) - lin.bias - x.float() @ wq.t()).norm() / (x.float() @ wq.t()).norm()
    assert with_8bit_rows < 0.02  # what rounding the rows costs


def test_embedded_model_runs_its_q8_head(embedded_dir):
    dec = load_decoder(embedded_dir, dtype=torch.bfloat16, quantization="auto")
    assert dec.lm_head_q8 is not None and dec.weight_format == "bfloat16/int4+q8-head"
    assert dec.lm_head.weight is dec.embed_tokens.weight  # the drafter still reads the bf16 rows


# ---- the drafter's round on the kernels ------------------------------------------------------------
def _markov_reference(anchors, base, w1, w2, w_tok, conf, d2t):
    """Per position, as DraftRunner.step + argmax do it, in fp32 over the bf16 weights."""
    r, n, _ = base.shape
    tokens, confs, prev = torch.empty(r, n, dtype=torch.long), torch.empty(r, n), anchors.clone()
    for k in range(n):
        e = w1[prev].float()
        ids = (base[:, k].float() + e @ w2.float().t()).argmax(-1)
        confs[:, k] = conf[:, k] + e @ w_tok.float()
        prev = d2t[ids] if d2t is not None else ids
        tokens[:, k] = prev
    return tokens, confs


@pytest.mark.parametrize("vd, rank, r", [(300, 16, 3), (16384, 64, 3), (40, 7, 3), (300, 16, 11), (1000, 64, 70)])
def test_markov_greedy_picks_what_the_per_position_path_picks(vd, rank, r):
    """Requests go through the kernel up to 8 at a time and 64 to a call: 11 and 70 take the remainders."""
    gen = torch.Generator().manual_seed(vd)
    vocab, n = vd + 500, 5
    w1 = (torch.randn(vocab, rank, generator=gen)).bfloat16()
    w2 = (torch.randn(vd, rank, generator=gen) * 0.5).bfloat16()
    w_tok = torch.randn(rank, generator=gen).bfloat16()
    base = (torch.randn(r, n + 2, vd, generator=gen) * 4).bfloat16()[:, :n]  # a strided view, as block() gives
    conf = torch.randn(r, n, generator=gen)
    d2t = torch.randperm(vocab, generator=gen)[:vd]
    anchors = torch.cat([torch.tensor([0, 7, vocab - 1]), torch.randint(vocab, (r - 3,), generator=gen)])
    tokens, confs = native.markov_greedy(lib, anchors, base, w1, native.markov_pack(lib, w2), w_tok, conf, d2t)
    want, want_conf = _markov_reference(anchors, base, w1, w2, w_tok, conf, d2t)
    assert torch.equal(tokens, want)
    torch.testing.assert_close(confs, want_conf, rtol=1e-5, atol=1e-5)
    bare, none = native.markov_greedy(lib, anchors, base, w1, native.markov_pack(lib, w2), None, None, None)
    assert none is None and torch.equal(bare, _markov_reference(anchors, base, w1, w2, w_tok, conf, None)[0])


def test_markov_greedy_breaks_ties_to_the_lowest_id_like_argmax():
    vd, rank = 100, 4
    w1, w2 = torch.zeros(10, rank).bfloat16(), torch.zeros(vd, rank).bfloat16()
    base = torch.zeros(2, 3, vd).bfloat16()
    base[0, :, [37, 53, 99]] = 1.0  # equal maxima in different tiles and lanes
    base[1, :, [5, 21]] = 2.0
    tokens, _ = native.markov_greedy(lib, torch.tensor([1, 2]), base, w1, native.markov_pack(lib, w2), None, None,
                                     torch.arange(vd) % 10)
    assert tokens.tolist() == [[7, 7, 7], [5, 5, 5]]  # ids 37 and 5 through d2t (id % 10)


@pytest.mark.parametrize("head_dim", [16, 32])  # 32: RoPE and the block's K/V write in one kernel call
def test_packed_drafter_on_kernels_drafts_like_the_pytorch_route(head_dim):
    """The kernels' round (fp32 attention over one key matrix per head, every greedy pick in one call)
    against the same packed weights with PyTorch's attention and per-position heads, both measured
    against the fp32 drafter: requests of different lengths, then a narrower round that reuses the
    context buffer. Both routes round to bf16 and 8-bit weights, so neither is exact; the kernels' must
    be no further off."""
    from dspark.drafters.runner import DraftRunner

    model, exact = kernel_drafter(head_dim=head_dim), kernel_drafter(torch.float32, pack=False, head_dim=head_dim)
    kernels = model.runner()
    assert kernels._native and kernels._chain is not None
    torch_route = DraftRunner(model, pack=True)
    torch_route._native, torch_route._chain = False, None
    feats = torch.randn(40, 2 * 64, generator=torch.Generator().manual_seed(4))
    for lengths in ([31, 9, 20], [6]):
        anchors = [11, 200, 3][:len(lengths)]
        out = {}
        for name, m, runner in (("kernels", model, kernels), ("torch", model, torch_route), ("fp32", exact, None)):
            m._runner = runner if runner is not None else m._runner
            caches = [m.new_cache() for _ in lengths]
            m.extend_many(caches, [feats[:n].to(m.fc.weight.dtype) for n in lengths], [0] * len(lengths))
            out[name] = m.draft(caches, anchors, lengths)
            if name == "kernels":  # the engine's call: every pick in one kernel call, the same picks
                lean = m.draft(caches, anchors, lengths, return_logits=False)
                assert torch.equal(lean.tokens, out[name].tokens)
                torch.testing.assert_close(lean.conf_logits, out[name].conf_logits, rtol=0, atol=0.05)
        model._runner = kernels

        def err(name):
            return (out[name].logits.float() - out["fp32"].logits).abs().mean()

        assert err("kernels") <= 1.25 * err("torch")


@pytest.mark.parametrize("weight_bits", [8, 4])
def test_a_greedy_round_in_one_call_drafts_what_the_calls_one_by_one_draft(weight_bits):
    """DraftRunner.greedy_block (csrc/draft_block.c) against block() then greedy_picks(): the same kernels in the
    same order, so the same drafts and confidence logits bit for bit, for one request (its fp32 cache read where it
    lies), for several of different lengths (copied side by side) and for fewer drafts than the block."""
    model = kernel_drafter(pack=False, head_dim=32).pack(weight_bits=weight_bits)
    runner = model.runner()
    assert runner._plan is not None
    feats = torch.randn(60, 2 * 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    for lengths, anchors, n in (([31], [7], 5), ([31, 9, 50], [11, 200, 3], 5), ([12, 40], [5, 6], 2)):
        caches = [model.new_cache() for _ in lengths]
        assert all(c.kv.dtype == torch.float32 for c in caches)
        model.extend_many(caches, [feats[:k] for k in lengths], [0] * len(lengths))
        one_call = model.draft(caches, anchors, lengths, num_drafts=n, return_logits=False)
        plan, runner._plan = runner._plan, None  # the calls one by one
        try:
            by_calls = model.draft(caches, anchors, lengths, num_drafts=n, return_logits=False)
        finally:
            runner._plan = plan
        assert one_call.tokens.shape == (len(lengths), n)
        assert torch.equal(one_call.tokens, by_calls.tokens)
        assert torch.equal(one_call.conf_logits, by_calls.conf_logits)


def test_4bit_drafter_computes_its_weights_on_the_fused_calls():
    """pack(weight_bits=4): every projection and the LM head on the 4-bit kernel, layers and context projection
    as fused calls (head_dim 32). On weights that already are 4-bit groups the 4-bit route loses nothing the
    8-bit one keeps: both round the rows to 8 bits, so against the fp32 drafter the 4-bit round must be no
    further off than the 8-bit round (a wrong layout or argument would be far off)."""
    exact = kernel_drafter(torch.float32, pack=False, head_dim=32)
    with torch.no_grad():  # every packed matrix onto its 4-bit grid (in fp32)
        mats = [exact.fc.weight, exact.lm_head] + [m.weight for layer in exact.layers for m in layer.modules()
                                                   if isinstance(m, torch.nn.Linear)]
        for w in mats:
            rows = -(-w.shape[0] // 16) * 16
            codes, step, lo, _ = fit_int4(torch.cat([w, w.new_zeros(rows - w.shape[0], w.shape[1])]))
            grid = codes.float().view(rows, -1, GROUP) * step[..., None] + lo[..., None]
            w.copy_(grid.view(rows, -1)[:w.shape[0]])
    w4 = copy.deepcopy(exact).to(torch.bfloat16).pack(weight_bits=4)
    w8 = copy.deepcopy(exact).to(torch.bfloat16).pack()
    runner = w4.runner()
    assert runner._w4 and runner._fused_layers and runner._fused_context and not w8.runner()._w4
    assert all(isinstance(lin, Int4Linear) for lin in (runner.fc, runner.ctx_kv, runner.head, runner.layers[0].qkv,
                                                       runner.layers[1].down))
    feats = torch.randn(40, 2 * 64, generator=torch.Generator().manual_seed(4))
    lengths, anchors = [31, 9, 20], [11, 200, 3]
    out = {}
    for name, m in (("w4", w4), ("w8", w8), ("fp32", exact)):
        caches = [m.new_cache() for _ in lengths]
        m.extend_many(caches, [feats[:n].to(m.fc.weight.dtype) for n in lengths], [0] * len(lengths))
        out[name] = m.draft(caches, anchors, lengths)
    err = {k: (out[k].logits.float() - out["fp32"].logits).abs().mean().item() for k in ("w4", "w8")}
    assert err["w4"] <= 1.25 * err["w8"], err
    with pytest.raises(ValueError, match="weight_bits must be 4 or 8"):
        kernel_drafter(pack=False).pack(weight_bits=2)
