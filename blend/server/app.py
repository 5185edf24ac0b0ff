"""The FastAPI application: OpenAI-compatible endpoints over one BlendEngine.

  POST   /v1/chat/completions   messages (+ documents, kvblend) -> chat.completion, or SSE chunks
  POST   /v1/completions        prompt = the question of the engine's RAG prompt -> text_completion
  POST   /v1/documents          ingest: per document its id, block keys, cached, stored (an empty one: 400)
  DELETE /v1/documents/{id}     remove a document's KV blocks from every tier
  GET    /v1/models, /health, /metrics

`create_app` assembles it: the one `ServerState` (blend.server.state) on `app.state`, the
lifespan (warm-up, then closing the engine), the body limit (`BodyLimit`: 413 before
parsing), the error handlers (blend.server.errors) and the routes (blend.server.handlers).

Every generation and ingest is queued on the engine's scheduler (batched decode, at most
`queue_size` requests waiting: more get 503); handlers only wait on their job's events
(blend.server.jobs), so the event loop stays free. A request is cancelled when its client
disconnects or when the request timeout passes (504, or an error event in a stream:
blend.server.stream): it leaves the decode batch at the scheduler's next step, the others
go on unchanged. Bad input is 400 (the engine's checks) or 422 (the body's shape), always
as OpenAI's error object.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from blend.engine.engine import BlendEngine
from blend.server import schemas
from blend.server.errors import EXCEPTION_HANDLERS, ApiError
from blend.server.handlers import ROUTES
from blend.server.state import SHUTDOWN_STOP_S, ServerSettings, ServerState, app_state

log = logging.getLogger(__name__)

__all__ = ["ApiError", "BodyLimit", "ServerSettings", "ServerState", "create_app"]


def create_app(engine: BlendEngine, settings: ServerSettings) -> FastAPI:
    """The application over `engine`. Its lifespan warms the engine up and, at shutdown,
    after uvicorn has let the in-flight requests finish (or `ServerState.shut_down` ended them),
    closes the engine (queued cache writes flushed, at most SHUTDOWN_STOP_S)."""
    app = FastAPI(title="kvblend", lifespan=lifespan)
    ServerState.create(engine, settings).attach(app)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    for kind, handler in EXCEPTION_HANDLERS.items():
        app.add_exception_handler(kind, handler)
    for method, path, endpoint in ROUTES:
        app.add_api_route(path, endpoint, methods=[method])
    return app


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Warm the engine up (unless `settings.warmup` is off), then mark the server ready;
    at shutdown, not ready, and the engine closed (off the event loop)."""
    state = app_state(app)
    loop = asyncio.get_running_loop()
    if state.settings.warmup:
        seconds = await loop.run_in_executor(None, state.engine.warmup)
        log.info("engine warmed up in %.2f s", seconds)
    state.ready.set()
    try:
        yield
    finally:
        state.ready.clear()
        await loop.run_in_executor(None, state.engine.close, SHUTDOWN_STOP_S)


class BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 (OpenAI's error
    object) as soon as the limit is passed, by its Content-Length or while it arrives,
    before anything parses it. Accepted bodies are buffered once and handed on whole."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.limit:
            return await self._too_large(send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the body ended
                return await self.app(scope, _replay(message, receive), send)
            body += message.get("body", b"")
            if len(body) > self.limit:
                return await self._too_large(send)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay(whole, receive), send)

    async def _too_large(self, send: Callable) -> None:
        payload = json.dumps(schemas.error_body(
            f"the request body is larger than this server's limit of {self.limit} bytes; send fewer or shorter "
            "documents (or start the server with a larger --max-body)", "request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def _replay(first: dict, receive: Callable) -> Callable:
    """A `receive` that returns `first` once, then defers to `receive` (disconnect watching)."""
    pending = [first]

    async def replay() -> dict:
        return pending.pop() if pending else await receive()

    return replay
