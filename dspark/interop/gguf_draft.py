"""llama.cpp draft GGUFs: `general.architecture = dflash`, the file `llama-server -md` loads for
`--spec-type draft-dspark` (the layout of llama.cpp b11434, as its own converter writes it from a
speculators checkpoint plus `--target-model-dir`).

Tensors (GGUF names; shapes as torch / numpy rows x columns, ggml lists them reversed):
  fc.weight [d, m*d]              enc.output_norm.weight [d] (speculators' hidden_norm)
  blk.N.attn_norm / attn_q / attn_k / attn_v / attn_output / attn_q_norm / attn_k_norm / ffn_norm /
  ffn_gate / ffn_up / ffn_down .weight (the Qwen3 layer; dspark's fused mlp.gate_up is split)
  output_norm.weight [d]          output.weight [Vd, d]: the target's LM head rows, reduced vocabulary only
                                  (a full-vocabulary draft shares the target's head in llama.cpp)
  markov_w1.weight [V, r], markov_w2.weight [Vd, r]: the vanilla Markov head
  conf_proj.weight [1, d + r], conf_proj.bias [1]: the confidence head (read only next to a Markov head)
  d2t [Vd]: absolute target ids (I64), ascending, reduced vocabulary only
Keys: dflash.{block_count, context_length, embedding_length, feed_forward_length, attention.head_count,
attention.head_count_kv, attention.key_length, attention.value_length, rope.freq_base,
attention.layer_norm_rms_epsilon, block_size, target_layers, sample_from_anchor, has_confidence_head},
general.{architecture, type, name, size_label, file_type, quantization_version}, and the target's
tokenizer (gguf_vocab.py) with the drafter's mask token. `target_layers` are HF hidden_states indices
(dspark layer i -> i + 1): llama.cpp taps the input of target layer i + 1, the output of layer i.
Dtypes: tensors of two or more dims in the output type (default: the drafter's own dtype), 1-D tensors
(norms, the confidence bias) in F32, d2t in I64. dspark's STS temperatures are not carried: llama.cpp
thresholds the raw sigmoid of the confidence logit (an sts.json logit offset is already in the bias).
"""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from dspark.drafters.io import CONFIG
from dspark.interop.gguf_vocab import write_tokenizer
from dspark.interop.layout import Tensors, read_json
from dspark.interop.parts import DrafterParts
from dspark.interop.speculators import speculators_tensors

