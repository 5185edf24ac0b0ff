"""What the scheduler runs, as data, and the plans it makes of it.

A `Sequence` holds a `PromptWork` (a request's prefill) or a `TurnWork` (a chat turn's); a
`Task` holds a `PromptWork` (`BlendEngine.prefill`), an `IngestWork` or an `ExclusiveWork`
(a caller's function on the scheduler's thread). None of them holds code of the engine:
`Plans.plan` reads an item's work and returns its plan, a cursor (blend.engine.prefill,
blend.kv.ingest), and `Plans.ended` tells a chat turn's session how its sequence ended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from blend.decode.result import GenerationResult
from blend.engine.prefill import Prefiller, PromptWork
from blend.engine.sequence import Sequence, Task
from blend.kv.ingest import IngestJob, Ingestor
from blend.model.cache import KVCache
from blend.model.plan import Once, PlanCursor
from blend.session.manager import SessionManager, Turn


@dataclass(frozen=True)
class TurnWork:
    """A chat turn's prefill: its exact KV (device copy, stored prefix chain, the rest computed),
    or its documents blended in (`blend`: when the turn blends and they are not all on the
    device). Its session is told how the turn ended (`Plans.ended`)."""

    turn: Turn
    blend: PromptWork | None = None


@dataclass(frozen=True)
class IngestWork:
    """Documents computed and stored, one forward pass per step (`sync`: their writes awaited by
    the handle, off the scheduler's thread: `Ingestor.confirm`).
    `stop`: the caller's own stop (a server job's deadline), asked with the handle's."""

    job: IngestJob
    sync: bool = True
    stop: Callable[[], bool] | None = None


@dataclass(frozen=True)
class ExclusiveWork:
    """A caller's function run on the scheduler's thread between two steps (`run_exclusive`)."""

    fn: Callable[[], Any]


class Plans:
    """The plan of each kind of work (the scheduler's `PlanSource`)."""

    def __init__(self, prefiller: Prefiller, sessions: SessionManager, ingestor: Ingestor):
        self.prefiller, self.sessions, self.ingestor = prefiller, sessions, ingestor

    def plan(self, item: Sequence | Task) -> PlanCursor:
        """`item`'s plan, as a cursor (blend.model.plan): what it wants of each step, and what it
        does with the step's output."""
        work = item.work
        if isinstance(work, PromptWork):
            return self.prefiller.plan(work)
        if isinstance(work, TurnWork):
            return self.prefiller.turn_plan(work.turn, work.blend)
        if isinstance(work, IngestWork):
            handle, own = item.handle, work.stop
            return self.ingestor.plan(work.job, lambda: handle.stopped() or (own is not None and own()))
        if isinstance(work, ExclusiveWork):
            return Once(work.fn)
        raise TypeError(f"no plan for {type(work).__name__}: give PromptWork, TurnWork, IngestWork or ExclusiveWork")

    def ended(self, seq: Sequence, result: GenerationResult | None, cache: KVCache | None) -> None:
        """A sequence ended: a chat turn's session stores its blocks and history and keeps its KV
        (`result`), or is released (None: it failed or was cancelled)."""
        if not isinstance(seq.work, TurnWork):
            return
        if result is None:
            self.sessions.abort(seq.work.turn)
        else:
            assert cache is not None
            self.sessions.finish(seq.work.turn, result, cache, seq.exact_kv)
