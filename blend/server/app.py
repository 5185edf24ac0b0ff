"""The FastAPI application: OpenAI-compatible endpoints over one BlendEngine.

  POST   /v1/chat/completions   messages (+ documents, kvblend) -> chat.completion, or SSE chunks
  POST   /v1/completions        prompt = the question of the engine's RAG prompt -> text_completion
  POST   /v1/documents          ingest: per document its id, block keys, cached, stored (an empty one: 400)
  DELETE /v1/documents/{id}     remove a document's KV blocks from every tier
  GET    /v1/models, /health, /metrics

Every generation and ingest is queued on the engine's scheduler (batched decode, at most
`queue_size` requests waiting: more get 503); handlers only wait on their job's events
(blend.server.jobs), so the event loop stays free. A request is cancelled when its client
disconnects or when the request timeout passes (504, or an error event in a stream): it
leaves the decode batch at the scheduler's next step, the others go on unchanged. Bad
input is 400 (the engine's checks) or 422 (the body's shape), always as OpenAI's error
object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blend.decode.result import GenerationResult, TextDelta
from blend.engine.engine import BlendEngine
from blend.engine.request import GenerationRequest
from blend.engine.scheduler import QueueFull
from blend.engine.sequence import Handle
from blend.prompt.document import check_document_id, check_documents, render_document
from blend.server import schemas
from blend.server.jobs import Finished, Job
from blend.server.metrics import CONTENT_TYPE, Metrics
from storage.tier import StoreUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """How the server shares its engine."""

    served_model_name: str
    queue_size: int = 64  # requests that may wait for the scheduler (beyond those running); more get 503
    request_timeout_s: float = 300.0  # from acceptance to the last token
    warmup: bool = True  # run engine.warmup() before accepting requests
    max_body_bytes: int = 16 << 20  # larger request bodies get 413 before they are parsed

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"the request body limit must be >= 1 byte, got {self.max_body_bytes}")
        if self.queue_size < 1:
            raise ValueError(f"queue size must be >= 1, got {self.queue_size}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 seconds, got {self.request_timeout_s}")


class ApiError(Exception):
    """An error answered as OpenAI's error object."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, headers


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


