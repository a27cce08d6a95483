"""The target's tokenizer as GGUF `tokenizer.*` keys, for a llama.cpp draft GGUF.

llama.cpp loads the draft's vocabulary on its own and refuses speculation unless its type, BOS/EOS
handling and token texts match the target's, and it reads the draft's mask token from
`tokenizer.ggml.mask_token_id`. Two sources:
  * the target's own GGUF (the file `llama-server -m` loads): every `tokenizer.*` key is copied as it is,
    which matches the served target by construction, whatever its tokenizer type;
  * the target's Hugging Face directory: a byte-level BPE `tokenizer.json` (GPT-2 style, as Qwen, Llama 3
    and SmolLM use) gives `tokenizer.ggml.tokens` / `token_type`, padded with unused `[PAD{i}]` entries to
    the embedding rows; merges, special ids, add-BOS/EOS flags and the chat template come from the `gguf`
    package's SpecialVocab. The pre-tokenizer is written as "default": llama.cpp names it from a table of
    tokenizer hashes we do not reproduce, and llama-server never tokenizes text with the draft's vocabulary
    (the target does), so it only silences llama.cpp's missing-pre-tokenizer warning.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter, SpecialVocab, TokenType

from dspark.interop.layout import read_json

MASK_KEY = "tokenizer.ggml.mask_token_id"
TOKENS_KEY = "tokenizer.ggml.tokens"
Field = tuple[Any, GGUFValueType, GGUFValueType | None]  # value, type, array element type


def write_tokenizer(writer: GGUFWriter, vocab_size: int, mask_token_id: int, *, target: Path | None,
                    target_gguf: Path | None) -> str:
    """Add the target's tokenizer keys and the drafter's mask id to writer; returns where they came from."""
    if target_gguf is not None:
        fields, special = gguf_tokenizer_fields(target_gguf, vocab_size), None
        source = f"copied from {target_gguf}"
    elif target is not None:
        fields = hf_tokenizer_fields(target, vocab_size)
        special = SpecialVocab(target, load_merges=True, n_vocab=vocab_size)
        # always explicit: llama.cpp's default depends on the pre-tokenizer name, and speculation is refused
        # unless the draft's add-BOS/EOS flags equal the target's
        for typ, adds in zip(("bos", "eos"), adds_special_tokens(target / "tokenizer.json")):
            special.add_special_token.setdefault(typ, adds)
        source = f"built from {target / 'tokenizer.json'} (pre-tokenizer 'default')"
    else:
        raise ValueError("a draft GGUF needs the target's tokenizer: pass --target DIR or --target-gguf FILE")
    for key, (value, vtype, sub) in fields.items():
        writer.add_key_value(key, value, vtype, sub)
    if special is not None:  # merges, special token ids, add-BOS/EOS flags, chat template
        special.add_to_gguf(writer, quiet=True)
    writer.add_uint32(MASK_KEY, mask_token_id)
    return source


def gguf_tokenizer_fields(path: Path, vocab_size: int) -> dict[str, Field]:
    """Every `tokenizer.*` key of a GGUF file except the mask id (the drafter brings its own)."""
    if not path.is_file():
        raise FileNotFoundError(f"target GGUF {path} not found")
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, IndexError, KeyError) as e:  # bad magic, truncated or corrupt header
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None
    fields: dict[str, Field] = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.") and key != MASK_KEY:
            fields[key] = _field_value(field, f"{path}: {key}")
    tokens = fields.get(TOKENS_KEY)
    if tokens is None:
        raise ValueError(f"{path} has no {TOKENS_KEY}: not a model GGUF with a vocabulary")
    if len(tokens[0]) != vocab_size:
        raise ValueError(f"{path} has {len(tokens[0])} tokens but the drafter's target vocabulary has {vocab_size} "
                         "rows: it is not the drafter's target")
    return fields


def _field_value(field: Any, where: str) -> Field:
    """A reader field back as (value, type, element type); strings stay bytes so any token text survives."""
    vtype = GGUFValueType(field.types[0])
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]), vtype, None
    if vtype != GGUFValueType.ARRAY:
        return field.parts[field.data[0]][0].item(), vtype, None
    sub = GGUFValueType(field.types[1]) if len(field.types) > 1 else None
    if sub == GGUFValueType.STRING:
        return [bytes(field.parts[i]) for i in field.data], vtype, sub
    if sub is None or sub == GGUFValueType.ARRAY:
        raise ValueError(f"{where}: nested or untyped arrays are not copied")
    items = np.concatenate([field.parts[i] for i in field.data]) if len(field.data) else np.array([])
    return items.tolist(), vtype, sub


def adds_special_tokens(path: Path) -> tuple[bool, bool]:
    """Whether the HF tokenizer puts a token before / after the text when asked for special tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    plain, full = (tok.encode("Hello world", add_special_tokens=flag).ids for flag in (False, True))
    start = full.index(plain[0]) if plain and plain[0] in full else 0
    return start > 0, len(full) - start > len(plain)


def hf_tokenizer_fields(target: Path, vocab_size: int) -> dict[str, Field]:
    """tokenizer.ggml.model / pre / tokens / token_type from a byte-level BPE tokenizer.json."""
    path = target / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"target {target} has no tokenizer.json; pass --target-gguf TARGET.gguf (the GGUF "
                                "llama-server loads as the target) to copy its tokenizer")
    data = read_json(path)
    model, decoder = data.get("model") or {}, data.get("decoder") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or decoder.get("type") != "ByteLevel" \
            or not isinstance(model.get("vocab"), dict):
        raise ValueError(f"{path} is not a byte-level BPE tokenizer (GPT-2 style); pass --target-gguf TARGET.gguf "
                         "to copy the tokenizer of the GGUF llama-server loads as the target")
    texts: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    types: dict[int, int] = dict.fromkeys(texts, int(TokenType.NORMAL))
    for added in data.get("added_tokens") or []:
        tid = int(added["id"])
        texts[tid] = added["content"]
        types[tid] = int(TokenType.CONTROL if added.get("special") else TokenType.USER_DEFINED)
    if texts and max(texts) >= vocab_size:
        raise ValueError(f"{path} has token id {max(texts)} but the drafter's target vocabulary has {vocab_size} "
                         "rows: it is not the drafter's target")
    # embedding rows past the tokenizer (padding) are unused tokens, as llama.cpp's converter writes them
    tokens = [texts.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    token_types = [types.get(i, int(TokenType.UNUSED)) for i in range(vocab_size)]
    return {
        "tokenizer.ggml.model": ("gpt2", GGUFValueType.STRING, None),
        "tokenizer.ggml.pre": ("default", GGUFValueType.STRING, None),
        TOKENS_KEY: (tokens, GGUFValueType.ARRAY, GGUFValueType.STRING),
        "tokenizer.ggml.token_type": (token_types, GGUFValueType.ARRAY, GGUFValueType.INT32),
    }
