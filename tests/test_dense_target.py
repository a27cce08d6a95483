"""The dense training target: same logits as the served decoder, same greedy text as the engine."""
from __future__ import annotations

import pytest
import torch

from dspark.models.loader import load_decoder
from dspark.models.int4 import int4_kernel
from dspark.train import dense_target
from dspark.train.dense_target import DenseTarget, dense_quantization, served_logits


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 11, 3, 17, 8)]


def test_teacher_forced_logits_match_the_served_decoder(tiny_model_dir):
    decoder = load_decoder(tiny_model_dir, quantization="none")  # fp32: the two paths agree to rounding
    target = DenseTarget(decoder)
    ids = torch.randint(3, 400, (2, 13), generator=torch.Generator().manual_seed(1))
    hidden, final = target.forward(ids, hidden_layers=(0, 2))
    for row in range(2):
        torch.testing.assert_close(target.logits(final[row]), served_logits(decoder, ids[row]), atol=1e-4, rtol=1e-4)
    assert hidden.shape == (2, 13, 2 * decoder.config.hidden_size)
    assert target.agreement(decoder, list(ids)) == 1.0


def test_right_padding_never_changes_earlier_positions(tiny_llama_dir):
    target = DenseTarget(load_decoder(tiny_llama_dir, quantization="none"))
    ids = torch.randint(3, 400, (1, 9), generator=torch.Generator().manual_seed(2))
    _, alone = target.forward(ids)
    padded = torch.cat([ids, torch.zeros(1, 6, dtype=torch.long)], dim=1)
    _, with_pad = target.forward(padded)
    torch.testing.assert_close(with_pad[:, :9], alone, atol=1e-5, rtol=1e-5)


def test_packed_pass_equals_each_sequence_alone(tiny_llama_dir):
    """forward_packed over sequences of several lengths, end to end without padding: each sequence's rows
    are its own pass (attention never crosses into a neighbour, positions restart at 0)."""
    target = DenseTarget(load_decoder(tiny_llama_dir, quantization="none"))
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 400, (n,), generator=g) for n in (9, 1, 14, 5)]
    hidden, final = target.forward_packed(seqs, hidden_layers=(0, 1))
    assert hidden.shape[0] == final.shape[0] == sum(len(s) for s in seqs)
    start = 0
    for s in seqs:
        h, f = target.forward(s.view(1, -1), hidden_layers=(0, 1))
        torch.testing.assert_close(hidden[start:start + len(s)], h[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[start:start + len(s)], f[0], atol=1e-5, rtol=1e-5)
        start += len(s)


def test_greedy_generation_matches_the_engine(tiny_llama_dir, prompts):
    from dspark import LLM, SamplingParams

    llm = LLM(str(tiny_llama_dir), dtype="float32", max_num_seqs=8)
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))]
    target = DenseTarget(llm.decoder if llm.decoder.quantization == "none" else
                         load_decoder(tiny_llama_dir, quantization="none"))
    target.eos = set()  # ignore_eos, as above
    got = target.generate(prompts, max_tokens=12, batch=2)  # 5 prompts through 2 slots: refills mid-run
    assert [g.tokens for g in got] == [list(w) for w in want]
    assert all(g.finish_reason == "length" for g in got)


def test_bf16_generation_on_the_decode_kernel_matches_sdpa(tiny_llama_dir, prompts, monkeypatch):
    """In bf16 on a CPU where dspark's kernels run, decode attention is the kernel's: the tokens are those
    of the SDPA route (the tiny model's margins are far wider than bf16 rounding)."""
    target = DenseTarget(load_decoder(tiny_llama_dir, dtype=torch.bfloat16, quantization="none"))
    target.eos = set()
    if target._decode_kernel(torch.zeros(1, dtype=torch.bfloat16)) is None:
        pytest.skip("decode attention runs on SDPA here")
    kernel = target.generate(prompts, max_tokens=10, batch=3)
    monkeypatch.setattr(target, "_decode_kernel", lambda kv: None)
    sdpa = target.generate(prompts, max_tokens=10, batch=3)
    assert [g.tokens for g in kernel] == [g.tokens for g in sdpa]


def test_sampled_generation_is_reproducible(tiny_llama_dir, prompts):
    target = DenseTarget(load_decoder(tiny_llama_dir, quantization="none"))
    a = target.generate(prompts, max_tokens=6, temperature=0.7, top_p=0.8, top_k=20, seed=5, batch=3)
    b = target.generate(prompts, max_tokens=6, temperature=0.7, top_p=0.8, top_k=20, seed=5, batch=3)
    assert [x.tokens for x in a] == [x.tokens for x in b]


def test_unknown_weight_formats_are_refused(tiny_llama_dir):
    dec = load_decoder(tiny_llama_dir, quantization="none")
    dec.quantization = "int3"
    with pytest.raises(ValueError, match="plain or 4-bit"):
        DenseTarget(dec)
    with pytest.raises(ValueError, match="one of auto, served, none"):  # forcing 4 bits: another target
        dense_quantization("int4")


@pytest.mark.parametrize("amx", [False, True])
def test_auto_target_pass_is_plain_on_amx_cpus_only(amx, monkeypatch):
    monkeypatch.setattr(dense_target, "amx_tiles", lambda: amx)
    assert dense_quantization("auto") == ("none" if amx else "auto")
    assert dense_quantization("auto", "cuda") == "auto"  # the host CPU's tiles say nothing about a GPU's pass
    assert dense_quantization("served") == "auto" and dense_quantization("none") == "none"


@pytest.mark.skipif(int4_kernel(torch.bfloat16, "cpu") != "dspark", reason="dspark's 4-bit kernel does not run here")
def test_four_bit_layers_run_on_their_kernel(tiny_llama_dir):
    """A decoder with 4-bit layers (forced here; the embedded GGUF's already are) keeps them: the dense pass
    runs each through its kernel, so its logits track the served decoder's several times closer than the
    pass on the same weights dequantised (only attention's rounding differs)."""
    served = load_decoder(tiny_llama_dir, dtype=torch.bfloat16, quantization="int4")
    target = DenseTarget(served)
    plain = DenseTarget(load_decoder(tiny_llama_dir, dtype=torch.bfloat16, quantization="none"))
    assert target.quantization == "int4" and plain.quantization == "none"
    ids = torch.randint(3, 400, (2, 13), generator=torch.Generator().manual_seed(1))
    _, final = target.forward(ids)
    _, final_plain = plain.forward(ids)
    for row in range(2):
        want = served_logits(served, ids[row])
        near = (target.logits(final[row]).float() - want).abs().mean()
        far = (plain.logits(final_plain[row]).float() - want).abs().mean()
        assert near * 3 < far, (near, far)
    packed, _ = target.forward_packed(list(ids), hidden_layers=(0, 2))
    hidden, _ = target.forward(ids, hidden_layers=(0, 2))
    torch.testing.assert_close(packed, hidden.flatten(0, 1), atol=2e-2, rtol=2e-2)
