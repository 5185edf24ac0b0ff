"""`kvblend serve`: an OpenAI-compatible HTTP server over one BlendEngine.

  app.py       the FastAPI application: create_app, its lifespan, the body limit
  state.py     ServerSettings and the one ServerState the handlers share
  handlers.py  the endpoints (module-level functions over the ServerState)
  stream.py    a generation streamed as server-sent events
  jobs.py      an engine item as the event loop waits on it (queue full: 503, timeouts, disconnects)
  shutdown.py  uvicorn's server with a bounded drain (GracefulServer)
  errors.py    every error as OpenAI's error object
  schemas.py   request bodies (pydantic) and response bodies (OpenAI's shapes)
  metrics.py   Prometheus metrics

`listen_socket(host, port)` binds and listens first (one-line errors naming the fix, before
the model loads; connections that arrive while it loads wait in the backlog); `serve(engine, settings, sock)` runs the app on it with uvicorn until
SIGINT/SIGTERM, letting in-flight requests finish within the shutdown grace (then, or at a
second signal, they end with an error), and exits within that grace plus SHUTDOWN_STOP_S twice.
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
    """Serve `engine` over HTTP on `sock` (from `listen_socket`) until SIGINT or SIGTERM, then
    stop accepting and let the requests in flight or queued finish for up to
    `settings.shutdown_grace_s`; those still there then end with an error (a stream: an error
    event, then `[DONE]`; otherwise 503), the engine stops (the step under way finishes) and
    its queued writes are flushed (each at most SHUTDOWN_STOP_S); returns False. A second
    signal (SIGINT or SIGTERM) ends the grace at once: the requests still there end with an
    error the same way, the engine is closed the same way, and it returns True."""
    import signal

    import uvicorn

    from blend.server.app import create_app
    from blend.server.shutdown import GracefulServer
    from blend.server.state import SHUTDOWN_STOP_S, app_state

    host, port = sock.getsockname()[:2]
    app = create_app(engine, settings)
    state = app_state(app)
    # uvicorn's own limit only backs ours up: by then every request has ended (ServerState.shut_down)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=settings.shutdown_grace_s + 2 * SHUTDOWN_STOP_S + 5)

    def stopped(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    # uvicorn handles the signal (graceful shutdown), restores these handlers and raises
    # the signal again: the process then ends normally instead of dying from it
    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = GracefulServer(config, settings.shutdown_grace_s, state.shut_down)
    try:
        server.run(sockets=[sock])
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    finally:
        server.cancel_grace()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        # idempotent (after the grace or the lifespan, a no-op); after a forced exit: requests ended, writes flushed
        engine.close(SHUTDOWN_STOP_S, cancel=True)
    return server.forced
