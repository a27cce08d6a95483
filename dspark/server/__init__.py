"""OpenAI-compatible HTTP server over one continuous-batching engine loop.

    app.py          routes: validation, admission, plain and streaming answers
    engine_loop.py  the thread that owns the engine; bounded admission; per-request queues
    protocol.py     request bodies -> GenerationRequest (OpenAI error statuses)
    responses.py    response bodies and server-sent events
    metrics.py      Prometheus text exposition
    launch.py       bind, uvicorn, ServerThread;  cli.py: `dspark serve` flags
"""
from dspark.server.app import create_app
from dspark.server.config import ServerConfig
from dspark.server.launch import ServerThread

__all__ = ["ServerConfig", "ServerThread", "create_app"]
