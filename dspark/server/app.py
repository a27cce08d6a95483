"""The OpenAI-compatible HTTP API over one EngineLoop: /v1/chat/completions, /v1/completions
(plain and streaming), /v1/models, /health, /metrics.

Every failure reaches the client as an OpenAI error object; nothing a client sends reaches the
engine before it is validated, so one bad request never disturbs the others."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse

from dspark.llm import LLM
from dspark.server.body import ClientGone, parse_json_object, read_body
from dspark.server.config import ServerConfig
from dspark.server.compute import ComputeThread
from dspark.server.engine_loop import EngineLoop, QueueFull, RequestHandle
from dspark.server.errors import APIError, bad_request
from dspark.server.metrics import CONTENT_TYPE
from dspark.server.prompts import PromptEncoder
from dspark.server.protocol import GenerationRequest, check_model, parse_chat, parse_completion
from dspark.server.responses import TextDelta, chunk_body, final_body, spec_stats, sse, usage_chunk

log = logging.getLogger("dspark.server")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


class OpenAIServer:
    """Request handling: authenticate, read, validate, tokenize, admit, then answer or stream."""

    def __init__(self, llm: LLM, config: ServerConfig, compute: ComputeThread | None = None):
        """compute: the thread that loaded llm, for the engine loop to run on (see server/compute.py)."""
        self.llm = llm
        self.config = config
        self.engine = llm.engine
        max_running = self.engine.scheduler.config.max_num_seqs
        self.loop = EngineLoop(self.engine, capacity=max_running + config.max_queued_requests, compute=compute)
        self.model_name = config.served_model_name or llm.model_path.name
        self.prompts = PromptEncoder(llm.tokenizer, vocab_size=self.engine.model.config.vocab_size,
                                     model_name=self.model_name, max_pending=self.loop.capacity)
        self.served = (self.model_name, str(llm.model_path))
        self.algorithm = llm.config.speculative.algorithm
        self.created = int(time.time())

    # --- validation ------------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), self.config.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: pass it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def read_json(self, request: Request) -> dict:
        raw = await read_body(request, self.config.max_request_bytes, self.config.read_timeout_s)
        return parse_json_object(raw)

    def max_tokens(self, req: GenerationRequest, n: int) -> int:
        """The request's max_tokens, or the room left; 400 when prompt + completion cannot fit."""
        where = "messages" if req.kind == "chat" else "prompt"
        context = self.engine.max_model_len
        cache = self.engine.cache.num_blocks * self.engine.cache.block_size - self.engine.proposer.max_drafts
        if n >= context:
            raise bad_request(f"This model's maximum context length is {context} tokens, but the prompt has {n} "
                              "tokens (the prompt and at least one generated token must fit).", where,
                              "context_length_exceeded")
        if n >= cache:
            raise bad_request(f"The prompt has {n} tokens; the server's KV cache holds {cache}.", where,
                              "context_length_exceeded")
        room = min(context, cache) - n
        if req.max_tokens is None:
            return room
        if req.max_tokens > room:
            limit = f"maximum context length is {context}" if context <= cache else f"KV cache holds {cache}"
            raise bad_request(f"This model's {limit} tokens. However, you requested {n + req.max_tokens} tokens "
                              f"({n} in the prompt, {req.max_tokens} for the completion). Reduce the prompt or "
                              f"max_tokens (at most {room} here).", "max_tokens", "context_length_exceeded")
        return req.max_tokens

    # --- generation ------------------------------------------------------------------------------
    async def generate(self, request: Request, kind: str) -> Response:
        self.check_auth(request)
        body = await self.read_json(request)
        req = parse_chat(body) if kind == "chat" else parse_completion(body)
        check_model(req.model, self.served)
        try:
            text, ids = await self.prompts.encode(req)
            params = req.sampling_params(self.max_tokens(req, len(ids)))
            rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            handle = self.loop.submit(ids, params, request_id=rid, prompt=text)
        except QueueFull as e:
            s = self.config.retry_after_s
            raise APIError(429, f"The server is at capacity ({e}); retry after {s} s.", code="queue_full",
                           headers={"Retry-After": str(s)}) from None
        try:
            news, value = await self._next_or_disconnect(handle, request)  # "accepted", or why not
            if news == "error":
                raise value
        except BaseException:
            self.loop.abort(rid)
            raise
        if news == "gone":
            return Response(status_code=499)
        meta = dict(rid=rid, created=int(time.time()), model=self.model_name)
        if req.stream:
            return StreamingResponse(self._stream(handle, req, meta), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await self._complete(handle, req, meta, request)

    async def _complete(self, handle: RequestHandle, req: GenerationRequest, meta: dict, request: Request) -> Response:
        finished = False
        try:
            while True:
                news, value = await self._next_or_disconnect(handle, request)
                if news == "gone":
                    return Response(status_code=499)  # nobody reads it; the request was aborted
                if news == "error":
                    raise value
                if news == "output" and value.finished:
                    finished = True
                    return JSONResponse(final_body(req.kind, out=value, prompt_tokens=handle.num_prompt_tokens,
                                                   algorithm=self.algorithm, **meta))
        finally:
            if not finished:
                self.loop.abort(handle.request_id)

    async def _stream(self, handle: RequestHandle, req: GenerationRequest, meta: dict):
        """Server-sent events; if the client goes away Starlette cancels this and `finally` aborts."""
        finished, delta, extra = False, TextDelta(req.sampling["stop"]), {"include_usage": req.include_usage}
        try:
            if req.kind == "chat":
                yield sse(chunk_body(req.kind, text="", first=True, **extra, **meta))
            while not finished:
                news, value = await handle.next()
                if news == "error":
                    yield sse(value.body())
                    break
                piece = delta(value.text, value.finished)
                if piece:
                    yield sse(chunk_body(req.kind, text=piece, **extra, **meta))
                if value.finished:
                    finished = True
                    last = chunk_body(req.kind, text=None, finish_reason=value.finish_reason, **extra, **meta)
                    last["dspark"] = spec_stats(value, self.algorithm)
                    yield sse(last)
                    if req.include_usage:
                        yield sse(usage_chunk(req.kind, out=value, prompt_tokens=handle.num_prompt_tokens,
                                              algorithm=self.algorithm, **meta))
            yield sse("[DONE]")
        finally:
            if not finished:
                self.loop.abort(handle.request_id)

    async def _next_or_disconnect(self, handle: RequestHandle, request: Request) -> tuple[str, object]:
        """The handle's next news, or ("gone", None) as soon as the client disconnects."""
        getter = asyncio.ensure_future(handle.next())
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not getter.done():
                getter.cancel()
        return getter.result() if getter in done else ("gone", None)

    # --- other endpoints -----------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "dspark",
                "root": self.model_name, "max_model_len": self.engine.max_model_len,
                "speculative_algorithm": self.algorithm}


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _CountResponses:
    """ASGI middleware: count responses by endpoint and status code."""

    def __init__(self, app, server: OpenAIServer):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")
            self.server.loop.metrics.http_requests.inc(endpoint=endpoint, status=str(status))


