"""ConfigError: a bad setting, named by its keyword so that each front end can name its own flag."""
from __future__ import annotations


class ConfigError(ValueError):
    """`key` is the keyword of EngineConfig.from_kwargs (e.g. "max_num_seqs") that holds the bad value."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key
