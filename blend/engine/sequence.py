"""What the scheduler runs: a `Sequence` (one generation: a prefill, then decode steps in
the running batch) or a `Task` (other model work: an ingest, a prefill for inspection), and
the caller's `Handle` on either.

A handle carries the events of its work to the caller: `TextDelta`s while a sequence
decodes, then exactly one `Finished` (its value, the error it raised, or `cancelled`).
Events go to a thread-safe queue (`Handle()`: `events()` / `result()` block the calling
thread) or to any callable (`Handle(sink=...)`: the asyncio facade and the server hand the
events to their event loop). `cancel()` (client gone) and the deadline are seen by the
scheduler at its next step: a waiting item is dropped, a running sequence leaves the batch.
`Handle(then=...)`: the work's value is finished off the scheduler's thread before the caller
gets it (an ingest's writes awaited: nothing that waits for the store runs on the thread that
serves every request).
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeVar

from blend.decode.generation import Generation
from blend.decode.result import GenerationResult
from blend.model.cache import KVCache
from blend.stats import RequestStats

T = TypeVar("T")


class Cancelled(RuntimeError):
    """The work was cancelled (its handle's `cancel()`, or its deadline passed) before it finished."""


@dataclass(frozen=True)
class Finished:
    """The last event of a handle: its value, or the exception it raised, or `cancelled`."""

    value: Any = None
    error: BaseException | None = None
    cancelled: bool = False
    queued_s: float = 0.0  # submit to start (the first prefill step)
    run_s: float = 0.0  # start to finish


class Handle:
    """The caller's side of one scheduled item. Thread-safe. `then`: applied to the value of a
    `Finished` that holds one, on a thread of its own, before the caller gets it (its exception
    becomes the event's error)."""

    def __init__(self, sink: Callable[[Any], None] | None = None, deadline: float | None = None,
                 then: Callable[[Any], Any] | None = None):
        self._queue: queue.SimpleQueue[Any] | None = queue.SimpleQueue() if sink is None else None
        self._sink = sink if sink is not None else self._queue.put  # type: ignore[union-attr]
        self._cancelled = threading.Event()
        self.deadline = deadline  # time.monotonic() after which the work is stopped
        self.submitted = time.monotonic()
        self._finished = False
        self._then = then

    def emit(self, event: Any) -> None:
        """Hand an event to the caller (never blocks: `then` runs on a thread of its own); a sink
        that fails (its loop closed) cancels the work: nobody is listening any more."""
        if self._finished:
            return
        self._finished = isinstance(event, Finished)
        if self._finished and self._then is not None and event.error is None and not event.cancelled:
            threading.Thread(target=self._finish, args=(self._then, event), name="kvblend-handle-then",
                             daemon=True).start()
            return
        self._deliver(event)

    def _finish(self, then: Callable[[Any], Any], event: Finished) -> None:
        try:
            event = dataclasses.replace(event, value=then(event.value))
        except Exception as err:  # noqa: BLE001 - the caller gets it as the work's error
            event = dataclasses.replace(event, value=None, error=err)
        self._deliver(event)

    def _deliver(self, event: Any) -> None:
        try:
            self._sink(event)
        except RuntimeError:
            self._cancelled.set()

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def finished(self) -> bool:
        """Whether the `Finished` event was handed over (nothing more reaches the caller)."""
        return self._finished

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def stopped(self) -> bool:
        """Cancelled, or past its deadline."""
        return self._cancelled.is_set() or (self.deadline is not None and time.monotonic() > self.deadline)

    def events(self) -> Iterator[Any]:
        """The events as they come (blocking), the `Finished` one last. Only for handles
        made without a sink."""
        if self._queue is None:
            raise RuntimeError("this handle sends its events to a sink")
        while True:
            event = self._queue.get()
            yield event
            if isinstance(event, Finished):
                return

    def result(self) -> Any:
        """Wait for the end: the value, or the work's exception (`Cancelled` if it was cancelled)."""
        return unwrap(self.finished_event())

    def finished_event(self) -> Finished:
        """Wait for the end: the `Finished` event itself (the events before it dropped)."""
        for event in self.events():
            if isinstance(event, Finished):
                return event
        raise AssertionError("unreachable")

    def stream(self) -> Iterator[Any]:
        """The events as they come, the `Finished` unwrapped into its value (or its error
        raised); the work is cancelled when the iterator is closed before that."""
        ended = False
        try:
            for event in self.events():
                if isinstance(event, Finished):
                    ended = True
                    yield unwrap(event)
                    return
                yield event
        finally:
            if not ended:
                self.cancel()


def results(handles: list[Handle]) -> list[Any]:
    """The handles' results in order; those not awaited are cancelled when one fails."""
    done = []
    try:
        for handle in handles:
            done.append(handle.result())
    finally:
        for handle in handles[len(done):]:
            handle.cancel()
    return done


def unwrap(finished: Finished) -> Any:
    if finished.error is not None:
        raise finished.error
    if finished.cancelled:
        raise Cancelled("the request was cancelled (or its deadline passed) before it finished")
    return finished.value


class Task(Generic[T]):
    """Model work that is not a generation, run in the scheduler's prefill slot: its `work`
    (typed data: an ingest, a prefill for inspection, a caller's function) becomes a plan (a
    cursor, blend.model.plan) that wants bounded units of compute (an ingest: a packed pass
    each) so that running sequences decode in between, and ends with the task's value."""

    def __init__(self, name: str, work: Any, handle: Handle):
        self.name, self.work, self.handle = name, work, handle
        self.started: float | None = None


class Status(Enum):
    WAITING = "waiting"  # submitted, not started (or preempted: its KV parked in the tiers)
    PREFILLING = "prefilling"  # its prefill is running, step by step
    RUNNING = "running"  # in the decode batch
    FINISHED = "finished"


_ids = itertools.count(1)


class Sequence:
    """One generation as the scheduler sees it.

    `work` is its prefill as typed data (blend.engine.work: a `PromptWork` or a chat turn's
    `TurnWork`), which the scheduler's `PlanSource` makes into a plan's steps (again, to
    recompute a preempted sequence whose parked KV the tiers lost); `generation` decodes. The
    scheduler owns every field below the first ones.
    """

    def __init__(self, work: Any, generation: Generation, handle: Handle, *, kv_bytes: int, mode: str = "blend",
                 warnings: tuple[str, ...] = ()):
        self.id = next(_ids)
        self.work, self.generation, self.handle = work, generation, handle
        self.kv_bytes = kv_bytes  # KV of the prompt and its first new tokens, compute dtype (admission)
        self.mode, self.warnings = mode, warnings
        self.status = Status.WAITING
        self.prompt_ids: tuple[int, ...] = ()  # what the cache's first positions hold
        self.cache: KVCache | None = None
        self.stats: RequestStats | None = None
        self.follow_logprobs: Any = None  # teacher forcing after the prefill (Prefilled.follow_logprobs)
        self.exact_kv: Any = None  # a chat turn's exact prefill: what its session stores (Prefilled.exact_kv)
        self.started: float | None = None  # first prefill step (monotonic)
        self.ttft_s = 0.0  # prefill start to the first token's logits
        self.decode_steps = 0
        self.batch_total = 0  # sum of the batch sizes of its decode steps
        self.preemptions = 0
        self.resume_s = 0.0  # time spent restoring its parked KV
        self.parked: Any = None  # blend.kv.offload.ParkedKV while preempted

    def result(self, total_s: float) -> GenerationResult:
        gen = self.generation
        stats = self.stats or RequestStats(mode=self.mode, recompute_ratio=0.0, context_tokens=0, query_tokens=0,
                                           loaded_tokens=0, recomputed_tokens=0)
        queued = (self.started or self.handle.submitted) - self.handle.submitted
        stats = stats.replace(ttft_s=self.ttft_s, total_s=total_s, new_tokens=len(gen.tokens), queued_s=queued,
                              batch_size_mean=self.batch_total / self.decode_steps if self.decode_steps else 0.0,
                              preempted=self.preemptions, resume_s=self.resume_s)
        result = gen.result(stats, self.ttft_s, follow_logprobs=self.follow_logprobs)
        result.warnings = self.warnings
        return result
