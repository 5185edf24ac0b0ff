"""`kvblend serve`: an OpenAI-compatible HTTP server over one BlendEngine.

  app.py       the FastAPI application: create_app, its lifespan, the body limit
  state.py     ServerSettings and the one ServerState the handlers share
  handlers.py  the endpoints (module-level functions over the ServerState)
  stream.py    a generation streamed as server-sent events
  jobs.py      an engine item as the event loop waits on it (queue full: 503, timeouts, disconnects)
  errors.py    every error as OpenAI's error object
  schemas.py   request bodies (pydantic) and response bodies (OpenAI's shapes)
  metrics.py   Prometheus metrics

`listen_socket(host, port)` binds and listens first (one-line errors naming the fix, before
the model loads; connections that arrive while it loads wait in the backlog); `serve(engine, settings, sock)` runs the app on it with uvicorn until
SIGINT/SIGTERM, letting in-flight requests finish.
"""

from __future__ import annotations

import errno
import socket
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blend.engine.engine import BlendEngine
    from blend.server.state import ServerSettings


LISTEN_BACKLOG = 2048  # uvicorn's default

_BIND_FIXES = {
    errno.EADDRINUSE: "another process listens there: pick another --port or stop it",
    errno.EACCES: "ports below 1024 need privileges: pick a --port above 1023",
    errno.EADDRNOTAVAIL: "that address is not this machine's: use --host 127.0.0.1 (or 0.0.0.0 for every interface)",
}


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port and listening (uvicorn accepts on it). ValueError,
    one line naming the fix, when the name does not resolve or the address cannot be bound.

    It listens at once: with SO_REUSEADDR two processes may both bind a port that nobody
    listens on yet, and the second would only fail once its model had loaded."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ValueError(f"--host {host!r} does not resolve ({reason}); use an address of this machine, e.g. "
                         "127.0.0.1 or 0.0.0.0") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as err:
        sock.close()
        fix = _BIND_FIXES.get(err.errno or 0, "check --host and --port")
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}; {fix}") from None
    return sock


def serve(engine: BlendEngine, settings: ServerSettings, sock: socket.socket, log_level: str = "warning") -> bool:
    """Serve `engine` over HTTP on `sock` (from `listen_socket`) until SIGINT or SIGTERM,
    then stop accepting, let the in-flight requests finish (up to the request timeout),
    close the engine and return False. A second signal stops at once (uvicorn's forced
    exit: in-flight requests are dropped); the engine is still closed, so queued cache
    writes are flushed, and it returns True."""
    import signal

    import uvicorn

    from blend.server.app import create_app

    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(create_app(engine, settings), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=settings.request_timeout_s, access_log=False)

    def stopped(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    # uvicorn handles the signal (graceful shutdown), restores these handlers and raises
    # the signal again: the process then ends normally instead of dying from it
    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        engine.close()  # idempotent; the lifespan's close may not have run after a forced exit
    return bool(server.force_exit)
