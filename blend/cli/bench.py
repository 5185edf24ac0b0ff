"""`kvblend bench load | ttft | resume | serve | decode`: argument parsing and printing; the measurements
live in eval/bench. Arguments are checked before anything is loaded or written; progress
and tables go to stdout, or to stderr with --json (stdout then holds the JSON line only)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blend.cli import serve
from blend.cli.common import (
    POSITIVE_FLOAT,
    POSITIVE_INT,
    arg_type,
    check_out_dir,
    config_arg,
    csv_list,
    directory,
    emit_json,
    human,
    json_arg,
    require_eval_extra,
)
from blend.modes import parse_ratio
from storage.dtypes import DTYPE_NAMES

COMPUTE_DTYPES = ("auto", *DTYPE_NAMES)


def _tiers(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    """Tier kinds from "cpu,disk"; ValueError lists the valid ones (default: every kind)."""
    from storage.config import TIER_CONFIGS

    allowed = allowed or tuple(TIER_CONFIGS)
    kinds = csv_list(text, "--tiers")
    for kind in kinds:
        if kind not in allowed:
            raise ValueError(f"unknown tier {kind!r}; use some of {', '.join(allowed)}")
    return kinds


# ------------------------------------------------------------------- load
def cmd_load(args: argparse.Namespace) -> int:
    kinds = _tiers(",".join(args.tier or ["cpu"]))
    config = None
    if args.config:
        from blend.config import load_config

        config = load_config(args.config).store
    from eval.bench.common import one_tier
    from eval.bench.load import ChunkShape, run_load

    cluster_urls = args.cluster_urls.split(",") if args.cluster_urls else None
    for kind in kinds:  # every tier's settings checked (a URL, node URLs) before any tier runs
        one_tier(kind, config, scratch=Path("."), redis_url=args.redis_url, cluster_urls=cluster_urls)
    shape = ChunkShape(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, tokens=args.chunk_tokens,
                       kv_dtype=args.kv_dtype)
    say = human(args)
    results = [
        run_load(kind, args.size_mb, shape, config=config, redis_url=args.redis_url, cluster_urls=cluster_urls,
                 rounds=args.rounds, log=say)
        for kind in kinds
    ]
    if args.json:
        emit_json({"tiers": results})
    return 0


def _register_load(sub: Any) -> None:
    p = sub.add_parser("load", help="KV store throughput per tier vs raw reads")
    p.add_argument("--tier", action="append", default=None, metavar="KIND",
                   help="a tier kind (cpu, disk, redis, redis-cluster); repeat or comma-separate (default cpu)")
    p.add_argument("--size-mb", type=POSITIVE_FLOAT, default=256, help="MiB of KV written and read (default 256)")
    json_arg(p)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="take tier settings (disk path, redis url) from this YAML")
    p.add_argument("--redis-url", default=None, help="redis tier URL (default from --config, else redis://127.0.0.1:6379/0)")
    p.add_argument("--cluster-urls", default=None, help="redis-cluster node URLs, comma-separated")
    p.add_argument("--layers", type=POSITIVE_INT, default=30)
    p.add_argument("--kv-heads", type=POSITIVE_INT, default=3)
    p.add_argument("--head-dim", type=POSITIVE_INT, default=64)
    p.add_argument("--chunk-tokens", type=POSITIVE_INT, default=512)
    p.add_argument("--kv-dtype", default="float16", choices=DTYPE_NAMES)
    p.add_argument("--rounds", type=POSITIVE_INT, default=5, help="interleaved measured rounds (median reported)")
    p.set_defaults(func=cmd_load)


# ------------------------------------------------------------------- ttft
def cmd_ttft(args: argparse.Namespace) -> int:
    _tiers(args.tiers)
    for r in csv_list(args.ratios, "--ratios"):
        parse_ratio(r, "--ratios")
    if args.out:
        require_eval_extra("matplotlib")
        from eval.bench.ttft import REPORT_FILES

        check_out_dir(args.out, REPORT_FILES)
    from blend.config import load_config

    load_config(args.config)  # a bad config fails here, before the model loads
    from eval.bench.ttft import run_ttft, write_report

    summary = run_ttft(args)
    if args.out:
        write_report(summary, Path(args.out))
    say = human(args)
    for r in summary["results"]:
        if "error" in r:
            say(f"{r['tier']:>6}: {r['error']}")
            continue
        say(f"{r['tier']:>6} r={r['ratio']:<5} TTFT {r['ttft_s']:.3f} s  speedup {r['speedup']:.2f}x "
            f"(ideal {r['ideal_speedup']:.2f}x, bound {r['bound_speedup']:.2f}x)  exposed load {r['exposed_load_s']:.3f} s  {r['load_gbps']} GB/s")
    say(f"full prefill TTFT {summary['full_ttft_s']:.3f} s over {summary['context_tokens']} tokens "
        f"({summary['model']}, {summary['dtype']}, {summary['device_name']}); CPU probe "
        f"{summary['probe_gflops_start']} -> {summary['probe_gflops_end']} GFLOP/s, widest spread of repeats "
        f"{summary['widest_spread']:.0%}")
    if summary["random_weights"]:
        say("random weights: these figures are timings only")
    if args.json:
        emit_json(summary)
    return 0


def _register_ttft(sub: Any) -> None:
    p = sub.add_parser("ttft", help="TTFT of full prefill vs blend per tier and ratio")
    config_arg(p)
    p.add_argument("--chunks", type=POSITIVE_INT, default=6)
    p.add_argument("--chunk-tokens", type=POSITIVE_INT, default=512)
    p.add_argument("--ratios", default="0,0.05,0.15,0.3,1", help="recompute ratios, comma-separated, each in [0, 1]")
    p.add_argument("--tiers", default="cpu,disk", help="tier kinds, comma-separated")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3)
    p.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    p.add_argument("--cluster-urls", default=None)
    p.add_argument("--model", default=None,
                   help="override the config's model, e.g. random:llama-3-8b (random weights: timing only)")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES, help="override the compute dtype, e.g. bfloat16")
    p.add_argument("--device", default=None, help="override the device: auto, cpu, cuda, cuda:<index>")
    p.add_argument("--kv-dtype", default=None, choices=DTYPE_NAMES, help="override the stored KV dtype")
    json_arg(p)
    p.add_argument("--out", default=None, metavar="DIR", help="write ttft.json, ttft.md and PNG plots here")
    p.set_defaults(func=cmd_ttft)


# ----------------------------------------------------------------- resume
def _lengths(text: str) -> list[int]:
    from blend.cli.common import positive_ints

    return positive_ints(text, "--history-tokens")


def cmd_resume(args: argparse.Namespace) -> int:
    lengths = _lengths(args.history_tokens)
    from eval.bench.resume import TIER_KINDS, run_resume_bench

    tiers = _tiers(args.tiers, TIER_KINDS)
    from blend.config import load_config

    load_config(args.config)  # a bad config fails here, before the model loads
    say = human(args)
    report = run_resume_bench(args.config, lengths, tiers, repeats=args.repeats, redis_url=args.redis_url,
                              disk_path=args.disk_path, cold_disk=not args.warm_disk, log=say)
    for row in report["results"]:
        if "error" in row:
            say(f"{row['tier']:<6} {row['history_tokens']:>6} tokens  ERROR {row['error']}")
        else:
            say(f"{row['tier']:<6} {row['history_tokens']:>6} tokens  resume {row['resume_ttft_s'] * 1000:8.1f} ms  "
                f"re-prefill {row['reprefill_ttft_s'] * 1000:8.1f} ms  speedup {row['speedup']:6.2f}x  "
                f"(loaded {row['loaded_tokens']}, computed {row['computed_tokens']})")
    if args.json:
        emit_json(report)
    return 0


def _register_resume(sub: Any) -> None:
    p = sub.add_parser("resume", help="TTFT of resuming an offloaded chat from each tier vs re-prefill")
    config_arg(p)
    p.add_argument("--history-tokens", default="1024,2048,4096", help="comma-separated history lengths (tokens)")
    p.add_argument("--tiers", default="cpu,disk,redis", help="comma-separated, from cpu, disk, redis")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="measured rounds after the warm-up (median reported)")
    p.add_argument("--redis-url", default=None,
                   help="redis tier URL (default: the config's redis tier, else redis://127.0.0.1:6379/0)")
    p.add_argument("--disk-path", default=None, type=arg_type(directory),
                   help="scratch directory for the disk tier (default: under the config's disk path, else a temp dir)")
    p.add_argument("--warm-disk", action="store_true", help="leave disk entries in the OS page cache")
    json_arg(p)
    p.set_defaults(func=cmd_resume)


# ----------------------------------------------------------------- decode
def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise ValueError(f"must be >= 0, got {value}")
    return value


def cmd_decode(args: argparse.Namespace) -> int:
    from blend.cli.common import positive_ints

    contexts = positive_ints(args.context_tokens, "--context-tokens")
    batches = positive_ints(args.batch, "--batch")
    from blend.config import load_config

    overrides = {name: getattr(args, name) for name in ("model", "dtype", "device") if getattr(args, name)}
    config = load_config(args.config, **overrides)  # a bad config fails here, before the model loads
    from eval.bench.decode import DecodeSettings, run_decode_bench

    settings = DecodeSettings(tuple(contexts), tuple(batches), args.steps, args.repeats, args.warmup)
    say = human(args)
    summary = run_decode_bench(config, settings, log=say)
    say(f"{summary['model']} ({summary['dtype']}, {summary['device']}, {summary['torch_threads']} threads, "
        f"projections {summary['projections']}); CPU probe {summary['probe_gflops_start']} -> "
        f"{summary['probe_gflops_end']} GFLOP/s, widest spread of rounds {summary['widest_spread']:.0%}")
    if summary["random_weights"]:
        say("random weights: these figures are timings only")
    if args.json:
        emit_json(summary)
    return 0


def _register_decode(sub: Any) -> None:
    p = sub.add_parser("decode", help="decode step time and tokens/s per context length and batch size")
    config_arg(p)
    p.add_argument("--context-tokens", default="1024,4096", metavar="N,...",
                   help="context lengths prefilled before decoding, comma-separated (default 1024,4096)")
    p.add_argument("--batch", default="1,8", metavar="B,...",
                   help="sequences decoding together, comma-separated (default 1,8)")
    p.add_argument("--steps", type=POSITIVE_INT, default=16, help="decode steps per timed round (default 16)")
    p.add_argument("--repeats", type=POSITIVE_INT, default=3, help="timed rounds per setting; the median is reported")
    p.add_argument("--warmup", type=arg_type(_non_negative_int), default=2, help="untimed steps per setting (default 2)")
    p.add_argument("--model", default=None, help="override the config's model, e.g. random:llama-3.2-1b (timing only)")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES, help="override the compute dtype (auto: "
                   "bfloat16 where the CPU or GPU computes it natively)")
    p.add_argument("--device", default=None, help="override the device: auto, cpu, cuda, cuda:<index>")
    json_arg(p)
    p.set_defaults(func=cmd_decode)


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (load, ttft, resume, serve, decode)")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_load(sub)
    _register_ttft(sub)
    _register_resume(sub)
    serve.register_bench(sub)
    _register_decode(sub)
