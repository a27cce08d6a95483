"""`dspark convert --to gguf`: the llama.cpp draft GGUF (`general.architecture = dflash`) read back with the
`gguf` package's GGUFReader, without llama.cpp: the keys and tensors of llama.cpp's DFlash / DSpark layout,
and every drafter tensor recovered (values equal after the documented dtype conversion)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from safetensors.torch import load_file, save_file

from dspark.cli import main as cli_main
from dspark.interop import convert
from dspark.models.loader import load_decoder
from tests.conftest import make_tiny_model
from tests.test_interop import BLOCK, IDS, random_dspark

LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
         "ffn_gate", "ffn_up", "ffn_down")
# GGUF name -> dspark name (the MLP's gate and up are re-joined below)
BACK = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight", "output_norm.weight": "norm.weight",
        "markov_w1.weight": "markov_head.markov_w1.weight", "markov_w2.weight": "markov_head.markov_w2.weight",
        "conf_proj.weight": "confidence_head.proj.weight", "conf_proj.bias": "confidence_head.proj.bias",
        "d2t": "d2t"}
BACK_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
              "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_down": "mlp.down"}
TORCH = {GGMLQuantizationType.F32: torch.float32, GGMLQuantizationType.F16: torch.float16,
         GGMLQuantizationType.BF16: torch.bfloat16, GGMLQuantizationType.I64: torch.int64}


VOCAB = 384  # embedding rows of the tiny target; its tokenizer has 321 tokens, the rest is padding
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def small_tokenizer(directory: Path) -> None:
    """A byte-level BPE tokenizer of 320 tokens (+ one added) that prepends <|im_start|> as its BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "speculative drafts of blocks"] * 20,
                            trainer)
    tok.add_tokens(["<think>"])
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}))
    (directory / "chat_template.jinja").write_text(TEMPLATE)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3", vocab_size=VOCAB)
    small_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def head(qwen3_dir):
    return load_decoder(qwen3_dir).lm_head.weight.detach()


def keys(reader: GGUFReader) -> dict:
    """Every metadata key as a python value (strings decoded, arrays as lists)."""
    out = {}
    for name, f in reader.fields.items():
        kind = GGUFValueType(f.types[0])
        if kind == GGUFValueType.ARRAY:
            sub = GGUFValueType(f.types[1])
            out[name] = [bytes(f.parts[i]).decode() if sub == GGUFValueType.STRING else f.parts[i][0].item()
                         for i in f.data]
        elif kind == GGUFValueType.STRING:
            out[name] = bytes(f.parts[f.data[0]]).decode()
        else:
            out[name] = f.parts[f.data[0]][0].item()
    return out


def tensor(t) -> torch.Tensor:
    """A GGUFReader tensor as torch, in numpy's row-major shape (ggml lists dims reversed)."""
    shape = [int(s) for s in reversed(t.shape)]
    raw = np.ascontiguousarray(t.data).view(np.uint8).tobytes()
    return torch.frombuffer(bytearray(raw), dtype=TORCH[t.tensor_type]).reshape(shape)


def read_back(path: Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, GGMLQuantizationType]]:
    """(keys, tensors by GGUF name, ggml type by GGUF name) of a GGUF file."""
    r = GGUFReader(str(path))
    return keys(r), {t.name: tensor(t) for t in r.tensors}, {t.name: t.tensor_type for t in r.tensors}


