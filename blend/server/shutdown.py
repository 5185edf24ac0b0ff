"""How `kvblend serve` stops: uvicorn's server with a bounded drain.

The first SIGINT or SIGTERM starts uvicorn's graceful shutdown (no new connections; the
requests in flight go on) and a timer of the server's shutdown grace
(`ServerSettings.shutdown_grace_s`). When it fires, `ServerState.shut_down` ends every request
still queued or running with an error (503: its handler answers) and closes the engine (the
step under way finishes, queued writes flushed, each bounded by SHUTDOWN_STOP_S), so uvicorn's
wait for its connections ends and the process exits. A second signal of either kind forces
the exit at once (uvicorn forces only on a second SIGINT: a second SIGTERM did nothing).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import FrameType

import uvicorn


class GracefulServer(uvicorn.Server):
    """uvicorn's server whose drain ends after `grace_s` (then `expire` runs, on a timer thread)."""

    def __init__(self, config: uvicorn.Config, grace_s: float, expire: Callable[[], None]):
        super().__init__(config)
        self.grace_s, self.expire = grace_s, expire
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """A signal (in the main thread, between two steps of the event loop): the first starts
        the graceful shutdown and the grace timer, any later one forces the exit."""
        again = self.should_exit
        super().handle_exit(sig, frame)
        if again:
            self.force_exit = True
        elif self._timer is None:
            self._timer = threading.Timer(self.grace_s, self.expire)
            self._timer.name = "kvblend-shutdown-grace"
            self._timer.start()

    def cancel_grace(self) -> None:
        """The server has stopped: a grace timer that has not fired is not needed (one that has
        fired is awaited: the engine's close it started ends first)."""
        timer = self._timer
        if timer is not None:
            timer.cancel()
            if timer.is_alive() and timer is not threading.current_thread():
                timer.join()
