"""A generation streamed as server-sent events, in OpenAI's chunk shapes.

`stream` waits for the job's first event (a timeout or an engine error before it is a
plain HTTP error: 504, 400, 503, 500), then answers `text/event-stream`: for a chat the
assistant role first, a chunk per text delta, the final chunk with the finish reason and
kvblend's stats, the usage chunk when `stream_options.include_usage` asks for it, then
`data: [DONE]`. An error after the first token is one error event before `[DONE]` (the
status was sent already). A client that leaves mid-stream cancels the job (Starlette stops
the event generator); each stream is counted once in the metrics, with its final status.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from blend.decode.result import GenerationResult, TextDelta
from blend.server import schemas
from blend.server.errors import ApiError, job_error, timed_out
from blend.server.jobs import Finished, Job, cancelled_error, next_event, watch_disconnect
from blend.server.state import ServerState


@dataclass(frozen=True)
class Reply:
    """One accepted generation: its job, and how its answer is labelled (JSON or streamed)."""

    state: ServerState
    job: Job
    endpoint: str  # "chat" or "completions": the metrics' label and the answer's shape
    mode: str  # the request's kvblend mode (the metrics' label)
    rid: str  # the answer's id (chatcmpl-... or cmpl-...)
    accepted: float  # time.monotonic() when the request was accepted

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def count(self, status: int) -> None:
        """Record the request's final status in the metrics."""
        self.state.metrics.request(self.endpoint, self.mode, status)


async def stream(reply: Reply, body: schemas._Generation, request: Request) -> Response:
    """Wait for the first event (errors before it are plain HTTP errors), then stream SSE."""
    job = reply.job
    first, client_gone = None, False
    try:
        async with watch_disconnect(request, job):
            first = await next_event(job, job.deadline)
    finally:
        if first is None:
            client_gone = job.cancelled
            job.cancel()
    if first is None:
        reply.count(499 if client_gone else 504)
        raise timed_out(reply.state.settings.request_timeout_s)
    if isinstance(first, Finished) and first.error is not None:
        known = job_error(first.error)
        reply.count(known.status if known is not None else 500)
        raise known or first.error
    usage = body.stream_options is not None and body.stream_options.include_usage
    return StreamingResponse(Chunks(reply).events(first, usage), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class Chunks:
    """The SSE chunks of one reply, in the shape of its endpoint (chat or text completion)."""

    def __init__(self, reply: Reply):
        self.reply = reply
        self.model = reply.state.model

    def chunk(self, text: str, finish: str | None = None, **extra: Any) -> str:
        """A text delta, or with `finish` the final chunk (an empty delta for a chat)."""
        rid, model = self.reply.rid, self.model
        if self.reply.chat:
            return sse(schemas.chat_chunk(rid, model, {"content": text} if finish is None else {}, finish, **extra))
        return sse(schemas.completion_chunk(rid, model, text, finish, **extra))

    def usage(self, result: GenerationResult) -> str:
        """The last chunk `stream_options.include_usage` asks for: no choices, the usage."""
        rid, model, usage = self.reply.rid, self.model, schemas.usage(result)
        if self.reply.chat:
            last = schemas.chat_chunk(rid, model, {}, None, usage=usage)
        else:
            last = schemas.completion_chunk(rid, model, "", None, usage=usage)
        last["choices"] = []
        return sse(last)

    async def events(self, first: Any, include_usage: bool) -> AsyncIterator[str]:
        """The stream from the job's `first` event to `[DONE]`; its status counted when it ends
        (499 if the client left: the job is cancelled)."""
        reply, job = self.reply, self.reply.job
        metrics, timeout_s = reply.state.metrics, reply.state.settings.request_timeout_s
        status, tokens = 499, 0
        event: Any = first
        try:
            if reply.chat:
                yield sse(schemas.chat_chunk(reply.rid, self.model, {"role": "assistant", "content": ""}))
            while True:
                if isinstance(event, TextDelta):
                    tokens = event.tokens
                    if event.text:
                        yield self.chunk(event.text)
                elif event is None:
                    job.cancel()
                    status = 504
                    late = timed_out(timeout_s)
                    yield sse(schemas.error_body(late.message, late.kind))
                    break
                else:  # Finished
                    result = event.value
                    if event.error is not None or not isinstance(result, GenerationResult):
                        if event.error is None:  # cancelled: the client left, the deadline, a shutdown
                            known = cancelled_error(reply.state, job)
                        else:
                            known = job_error(event.error) or ApiError(
                                500, f"internal error ({type(event.error).__name__})", "internal_error")
                        status = known.status
                        yield sse(schemas.error_body(known.message, known.kind))
                        break
                    status = 200
                    metrics.finished(result.stats, result.prompt_tokens, time.monotonic() - reply.accepted,
                                     event.queued_s)
                    yield self.chunk("", result.finish_reason, kvblend=schemas.kvblend_stats(result, event.queued_s))
                    if include_usage:
                        yield self.usage(result)
                    break
                event = await next_event(job, job.deadline)
            yield "data: [DONE]\n\n"
        finally:
            if status != 200:
                job.cancel()
                metrics.cancelled(reply.mode, tokens)
            reply.count(status)
