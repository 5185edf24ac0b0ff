"""`kvblend ask`, `kvblend ingest`, `kvblend chat`: requests to one engine built from a config.

Every argument and the config are checked before the model is loaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from blend.cli.common import (
    POSITIVE_INT,
    RATIO,
    check_document_files,
    config_arg,
    document_positions,
    emit_json,
    human,
    json_arg,
    open_engine,
    read_documents,
)
from blend.modes import MODES


def _config(args: argparse.Namespace, **overrides: Any) -> Any:
    """The config of `args.config` with the non-None overrides, validated before torch and the
    model are loaded."""
    from blend.config import load_config

    return load_config(args.config, **{k: v for k, v in overrides.items() if v is not None})


def _engine(args: argparse.Namespace, config: Any = None) -> Any:
    return open_engine(args.config, config if config is not None else _config(args))


def _documents(args: argparse.Namespace, paths: list[str], config: Any) -> list[str]:
    """The document files' text, each refused on its size first when it cannot fit the model."""
    if not paths:
        return []
    check_document_files(paths)  # a missing file is named before the model's config is looked up
    return read_documents(paths, document_positions(args.config, config))


def cmd_ask(args: argparse.Namespace) -> int:
    config = _config(args)
    docs = _documents(args, args.doc or [], config)
    with _engine(args, config) as engine:
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
    from blend.prompt.document import Document, check_document_id

    config = _config(args)
    # named by file name: a path's '/' cannot be part of a document id (blend.prompt.document.ID_RULE)
    ids = [check_document_id(Path(path).name, "document file name") for path in args.files]
    docs = [Document(text, id=i) for i, text in zip(ids, _documents(args, args.files, config), strict=True)]
    with _engine(args, config) as engine:
        ingested = engine.ingest(docs)
        overflow = _budget_overflow(engine.store.stats())
    keys = [k for doc in ingested for k in doc.keys]
    if args.json:
        emit_json({"documents": [doc.to_dict() for doc in ingested], "chunks": keys})
    else:
        new = sum(doc.keys != () and not doc.cached for doc in ingested)
        print(f"ingested {len(docs)} document(s) as {len(keys)} chunk(s), {new} newly computed")
    lost = [doc.id for doc in ingested if doc.keys and doc.stored is False]
    if lost and overflow:
        print(f"kvblend: error: {len(lost)} of {len(docs)} document(s) were not stored, e.g. {lost[0]!r}: this ingest "
              f"is larger than {'; '.join(overflow)}, so its later documents evicted the earlier ones; raise the "
              "budget or ingest fewer documents at a time", file=sys.stderr)
        return 2
    if lost:
        print(f"kvblend: error: {len(lost)} of {len(docs)} document(s) were not stored, e.g. {lost[0]!r}: no tier "
              "accepted their blocks (the warnings above say why); fix the tier's path, permissions or server "
              "in the config", file=sys.stderr)
        return 2
    return 0


def _budget_overflow(stats: dict[str, dict]) -> list[str]:
    """Per budgeted tier that evicted while this process wrote more than its budget: "the budget of
    tier T (B): the ingest wrote W, X more" (the tiers of a fresh engine count this ingest only)."""
    from storage.units import format_bytes

    out = []
    for name, s in stats.items():
        budget, written = s.get("budget"), s.get("bytes_written", 0)
        if budget and s.get("evictions", 0) and written > budget:
            out.append(f"the budget of tier {name} ({format_bytes(budget)}): it wrote {format_bytes(written)} of KV, "
                       f"{format_bytes(written - budget)} more")
    return out


def cmd_chat(args: argparse.Namespace) -> int:
    from blend.session.manager import check_session_id

    check_session_id(args.session)
    say = human(args)

    turns = 0

    def turn(engine: Any, message: str) -> None:
        nonlocal turns
        turns += 1
        result = engine.chat(args.session, message, max_new_tokens=args.max_new_tokens)
        if args.json:  # one JSON line per turn: the last stdout line is always a JSON object
            emit_json({"text": result.text, "ttft_s": result.ttft_s, "stats": result.stats.to_dict()})
            return
        print(result.text)
        if args.message is None:
            print(f"[ttft {result.ttft_s * 1000:.0f} ms, loaded {result.stats.loaded_tokens} "
                  f"/ {result.stats.context_tokens} tokens]", flush=True)

    with _engine(args) as engine:
        if args.message is not None:
            turn(engine, args.message)
            return 0
        say(f"session {args.session}: type a message, empty line or Ctrl-D to quit")
        for line in sys.stdin:
            if not line.strip():
                break
            turn(engine, line.strip())
    if args.json and not turns:  # no turn: the last stdout line is still one JSON object
        emit_json({"session": args.session, "turns": 0})
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("ask", help="answer a question over documents")
    config_arg(p)
    p.add_argument("--doc", action="append", metavar="FILE", help="a document, UTF-8 text (repeatable)")
    p.add_argument("--question", required=True)
    p.add_argument("--mode", default="blend", choices=MODES)
    p.add_argument("--ratio", type=RATIO, default=None, help="recompute ratio for blend, in [0, 1] (default: config)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=None)
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
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=None)
    json_arg(p, "print one JSON object per turn (the last stdout line is JSON)")
    p.set_defaults(func=cmd_chat)
