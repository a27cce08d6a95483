"""Stop conditions, checked token by token so a stop inside an accepted prefix ends the request
exactly where plain decoding would."""
from __future__ import annotations

from dspark.engine.detokenizer import append_text
from dspark.engine.sequence import Sequence


def commit_tokens(seq: Sequence, tokens: list[int], *, eos_ids: frozenset[int], max_model_len: int,
                  tokenizer) -> int:
    """Append `tokens` to `seq` until a stop condition; return how many were appended."""
    p = seq.params
    for n, tok in enumerate(tokens, start=1):
        seq.output_token_ids.append(tok)
        append_text(seq, tokenizer)
        reason = None
        if (tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            reason = "stop"
        elif p.stop and _hits_stop_string(seq, tokenizer):
            reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
            reason = "length"
        if reason:
            seq.finish_reason = reason
            return n
    return len(tokens)


def _hits_stop_string(seq: Sequence, tokenizer) -> bool:
    """On a stop string in the newest text, cut the text before it (as OpenAI / vLLM do)."""
    longest = max(len(s) for s in seq.params.stop)
    tail_from = max(0, seq.checked_len - longest + 1)  # a stop string can end only in the new text
    seq.checked_len = len(seq.text)
    hits = [i for i in (seq.text.find(s, tail_from) for s in seq.params.stop) if i >= 0]
    if hits:
        seq.text = seq.text[: min(hits)]
        seq.stopped_by_string = True
    return seq.stopped_by_string
