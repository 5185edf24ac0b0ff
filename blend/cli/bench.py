"""`kvblend bench load | ttft | resume | workload | serve | decode`: argument parsing and printing; the measurements
live in eval/bench. Arguments are checked before anything is loaded or written; progress
and tables go to stdout, or to stderr with --json (stdout then holds the JSON line only)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from blend.cli import serve
from blend.cli.common import (
    NON_NEGATIVE_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    RATIO,
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
from blend.cli.eval import parse_field_map
from blend.modes import check_mode, parse_ratio
from storage.codec import CODEC_NAMES
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


def _codecs(text: str) -> list[str]:
    """Codec names from "none,int8,int4"; ValueError lists the valid ones."""
    names = csv_list(text, "--codec")
    for name in names:
        if name not in CODEC_NAMES:
            raise ValueError(f"unknown codec {name!r}; use some of {', '.join(CODEC_NAMES)}")
    return list(dict.fromkeys(names))


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
    codecs = _codecs(args.codec) if args.codec else [None]
    shape = ChunkShape(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, tokens=args.chunk_tokens,
                       kv_dtype=args.kv_dtype)
    say = human(args)
    results = [
        run_load(kind, args.size_mb, shape, config=config, redis_url=args.redis_url, cluster_urls=cluster_urls,
                 rounds=args.rounds, codec=codec, log=say)
        for kind in kinds for codec in codecs
    ]
    if args.json:
        emit_json({"tiers": results})
    return 0


def _register_load(sub: Any) -> None:
    p = sub.add_parser("load", help="KV store throughput per tier vs raw reads")
    p.add_argument("--tier", action="append", default=None, metavar="KIND",
                   help="a tier kind (cpu, disk, redis, redis-cluster); repeat or comma-separate (default cpu)")
    p.add_argument("--size-mb", type=POSITIVE_FLOAT, default=256,
                   help="MiB of KV written and read, float16-equivalent (default 256)")
    p.add_argument("--codec", default=None, metavar="C,...",
                   help="codecs to store the KV in, comma-separated, from " + ", ".join(CODEC_NAMES)
                        + " (default: the tier's configured codec); one row per tier and codec")
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
    return _timings_done(args, say, summary)


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
def cmd_decode(args: argparse.Namespace) -> int:
    from blend.cli.common import positive_ints

    contexts = positive_ints(args.context_tokens, "--context-tokens")
    batches = positive_ints(args.batch, "--batch")
    from eval.bench.decode import check_peer

    check_peer(args.peer_llamacpp)
    from blend.config import load_config

    overrides = {name: getattr(args, name) for name in ("model", "dtype", "device", "weights") if getattr(args, name)}
    config = load_config(args.config, **overrides)  # a bad config fails here, before the model loads
    from eval.bench.decode import DecodeSettings, run_decode_bench

    settings = DecodeSettings(tuple(contexts), tuple(batches), args.steps, args.repeats, args.warmup)
    say = human(args)
    summary = run_decode_bench(config, settings, log=say, peer=args.peer_llamacpp)
    say(f"{summary['model']} ({summary['dtype']}, {summary['device']}, {summary['torch_threads']} threads, "
        f"projections {summary['projections']}, decode kernel {summary['decode_kernel']}); CPU probe "
        f"{summary['probe_gflops_start']} -> {summary['probe_gflops_end']} GFLOP/s, widest spread of rounds "
        f"{summary['widest_spread']:.0%}")
    resident = summary["weights_resident_bytes"]
    say(f"weights: {summary['weights']} (kernel {summary['quant_kernel']}), {summary['weights_bytes_read_per_token'] / 1e6:.1f} "
        f"MB read a batch-1 token; resident {resident['total'] / 1e6:.0f} MB (model {resident['model'] / 1e6:.0f}, "
        f"dense copies {resident['dense_copies'] / 1e6:.0f}, blocks {resident['blocks'] / 1e6:.0f}, "
        f"packed blocks {resident['packed_blocks'] / 1e6:.0f})")
    return _timings_done(args, say, summary)


def _timings_done(args: argparse.Namespace, say: Any, summary: dict[str, Any]) -> int:
    """The end of a timing bench on a model: the random-weights caveat, the JSON line."""
    if summary["random_weights"]:
        say("random weights: these figures are timings only")
    if args.json:
        emit_json(summary)
    return 0


# --------------------------------------------------------------- workload
def _workload_settings(args: argparse.Namespace) -> Any:
    """The checked settings of `bench workload` (one-line ValueErrors naming the flag)."""
    from eval.bench.workload import WorkloadSettings

    modes = tuple(dict.fromkeys(check_mode(m) for m in csv_list(args.modes, "--modes")))
    if (args.passages is None) == (args.zipf is None):
        raise ValueError("give either --passages K (each question over its own first K passages) or --zipf ALPHA "
                         "--docs-per-request K (passages drawn by popularity over the whole corpus)")
    if (args.zipf is None) != (args.docs_per_request is None):
        raise ValueError("--zipf and --docs-per-request go together: popularity ALPHA and the passages per request")
    if args.clients is not None and args.rate is not None:
        raise ValueError("give either --clients N (closed loop) or --rate R (open loop, requests per second), not both")
    if args.cache_fraction is not None and not 0 < args.cache_fraction:
        raise ValueError(f"--cache-fraction must be > 0, got {args.cache_fraction}")
    return WorkloadSettings(
        dataset=args.dataset, requests=args.requests, modes=modes,
        codecs=tuple(_codecs(args.codecs)) if args.codecs else None, passages=args.passages, zipf=args.zipf,
        docs_per_request=args.docs_per_request, clients=args.clients if args.rate is None else None,
        rate=args.rate, seed=args.seed, cache_fraction=args.cache_fraction, fidelity_every=args.fidelity_every,
        ratio=args.ratio, max_new_tokens=args.max_new_tokens, split=args.split, limit=args.limit,
        field_map=args.field_map, passes=args.passes)


def cmd_workload(args: argparse.Namespace) -> int:
    if args.clients is None and args.rate is None:
        args.clients = 1
    settings = _workload_settings(args)
    if args.out:
        require_eval_extra("matplotlib")
        from eval.bench.workload import REPORT_FILES

        check_out_dir(args.out, REPORT_FILES)
    from blend.config import load_config

    config = load_config(args.config)  # a bad config fails here, before the model loads
    from eval.bench.workload import run_workload, write_report

    say = human(args)
    summary = run_workload(settings, config, log_line=say)
    if args.out:
        write_report(summary, Path(args.out))
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
    p.add_argument("--warmup", type=NON_NEGATIVE_INT, default=2, help="untimed steps per setting (default 2)")
    p.add_argument("--model", default=None, help="override the config's model, e.g. random:llama-3.2-1b (timing only)")
    p.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES, help="override the compute dtype (auto: "
                   "bfloat16 where the CPU or GPU computes it natively)")
    p.add_argument("--device", default=None, help="override the device: auto, cpu, cuda, cuda:<index>")
    p.add_argument("--weights", default=None, choices=("auto", "quantized", "dequantized"),
                   help="override which weights the linear layers read (config `weights`)")
    p.add_argument("--peer-llamacpp", default=None, metavar="PATH_TO_LLAMA_BENCH",
                   help="also run llama.cpp's llama-bench on the same GGUF at the same depths and threads")
    json_arg(p)
    p.set_defaults(func=cmd_decode)


def _register_workload(sub: Any) -> None:
    p = sub.add_parser("workload", help="a stream of RAG requests over a corpus larger than the cache: hit rate, "
                                        "misses, writes, evictions, TTFT and end-to-end latency per mode and codec")
    config_arg(p)
    p.add_argument("--dataset", required=True, metavar="PATH_OR_NAME",
                   help="any file or hub name `kvblend eval` reads; its passages are the corpus")
    p.add_argument("--split", default=None, help="dataset split")
    p.add_argument("--field-map", type=arg_type(parse_field_map), default=None, metavar="OURS=THEIRS,...",
                   help="rename source fields, e.g. question=query,answers=gold (as kvblend eval)")
    p.add_argument("--limit", type=POSITIVE_INT, default=None, help="first N usable examples of the dataset")
    p.add_argument("--passages", type=POSITIVE_INT, default=None, metavar="K",
                   help="each request: one question over its own first K passages")
    p.add_argument("--zipf", type=POSITIVE_FLOAT, default=None, metavar="ALPHA",
                   help="each request: --docs-per-request passages drawn with Zipf popularity ALPHA over the corpus")
    p.add_argument("--docs-per-request", type=POSITIVE_INT, default=None, metavar="K")
    p.add_argument("--clients", type=POSITIVE_INT, default=None, metavar="N",
                   help="closed loop: N clients, each sends its next request when the last one finished (default 1)")
    p.add_argument("--rate", type=POSITIVE_FLOAT, default=None, metavar="R",
                   help="open loop: Poisson arrivals at R requests per second (seeded)")
    p.add_argument("--requests", type=POSITIVE_INT, default=40, help="requests in the stream (default 40)")
    p.add_argument("--passes", type=POSITIVE_INT, default=1, metavar="N",
                   help="run the stream N times on the same store: pass 1 cold, later passes warm (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the stream and its arrivals (default 0)")
    p.add_argument("--modes", default="full,blend", help="modes, comma-separated (default full,blend)")
    p.add_argument("--codecs", default=None, metavar="C,...",
                   help="run every tier in each of these codecs (" + ", ".join(CODEC_NAMES)
                        + "); default: the tiers as configured")
    p.add_argument("--cache-fraction", type=POSITIVE_FLOAT, default=None, metavar="F",
                   help="set every budgeted tier's budget to F x the corpus' uncompressed KV")
    p.add_argument("--fidelity-every", type=int, default=0, metavar="N",
                   help="every N-th request also answered with full prefill: first-token KL samples (default 0: off)")
    p.add_argument("--ratio", type=RATIO, default=None, help="blend recompute ratio (default: the config's)")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=8, help="tokens generated per request (default 8)")
    json_arg(p)
    p.add_argument("--out", default=None, metavar="DIR",
                   help="write workload.json, workload.md, hit_rate_over_time.png and ttft_cdf.png here")
    p.set_defaults(func=cmd_workload)


def register(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks (load, ttft, resume, workload, serve, decode)")
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    _register_load(sub)
    _register_ttft(sub)
    _register_resume(sub)
    _register_workload(sub)
    serve.register_bench(sub)
    _register_decode(sub)