ARCH = "dflash"
OUTTYPES = ("auto", "f32", "f16", "bf16")
QUANT_VERSION = 2  # ggml's quantization version, written by every llama.cpp converter
_KINDS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_QTYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}
_FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}  # llama.cpp's LLAMA_FTYPE_ALL_F32 / MOSTLY_F16 / MOSTLY_BF16
_TOP = {
    "fc.weight": "fc.weight",
    "hidden_norm.weight": "enc.output_norm.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "markov_head.markov_w1.weight": "markov_w1.weight",
    "markov_head.markov_w2.weight": "markov_w2.weight",
    "confidence_head.proj.weight": "conf_proj.weight",
    "confidence_head.proj.bias": "conf_proj.bias",
    "d2t": "d2t",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


def gguf_name(name: str) -> str:
    """The llama.cpp DFlash tensor name of a speculators-named drafter tensor."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_NAME.match(name)
    if m and m[2] in _LAYER:
        return f"blk.{m[1]}.{_LAYER[m[2]]}"
    raise ValueError(f"llama.cpp's DFlash draft has no tensor for {name}")


def check_supported(parts: DrafterParts) -> None:
    """Refuse what llama.cpp's DFlash / DSpark draft graph does not compute."""
    c = parts.config
    problems = []
    if c.markov_rank > 0 and c.markov_head_type != "vanilla":
        problems.append(f"a {c.markov_head_type!r} Markov head (llama.cpp runs the vanilla head only: "
                        "bias = markov_w2 @ markov_w1[previous token])")
    if c.confidence_head and c.markov_rank == 0:
        problems.append("a confidence head without a Markov head (llama.cpp reads conf_proj only next to one)")
    if not c.qk_norm:
        problems.append("qk_norm=False (llama.cpp's DFlash layers require attn_q_norm / attn_k_norm)")
    if c.attention_bias:
        problems.append("attention biases (llama.cpp's DFlash layers have none)")
    if problems:
        raise ValueError("cannot export to a llama.cpp draft GGUF: " + "; ".join(problems))


def gguf_tensors(parts: DrafterParts, target: Path | None) -> Tensors:
    """The drafter's tensors under llama.cpp's names, before the dtype conversion."""
    check_supported(parts)
    if parts.config.draft_vocab_size is not None and target is None:
        raise ValueError("a reduced-vocabulary drafter needs the target (--target DIR): the GGUF carries the "
                         "target's LM head rows of the draft vocabulary as output.weight")
    # speculators' tensors are what llama.cpp's converter reads: split MLP, d2t sorted ascending (rows of
    # markov_w2 permuted with it) as offsets, and the pruned LM head
    hf = speculators_tensors(parts, target)
    hf.pop("t2d", None)
    if "d2t" in hf:
        hf["d2t"] = hf["d2t"].long() + torch.arange(len(hf["d2t"]))  # offsets -> absolute target ids
    return {gguf_name(k): v for k, v in hf.items()}


def gguf_array(name: str, tensor: torch.Tensor, kind: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """One tensor as written: d2t I64, 1-D tensors F32, the rest in `kind` (numpy has no bfloat16: raw bits)."""
    t = tensor.detach().cpu().contiguous()
    if name == "d2t":
        return t.to(torch.int64).numpy(), GGMLQuantizationType.I64
    kind = "f32" if t.dim() == 1 else kind
    if kind == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy(), GGMLQuantizationType.BF16
    return t.to(torch.float16 if kind == "f16" else torch.float32).numpy(), _QTYPES[kind]


def write_gguf(parts: DrafterParts, out: Path, *, target: Path | None, target_gguf: Path | None = None,
               outtype: str = "auto", name: str | None = None, force: bool = False, verbose: bool = False) -> Path:
    """Write parts as a llama.cpp draft GGUF file at out (see the module docstring for the layout).

    target: the target's HF dir (tokenizer, chat template, context length; LM head rows for a reduced
    vocabulary). target_gguf: the target's own GGUF, whose tokenizer keys are copied instead.
    outtype: "auto" (the drafter's dtype), "f32", "f16" or "bf16" for tensors of two or more dims.
    """
    if outtype not in OUTTYPES:
        raise ValueError(f"outtype must be one of {OUTTYPES}, got {outtype!r}")
    _check_output(out, force)
    c = parts.config
    target_cfg = _target_config(target, c.vocab_size, c.hidden_size)
    tensors = gguf_tensors(parts, target)
    kind = _KINDS.get(parts.tensors["fc.weight"].dtype, "f32") if outtype == "auto" else outtype

    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    writer = GGUFWriter(str(part), ARCH)
    try:
        writer.add_string("general.type", "model")
        writer.add_string("general.name", name or out.stem)
        for key, value, vtype in _hparams(parts, target_cfg, kind):
            sub = GGUFValueType.INT32 if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, value, vtype, sub)
        source = write_tokenizer(writer, c.vocab_size, c.mask_token_id, target=target, target_gguf=target_gguf)
        for tname, tensor in tensors.items():
            array, qtype = gguf_array(tname, tensor, kind)
            writer.add_tensor(tname, array, raw_dtype=qtype)
        if hasattr(gguf, "size_label"):  # "17M": the size tag llama.cpp's converter writes (newer gguf only)
            writer.add_string("general.size_label", gguf.size_label(writer.get_total_parameter_count()[0], 0, 0, 0))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(part, out)
    finally:
        writer.close()
        part.unlink(missing_ok=True)
    if verbose:
        print(f"gguf: {len(tensors)} tensors ({kind}; norms F32, d2t I64), tokenizer {source}", file=sys.stderr)
    return out


def _hparams(parts: DrafterParts, target_cfg: dict, kind: str) -> list[tuple[str, object, GGUFValueType]]:
    """(key, value, type) of the model hyper-parameters llama.cpp's DFlash loader reads."""
    c, u32, f32 = parts.config, GGUFValueType.UINT32, GGUFValueType.FLOAT32
    rows: list[tuple[str, object, GGUFValueType]] = [(f"{ARCH}.block_count", c.num_layers, u32)]
    if target_cfg.get("max_position_embeddings"):
        rows.append((f"{ARCH}.context_length", int(target_cfg["max_position_embeddings"]), u32))
    rows += [
        (f"{ARCH}.embedding_length", c.hidden_size, u32),
        (f"{ARCH}.feed_forward_length", c.intermediate_size, u32),
        (f"{ARCH}.attention.head_count", c.num_attention_heads, u32),
        (f"{ARCH}.attention.head_count_kv", c.num_key_value_heads, u32),
        (f"{ARCH}.rope.freq_base", float(c.rope_theta), f32),
        (f"{ARCH}.attention.layer_norm_rms_epsilon", float(c.rms_norm_eps), f32),
        (f"{ARCH}.attention.key_length", c.head_dim, u32),
        (f"{ARCH}.attention.value_length", c.head_dim, u32),
        ("general.file_type", _FILE_TYPES[kind], u32),
        (f"{ARCH}.block_size", c.block_size, u32),
        (f"{ARCH}.target_layers", [i + 1 for i in c.target_layer_ids], GGUFValueType.ARRAY),
        # dspark blocks are anchor-first ([anchor, mask, ...], slot k predicts x_{k+1}): llama.cpp's
        # sample_from_anchor; false would be the bonus-anchor layout (slot 0 unread)
        (f"{ARCH}.sample_from_anchor", True, GGUFValueType.BOOL),
        (f"{ARCH}.has_confidence_head", bool(c.confidence_head), GGUFValueType.BOOL),
        ("general.quantization_version", QUANT_VERSION, u32),
    ]
    return rows


def _target_config(target: Path | None, vocab_size: int, hidden_size: int) -> dict:
    """The target's config.json (empty without a target), checked against the drafter's shapes."""
    if target is None:
        return {}
    cfg = read_json(target / CONFIG)
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    for key, want in (("vocab_size", vocab_size), ("hidden_size", hidden_size)):
        if cfg.get(key) is not None and int(cfg[key]) != want:
            raise ValueError(f"target {target} has {key} {cfg[key]}, the drafter expects {want}: not its target")
    return cfg


def _check_output(out: Path, force: bool) -> None:
    """OUT is a file path; an existing one is replaced only with force."""
    if out.is_dir():
        raise ValueError(f"{out} is a directory; --to gguf writes one file (e.g. {out / 'draft.gguf'})")
    if out.exists() and not force:
        raise ValueError(f"{out} exists; pass --force (force=True) to overwrite it")


__all__ = ["ARCH", "OUTTYPES", "check_supported", "gguf_name", "gguf_tensors", "write_gguf"]
