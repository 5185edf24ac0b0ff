"""The endpoints: module-level handlers over the app's one `ServerState`.

Each handler fetches the state with `server_state(request)`, checks what the engine would
refuse anyway before queueing (400 at once, counted), queues its engine item as a job
(blend.server.jobs: 503 when the queue is full) and answers from the job's events. A
generation answers as one JSON object (`complete`) or as SSE (blend.server.stream); every
request is counted once in the metrics, by endpoint, mode and final status. `ROUTES` is
what `create_app` registers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from blend.decode.result import GenerationResult, TextDelta
from blend.engine.request import GenerationRequest
from blend.engine.sequence import Handle
from blend.prompt.document import check_document_id, check_documents, render_document
from blend.server import schemas
from blend.server.errors import ApiError, bad_request, job_error, timed_out
from blend.server.jobs import Finished, Job, cancelled_error, next_event, run_job, submit, watch_disconnect
from blend.server.metrics import CONTENT_TYPE
from blend.server.state import ServerState, server_state
from blend.server.stream import Reply, stream

# ------------------------------------------------------------------ generation


def check_model(state: ServerState, name: str | None) -> None:
    """404 for a model name that is neither the served name nor the engine's model."""
    if name is not None and name not in (state.model, state.engine.config.model):
        raise ApiError(404, f"model {name!r} is not served here; this server serves {state.model!r}",
                       "model_not_found")


async def generate(endpoint: str, body: schemas._Generation, query: Any, request: Request) -> Response:
    """The path of /v1/chat/completions and /v1/completions: check, queue, answer (JSON or SSE).
    A raw /v1/completions (`completions_prompt: raw`) runs its prompt in full unless it names a mode."""
    state = server_state(request)
    check_model(state, body.model)
    kwargs = body.engine_kwargs()
    if endpoint == "completions" and state.settings.completions_prompt == "raw":
        kwargs["raw"] = True
        if "mode" not in body.kvblend.model_fields_set:
            kwargs["mode"] = "full"
    mode = kwargs["mode"]
    try:  # bad arguments: 400 before queueing (the text's fit is checked when it is queued: 400 too)
        docs = [d.to_document() for d in body.documents]
        req = GenerationRequest.create(state.engine.config.engine, query, docs, **kwargs)
    except (TypeError, ValueError) as err:
        state.metrics.request(endpoint, mode, 400)
        raise bad_request(err) from None

    accepted = time.monotonic()
    rid = schemas.new_id("chatcmpl" if endpoint == "chat" else "cmpl")
    try:
        job = await submit(state, lambda job: state.engine.submit(req, sink=job.sink, deadline=job.deadline))
    except ApiError as err:
        state.metrics.request(endpoint, mode, err.status)
        raise
    reply = Reply(state, job, endpoint, mode, rid, accepted)
    if body.stream:
        return await stream(reply, body, request)
    return await complete(reply, request)


async def complete(reply: Reply, request: Request) -> Response:
    """Wait for the whole generation and answer it as one chat.completion / text_completion
    (504 past the request timeout, 499 when the client left, the engine's errors as theirs)."""
    state, job = reply.state, reply.job
    status, tokens = 499, 0
    try:
        async with watch_disconnect(request, job):
            while True:
                event = await next_event(job, job.deadline)
                if isinstance(event, TextDelta):
                    tokens = event.tokens
                    continue
                if event is None:  # timed out
                    job.cancel()
                    status = 504
                    raise timed_out(state.settings.request_timeout_s)
                break
        if event.error is not None:
            known = job_error(event.error)
            status = known.status if known is not None else 500
            raise known or event.error
        result = event.value
        if not isinstance(result, GenerationResult):  # cancelled: the client is gone, the deadline, a shutdown
            refusal = cancelled_error(state, job)
            status = refusal.status
            raise refusal
        status = 200
        state.metrics.finished(result.stats, result.prompt_tokens, time.monotonic() - reply.accepted, event.queued_s)
        build = schemas.chat_completion if reply.chat else schemas.completion
        return JSONResponse(build(reply.rid, state.model, result, event.queued_s))
    finally:
        if status != 200:
            state.metrics.cancelled(reply.mode, tokens)
        reply.count(status)


