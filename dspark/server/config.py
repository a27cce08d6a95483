"""ServerConfig: how the HTTP server listens and admits requests (the engine is configured by LLM)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerConfig:
    """Listening address, authentication and admission limits; validated on construction."""

    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None  # None: the model directory's name
    max_queued_requests: int = 128  # admitted beyond the running batch; more get 429
    max_request_bytes: int = 1 << 20  # larger bodies get 413
    retry_after_s: int = 1  # the Retry-After of a 429
    read_timeout_s: float = 30.0  # for a request's headers, and again for its body; then 408 / closed

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty (omit it to serve without authentication)")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("--served-model-name must not be empty")
        if self.max_queued_requests < 0:
            raise ValueError(f"--max-queued-requests must be >= 0, got {self.max_queued_requests}")
        if self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be >= 1024, got {self.max_request_bytes}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"--read-timeout must be > 0 seconds, got {self.read_timeout_s}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
