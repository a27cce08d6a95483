"""EngineConfig: every setting of an engine in one frozen object, built once by whichever front end
starts it (LLM(...) keywords, `dspark generate` / `serve` / `bench` flags) and passed whole to the
engine. Each part checks its own values when built, so a bad setting fails before anything loads; the
error (ConfigError) names the keyword, and each command line names its own flag for it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from dspark.cache.kv_cache import DEFAULT_BLOCK_SIZE, blocks_for
from dspark.errors import ConfigError
from dspark.speculative.config import SpeculativeConfig


@dataclass(frozen=True)
class TargetConfig:
    """The target model and how it is loaded."""

    model: str | None = None  # a local Hugging Face directory; None: the embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto: bfloat16 on CUDA and CPUs with AMX / AVX-512-bf16, else float32
    quantization: str = "auto"  # auto / none / int4 (models/loader.py)
    device: str = "cpu"
    max_model_len: int | None = None  # prompt + completion tokens; None: the model's

    def __post_init__(self) -> None:
        from dspark.models.loader import DTYPE_CHOICES, QUANTIZATION_CHOICES

        if self.model is not None:
            object.__setattr__(self, "model", str(self.model))
        for key, allowed in (("dtype", DTYPE_CHOICES), ("quantization", QUANTIZATION_CHOICES)):
            if getattr(self, key) not in allowed:
                raise ConfigError(key, f"{key} must be one of {', '.join(allowed)}, got {getattr(self, key)!r}")
        _at_least("max_model_len", self.max_model_len, 2)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache. Its pages are `kv_block_size` tokens: not the drafter's block of drafts."""

    kv_cache_mb: int = 1024
    kv_block_size: int = DEFAULT_BLOCK_SIZE
    max_total_tokens: int | None = None  # SGLang's name: the cache in tokens; overrides kv_cache_mb

    def __post_init__(self) -> None:
        _at_least("kv_cache_mb", self.kv_cache_mb, 1)
        _at_least("kv_block_size", self.kv_block_size, 1)
        _at_least("max_total_tokens", self.max_total_tokens, self.kv_block_size)

    def num_blocks(self, bytes_per_token: int) -> int:
        if self.max_total_tokens is not None:
            return blocks_for(self.max_total_tokens, self.kv_block_size)
        return max(1, self.kv_cache_mb * 2**20 // (bytes_per_token * self.kv_block_size))


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits."""

    max_num_seqs: int = 32  # running requests
    max_num_batched_tokens: int = 512  # prefill tokens per step (chunked prefill)

    def __post_init__(self) -> None:
        _at_least("max_num_seqs", self.max_num_seqs, 1)
        _at_least("max_num_batched_tokens", self.max_num_batched_tokens, 1)


@dataclass(frozen=True)
class EngineConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Flat keywords (those of LLM(...)) -> the parts that own them; ConfigError for an unknown one."""
        parts: dict[str, dict] = {name: {} for name in _PARTS}
        for key, value in kwargs.items():
            if key not in _KEYWORDS:
                raise ConfigError(key, f"unknown engine option {key!r}; the options are {', '.join(_KEYWORDS)}")
            parts[_OWNER[key]][_KEYWORDS[key]] = value
        return cls(**{name: _PARTS[name](**values) for name, values in parts.items()})

    def check_files(self, model_path: Path) -> None:
        """Every file the settings name exists; run before loading anything."""
        self.speculative.check_files(model_path)


def _at_least(key: str, value, least: int) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
        raise ConfigError(key, f"{key} must be an integer >= {least}, got {value!r}")


_PARTS = {"target": TargetConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
          "speculative": SpeculativeConfig}
_RENAMED = {("speculative", "algorithm"): "speculative_algorithm"}  # keyword names that differ from the field
_KEYWORDS: dict[str, str] = {}  # keyword -> field
_OWNER: dict[str, str] = {}  # keyword -> part
for _part, _cls in _PARTS.items():
    for _f in dataclasses.fields(_cls):
        _key = _RENAMED.get((_part, _f.name), _f.name)
        _KEYWORDS[_key], _OWNER[_key] = _f.name, _part
