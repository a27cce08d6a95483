"""Run the server: bind the address first (a taken port fails before the model loads), then serve
with uvicorn in the foreground (`dspark serve`) or in a background thread (tests, benchmarks)."""
from __future__ import annotations

import functools
import gc
import logging
import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from dspark.llm import LLM
from dspark.server.app import create_app
from dspark.server.compute import ComputeThread
from dspark.server.config import ServerConfig

log = logging.getLogger("dspark.server")


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket; ValueError when the address cannot be used."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve: {e}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn.Server that says "ready" once it accepts connections."""

    def __init__(self, config: uvicorn.Config, url: str):
        super().__init__(config)
        self.url = url

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            log.info("ready: accepting requests on %s", self.url)


class _HeaderTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers do not all arrive within
    `header_timeout_s` (uvicorn has no such limit: a slowloris client could hold a socket for ever).
    The body has its own limit in the app (dspark/server/body.py)."""

    def __init__(self, *args, header_timeout_s: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self._header_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        self._arm()  # the next request on this connection; a pipelined one disarms it at once
        super().on_response_complete()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers are complete
            self._disarm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def _uvicorn_server(llm: LLM, config: ServerConfig, sock: socket.socket, log_level: str,
                    compute: ComputeThread | None = None) -> _Server:
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    app = create_app(llm, config, compute)
    http = functools.partial(_HeaderTimeoutH11, header_timeout_s=config.read_timeout_s)
    uv = uvicorn.Config(app, http=http, log_level=log_level, access_log=log_level == "debug", lifespan="on",
                        timeout_graceful_shutdown=5, log_config=None)
    return _Server(uv, f"http://{host}:{port}")


def run_server(llm: LLM, config: ServerConfig, sock: socket.socket, *, log_level: str = "info",
               compute: ComputeThread | None = None) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM). The objects alive once the model is loaded (modules,
    parameters, tokenizer tables) live as long as the server: gc.freeze() leaves them out of every later
    collection, which otherwise walked them again and again during decoding (1-2% of batch-1 decode speed,
    three interleaved runs of 16 generations on a 2-core Zen 5), as vLLM does at start-up. compute: the
    thread that loaded llm, where the engine loop then runs (server/compute.py says why)."""
    server = _uvicorn_server(llm, config, sock, log_level, compute)
    gc.collect()
    gc.freeze()
    server.run(sockets=[sock])


class ServerThread:
    """Serve an LLM from a background thread on a free port (port 0): `with ServerThread(llm) as s: s.url`.
    Its engine loop runs on `compute` where given (the thread that loaded llm), else on a thread of its own:
    correct either way, but a loop on another thread than the one that loaded the model steps it up to ~3x
    slower (server/compute.py), so time a server started by `dspark serve`, which loads on its loop's thread."""

    def __init__(self, llm: LLM, config: ServerConfig | None = None, *, log_level: str = "warning",
                 compute: ComputeThread | None = None):
        config = config or ServerConfig(port=0)
        self._sock = bind_socket(config.host, config.port)
        self.server = _uvicorn_server(llm, config, self._sock, log_level, compute)
        self.url = self.server.url
        self.app = self.server.config.app  # app.state.server is the OpenAIServer
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="dspark-server", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server thread did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)
