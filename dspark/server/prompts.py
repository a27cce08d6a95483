"""Prompt rendering and tokenization off the event loop.

Tokenizing a 1 MB prompt takes about a second of CPU; on the event loop that second would stall every
stream and /health. A small pool of threads does it instead (the tokenizer releases the GIL), each
thread with its own copy of the tokenizer, since one tokenizer object is not safe to share between
threads. The prompts waiting for the pool are bounded too (QueueFull past `max_pending`): a flood of
large prompts gets 429s instead of a queue of CPU-seconds in front of every later client."""
from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

from dspark.server.engine_loop import QueueFull
from dspark.server.errors import bad_request
from dspark.server.protocol import GenerationRequest

TOKENIZE_THREADS = 2


class PromptEncoder:
    """Render and tokenize prompts exactly as the offline LLM.chat / LLM.generate do, in a thread pool."""

    def __init__(self, tokenizer, *, vocab_size: int, model_name: str, max_pending: int,
                 threads: int = TOKENIZE_THREADS):
        self._source = copy.deepcopy(tokenizer)  # the engine thread decodes with the original
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dspark-tokenize")
        self.vocab_size = vocab_size
        self.model_name = model_name
        self.max_pending = max_pending
        self._pending = 0  # prompts in or waiting for the pool; touched on the event loop only

    async def encode(self, req: GenerationRequest) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); 400 for what cannot be a prompt."""
        if req.kind == "chat" and not self._source.chat_template:
            raise bad_request(f"The tokenizer of {self.model_name} has no chat template; use /v1/completions.",
                              "messages")
        if isinstance(req.prompt, list):
            if not all(0 <= t < self.vocab_size for t in req.prompt):
                raise bad_request(f"prompt token ids must be in [0, {self.vocab_size}).", "prompt")
            return None, req.prompt
        if self._pending >= self.max_pending:
            raise QueueFull(f"{self.max_pending} prompts waiting to be tokenized")
        self._pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, req)
        finally:
            self._pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _encode(self, req: GenerationRequest) -> tuple[str, list[int]]:
        """In a pool thread."""
        tokenizer = self._tokenizer()
        text = req.prompt
        if req.kind == "chat":
            try:  # the same rendering as LLM.apply_chat_template
                text = tokenizer.apply_chat_template(req.messages, tokenize=False, add_generation_prompt=True)
            except Exception as e:  # noqa: BLE001 - template errors (e.g. role order) are the client's
                raise bad_request(f"The chat template rejected the messages: {e}", "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise bad_request("The prompt is empty after tokenization.", "prompt")
        return text, ids

    def _tokenizer(self):
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            tokenizer = self._local.tokenizer = copy.deepcopy(self._source)
        return tokenizer
