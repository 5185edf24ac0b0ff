"""The server's settings and its one state object, shared by every handler.

`create_app` builds one `ServerState` (the engine, the settings, the Prometheus metrics and
the readiness flag) and keeps it on `app.state`; a handler fetches it with
`server_state(request)` (the lifespan: `app_state(app)`). Nothing else is shared between requests.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import cast

from fastapi import FastAPI, Request

from blend.engine.engine import BlendEngine
from blend.server.metrics import Metrics

COMPLETIONS_PROMPTS = ("question", "raw")  # what /v1/completions' prompt is (ServerSettings.completions_prompt)


@dataclass(frozen=True)
class ServerSettings:
    """How the server shares its engine."""

    served_model_name: str
    queue_size: int = 64  # requests that may wait for the scheduler (beyond those running); more get 503
    request_timeout_s: float = 300.0  # from acceptance to the last token
    warmup: bool = True  # run engine.warmup() before accepting requests
    max_body_bytes: int = 16 << 20  # larger request bodies get 413 before they are parsed
    # after SIGTERM / SIGINT, in-flight and queued requests have this long to finish; then each still
    # there ends with an error (503), the engine stops and its queued writes are flushed (SHUTDOWN_STOP_S)
    shutdown_grace_s: float = 20.0
    # /v1/completions' prompt: "question" (the question of the engine's RAG prompt) or "raw" (the
    # whole prompt as text, as OpenAI-style servers take it: modes full and prefix, full by default)
    completions_prompt: str = "question"

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError(f"the request body limit must be >= 1 byte, got {self.max_body_bytes}")
        if self.queue_size < 1:
            raise ValueError(f"queue size must be >= 1, got {self.queue_size}")
        if self.completions_prompt not in COMPLETIONS_PROMPTS:
            raise ValueError(f"completions prompt must be one of {', '.join(COMPLETIONS_PROMPTS)}, "
                             f"got {self.completions_prompt!r}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 seconds, got {self.request_timeout_s}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown grace must be >= 0 seconds, got {self.shutdown_grace_s}")


# at shutdown, the longest wait for the scheduler's step under way, and again for the store's queued
# writes (what is still queued then is dropped with a warning: computed again when next needed)
SHUTDOWN_STOP_S = 10.0


@dataclass(frozen=True)
class ServerState:
    """What the handlers share: one engine, its settings, the metrics, whether the server is
    ready (set by the lifespan once the engine is warmed up, cleared at shutdown) and whether
    its shutdown grace ran out (`stopping`: the requests it ended get 503)."""

    engine: BlendEngine
    settings: ServerSettings
    metrics: Metrics
    ready: threading.Event = field(default_factory=threading.Event)
    stopping: threading.Event = field(default_factory=threading.Event)

    def shut_down(self) -> None:
        """The shutdown grace ran out (or a second signal came): every request still queued or
        running ends now with an error (503), the engine stops (the step under way finishes,
        at most SHUTDOWN_STOP_S) and its queued writes are flushed (at most SHUTDOWN_STOP_S).
        Blocks; idempotent."""
        self.stopping.set()
        self.engine.close(SHUTDOWN_STOP_S, cancel=True)

    @classmethod
    def create(cls, engine: BlendEngine, settings: ServerSettings) -> ServerState:
        return cls(engine, settings, Metrics(engine.scheduler, settings.queue_size))

    @property
    def model(self) -> str:
        """The name the server answers to (besides the engine's own model name)."""
        return self.settings.served_model_name

    def attach(self, app: FastAPI) -> None:
        """Keep this state on `app` (what `server_state` reads)."""
        app.state.kvblend = self


def app_state(app: FastAPI) -> ServerState:
    """The state `create_app` kept on `app`."""
    return cast(ServerState, app.state.kvblend)


def server_state(request: Request) -> ServerState:
    """The state of the application serving `request`."""
    return app_state(request.app)
