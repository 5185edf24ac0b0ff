"""`kvblend serve`: the OpenAI-compatible HTTP server (blend.server) over one engine."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from blend.cli.common import arg_type, config_arg, positive_int

log = logging.getLogger(__name__)


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise ValueError(f"a port must be within 1..65535, got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ValueError(f"must be a positive number of seconds, got {text}")
    return value


def cmd_serve(args: argparse.Namespace) -> int:
    from blend.engine import BlendEngine
    from blend.server import serve
    from blend.server.app import ServerSettings

    engine = BlendEngine.from_config(args.config)
    settings = ServerSettings(served_model_name=args.served_model_name or engine.config.model,
                              queue_size=args.queue_size, request_timeout_s=args.request_timeout,
                              warmup=not args.no_warmup)
    print(f"kvblend: serving {settings.served_model_name} on http://{args.host}:{args.port} "
          f"(queue {settings.queue_size}, timeout {settings.request_timeout_s:g} s)", flush=True)
    serve(engine, settings, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, documents, metrics)",
                              description="Serve the engine over HTTP: /v1/chat/completions, /v1/completions, "
                              "/v1/documents, /v1/models, /health, /metrics. One request runs at a time (batch "
                              "size 1); others wait in a bounded queue.")
    config_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=arg_type(_port), default=8000, help="port (default 8000)")
    p.add_argument("--queue-size", type=arg_type(positive_int), default=64,
                   help="requests that may wait while one runs; more get 503 + Retry-After (default 64)")
    p.add_argument("--request-timeout", type=arg_type(_seconds), default=300.0,
                   help="seconds from acceptance to the last token before a request is cancelled (default 300)")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: the config's model)")
    p.add_argument("--no-warmup", action="store_true", help="skip the warm-up request at start")
    p.set_defaults(func=cmd_serve)
