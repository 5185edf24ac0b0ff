"""Plans as cursors: a plan's progress kept as data, between the steps the executor runs.

A plan (a request's prefill, a document pass, an ingest, a resume, ...) answers two calls:

    `want`   what it asks of the next step: `Rows` (token rows, chunked by the executor), a list
             of them (a pass of documents, one item each), a model-work `Cursor` (a blend's
             layer-synchronous passes), `PAUSE` (nothing: it did a unit of planning, or waits
             for another plan, and asks again at its next advance) or `Done` (its value);
    `take`   what it does with the output of that want (the logits of the rows it asked for,
             None after a cursor or a pause) or the error that work raised: it plans up to its
             next want.

Where a plan is (`stage`) and what it has made so far are fields; a plan that runs another plan
first (a blend's missing documents, a timed run) holds it as `sub` and passes its wants on until
it is done, then goes on with its value (or its error). No generator or closure carries work
between two steps: the scheduler reads each plan's want as plain data.

`close` ends a plan early (cancelled, failed): what it holds (claims, a layer loader) is
released, its `sub`'s first; a plan that ends or raises closes itself.

`drive` runs a plan alone to its end (a tool's call, a test: no scheduler around it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from blend.model.runner import Cursor, Rows, RowsCursor, Runner


@dataclass(frozen=True)
class Done:
    """A plan's end: its value."""

    value: Any


class _Pause:
    def __repr__(self) -> str:
        return "PAUSE"


PAUSE = _Pause()  # a want of nothing: a unit of planning done, or waiting for another plan
Want = Rows | list[Rows] | Cursor | _Pause | Done


class PlanCursor:
    """A plan's progress as data (see the module docstring). A subclass sets `stage` and fields
    in `__init__` and answers `_next(output, error)`: what it does with the output of its last
    want (its `sub`'s value when one ran) and its next want; `_release` frees what it holds. An
    error of its work (or its sub-plan's) reaches `_next` when it is one of `handles` (a fallback
    it takes); any other is raised, the plan closed."""

    stage = "start"
    handles: tuple[type[BaseException], ...] = ()

    def __init__(self) -> None:
        self.sub: PlanCursor | None = None
        self._want: Want | None = None  # None: never advanced
        self._closed = False

    @property
    def want(self) -> Want:
        """What it asks of the next step (after a `take`)."""
        if self._want is None:
            raise RuntimeError(f"{type(self).__name__} has not started: call take() first")
        return self._want

    @property
    def done(self) -> bool:
        return isinstance(self._want, Done)

    def take(self, output: Any = None, error: BaseException | None = None) -> Want:
        """The output of its last want (or the error it raised) in; plans to its next want, which
        it returns (and keeps as `want`). The first call starts it (nothing in). An error it does
        not handle is raised, the plan closed."""
        if self.done or self._closed:
            raise RuntimeError(f"{type(self).__name__} has ended: nothing more to take")
        try:
            want = self._resume(output, error)
        except BaseException:
            self.close()
            raise
        if isinstance(want, Done):
            self.close()
        self._want = want
        return want

    def _resume(self, output: Any, error: BaseException | None) -> Want:
        if self.sub is None:
            return self._on(output, error)
        try:
            want = self.sub.take(output, error)
        except Exception as err:  # noqa: BLE001 - the sub-plan's failure is this plan's to handle or raise
            self.sub = None
            return self._on(None, err)
        if not isinstance(want, Done):
            return want
        self.sub = None
        return self._next(want.value, None)

    def _on(self, output: Any, error: BaseException | None) -> Want:
        if error is not None and not isinstance(error, self.handles):
            raise error
        return self._next(output, error)

    def run(self, sub: PlanCursor) -> Want:
        """Start `sub` as this plan's next part: its first want (its value at once, if it asks for nothing)."""
        self.sub = sub
        return self._resume(None, None)

    def close(self) -> None:
        """End early: the sub-plan closed, what this plan holds released (idempotent)."""
        if self._closed:
            return
        self._closed = True
        sub, self.sub = self.sub, None
        try:
            if sub is not None:
                sub.close()
        finally:
            self._release()

    def _next(self, output: Any, error: BaseException | None) -> Want:
        raise NotImplementedError

    def _release(self) -> None:
        """What it holds, freed: on its end, its failure or its close."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(stage={self.stage!r}, sub={self.sub!r})"


class Clock:
    """A plan's own time while it runs as steps: the time inside its advances, and from a want of
    model work to the output taken back (the steps that computed its rows); not its pauses, nor
    the other plans' advances between them."""

    def __init__(self) -> None:
        self.own_s = 0.0
        self._asked: float | None = None

    def take(self, plan: PlanCursor, output: Any, error: BaseException | None) -> Want:
        """`plan.take(output, error)`, timed."""
        t0 = time.perf_counter()
        if self._asked is not None:
            self.own_s += t0 - self._asked
        self._asked = None
        try:
            want = plan.take(output, error)
        finally:
            t1 = time.perf_counter()
            self.own_s += t1 - t0
        if not isinstance(want, (_Pause, Done)):
            self._asked = t1
        return want


class Timed(PlanCursor):
    """`plan` run with its own time measured (`clock.own_s`): its value comes back as is."""

    def __init__(self, plan: PlanCursor, clock: Clock | None = None):
        super().__init__()
        self.plan, self.clock = plan, clock or Clock()
        self.stage = "run"

    def _resume(self, output: Any, error: BaseException | None) -> Want:
        return self.clock.take(self.plan, output, error)

    def _release(self) -> None:
        self.plan.close()


class Once(PlanCursor):
    """A plan of one unit: `fn`'s value, computed at its first advance."""

    def __init__(self, fn: Any):
        super().__init__()
        self.fn = fn

    def _next(self, output: Any, error: BaseException | None) -> Want:
        return Done(self.fn())


def drive(runner: Runner, plan: PlanCursor) -> Any:
    """Run `plan` alone to its end and return its value: a `Rows` or a list of them it wants is
    computed (`RowsCursor`: its logits taken back), a `Cursor` is driven to its end (None taken
    back), a pause continues it. An error of its work is handed to it, as the scheduler does."""
    want = plan.take()
    while not isinstance(want, Done):
        output, error = None, None
        try:
            if isinstance(want, (Rows, list)):
                cursor = RowsCursor(want, runner.chunk_tokens)
                while not cursor.done:
                    cursor.take(runner.forward(cursor.want()))
                output = cursor.value()
            elif not isinstance(want, _Pause):
                while not want.done:
                    want.take(runner.forward(want.want()))
        except Exception as err:  # noqa: BLE001 - delivered into the plan, as the scheduler does
            error = err
        want = plan.take(output, error)
    return want.value
