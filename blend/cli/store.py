"""`kvblend store stats|ls|clear`: inspect or empty the tiers of a config's `store:` section.

Every command sees only the config's namespace: the tiers are built for it, so another
namespace's entries on a shared server or directory are never listed, counted or deleted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from blend.cli.common import config_arg, confirm, emit_json, json_arg


def _store_config(args: argparse.Namespace) -> Any:
    from blend.config import load_config

    return load_config(args.config).store


def _open_store(args: argparse.Namespace, config: Any = None) -> Any:
    """The TieredStore of the config (validated before any tier is opened or created)."""
    config = config or _store_config(args)
    from storage.stack import TieredStore

    return TieredStore.from_config(config)


def bytes_per_token(config: Any) -> dict[str, float | None]:
    """Per tier of an engine config, the bytes of KV one token takes there: the model's KV shape
    (read from its config, no weights), the tier's codec, full blocks of `chunk_tokens`. None per
    tier when the model's config cannot be read, or is an MLA model's (which the engine cannot run)."""
    from storage.codec import codec_named
    from storage.config import tier_display_name

    try:
        from blend.planning.planner import model_kv_shape

        shape = model_kv_shape(config.model)
    except Exception:  # noqa: BLE001 - an unreadable model config leaves the column empty, never fails stats
        return {tier_display_name(t): None for t in config.store.tiers}
    if shape.mla is not None:  # an MLA model never runs here: no tier holds its entries
        return {tier_display_name(t): None for t in config.store.tiers}
    tokens = config.engine.blend.chunk_tokens
    return {tier_display_name(t): codec_named(t.codec).layer_nbytes(shape.kv_heads, tokens, shape.head_dim,
                                                                     config.store.kv_dtype) * shape.layers / tokens
            for t in config.store.tiers}


def entry_kind(fingerprint: str) -> str:
    """What an entry holds, from its header's fingerprint: `window` (a hybrid model's sliding
    layers, last window of a conversation), `global` (its full-attention layers' prefix
    block) or `all` (every layer: documents, prefix blocks of other models)."""
    from blend.kv.windowed import FULL_SUFFIX, WINDOW_SUFFIX

    return "window" if fingerprint.endswith(WINDOW_SUFFIX) else "global" if fingerprint.endswith(FULL_SUFFIX) else "all"


def _bytes_by_kind(tier: Any) -> dict[str, int]:
    """Entry bytes of one tier by `entry_kind` (every header read with peek_header: nothing touched)."""
    from storage.entry import CorruptEntry

    out = dict.fromkeys(("all", "global", "window"), 0)
    for key in tier.keys():
        try:
            header = tier.peek_header(key)
        except CorruptEntry:
            continue
        if header is not None:
            out[entry_kind(header.fingerprint)] += header.nbytes
    return out


def _cmd_stats(args: argparse.Namespace) -> int:
    from blend.config import load_config

    config = load_config(args.config)
    with _open_store(args, config.store) as store:
        stats = store.stats()
        if args.by_kind:  # per layer type: a hybrid model's sessions keep windows and global blocks apart
            for tier in store.tiers:
                if tier.name in stats and not stats[tier.name].get("down"):
                    stats[tier.name] = {**stats[tier.name], "bytes_by_kind": _bytes_by_kind(tier)}
    for name, per_token in bytes_per_token(config).items():
        stats[name]["bytes_per_token"] = per_token
    if args.json:
        emit_json(stats)
        return 0
    for name, s in stats.items():
        down = " DOWN" if s.get("down") else ""
        per_token = f"{s['bytes_per_token'] / 1024:.1f} KiB/token" if s["bytes_per_token"] else "? KiB/token"
        kinds = "".join(f"  {k} {v / 2**20:.1f} MiB" for k, v in s.get("bytes_by_kind", {}).items())
        print(f"{name:<14} {s['kind']:<14} {s['codec']:<5} exact {s.get('exact_codec', 'none'):<5} {per_token:>15}  "
              f"entries {s['entries']:>7}  used "
              f"{s['bytes_used'] / 2**20:>10.1f} MiB  corrupt {s['corrupt']}  errors {s['errors']}{down}{kinds}")
    return 0


def _cmd_ls(args: argparse.Namespace) -> int:
    from storage.entry import CorruptEntry

    rows = []
    with _open_store(args) as store:
        if not args.json:
            print(f"{'key':<48} {'tier':<14} {'tokens':>7} {'bytes':>11} {'pos_start':>9}", flush=True)
        for tier in store.tiers:
            for key in tier.keys():
                # a listing changes nothing: no recency, and an unreadable entry is shown, not deleted
                # (a request that meets it deletes it)
                try:
                    header = tier.peek_header(key)
                except CorruptEntry as err:
                    row = {"key": key, "tier": tier.name, "tokens": None, "bytes": None, "pos_start": None,
                           "corrupt": str(err)}
                    line = f"corrupt: {err}"
                else:
                    if header is None:
                        continue
                    row = {"key": key, "tier": tier.name, "tokens": header.num_tokens, "bytes": header.nbytes,
                           "pos_start": header.pos_start, "corrupt": None}
                    line = f"{header.num_tokens:>7} {header.nbytes:>11} {header.pos_start:>9}"
                if args.json:
                    rows.append(row)
                else:
                    print(f"{key:<48} {tier.name:<14} {line}")
    if args.json:
        emit_json({"entries": rows})
    return 0


def _cmd_clear(args: argparse.Namespace) -> int:
    from storage.config import tier_display_name

    config = _store_config(args)
    names = [tier_display_name(t) for t in config.tiers]
    if not confirm(f"delete every entry of the tiers {', '.join(names)}?", args.yes):  # before opening any tier
        print("nothing deleted", file=sys.stderr)
        return 1
    with _open_store(args, config) as store:
        failed = store.clear()
        where = f"namespace {store.namespace!r}" if store.namespace else "the default namespace"
        cleared = [t.name for t in store.tiers if t.name not in failed]
    for name in failed:
        print(f"kvblend: error: tier {name} could not be reached: its entries were not deleted; start it (or fix "
              "its url) and run `store clear` again", file=sys.stderr)
    if args.json:
        emit_json({"cleared": cleared, "not_cleared": failed, "namespace": config.namespace})
    elif cleared:
        print(f"cleared {where} in {', '.join(cleared)}")
    return 1 if failed else 0


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `store stats|ls|clear [--config C] [--json]` (the config's `store:` section)."""
    parser = subparsers.add_parser("store", help="inspect or empty the tiered KV store")
    sub = parser.add_subparsers(dest="store_command", required=True, metavar="ACTION")
    for name, func, text in (
        ("stats", _cmd_stats, "per-tier codec, bytes per token, counters and usage"),
        ("ls", _cmd_ls, "list entries: key, tier, tokens, bytes, pos_start"),
        ("clear", _cmd_clear, "delete every entry of the config's namespace from every tier (asks, or pass --yes)"),
    ):
        p = sub.add_parser(name, help=text)
        config_arg(p)
        json_arg(p)
        if name == "clear":
            p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
        if name == "stats":
            p.add_argument("--by-kind", action="store_true",
                           help="also the bytes of each entry kind (all layers / a hybrid model's global blocks / "
                                "its sliding windows), read from every entry's header")
        p.set_defaults(func=func)
    return parser
