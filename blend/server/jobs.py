"""How the event loop waits on the engine: a `Job` is one scheduled item (a generation, an
ingest) whose events (text deltas, then one `Finished`) reach an asyncio queue.

The engine's scheduler runs every request (blend.engine.scheduler: batched decode,
prefills between decode steps); handlers only await their job's events, so the event
loop never blocks on the model. A job is cancelled when its client disconnects (the
scheduler drops it at its next step: a running sequence leaves the batch) or when its
deadline passes.

`submit` queues an engine item as a job (503 with Retry-After when `queue_size` requests
already wait), `next_event` / `wait_finished` wait for its events under its deadline,
`watch_disconnect` cancels it when its client goes away and `run_job` is the three at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request

from blend.engine.scheduler import QueueFull
from blend.engine.sequence import Finished, Handle
from blend.server.errors import ApiError, bad_request, job_error
from blend.server.state import ServerState


class Job:
    """One engine item as the event loop sees it. Make it on the loop, then `attach` the
    engine's handle (the item is queued with `job.sink` as its events' sink)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadline: float | None):
        self.loop, self.deadline = loop, deadline
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self.handle: Handle | None = None
        self._cancelled = False

    def sink(self, event: Any) -> None:
        """Called on the scheduler thread: hand the event to the loop (RuntimeError once it is closed)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def attach(self, handle: Handle) -> None:
        self.handle = handle
        if self._cancelled:
            handle.cancel()

    def cancel(self) -> None:
        self._cancelled = True
        if self.handle is not None:
            self.handle.cancel()

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def stopped(self) -> bool:
        """Cancelled, or past its deadline."""
        return self._cancelled or (self.deadline is not None and time.monotonic() > self.deadline)


async def submit(state: ServerState, start: Callable[[Job], Handle]) -> Job:
    """Queue an engine item (`start(job)` queues it with `job.sink` and returns its handle;
    it lays the prompt out, so it runs off the event loop). 503 when `queue_size`
    requests already wait; the engine's own refusals (bad input: 400) are raised as is."""
    scheduler = state.engine.scheduler
    if scheduler.waiting >= state.settings.queue_size:
        err = scheduler.busy()
        raise ApiError(503, str(err), "server_busy", {"Retry-After": str(err.retry_after_s)})
    job = Job(asyncio.get_running_loop(), time.monotonic() + state.settings.request_timeout_s)
    try:
        job.attach(await asyncio.get_running_loop().run_in_executor(None, start, job))
    except QueueFull as err:
        raise ApiError(503, str(err), "server_busy", {"Retry-After": str(err.retry_after_s)}) from None
    except (TypeError, ValueError) as err:
        raise bad_request(err) from None
    return job


def cancelled_error(state: ServerState, job: Job) -> ApiError:
    """The answer to a job that ended cancelled: 499 when its client left, 503 when the server
    shut down before it finished (its shutdown grace ran out), else 504 (its deadline)."""
    if job.cancelled:
        return ApiError(499, "the request was cancelled", "cancelled")
    if state.stopping.is_set():
        return ApiError(503, f"the server shut down before this request finished (its shutdown grace of "
                             f"{state.settings.shutdown_grace_s:g} s ran out); send it again", "server_shutdown")
    return ApiError(504, "the request was cancelled", "cancelled")


async def run_job(state: ServerState, start: Callable[[Job], Handle], request: Request) -> Finished:
    """Submit and wait for the end (cancelled if the client leaves or time runs out)."""
    job = await submit(state, start)
    async with watch_disconnect(request, job):
        finished = await wait_finished(job, job.deadline)
    if finished.cancelled:
        raise cancelled_error(state, job)
    if finished.error is not None:
        raise job_error(finished.error) or finished.error
    return finished


async def next_event(job: Job, deadline: float | None) -> Any:
    """The job's next event, or None once `deadline` (monotonic) has passed."""
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return await asyncio.wait_for(job.events.get(), timeout)
    except TimeoutError:
        return None


async def wait_finished(job: Job, deadline: float | None = None) -> Finished:
    """Wait for the job's Finished event (None deadline: no limit); cancels it on timeout."""
    while True:
        event = await next_event(job, deadline)
        if event is None:
            job.cancel()
            raise ApiError(504, "the request timed out", "timeout")
        if isinstance(event, Finished):
            return event


@contextlib.asynccontextmanager
async def watch_disconnect(request: Request, job: Job) -> AsyncIterator[None]:
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


__all__ = ["Finished", "Job", "cancelled_error", "next_event", "run_job", "submit", "wait_finished",
           "watch_disconnect"]
