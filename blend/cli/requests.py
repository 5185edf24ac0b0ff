"""`kvblend ask`, `kvblend ingest`, `kvblend chat`: requests to one engine built from a config."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from blend.cli.common import config_arg, emit_json, json_arg, read_documents


def _engine(args: argparse.Namespace, **overrides: Any):
    from blend.engine import BlendEngine

    return BlendEngine.from_config(args.config, **{k: v for k, v in overrides.items() if v is not None})


def cmd_ask(args: argparse.Namespace) -> int:
    docs = read_documents(args.doc or [])
    with _engine(args) as engine:
        result = engine.generate(args.question, docs, mode=args.mode, recompute_ratio=args.ratio,
                                 max_new_tokens=args.max_new_tokens)
    if args.json:
        emit_json({"text": result.text, "ttft_s": result.ttft_s, "stats": result.stats.to_dict()})
    else:
        print(result.text)
        print(f"[mode={args.mode} ttft={result.ttft_s * 1000:.0f} ms context={result.stats.context_tokens} tokens "
              f"recomputed={result.stats.recomputed_tokens}]")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from blend.document import Document

    docs = [Document(text, id=path) for path, text in zip(args.files, read_documents(args.files), strict=True)]
    with _engine(args) as engine:
        ingested = engine.ingest(docs)
    keys = [k for doc in ingested for k in doc.keys]
    if args.json:
        emit_json({"documents": [doc.to_dict() for doc in ingested], "chunks": keys})
    else:
        new = sum(not doc.cached for doc in ingested)
        print(f"ingested {len(docs)} document(s) as {len(keys)} chunk(s), {new} newly computed")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    with _engine(args) as engine:
        if args.message is not None:
            result = engine.chat(args.session, args.message, max_new_tokens=args.max_new_tokens)
            if args.json:
                emit_json({"text": result.text, "ttft_s": result.ttft_s, "stats": result.stats.to_dict()})
            else:
                print(result.text)
            return 0
        print(f"session {args.session}: type a message, empty line or Ctrl-D to quit")
        for line in sys.stdin:
            if not line.strip():
                break
            result = engine.chat(args.session, line.strip(), max_new_tokens=args.max_new_tokens)
            print(result.text)
            print(f"[ttft {result.ttft_s * 1000:.0f} ms, loaded {result.stats.loaded_tokens} "
                  f"/ {result.stats.context_tokens} tokens]", flush=True)
    return 0


def register(subparsers: Any) -> None:
    from blend.config import MODES

    p = subparsers.add_parser("ask", help="answer a question over documents")
    config_arg(p)
    p.add_argument("--doc", action="append", metavar="FILE", help="a document (repeatable)")
    p.add_argument("--question", required=True)
    p.add_argument("--mode", default="blend", choices=MODES)
    p.add_argument("--ratio", type=float, default=None, help="recompute ratio for blend (default: config)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    json_arg(p)
    p.set_defaults(func=cmd_ask)

    p = subparsers.add_parser("ingest", help="precompute and store the chunk caches of documents")
    config_arg(p)
    p.add_argument("files", nargs="+", metavar="FILE")
    json_arg(p)
    p.set_defaults(func=cmd_ingest)

    p = subparsers.add_parser("chat", help="a conversation whose KV is offloaded and resumed")
    config_arg(p)
    p.add_argument("--session", required=True, help="session id (a new one starts if unknown)")
    p.add_argument("--message", default=None, help="one turn, then exit (otherwise read lines from stdin)")
    p.add_argument("--max-new-tokens", type=int, default=None)
    json_arg(p)
    p.set_defaults(func=cmd_chat)
