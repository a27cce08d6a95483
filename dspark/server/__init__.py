"""OpenAI-compatible HTTP server over one continuous-batching engine loop.

    app.py          routes: validation, admission, plain and streaming answers
    engine_loop.py  the thread that owns the engine; bounded admission; per-request queues
    compute.py      ComputeThread: the one thread that loads the model and then runs its loop
    protocol.py     request bodies -> GenerationRequest (OpenAI error statuses)
    responses.py    response bodies and server-sent events
    metrics.py      Prometheus text exposition
    launch.py       bind, uvicorn, ServerThread;  cli.py: `dspark serve` flags
"""
from dspark.server.app import create_app
from dspark.server.compute import ComputeThread
from dspark.server.config import ServerConfig
from dspark.server.launch import ServerThread

__all__ = ["ComputeThread", "ServerConfig", "ServerThread", "create_app"]
