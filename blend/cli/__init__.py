"""The `kvblend` command line: the command root, the only place that imports across the
storage -> blend -> eval layers.

Subcommands: ask, ingest, chat, demo, eval, store, plan, serve, bench {load, ttft, resume, serve}.
Commands with --json print one JSON object as the last line of stdout. Bad input is one
line on stderr and exit code 2. Building the parser imports no torch.
"""

from __future__ import annotations

import argparse
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    from blend.cli import bench, demo, eval, plan, requests, serve, store

    parser = argparse.ArgumentParser(prog="kvblend", description="Reuse precomputed document KV caches for fast RAG.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    requests.register(subparsers)
    demo.register(subparsers)
    eval.register(subparsers)
    store.register(subparsers)
    plan.register(subparsers)
    bench.register(subparsers)
    serve.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from blend.session import SessionBusy

    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, SessionBusy) as err:
        print(f"kvblend: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
