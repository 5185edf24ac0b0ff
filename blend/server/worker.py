"""The engine's worker thread and its bounded queue: how concurrent HTTP requests share
one engine.

Concurrency contract (batch size 1): requests are accepted concurrently by the event
loop; each becomes a `Job` in a FIFO queue of at most `queue_size` waiting jobs, and
one worker thread runs them one at a time on the engine, so the event loop never
blocks on the model. A full queue is refused at once (`QueueFull`: the server answers
503 with Retry-After). A job cancelled before it starts is skipped; a running job sees
its cancellation (client gone, timeout) between two generated tokens, or an ingest
between two documents — a prefill in progress finishes first. `stop` lets the running and queued jobs finish, then ends the
thread.

Events of a job reach the event loop through `Job.events` (an asyncio.Queue fed with
`call_soon_threadsafe`): whatever the job emits, then exactly one `Finished`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The engine's queue is full; retry after `retry_after_s` seconds."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the server is busy (request queue full); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Finished:
    """The last event of a job: its return value, or the exception it raised, or
    `cancelled` (skipped or stopped early: client gone or deadline passed)."""

    value: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    queued_s: float = 0.0  # time from submit to start
    run_s: float = 0.0  # time on the worker


class Job:
    """One unit of engine work. `fn(job)` runs on the worker thread; it may `emit`
    events and should return early when `job.stopped()` (cancelled or past deadline)."""

    def __init__(self, fn: Callable[[Job], Any], loop: asyncio.AbstractEventLoop, deadline: float | None):
        self.fn, self.loop, self.deadline = fn, loop, deadline
        self.events: asyncio.Queue[Any] = asyncio.Queue()
        self._cancelled = threading.Event()
        self.submitted = time.monotonic()

    def emit(self, event: Any) -> None:
        """Hand an event to the event loop (thread-safe; never blocks)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._cancelled.set()

    def cancel(self) -> None:
        """Ask the job to stop (thread-safe); a queued job is skipped."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def stopped(self) -> bool:
        """Cancelled, or past its deadline."""
        return self._cancelled.is_set() or (self.deadline is not None and time.monotonic() > self.deadline)


_STOP = object()


class EngineWorker:
    """One thread that runs jobs on the engine, in order, from a bounded queue."""

    def __init__(self, queue_size: int, name: str = "kvblend-engine"):
        if queue_size < 1:
            raise ValueError(f"queue size must be >= 1, got {queue_size}")
        self.queue_size = queue_size
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._running = 0
        self._service_s = 1.0  # moving average of a job's run time (for Retry-After)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting plus the one running."""
        with self._lock:
            return self._queue.qsize() + self._running

    def submit(self, fn: Callable[[Job], Any], *, deadline: float | None = None) -> Job:
        """Queue a job (call from the event loop). Raises QueueFull at once when full."""
        job = Job(fn, asyncio.get_running_loop(), deadline)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            retry = max(1, min(60, math.ceil(self._service_s * (self.depth or 1))))
            raise QueueFull(retry) from None
        return job

    def stop(self, timeout: float | None = None) -> None:
        """Let the queued jobs finish, then end the thread (blocks up to `timeout`)."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            with self._lock:
                self._running = 1
            started = time.monotonic()
            queued = started - job.submitted
            try:
                if job.stopped():
                    job.emit(Finished(cancelled=True, queued_s=queued))
                    continue
                try:
                    value = job.fn(job)
                except Exception as err:  # noqa: BLE001 - handed to the request, which answers with it
                    # a job may end early by raising once stopped (an ingest between documents)
                    stopped = job.stopped()
                    job.emit(Finished(error=None if stopped else err, cancelled=stopped, queued_s=queued,
                                      run_s=time.monotonic() - started))
                else:
                    job.emit(Finished(value=value, queued_s=queued, run_s=time.monotonic() - started))
            finally:
                run_s = time.monotonic() - started
                with self._lock:
                    self._running = 0
                    self._service_s = 0.8 * self._service_s + 0.2 * run_s
