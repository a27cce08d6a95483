"""LLM: the offline facade. LLM(model=None) runs the embedded default; generate() batches requests
continuously; chat() applies the tokenizer's chat template."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence as Seq

from dspark.config import EngineConfig
from dspark.engine.llm_engine import LLMEngine
from dspark.models.embedded import resolve_model_path
from dspark.models.loader import load_decoder, resolve_dtype
from dspark.outputs import RequestOutput
from dspark.sampling_params import SamplingParams
from dspark.speculative.factory import build_planner, build_proposer


class LLM:
    """Load a target model and generate with continuous batching."""

    def __init__(self, model: str | Path | None = None, *, config: EngineConfig | None = None,
                 profile_progress: bool = True, **options):
        """LLM(model, **options) with the keywords of EngineConfig.from_kwargs (dtype, max_num_seqs,
        speculative_algorithm, ...), or LLM(config=EngineConfig(...)). profile_progress: show the progress
        bar of a first-time SPS profile."""
        if config is None:
            config = EngineConfig.from_kwargs(**({} if model is None else {"model": model}), **options)
        elif model is not None or options:
            raise TypeError("pass either config= or the model and its options, not both")
        from transformers import AutoTokenizer

        self.config = config
        self.model_path = resolve_model_path(config.target.model)
        config.check_files(self.model_path)
        t = config.target
        self.decoder = load_decoder(self.model_path, dtype=resolve_dtype(t.dtype, t.device), device=t.device,
                                    pack=True, quantization=t.quantization)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        proposer = build_proposer(config.speculative, self.decoder, self.model_path)
        planner = build_planner(config.speculative, proposer, self.decoder, self.model_path,
                                config.scheduler.max_num_seqs, progress=profile_progress)
        self.engine = LLMEngine(self.decoder, self.tokenizer, config, proposer=proposer, planner=planner)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids); outputs come back in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params_list = self._params_list(params, len(prompts))
        encoded = [self._encode(p) for p in prompts]
        ids: list[str] = []
        try:
            for (text, token_ids), p in zip(encoded, params_list):
                ids.append(self.engine.add_request(token_ids, p, prompt=text))
        except ValueError:
            for request_id in ids:  # all or nothing: never leave half a batch queued
                self.engine.abort(request_id)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[i] for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None):
        """Generate for one prompt, yielding its RequestOutput after every step that changed it."""
        text, token_ids = self._encode(prompt)
        request_id = self.engine.add_request(token_ids, params or SamplingParams(), prompt=text)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort(request_id)

    def chat(self, conversations, params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.apply_chat_template(c) for c in conversations], params)

    def apply_chat_template(self, messages: list[dict]) -> str:
        """Render a conversation into the prompt text the model expects, ready for the assistant turn."""
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise ValueError('a conversation must be a list of {"role": str, "content": str} messages')
        if not self.tokenizer.chat_template:
            raise ValueError(f"the tokenizer of {self.model_path} has no chat template; pass raw prompts")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _encode(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("each prompt must be a string or a list of token ids")

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        return params
