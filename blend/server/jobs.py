"""How the event loop waits on the engine: a `Job` is one scheduled item (a generation, an
ingest) whose events (text deltas, then one `Finished`) reach an asyncio queue.

The engine's scheduler runs every request (blend.engine.scheduler: batched decode,
prefills between decode steps); handlers only await their job's events, so the event
loop never blocks on the model. A job is cancelled when its client disconnects (the
scheduler drops it at its next step: a running sequence leaves the batch) or when its
deadline passes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from blend.engine.sequence import Finished, Handle


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


__all__ = ["Finished", "Job"]