def to_dspark(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GGUF names back to dspark's (gate + up rows -> mlp.gate_up); output.weight is the target's, dropped."""
    out = {}
    for name, t in tensors.items():
        if name.startswith("blk."):
            _, i, kind, _ = name.split(".")
            if kind in ("ffn_gate", "ffn_up"):
                continue
            out[f"layers.{i}.{BACK_LAYER[kind]}.weight"] = t
            if kind == "ffn_down":
                out[f"layers.{i}.mlp.gate_up.weight"] = torch.cat([tensors[f"blk.{i}.ffn_gate.weight"],
                                                                   tensors[f"blk.{i}.ffn_up.weight"]])
        elif name != "output.weight":
            out[BACK[name]] = t
    return out


def test_gguf_has_llama_cpp_dspark_layout(qwen3_dir, head, tmp_path):
    src = random_dspark(qwen3_dir, tmp_path / "src", dtype=torch.bfloat16, draft_vocab=128)
    out = convert(src, tmp_path / "draft.gguf", to="gguf", target=qwen3_dir)
    kv, tensors, types = read_back(out)
    tc = json.loads((qwen3_dir / "config.json").read_text())
    d, r, inter, v = 64, 16, 128, VOCAB
    assert kv["general.architecture"] == "dflash" and kv["general.type"] == "model"
    assert {k: kv[k] for k in ("dflash.block_count", "dflash.context_length", "dflash.embedding_length",
                               "dflash.feed_forward_length", "dflash.attention.head_count",
                               "dflash.attention.head_count_kv", "dflash.attention.key_length",
                               "dflash.attention.value_length", "dflash.block_size", "general.file_type")} == {
        "dflash.block_count": 2, "dflash.context_length": 512, "dflash.embedding_length": d,
        "dflash.feed_forward_length": inter, "dflash.attention.head_count": 4, "dflash.attention.head_count_kv": 2,
        "dflash.attention.key_length": 32, "dflash.attention.value_length": 32, "dflash.block_size": BLOCK,
        "general.file_type": 32}  # MOSTLY_BF16
    assert kv["dflash.target_layers"] == [i + 1 for i in IDS]  # HF hidden_states indices
    assert kv["dflash.sample_from_anchor"] is True and kv["dflash.has_confidence_head"] is True
    assert kv["dflash.rope.freq_base"] == pytest.approx(tc["rope_theta"] if "rope_theta" in tc
                                                        else tc["rope_parameters"]["rope_theta"])
    assert kv["tokenizer.ggml.mask_token_id"] == v - 1  # DrafterConfig.for_target's mask token
    hf = json.loads((qwen3_dir / "tokenizer.json").read_text())
    n = len(hf["model"]["vocab"])  # then the added <think>, then padding up to the embedding rows
    texts = {i: t for t, i in hf["model"]["vocab"].items()} | {n: "<think>"}
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "default"
    assert kv["tokenizer.ggml.tokens"] == [texts.get(i, f"[PAD{i}]") for i in range(v)]
    # control (the 3 specials), normal, user-defined (<think>), unused (padding)
    assert kv["tokenizer.ggml.token_type"] == [3] * 3 + [1] * (n - 3) + [4] + [5] * (v - n - 1)
    assert kv["tokenizer.ggml.merges"] == [" ".join(m) if isinstance(m, list) else m for m in hf["model"]["merges"]]
    assert kv["tokenizer.chat_template"] == TEMPLATE
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_eos_token"] is False

    layer = {f"blk.{i}.{k}.weight" for i in range(2) for k in LAYER}
    top = {"fc.weight", "enc.output_norm.weight", "output_norm.weight", "output.weight", "markov_w1.weight",
           "markov_w2.weight", "conf_proj.weight", "conf_proj.bias", "d2t"}
    assert set(tensors) == layer | top and len(tensors) == 31  # the count llama.cpp's converter writes
    shapes = {"fc.weight": (d, len(IDS) * d), "output.weight": (128, d), "markov_w1.weight": (v, r),
              "markov_w2.weight": (128, r), "conf_proj.weight": (1, d + r), "conf_proj.bias": (1,), "d2t": (128,),
              "blk.0.attn_q.weight": (4 * 32, d), "blk.0.attn_k.weight": (2 * 32, d), "blk.0.attn_q_norm.weight": (32,),
              "blk.0.ffn_gate.weight": (inter, d), "blk.0.ffn_down.weight": (d, inter)}
    assert {k: tuple(tensors[k].shape) for k in shapes} == shapes
    for name, kind in types.items():
        want = (GGMLQuantizationType.I64 if name == "d2t" else GGMLQuantizationType.F32 if tensors[name].dim() == 1
                else GGMLQuantizationType.BF16)
        assert kind == want, name
    d2t = load_file(str(src / "model.safetensors"))["d2t"]
    assert torch.equal(tensors["d2t"], d2t)  # absolute target ids
    assert torch.equal(tensors["output.weight"], head[d2t].to(torch.bfloat16))


CASES = {
    "dspark-fp32-full-vocab": dict(src={}, outtype="auto"),
    "dspark-bf16-draft-vocab": dict(src=dict(dtype=torch.bfloat16, draft_vocab=200), outtype="auto"),
    "dspark-fp32-as-f16": dict(src=dict(draft_vocab=200), outtype="f16"),
    "dflash-draft-vocab": dict(src=dict(markov_rank=0, confidence_head=False, draft_vocab=200), outtype="auto"),
}


@pytest.mark.parametrize("case", CASES)
def test_gguf_round_trip_keeps_every_tensor(case, qwen3_dir, head, tmp_path):
    src = random_dspark(qwen3_dir, tmp_path / "src", **CASES[case]["src"])
    out = convert(src, tmp_path / "d.gguf", to="gguf", target=qwen3_dir, outtype=CASES[case]["outtype"])
    kv, tensors, _ = read_back(out)
    a = load_file(str(src / "model.safetensors"))
    kind = {"auto": a["fc.weight"].dtype, "f16": torch.float16}[CASES[case]["outtype"]]
    back = to_dspark(tensors)
    assert back.keys() == a.keys()
    for name, t in a.items():  # the documented conversion: matrices in the output type, 1-D in F32, d2t I64
        want = t if name == "d2t" else t.to(torch.float32 if t.dim() == 1 else kind)
        assert back[name].dtype == want.dtype and torch.equal(back[name], want), name
    assert ("output.weight" in tensors) == ("d2t" in a)  # a full-vocabulary draft shares the target's head
    if "d2t" in a:
        assert torch.equal(tensors["output.weight"], head[a["d2t"]].to(kind))
    assert kv["dflash.has_confidence_head"] is ("confidence_head.proj.weight" in a)


def test_gguf_sorts_the_draft_vocabulary_with_its_rows(qwen3_dir, head, tmp_path):
    src = random_dspark(qwen3_dir, tmp_path / "src", draft_vocab=200)
    w = load_file(str(src / "model.safetensors"))
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(0))
    w["d2t"], w["markov_head.markov_w2.weight"] = w["d2t"][perm], w["markov_head.markov_w2.weight"][perm]
    save_file(w, str(src / "model.safetensors"))
    _, tensors, _ = read_back(convert(src, tmp_path / "d.gguf", to="gguf", target=qwen3_dir))
    d2t = tensors["d2t"]
    assert bool((d2t[1:] > d2t[:-1]).all())  # ascending, as llama.cpp's converter writes it
    row = {int(t): j for j, t in enumerate(w["d2t"])}
    order = torch.tensor([row[int(t)] for t in d2t])
    assert torch.equal(tensors["markov_w2.weight"], w["markov_head.markov_w2.weight"][order])
    assert torch.equal(tensors["output.weight"], head[d2t])


def fake_target_gguf(path: Path, n_tokens: int) -> Path:
    """A GGUF with only tokenizer keys (what the copy reads), its own mask id included."""
    w = GGUFWriter(str(path), "qwen3")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "qwen2")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(n_tokens)])
    w.add_array("tokenizer.ggml.token_type", [1] * n_tokens)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_uint32("tokenizer.ggml.eos_token_id", 3)
    w.add_uint32("tokenizer.ggml.mask_token_id", 7)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_tokenizer_copied_from_the_target_gguf(qwen3_dir, tmp_path):
    src = random_dspark(qwen3_dir, tmp_path / "src")
    target_gguf = fake_target_gguf(tmp_path / "target.gguf", VOCAB)
    kv, _, _ = read_back(convert(src, tmp_path / "d.gguf", to="gguf", target=qwen3_dir, target_gguf=target_gguf))
    copied = {k: v for k, v in keys(GGUFReader(str(target_gguf))).items() if k.startswith("tokenizer.")}
    mine = {k: v for k, v in kv.items() if k.startswith("tokenizer.")}
    assert mine == {**copied, "tokenizer.ggml.mask_token_id": VOCAB - 1}  # the drafter's mask token, not the target's
    with pytest.raises(ValueError, match="has 100 tokens"):
        convert(src, tmp_path / "e.gguf", to="gguf", target=qwen3_dir,
                target_gguf=fake_target_gguf(tmp_path / "small.gguf", 100))
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        convert(src, tmp_path / "f.gguf", to="gguf", target=qwen3_dir, target_gguf=tmp_path / "junk.gguf")


def test_gguf_refuses_what_llama_cpp_does_not_run(qwen3_dir, tmp_path):
    for i, (over, match) in enumerate([(dict(markov_head_type="gated"), "vanilla head only"),
                                       (dict(markov_rank=0, confidence_head=True), "without a Markov head")]):
        src = random_dspark(qwen3_dir, tmp_path / f"src{i}", **over)
        with pytest.raises(ValueError, match=match):
            convert(src, tmp_path / f"o{i}.gguf", to="gguf", target=qwen3_dir)
        assert not (tmp_path / f"o{i}.gguf").exists() and not list(tmp_path.glob("*.part"))
    dv = random_dspark(qwen3_dir, tmp_path / "dv", draft_vocab=128)
    with pytest.raises(ValueError, match="needs the target"):
        convert(dv, tmp_path / "dv.gguf", to="gguf")  # trained for "tiny-qwen3": nothing to remember


def test_cli_convert_to_gguf(qwen3_dir, tmp_path, capsys):
    src = random_dspark(qwen3_dir, tmp_path / "src")
    out = tmp_path / "draft.gguf"
    args = ["convert", "--to", "gguf", str(src), str(out), "--target", str(qwen3_dir)]
    assert cli_main(args) == 0 and GGUFReader(str(out)).fields["general.architecture"]
    assert cli_main(args) == 2 and "exists; pass --force" in capsys.readouterr().err
    assert cli_main(args + ["--force", "--outtype", "f32"]) == 0
    assert cli_main(["convert", "--to", "gguf", str(src), str(tmp_path), "--target", str(qwen3_dir)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert cli_main(["convert", "--to", "speculators", str(src), str(tmp_path / "s"), "--outtype", "f16"]) == 2
    assert "apply to --to gguf only" in capsys.readouterr().err
