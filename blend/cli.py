"""The `kvblend` command line.

Subcommands: ask, ingest, chat, demo, eval, store, plan, bench {load, ttft, resume}.
Commands with --json print one JSON object as the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = "configs/default.yaml"


def _config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG})")


def emit_json(obj: Any) -> None:
    """Print `obj` as one JSON line (the last line of stdout of a --json command)."""
    sys.stdout.write(json.dumps(obj, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


def read_documents(paths: list[str]) -> list[str]:
    docs = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise SystemExit(f"kvblend: document {p!r} not found; pass text files with --doc")
        docs.append(path.read_text(encoding="utf-8"))
    return docs


def _engine(args: argparse.Namespace, **overrides: Any):
    from blend.engine import BlendEngine

    return BlendEngine.from_config(args.config, **{k: v for k, v in overrides.items() if v is not None})


# ------------------------------------------------------------------ commands
def cmd_ask(args: argparse.Namespace) -> int:
    docs = read_documents(args.doc or [])
    with _engine(args) as engine:
        result = engine.generate(args.question, docs, mode=args.mode, recompute_ratio=args.ratio,
                                 max_new_tokens=args.max_new_tokens)
    if args.json:
        emit_json({"text": result.text, "ttft_s": result.ttft_s, "stats": result.stats})
    else:
        print(result.text)
        print(f"[mode={args.mode} ttft={result.ttft_s * 1000:.0f} ms context={result.stats['context_tokens']} tokens "
              f"recomputed={result.stats.get('recomputed_tokens', 0)}]")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    docs = read_documents(args.files)
    with _engine(args) as engine:
        keys = engine.ingest(docs)
    if args.json:
        emit_json({"chunks": keys})
    else:
        print(f"ingested {len(docs)} document(s) as {len(keys)} chunk(s)")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    with _engine(args) as engine:
        if args.message is not None:
            result = engine.chat(args.session, args.message, max_new_tokens=args.max_new_tokens)
            if args.json:
                emit_json({"text": result.text, "ttft_s": result.ttft_s, "stats": result.stats})
            else:
                print(result.text)
            return 0
        print(f"session {args.session}: type a message, empty line or Ctrl-D to quit")
        for line in sys.stdin:
            if not line.strip():
                break
            result = engine.chat(args.session, line.strip(), max_new_tokens=args.max_new_tokens)
            print(result.text)
            print(f"[ttft {result.ttft_s * 1000:.0f} ms, loaded {result.stats.get('loaded_tokens', 0)} "
                  f"/ {result.stats['history_tokens']} tokens]", flush=True)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from blend.demo import run_demo

    return run_demo(args.config, question=args.question, ratio=args.ratio, json_out=args.json)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvblend", description="Reuse precomputed document KV caches for fast RAG.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = subparsers.add_parser("ask", help="answer a question over documents")
    _config_arg(p)
    p.add_argument("--doc", action="append", metavar="FILE", help="a document (repeatable)")
    p.add_argument("--question", required=True)
    p.add_argument("--mode", default="blend", choices=["full", "reuse", "prefix", "blend"])
    p.add_argument("--ratio", type=float, default=None, help="recompute ratio for blend (default: config)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ask)

    p = subparsers.add_parser("ingest", help="precompute and store the chunk caches of documents")
    _config_arg(p)
    p.add_argument("files", nargs="+", metavar="FILE")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_ingest)

    p = subparsers.add_parser("chat", help="a conversation whose KV is offloaded and resumed")
    _config_arg(p)
    p.add_argument("--session", required=True, help="session id (a new one starts if unknown)")
    p.add_argument("--message", default=None, help="one turn, then exit (otherwise read lines from stdin)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_chat)

    p = subparsers.add_parser("demo", help="ingest the sample documents and compare full prefill with blend")
    _config_arg(p)
    p.add_argument("--question", default=None, help="default: the first sample question")
    p.add_argument("--ratio", type=float, default=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    bench = subparsers.add_parser("bench", help="benchmarks (load, ttft, resume)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")

    # registrations of the other packages' commands
    from blend.bench import register_bench_ttft
    from blend.bench_resume import register_bench_resume
    from blend.planner import register_plan
    from eval.cli import register_eval
    from storage.cli import register_bench_load, register_store

    register_eval(subparsers)
    register_store(subparsers)
    register_plan(subparsers)
    register_bench_load(bench_sub)
    register_bench_resume(bench_sub)
    register_bench_ttft(bench_sub)
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
