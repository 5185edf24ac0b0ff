"""How `kvblend serve` stops: uvicorn's server with a bounded drain.

The first SIGINT or SIGTERM starts uvicorn's graceful shutdown (no new connections; the
requests in flight go on) and a timer of the server's shutdown grace
(`ServerSettings.shutdown_grace_s`). When it fires, `ServerState.shut_down` ends every request
still queued or running with an error (503: its handler answers) and closes the engine (the
step under way finishes, queued writes flushed, each bounded by SHUTDOWN_STOP_S), so uvicorn's
wait for its connections ends and the process exits.

A second signal of either kind ends the grace at once: the same `shut_down` runs now, so every
stream still open ends with an error event and `[DONE]` (a plain request with 503) and the
queued writes are flushed, as after the grace. uvicorn itself is forced (its open tasks
cancelled) only when they outlive that by FORCE_AFTER_S: cancelling a task that still answers
is what leaves "Exception in ASGI application" tracebacks and 500s. (uvicorn alone forces
on a second SIGINT at once and ignores a second SIGTERM.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

FORCE_AFTER_S = 5.0  # after a second signal's shut_down, how long uvicorn's tasks may take to end


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose drain ends after `grace_s`, or at a second signal (then `expire`
    runs, on a thread of its own); `forced`: a second signal came."""

    def __init__(self, config: uvicorn.Config, grace_s: float, expire: Callable[[], None]):
        super().__init__(config)
        self.grace_s, self.expire = grace_s, expire
        self.forced = False
        self._timer: threading.Timer | None = None
        self._ending: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal (in the main thread, between two steps of the event loop): the first starts
        the graceful shutdown and the grace timer, a later one ends the grace now."""
        if not self.should_exit:
            super().handle_exit(sig, frame)
            self._timer = threading.Timer(self.grace_s, self.expire)
            self._timer.name = "kvblend-shutdown-grace"
            self._timer.start()
            return
        if self._ending is None:  # (handlers run one at a time, in the main thread)
            self.forced = True
            if self._timer is not None:
                self._timer.cancel()
            self._ending = threading.Thread(target=self._end_now, name="kvblend-shutdown-now", daemon=True)
            self._ending.start()

    def _end_now(self) -> None:
        """The grace's end, now; uvicorn forced only if its tasks outlive it by FORCE_AFTER_S."""
        try:
            self.expire()  # idempotent: it waits for a run the timer started
        finally:
            deadline = time.monotonic() + FORCE_AFTER_S
            while (self.server_state.tasks or self.server_state.connections) and time.monotonic() < deadline:
                time.sleep(0.05)
            if self.server_state.tasks:
                self.force_exit = True

    def cancel_grace(self) -> None:
        """The server has stopped: a grace timer that has not fired is not needed (one that has
        fired is awaited, and so is a second signal's end: the engine's close they started ends
        first)."""
        for thread in (self._timer, self._ending):
            if thread is None:
                continue
            if isinstance(thread, threading.Timer):
                thread.cancel()
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()
