"""`kvblend store stats|ls|clear`: inspect or empty the tiers of a config's `store:` section.

Every command sees only the config's namespace: the tiers are built for it, so another
namespace's entries on a shared server or directory are never listed, counted or deleted.
"""

from __future__ import annotations

import argparse
from typing import Any

from blend.cli.common import config_arg, emit_json, json_arg
from storage.config import StoreConfig, load_yaml


def _store_config(path: str) -> StoreConfig:
    data = load_yaml(path)
    return StoreConfig.from_mapping(data.get("store"), where=f"{path}: store")


def _open_store(path: str) -> Any:
    from storage.stack import TieredStore

    return TieredStore.from_config(_store_config(path))


def _cmd_stats(args: argparse.Namespace) -> int:
    with _open_store(args.config) as store:
        stats = store.stats()
    for name, s in stats.items():
        down = " DOWN" if s.get("down") else ""
        print(
            f"{name:<14} {s['kind']:<14} entries {s['entries']:>7}  used {s['bytes_used'] / 2**20:>10.1f} MiB"
            f"  corrupt {s['corrupt']}  errors {s['errors']}{down}"
        )
    if args.json:
        emit_json(stats)
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    with _open_store(args.config) as store:
        print(f"{'key':<48} {'tier':<14} {'tokens':>7} {'bytes':>11} {'pos_start':>9}")
        for tier in store.tiers:
            for key in tier.keys():
                header = tier.get_header(key)
                if header is not None:
                    print(f"{key:<48} {tier.name:<14} {header.num_tokens:>7} {header.nbytes:>11} {header.pos_start:>9}")
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    with _open_store(args.config) as store:
        store.clear()
        where = f"namespace {store.namespace!r}" if store.namespace else "the default namespace"
        print(f"cleared {where} in {', '.join(t.name for t in store.tiers)}")
    return 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `store stats|ls|clear --config C` (the config file's `store:` section)."""
    parser = subparsers.add_parser("store", help="inspect or empty the tiered KV store")
    sub = parser.add_subparsers(dest="store_command", required=True)
    for name, func, text in (
        ("stats", _cmd_stats, "per-tier counters and usage"),
        ("ls", _cmd_ls, "list entries: key, tier, tokens, bytes, pos_start"),
        ("clear", _cmd_clear, "delete every entry of the config's namespace from every tier"),
    ):
        p = sub.add_parser(name, help=text)
        config_arg(p)
        if name == "stats":
            json_arg(p, "also print one JSON object as the last line")
        p.set_defaults(func=func)
    return parser
