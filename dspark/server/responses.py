"""OpenAI response bodies and server-sent-event chunks, plus the streamed-text bookkeeping."""
from __future__ import annotations

import json

from dspark.outputs import RequestOutput


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_stats(out: RequestOutput, algorithm: str) -> dict:
    """The extra `dspark` field: speculative statistics of one request (OpenAI clients ignore it)."""
    m = out.metrics
    return {"speculative_algorithm": algorithm, "rounds": m.get("rounds", 0),
            "mean_accept_length": round(out.mean_accept_length, 4), "drafted": m.get("drafted", 0),
            "verified": m.get("verified", 0), "accepted": m.get("accepted", 0)}


def final_body(kind: str, *, rid: str, created: int, model: str, out: RequestOutput, prompt_tokens: int,
               algorithm: str) -> dict:
    """The whole response of a non-streaming request."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": out.text}} if kind == "chat"
              else {"index": 0, "text": out.text})
    choice |= {"logprobs": None, "finish_reason": out.finish_reason}
    return {"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage(prompt_tokens, len(out.token_ids)),
            "dspark": spec_stats(out, algorithm)}


def chunk_body(kind: str, *, rid: str, created: int, model: str, text: str | None, finish_reason: str | None = None,
               first: bool = False, include_usage: bool = False) -> dict:
    """One streamed chunk: a piece of text, or (text None) the closing chunk with the finish reason."""
    if kind == "chat":
        delta = {"role": "assistant", "content": text or ""} if first else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or ""}
    choice |= {"logprobs": None, "finish_reason": finish_reason}
    body = {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [choice]}
    if include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last
    return body


def usage_chunk(kind: str, *, rid: str, created: int, model: str, out: RequestOutput, prompt_tokens: int,
                algorithm: str) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage(prompt_tokens, len(out.token_ids)),
            "dspark": spec_stats(out, algorithm)}


def sse(data: dict | str) -> bytes:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


class TextDelta:
    """What to send next of a growing text: hold back an incomplete UTF-8 character (U+FFFD at the end)
    and the last characters that could still become a stop string (the engine cuts those)."""

    def __init__(self, stop: list[str]):
        self.sent = ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def __call__(self, text: str, finished: bool) -> str:
        if not finished:
            text = text.rstrip("\ufffd")
            text = text[: max(0, len(text) - self.hold)] if self.hold else text
        if len(text) <= len(self.sent) or not text.startswith(self.sent):
            return ""  # nothing new (a changed prefix cannot be unsent; the final text settles it)
        delta, self.sent = text[len(self.sent):], text
        return delta