def create_app(llm: LLM, config: ServerConfig | None = None, compute: ComputeThread | None = None) -> FastAPI:
    """The ASGI app; the engine loop starts with the app's lifespan and stops with it (on `compute`, the
    thread that loaded llm, where given)."""
    server = OpenAIServer(llm, config or ServerConfig(), compute)

    @asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        yield
        server.loop.stop()
        server.prompts.close()

    app = FastAPI(title="dspark", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    app.add_middleware(_CountResponses, server=server)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                        headers=dict(exc.headers or {})).response()

    async def guarded(fn):
        try:
            return await fn()
        except APIError as e:
            return e.response()
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nothing was admitted
        except Exception as e:  # noqa: BLE001 - a bug here must not take the server down
            log.exception("unhandled error")
            return APIError(500, f"internal server error: {type(e).__name__}", code="internal_error").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await guarded(lambda: server.generate(request, "chat"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await guarded(lambda: server.generate(request, "completion"))

    @app.get("/v1/models")
    async def models(request: Request):
        async def answer():
            server.check_auth(request)
            return JSONResponse(server.models())
        return await guarded(answer)

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str):
        async def answer():
            server.check_auth(request)
            check_model(model, server.served)
            return JSONResponse(server.model_card())
        return await guarded(answer)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not server.loop.alive:
            return APIError(503, "the engine loop is not running", code="engine_unavailable").response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics():
        return Response(server.loop.metrics.render(), media_type=CONTENT_TYPE)

    return app
