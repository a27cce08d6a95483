"""Incremental detokenization: each new token costs two decodes of a few tokens, not the whole output."""
from __future__ import annotations

from dspark.engine.sequence import Sequence


def append_text(seq: Sequence, tokenizer) -> None:
    """Extend seq.text with the text of tokens not yet shown, holding back an incomplete UTF-8 tail.

    Decoding starts a few tokens back (prefix_offset) so tokenizers that strip a leading space or
    merge bytes across tokens produce the same text as one full decode.
    """
    ids = seq.output_token_ids
    prefix = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    full = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=True)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        seq.text += full[len(prefix):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)


def final_text(seq: Sequence, tokenizer) -> str:
    """The finished request's text: one full decode, unless a stop string already cut it."""
    if seq.stopped_by_string:
        return seq.text
    return tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
