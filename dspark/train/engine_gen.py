"""Training-data generation on the serving engine: the target as it is served (its 4-bit kernels,
continuous batching over the paged cache), optionally with speculative decoding, which leaves greedy
answers token-identical and sampled ones distributed as the target's.

`EngineTarget.generate` has the call shape of `DenseTarget.generate`, so `generate_shards` takes either.
"""
from __future__ import annotations

from typing import Sequence

from dspark.train.dense_target import Generation


class EngineTarget:
    """The served target behind `generate(prompts, max_tokens=..., ...)` for `dspark train-data`."""

    def __init__(self, model: str | None = None, *, max_num_seqs: int = 64, kv_cache_mb: int = 1024,
                 speculative_algorithm: str = "none", dtype: str = "auto", quantization: str = "auto"):
        from dspark.llm import LLM

        self.llm = LLM(model, dtype=dtype, quantization=quantization, max_num_seqs=max_num_seqs, kv_cache_mb=kv_cache_mb,
                       speculative_algorithm=speculative_algorithm, profile_progress=False)
        self.eos = set(_eos_ids(self.llm))
        self.info = {"generator": "engine", "speculative_algorithm": speculative_algorithm,
                     "target_quantization": self.llm.config.target.quantization}

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = -1, seed: int = 0, batch: int | None = None) -> list[Generation]:
        """Answer every prompt (token ids); request j samples with seed `seed + j`. The stop token, when
        the answer ends on one, is part of `tokens`, as in the dense generator. `batch` is fixed by
        the engine's max_num_seqs and only accepted for the shared call shape."""
        from dspark.sampling_params import SamplingParams

        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                 seed=None if temperature == 0 else seed + j) for j in range(len(prompts))]
        outs = self.llm.generate([list(p) for p in prompts], params)
        results = []
        for out in outs:
            if out.finish_reason == "error":
                raise RuntimeError(f"generation failed: {out.error}")
            tokens = list(out.token_ids)
            results.append(Generation(tokens, out.finish_reason or "length"))
        return results


def _eos_ids(llm) -> list[int]:
    eos = llm.tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])
