"""Objects closed at interpreter exit if their owner did not close them.

A store's writer thread or an engine's scheduler thread still running torch work when the
interpreter finalises is ended inside torch's C++ code (a forced unwind that cannot cross its
noexcept frames), and the process aborts: "terminate called without an active exception", exit
134. `ClosedAtExit` keeps the open objects weakly (it never keeps one alive) and closes them from
one `atexit` hook, registered when the first one is added. atexit runs hooks last-registered
first: the engine's registry, filled after its store's, closes the engines (their scheduler, then
their store) before the stores left open on their own.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClosedAtExit(Generic[T]):
    """The open objects of one kind and how to close one at exit (`close(obj)`; its errors are
    logged, the exit goes on)."""

    def __init__(self, what: str, close: Callable[[T], None]):
        self.what, self._close = what, close
        self._open: weakref.WeakSet = weakref.WeakSet()
        self._lock = threading.Lock()
        self._registered = False

    def add(self, obj: T) -> None:
        with self._lock:
            self._open.add(obj)
            if not self._registered:
                atexit.register(self.close_all)
                self._registered = True

    def discard(self, obj: T) -> None:
        """`obj` was closed by its owner."""
        self._open.discard(obj)

    def close_all(self) -> None:
        for obj in list(self._open):
            try:
                self._close(obj)
            except Exception as err:  # noqa: BLE001 - the exit goes on; the next process sees what was written
                log.warning("closing the %s at exit: %s", self.what, err)
