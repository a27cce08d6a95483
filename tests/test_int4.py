"""4-bit weights (models/int4.py): recognising weights that already are 4-bit groups, the same numbers
as the dequantized weight, row results independent of the number of rows (speculative == plain), and
the loader's choice of format."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dspark import LLM, SamplingParams
from dspark.models import native
from dspark.models.int4 import GROUP, Int4Linear, fit_int4, int4_supported, native_int4, quantize_linears_int4
from dspark.models.loader import load_decoder
from invariance import assert_embedded_rows_invariant, batched_logits, logits_by_chunks
from rounding import rows_rounded_to_8bit

needs_int4 = pytest.mark.skipif(not int4_supported("cpu"), reason="this PyTorch has no CPU int4 kernel")


def _q4_weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """A weight the way a GGUF Q4_1 file stores it, dequantized: d * q + m per group of 32."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // GROUP, GROUP), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's Q4_1 maps a group's min to 0 and max to 15
    d = (torch.rand(n, k // GROUP, 1, generator=gen) * 0.01).half().float()
    m = (-8 * d + torch.randn(n, k // GROUP, 1, generator=gen) * 1e-3).half().float()
    return (q * d + m).reshape(n, k)


def test_native_int4_recognises_4bit_groups_only():
    w = _q4_weight(64, 128)
    assert native_int4(w)
    assert fit_int4(w)[3] < 1e-3
    assert not native_int4(w + 1e-4 * torch.randn_like(w))  # no longer on a 16-level grid
    assert not native_int4(torch.randn(64, 128))
    assert not native_int4(_q4_weight(64, 128)[:, :96][:8])  # out_features not a multiple of 16


@needs_int4
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (3072, 576)])
def test_int4_linear_matches_dequantized_weight_and_is_row_invariant(shape):
    w = _q4_weight(*shape)
    bias = torch.randn(shape[0])
    lin = Int4Linear(w, bias)
    x = torch.randn(70, shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    full = lin(x)
    rows = rows_rounded_to_8bit(x) if native.act8() else x.float()  # the activations the kernel multiplies
    ref = F.linear(rows, w, bias)
    torch.testing.assert_close(full.float(), ref, rtol=2e-2, atol=2e-2)
    for rows in (1, 2, 3, 7, 8, 9, 15, 33, 64):
        assert torch.equal(lin(x[:rows]), full[:rows]), rows
    assert torch.equal(torch.cat([lin(x[i:i + 5]) for i in range(0, 70, 5)]), full)
    assert lin(x[:0]).shape == (0, shape[0])
    assert lin(x[:16].view(4, 4, -1)).shape == (4, 4, shape[0])


@needs_int4
def test_int4_linear_rejects_shapes_the_kernel_cannot_take():
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Linear(torch.randn(32, 48))
    m = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24))
    assert quantize_linears_int4(m) == 1  # the second one stays as it is
    assert isinstance(m[0], Int4Linear) and isinstance(m[1], nn.Linear)


@needs_int4
def test_native_only_is_all_or_nothing():
    native, other = nn.Linear(64, 32), nn.Linear(64, 32)
    with torch.no_grad():
        native.weight.copy_(_q4_weight(32, 64))
    m = nn.Sequential(native, other)
    assert quantize_linears_int4(m, native_only=True) == 0
    assert m[0] is native and m[1] is other  # put back
    with torch.no_grad():
        other.weight.copy_(_q4_weight(32, 64, seed=1))
    assert quantize_linears_int4(m, native_only=True) == 2


def test_loader_quantization_choices(tiny_llama_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_decoder(tiny_llama_dir, quantization="int3")
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        load_decoder(tiny_llama_dir, dtype=torch.float16, quantization="int4")
    # random weights are not 4-bit groups: "auto" leaves them alone
    assert load_decoder(tiny_llama_dir, dtype=torch.bfloat16, pack=True, quantization="auto").quantization == "none"


@needs_int4
def test_forced_int4_decoder_is_window_invariant(tiny_llama_dir):
    dec = load_decoder(tiny_llama_dir, dtype=torch.bfloat16, pack=True, quantization="int4")
    assert dec.quantization == "int4"
    assert sum(isinstance(m, Int4Linear) for m in dec.modules()) == 4 * len(dec.layers)  # qkv, o, gate_up, down
    ids = torch.randint(1000, (20,), generator=torch.Generator().manual_seed(1))
    one_by_one = logits_by_chunks(dec, ids, [12] + [1] * 8)
    for chunks in ([12, 1, 5, 2], [12, 8], [12, 3, 3, 2]):
        assert torch.equal(logits_by_chunks(dec, ids, chunks), one_by_one), chunks


@needs_int4
def test_embedded_model_runs_its_4bit_weights_and_rows_do_not_depend_on_window_or_batch(embedded_dir):
    """The embedded GGUF Q4_1 model: "auto" keeps its layers 4-bit (the LM head, Q8_0 in the GGUF,
    stays packed bf16); a position's logits are bit-identical decoded alone, inside verify windows of
    any width, or next to other sequences; and they stay close to the fp32 model's."""
    dec = load_decoder(embedded_dir, dtype=torch.bfloat16, pack=True, quantization="auto")
    assert dec.quantization == "int4"
    assert_embedded_rows_invariant(dec)
    from transformers import AutoTokenizer

    text = ("The lighthouse keeper climbed the spiral stairs every evening at dusk. He lit the great lamp, wound "
            "the clockwork that turned the lens, and wrote the weather in his logbook. Ships passed far out at "
            "sea, and none of them knew his name, but all of them trusted his light. One winter night, a storm")
    ids = torch.tensor(AutoTokenizer.from_pretrained(str(embedded_dir)).encode(text))
    plan = [{0: 10}, {0: len(ids) - 10}]
    ref = batched_logits(load_decoder(embedded_dir, dtype=torch.float32), [ids], plan)[0].float()
    ours = batched_logits(dec, [ids], plan)[0].argmax(-1)
    # close to the fp32 model, not equal: 54 of 55 picks the same on bf16 activations, 50 on 8-bit ones (the
    # default where dspark's kernels run), and a pick that differs is a near tie for the fp32 model (<= 0.53 here)
    assert (ours == ref.argmax(-1)).float().mean().item() >= 0.85
    gap = ref.max(-1).values - ref.gather(1, ours[:, None])[:, 0]
    assert gap.max().item() < 1.0, gap.max()


@needs_int4
def test_speculative_decoding_is_lossless_on_the_4bit_embedded_model(embedded_llm):
    # bf16 (where the 4-bit layers run) is the default only on CPUs with fast bf16: ask for it by name
    plain_llm = (embedded_llm if embedded_llm.decoder.weight_format.startswith("bfloat16/int4")
                 else LLM(dtype="bfloat16", profile_progress=False))
    assert plain_llm.decoder.quantization == "int4"
    spec = LLM(dtype="bfloat16", speculative_algorithm="DSPARK", planner="fixed", profile_progress=False)
    assert spec.decoder.quantization == "int4"
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    plain = plain_llm.generate(prompts, params)
    fast = spec.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    assert any(max(o.accept_lengths) > 1 for o in fast)