async def chat_completions(body: schemas.ChatCompletionRequest, request: Request) -> Response:
    try:
        messages = [m.to_message() for m in body.messages]
    except (TypeError, ValueError) as err:
        server_state(request).metrics.request("chat", body.kvblend.mode, 400)
        raise bad_request(err) from None
    return await generate("chat", body, messages, request)


async def completions(body: schemas.CompletionRequest, request: Request) -> Response:
    prompt = body.question()
    state = server_state(request)
    if not isinstance(prompt, str) and state.settings.completions_prompt != "raw":
        state.metrics.request("completions", body.kvblend.mode, 400)
        raise bad_request(ValueError("a prompt of token ids needs a raw prompt (`kvblend serve --completions-prompt "
                                     "raw`); this server takes the question as text"))
    return await generate("completions", body, prompt, request)


# ------------------------------------------------------------------- documents


async def document_job(action: str, start: Callable[[Job], Handle], request: Request) -> Finished:
    """`run_job` for /v1/documents, counted under ("documents", action) with its final status."""
    state = server_state(request)
    status = 500
    try:
        finished = await run_job(state, start, request)
        status = 200
        return finished
    except ApiError as err:
        status = err.status
        raise
    finally:
        state.metrics.request("documents", action, status)


async def ingest(body: schemas.IngestRequest, request: Request) -> Response:
    state = server_state(request)
    try:
        docs = check_documents([d.to_document() for d in body.documents])
        empty = next((i for i, d in enumerate(docs) if not render_document(d)), None)
        if empty is not None:
            raise ValueError(f"documents[{empty}] is empty (no text nor title): there is nothing to cache; "
                             "give its text or leave it out")
    except (TypeError, ValueError) as err:
        state.metrics.request("documents", "ingest", 400)
        raise bad_request(err) from None
    finished = await document_job(
        "ingest", lambda job: state.engine.submit_ingest(docs, sink=job.sink, deadline=job.deadline), request)
    for doc in finished.value:
        state.metrics.documents.labels(str(doc.cached).lower()).inc()
    return JSONResponse({"object": "list", "data": [doc.to_dict() for doc in finished.value]})


async def delete_document(doc_id: str, request: Request) -> Response:
    """No model work: the store is asked directly (off the event loop)."""
    state = server_state(request)
    try:
        check_document_id(doc_id)
    except ValueError as err:  # an id that breaks the rule was never ingested
        state.metrics.request("documents", "delete", 404)
        raise ApiError(404, f"document {doc_id!r} is not known to this server: {err}", "not_found") from None
    status = 500
    try:
        keys = await asyncio.get_running_loop().run_in_executor(None, state.engine.delete_document, doc_id)
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
        state.metrics.request("documents", "delete", status)
    return JSONResponse({"id": doc_id, "object": "document.deleted", "deleted": True, "keys": list(keys)})


# ---------------------------------------------------------------- the server


async def models(request: Request) -> Response:
    state = server_state(request)
    return JSONResponse({"object": "list", "data": [
        {"id": state.model, "object": "model", "created": 0, "owned_by": "kvblend",
         "max_model_len": state.engine.runner.max_positions}]})


async def health(request: Request) -> Response:
    """200 once the engine is warmed up (503 "starting" before, and while shutting down)."""
    state = server_state(request)
    ready = state.ready.is_set()
    scheduler = state.engine.scheduler
    return JSONResponse({"status": "ok" if ready else "starting", "model": state.model,
                         "queue_depth": scheduler.depth(), "queue_size": state.settings.queue_size,
                         "running": scheduler.running, "waiting": scheduler.waiting,
                         "max_num_seqs": scheduler.config.max_num_seqs,
                         "prefill_chunk_tokens": scheduler.config.prefill_chunk_tokens},
                        status_code=200 if ready else 503)


async def prometheus(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


# (method, path, handler): what create_app registers
ROUTES: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("POST", "/v1/chat/completions", chat_completions),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/documents", ingest),
    ("DELETE", "/v1/documents/{doc_id:path}", delete_document),
    ("GET", "/v1/models", models),
    ("GET", "/health", health),
    ("GET", "/metrics", prometheus),
)
