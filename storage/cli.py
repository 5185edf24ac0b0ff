"""Command line for the store: `kvblend store stats|ls|clear` and `kvblend bench load`.

`register_store(subparsers)` and `register_bench_load(bench_subparsers)` attach the
commands to the main kvblend parser; each sets `func(args) -> int`. `python -m
storage.cli ...` runs the same commands without the rest of kvblend.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from storage.bench import ChunkShape, run_load
from storage.config import StoreConfig, load_yaml

DEFAULT_CONFIG = "configs/default.yaml"
TIER_CHOICES = ("cpu", "disk", "redis", "redis-cluster")


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
        print(json.dumps(stats, sort_keys=True))
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
        print(f"cleared {', '.join(t.name for t in store.tiers)}")
    return 0


def register_store(subparsers: Any) -> argparse.ArgumentParser:
    """Add `store stats|ls|clear --config C` (the config file's `store:` section)."""
    parser = subparsers.add_parser("store", help="inspect or empty the tiered KV store")
    sub = parser.add_subparsers(dest="store_command", required=True)
    for name, func, text in (
        ("stats", _cmd_stats, "per-tier counters and usage"),
        ("ls", _cmd_ls, "list entries: key, tier, tokens, bytes, pos_start"),
        ("clear", _cmd_clear, "delete every entry from every tier"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default {DEFAULT_CONFIG})")
        if name == "stats":
            p.add_argument("--json", action="store_true", help="also print one JSON object as the last line")
        p.set_defaults(func=func)
    return parser


def _cmd_bench_load(args: argparse.Namespace) -> int:
    config = _store_config(args.config) if args.config else None
    shape = ChunkShape(
        layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, tokens=args.chunk_tokens,
        kv_dtype=args.kv_dtype,
    )
    kinds = [k for group in args.tier or ["cpu"] for k in group.split(",") if k]
    for kind in kinds:
        if kind not in TIER_CHOICES:
            raise SystemExit(f"bench load: unknown --tier {kind!r}; use one of {', '.join(TIER_CHOICES)}")
    results = [
        run_load(
            kind, args.size_mb, shape, config=config, redis_url=args.redis_url,
            cluster_urls=args.cluster_urls.split(",") if args.cluster_urls else None, rounds=args.rounds,
            log=(lambda _: None) if args.json else print,
        )
        for kind in kinds
    ]
    print(json.dumps({"tiers": results}))
    return 0


def register_bench_load(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Add `bench load`: per-tier write/read throughput against raw reads of the same bytes."""
    p = bench_subparsers.add_parser("load", help="KV store throughput per tier vs raw reads")
    p.add_argument("--tier", action="append", default=None,
                   help="cpu | disk | redis | redis-cluster; repeat or comma-separate for several (default cpu)")
    p.add_argument("--size-mb", type=float, default=256, help="MiB of KV written and read (default 256)")
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--config", default=None, help="take tier settings (disk path, redis url) from this YAML")
    p.add_argument("--redis-url", default=None, help="redis tier URL (default from --config, else redis://127.0.0.1:6379/0)")
    p.add_argument("--cluster-urls", default=None, help="redis-cluster node URLs, comma-separated")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--chunk-tokens", type=int, default=512)
    p.add_argument("--kv-dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--rounds", type=int, default=5, help="interleaved measured rounds (median reported)")
    p.set_defaults(func=_cmd_bench_load)
    return p


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: `python -m storage.cli store stats` / `python -m storage.cli bench load`."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="python -m storage.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    register_store(sub)
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    register_bench_load(bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