def create_app(engine: BlendEngine, settings: ServerSettings) -> FastAPI:
    """The application. Its lifespan warms the engine up and, at shutdown, after uvicorn has
    let the in-flight requests finish, closes the engine (the scheduler's last items finish,
    queued cache writes are flushed)."""
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state["metrics"] = Metrics(engine.scheduler, settings.queue_size)
        loop = asyncio.get_running_loop()
        if settings.warmup:
            seconds = await loop.run_in_executor(None, engine.warmup)
            log.info("engine warmed up in %.2f s", seconds)
        state["ready"] = True
        try:
            yield
        finally:
            state["ready"] = False
            await loop.run_in_executor(None, engine.close)

    app = FastAPI(title="kvblend", lifespan=lifespan)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    model = settings.served_model_name

    def metrics() -> Metrics:
        return state["metrics"]

    # ----------------------------------------------------------------- errors
    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError) -> JSONResponse:
        return JSONResponse(schemas.error_body(err.message, err.kind), status_code=err.status, headers=err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        problems = err.errors()
        if any(p.get("type") == "json_invalid" for p in problems):
            return JSONResponse(schemas.error_body("the request body is not valid JSON"), status_code=400)
        kind = request.headers.get("content-type", "")
        if tuple(problems[0].get("loc", ())) == ("body",) and "json" not in kind.lower():
            return JSONResponse(schemas.error_body(f"send the body as JSON with Content-Type: application/json "
                                                   f"(got {kind[:60] or 'none'!r})"), status_code=415)
        parts = []
        for p in problems[:5]:
            where = ".".join(str(x) for x in p.get("loc", ()) if x != "body")
            parts.append(f"{where or 'body'}: {p.get('msg', 'invalid')}")
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        return JSONResponse(schemas.error_body("; ".join(parts) + more), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, err: StarletteHTTPException) -> JSONResponse:
        if err.status_code == 400 and err.detail == "There was an error parsing the body":
            return JSONResponse(schemas.error_body("the request body could not be parsed: send UTF-8 JSON (nested at "
                                                   "most a few hundred levels) with Content-Type: application/json"),
                                status_code=400)
        return JSONResponse(schemas.error_body(str(err.detail), "not_found" if err.status_code == 404 else
                                               "invalid_request_error"), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_request: Request, err: Exception) -> JSONResponse:
        log.exception("internal error")
        return JSONResponse(schemas.error_body(f"internal error ({type(err).__name__})", "internal_error"),
                            status_code=500)

    # ----------------------------------------------------------------- helpers
    def check_model(name: str | None) -> None:
        if name is not None and name not in (model, engine.config.model):
            raise ApiError(404, f"model {name!r} is not served here; this server serves {model!r}",
                           "model_not_found")

    async def submit(start: Callable[[Job], Handle]) -> Job:
        """Queue an engine item (`start(job)` queues it with `job.sink` and returns its handle;
        it lays the prompt out, so it runs off the event loop). 503 when `queue_size`
        requests already wait; the engine's own refusals (bad input: 400) are raised as is."""
        if engine.scheduler.waiting >= settings.queue_size:
            err = engine.scheduler.busy()
            raise ApiError(503, str(err), "server_busy", {"Retry-After": str(err.retry_after_s)})
        job = Job(asyncio.get_running_loop(), time.monotonic() + settings.request_timeout_s)
        try:
            job.attach(await asyncio.get_running_loop().run_in_executor(None, start, job))
        except QueueFull as err:
            raise ApiError(503, str(err), "server_busy", {"Retry-After": str(err.retry_after_s)}) from None
        except (TypeError, ValueError) as err:
            raise bad_request(err) from None
        return job

    def bad_request(err: Exception) -> ApiError:
        return ApiError(400, str(err))

    def job_error(err: BaseException) -> ApiError | None:
        """The answer to an engine error that is the caller's or the store's to fix (None:
        an internal error, 500): bad input 400; a required tier that cannot be used 503."""
        if isinstance(err, ValueError | TypeError):
            return bad_request(err)  # type: ignore[arg-type]
        if isinstance(err, StoreUnavailable):
            return ApiError(503, str(err), "store_unavailable")
        return None

    async def run_job(start: Callable[[Job], Handle], request: Request) -> Finished:
        """Submit and wait for the end (cancelled if the client leaves or time runs out)."""
        job = await submit(start)
        async with _watch_disconnect(request, job):
            finished = await _finished(job, job.deadline)
        if finished.cancelled:
            raise ApiError(499, "the request was cancelled", "cancelled")
        if finished.error is not None:
            raise job_error(finished.error) or finished.error
        return finished

    async def document_job(action: str, start: Callable[[Job], Handle], request: Request) -> Finished:
        """`run_job` for /v1/documents, counted under ("documents", action) with its final status."""
        status = 500
        try:
            finished = await run_job(start, request)
            status = 200
            return finished
        except ApiError as err:
            status = err.status
            raise
        finally:
            metrics().request("documents", action, status)

    # ------------------------------------------------------------ generation
    async def generate(endpoint: str, body: schemas._Generation, query: Any, request: Request) -> Response:
        check_model(body.model)
        kwargs = body.engine_kwargs()
        mode = body.kvblend.mode
        try:  # bad arguments: 400 before queueing (the text's fit is checked when it is queued: 400 too)
            docs = [d.to_document() for d in body.documents]
            req = GenerationRequest.create(engine.config.engine, query, docs, **kwargs)
        except (TypeError, ValueError) as err:
            metrics().request(endpoint, mode, 400)
            raise bad_request(err) from None

        accepted = time.monotonic()
        rid = schemas.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
        try:
            job = await submit(lambda job: engine.submit(req, sink=job.sink, deadline=job.deadline))
        except ApiError as err:
            metrics().request(endpoint, mode, err.status)
            raise
        if body.stream:
            return await _stream(job, endpoint, mode, rid, body, request, accepted)
        status, tokens = 499, 0
        try:
            async with _watch_disconnect(request, job):
                while True:
                    event = await _next_event(job, job.deadline)
                    if isinstance(event, TextDelta):
                        tokens = event.tokens
                        continue
                    if event is None:  # timed out
                        job.cancel()
                        status = 504
                        raise ApiError(504, f"the request took longer than {settings.request_timeout_s:g} s",
                                       "timeout")
                    break
            if event.error is not None:
                known = job_error(event.error)
                status = known.status if known is not None else 500
                raise known or event.error
            result = event.value
            if not isinstance(result, GenerationResult):  # cancelled: the client is gone, or the deadline
                status = 504 if job.stopped() and not job.cancelled else 499
                raise ApiError(status, "the request was cancelled", "cancelled")
            status = 200
            metrics().finished(result.stats, result.prompt_tokens, time.monotonic() - accepted, event.queued_s)
            build = schemas.chat_completion if endpoint == "chat" else schemas.completion
            return JSONResponse(build(rid, model, result, event.queued_s))
        finally:
            if status != 200:
                metrics().cancelled(mode, tokens)
            metrics().request(endpoint, mode, status)

    async def _stream(job: Job, endpoint: str, mode: str, rid: str, body: schemas._Generation, request: Request,
                      accepted: float) -> Response:
        """Wait for the first event (errors before it are plain HTTP errors), then stream SSE."""
        first, client_gone = None, False
        try:
            async with _watch_disconnect(request, job):
                first = await _next_event(job, job.deadline)
        finally:
            if first is None:
                client_gone = job.cancelled
                job.cancel()
        if first is None:
            metrics().request(endpoint, mode, 499 if client_gone else 504)
            raise ApiError(504, f"the request took longer than {settings.request_timeout_s:g} s", "timeout")
        if isinstance(first, Finished) and first.error is not None:
            known = job_error(first.error)
            metrics().request(endpoint, mode, known.status if known is not None else 500)
            raise known or first.error
        chat = endpoint == "chat"

        def sse(obj: Any) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

        def chunk(text: str, finish: str | None = None, **extra: Any) -> str:
            if chat:
                return sse(schemas.chat_chunk(rid, model, {"content": text} if finish is None else {}, finish, **extra))
            return sse(schemas.completion_chunk(rid, model, text, finish, **extra))

        async def events() -> AsyncIterator[str]:
            status, tokens = 499, 0
            event: Any = first
            try:
                if chat:
                    yield sse(schemas.chat_chunk(rid, model, {"role": "assistant", "content": ""}))
                while True:
                    if isinstance(event, TextDelta):
                        tokens = event.tokens
                        if event.text:
                            yield chunk(event.text)
                    elif event is None:
                        job.cancel()
                        status = 504
                        yield sse(schemas.error_body(f"the request took longer than {settings.request_timeout_s:g} s",
                                                     "timeout"))
                        break
                    else:  # Finished
                        result = event.value
                        if event.error is not None or not isinstance(result, GenerationResult):
                            if event.error is None:
                                known = ApiError(504 if not job.cancelled else 499, "the request was cancelled",
                                                 "cancelled")
                            else:
                                known = job_error(event.error) or ApiError(
                                    500, f"internal error ({type(event.error).__name__})", "internal_error")
                            status = known.status
                            yield sse(schemas.error_body(known.message, known.kind))
                            break
                        status = 200
                        metrics().finished(result.stats, result.prompt_tokens, time.monotonic() - accepted,
                                           event.queued_s)
                        yield chunk("", result.finish_reason, kvblend=schemas.kvblend_stats(result, event.queued_s))
                        if body.stream_options is not None and body.stream_options.include_usage:
                            base = schemas.chat_chunk if chat else schemas.completion_chunk
                            last = base(rid, model, {} if chat else "", None, usage=schemas.usage(result))
                            last["choices"] = []
                            yield sse(last)
                        break
                    event = await _next_event(job, job.deadline)
                yield "data: [DONE]\n\n"
            finally:
                if status != 200:
                    job.cancel()
                    metrics().cancelled(mode, tokens)
                metrics().request(endpoint, mode, status)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # -------------------------------------------------------------- endpoints
    @app.post("/v1/chat/completions")
    async def chat_completions(body: schemas.ChatCompletionRequest, request: Request) -> Response:
        try:
            messages = [m.to_message() for m in body.messages]
        except (TypeError, ValueError) as err:
            metrics().request("chat", body.kvblend.mode, 400)
            raise bad_request(err) from None
        return await generate("chat", body, messages, request)

    @app.post("/v1/completions")
    async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
        return await generate("completions", body, body.question(), request)

    @app.post("/v1/documents")
    async def ingest(body: schemas.IngestRequest, request: Request) -> Response:
        try:
            docs = check_documents([d.to_document() for d in body.documents])
            empty = next((i for i, d in enumerate(docs) if not render_document(d)), None)
            if empty is not None:
                raise ValueError(f"documents[{empty}] is empty (no text nor title): there is nothing to cache; "
                                 "give its text or leave it out")
        except (TypeError, ValueError) as err:
            metrics().request("documents", "ingest", 400)
            raise bad_request(err) from None
        finished = await document_job(
            "ingest", lambda job: engine.submit_ingest(docs, sink=job.sink, deadline=job.deadline), request)
        for doc in finished.value:
            metrics().documents.labels(str(doc.cached).lower()).inc()
        return JSONResponse({"object": "list", "data": [doc.to_dict() for doc in finished.value]})

    @app.delete("/v1/documents/{doc_id:path}")
    async def delete_document(doc_id: str) -> Response:
        """No model work: the store is asked directly (off the event loop)."""
        try:
            check_document_id(doc_id)
        except ValueError as err:  # an id that breaks the rule was never ingested
            metrics().request("documents", "delete", 404)
            raise ApiError(404, f"document {doc_id!r} is not known to this server: {err}", "not_found") from None
        status = 500
        try:
            keys = await asyncio.get_running_loop().run_in_executor(None, engine.delete_document, doc_id)
            status = 200
        except KeyError:
            status = 404
            raise ApiError(404, f"document {doc_id!r} is not known to this server (ingest it first)",
                           "not_found") from None
        except Exception as err:
            known = job_error(err)
            status = known.status if known is not None else 500
            raise known or err from None
        finally:
            metrics().request("documents", "delete", status)
        return JSONResponse({"id": doc_id, "object": "document.deleted", "deleted": True, "keys": list(keys)})

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "kvblend",
             "max_model_len": engine.runner.max_positions}]})

    @app.get("/health")
    async def health() -> Response:
        ready = bool(state.get("ready"))
        scheduler = engine.scheduler
        return JSONResponse({"status": "ok" if ready else "starting", "model": model,
                             "queue_depth": scheduler.depth(), "queue_size": settings.queue_size,
                             "running": scheduler.running, "waiting": scheduler.waiting,
                             "max_num_seqs": scheduler.config.max_num_seqs},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics().render(), media_type=CONTENT_TYPE)

    return app


async def _next_event(job: Job, deadline: float | None) -> Any:
    """The job's next event, or None once `deadline` (monotonic) has passed."""
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return await asyncio.wait_for(job.events.get(), timeout)
    except TimeoutError:
        return None


async def _finished(job: Job, deadline: float | None = None) -> Finished:
    """Wait for the job's Finished event (None deadline: no limit); cancels it on timeout."""
    while True:
        event = await _next_event(job, deadline)
        if event is None:
            job.cancel()
            raise ApiError(504, "the request timed out", "timeout")
        if isinstance(event, Finished):
            return event


@contextlib.asynccontextmanager
async def _watch_disconnect(request: Request, job: Job) -> AsyncIterator[None]:
    """While inside, a client disconnect cancels `job`."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel()
                return

    task = asyncio.create_task(watch())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
