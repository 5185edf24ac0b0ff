"""`kvblend serve`: an OpenAI-compatible HTTP server over one BlendEngine.

  app.py      the FastAPI application (endpoints, errors, streaming)
  schemas.py  request bodies (pydantic) and response bodies (OpenAI's shapes)
  worker.py   the engine's worker thread and bounded queue (the concurrency contract)
  metrics.py  Prometheus metrics

`serve(engine, settings, host, port)` runs it with uvicorn until SIGINT/SIGTERM, letting
in-flight requests finish.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blend.engine import BlendEngine
    from blend.server.app import ServerSettings


def serve(engine: BlendEngine, settings: ServerSettings, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning") -> None:
    """Serve `engine` over HTTP until SIGINT or SIGTERM, then stop accepting, let the
    in-flight requests finish (up to the request timeout), close the engine and return."""
    import signal

    import uvicorn

    from blend.server.app import create_app

    config = uvicorn.Config(create_app(engine, settings), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=settings.request_timeout_s, access_log=False)

    def stopped(_signum: int, _frame: object) -> None:
        raise SystemExit(0)

    # uvicorn handles the signal (graceful shutdown), restores these handlers and raises
    # the signal again: the process then ends normally instead of dying from it
    previous = {sig: signal.signal(sig, stopped) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        uvicorn.Server(config).run()
    except SystemExit as exit_:
        if exit_.code not in (0, None):
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
