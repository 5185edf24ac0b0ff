"""`kvblend bench ttft`: time-to-first-token of full prefill vs CacheBlend at several
recompute ratios, with chunk KV loaded from each storage tier.

Method: documents of `chunk_tokens` tokens are cut from the shipped sample text and
ingested into a store holding only the tier under test. After a warm-up, every repeat
runs full prefill and then blend at each (tier, ratio), interleaved, in one process;
medians are reported, and speedups are ratios within this run. The disk tier's files
are dropped from the page cache before each blend run (posix_fadvise) so reads are
real reads where the kernel honours it. `ideal_speedup` is the compute-bound bound:
the measured per-layer time of the full prefill weighted by the share of rows each
layer computes in blend.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from blend.stats import RequestStats
from eval.bench.common import drop_page_cache, one_tier_store
from storage.dtypes import dtype_bytes

log = logging.getLogger(__name__)

QUESTION = "Which of these passages mentions a railway, and in what year did it open?"


def bench_documents(tokenizer, n_chunks: int, chunk_tokens: int) -> list[str]:
    """`n_chunks` documents of just under `chunk_tokens` tokens each, cut from the sample text.

    A few tokens of headroom keep each document inside one chunk after its own
    tokenization (boundary tokens can merge differently).
    """
    from eval.samples import sample_documents

    ids: list[int] = []
    for _, text in sample_documents():
        ids += tokenizer(text, add_special_tokens=False).input_ids
    size = max(1, chunk_tokens - 8)
    while len(ids) < n_chunks * size:
        ids += ids
    return [tokenizer.decode(ids[i * size:(i + 1) * size]) for i in range(n_chunks)]


def layer_times_full(engine, prompt) -> tuple[float, list[float]]:
    """TTFT of a full prefill and the time spent in each layer (via the runner's hook)."""
    runner = engine.runner
    marks: list[float] = []
    cache = runner.new_cache(len(prompt))
    t0 = time.perf_counter()
    runner.prefill(torch.tensor(prompt.token_ids), cache, before_layer=lambda _layer: marks.append(time.perf_counter()))
    end = time.perf_counter()
    marks.append(end)
    return end - t0, [b - a for a, b in zip(marks, marks[1:], strict=False)]


def ideal_speedup(layer_s: list[float], rows_per_layer: list[int], n: int) -> float:
    """Full-prefill time over the compute-bound blend time sum_l t_l * rows_l / n."""
    ideal = sum(t * r / n for t, r in zip(layer_s, rows_per_layer, strict=True))
    return sum(layer_s) / ideal if ideal > 0 else float("inf")


def blend_rows_per_layer(stats: RequestStats, num_layers: int, n: int) -> list[int]:
    """Rows whose hidden states each layer computes in a blend run."""
    checks = stats.selection.check_layers
    q = stats.query_tokens
    if not checks:
        return [q] * num_layers
    rows = []
    current = n
    sel = dict(zip(checks, stats.selection.selected_per_layer, strict=False))
    for layer in range(num_layers):
        if layer in sel:
            current = sel[layer] + q
        rows.append(current)
    return rows


def run_ttft(args: argparse.Namespace) -> dict[str, Any]:
    from blend.config import load_config
    from blend.engine import BlendEngine
    from blend.model import load_model

    config = load_config(args.config, chunk_tokens=args.chunk_tokens)
    ratios = [float(r) for r in args.ratios.split(",")]
    tiers = [t for t in args.tiers.split(",") if t]
    lm = load_model(config.model, device=config.device, dtype=config.dtype)
    workdir = Path(tempfile.mkdtemp(prefix="kvblend-bench-"))
    engines: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for kind in tiers:
        try:
            store = one_tier_store(kind, dataclasses.replace(config.store, namespace="bench"),
                                   scratch=workdir / "disk", redis_url=args.redis_url,
                                   cluster_urls=[u for u in (args.cluster_urls or "").split(",") if u] or None)
            engines[kind] = BlendEngine(config.with_overrides(store=store), model=lm)
        except Exception as err:  # noqa: BLE001 - an unreachable tier becomes an error row, not a crash
            errors[kind] = f"{type(err).__name__}: {err}"
            log.warning("tier %s unavailable: %s", kind, err)
    if not engines:
        raise ValueError(f"no tier could be opened: {errors}")
    first = next(iter(engines.values()))
    docs = bench_documents(lm.tokenizer, args.chunks, args.chunk_tokens)
    prompt = first.build_prompt(QUESTION, docs)
    n = len(prompt)
    for engine in engines.values():
        engine.store.clear()
        engine.ingest(docs)
    # warm-up: one of each path
    first.generate(QUESTION, docs, mode="full", max_new_tokens=1)
    for engine in engines.values():
        engine.generate(QUESTION, docs, mode="blend", recompute_ratio=ratios[0], max_new_tokens=1)
    full_ttfts: list[float] = []
    layer_runs: list[list[float]] = []
    samples: dict[tuple[str, float], list[dict[str, Any]]] = {(k, r): [] for k in engines for r in ratios}
    dropped = False
    for _ in range(args.repeats):
        ttft, layer_s = layer_times_full(first, prompt)
        full_ttfts.append(ttft)
        layer_runs.append(layer_s)
        for kind, engine in engines.items():
            for ratio in ratios:
                if kind == "disk":
                    dropped = drop_page_cache(workdir / "disk") or dropped
                result = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=ratio, max_new_tokens=1)
                samples[(kind, ratio)].append(result.stats)
    full_ttft = statistics.median(full_ttfts)
    layer_s = [statistics.median(col) for col in zip(*layer_runs, strict=True)]
    num_layers = len(layer_s)
    entry_layer_bytes = lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) // num_layers
    results = []
    for (kind, ratio), runs in samples.items():
        ttft = statistics.median(r.ttft_s for r in runs)
        mid = sorted(runs, key=lambda r: r.ttft_s)[len(runs) // 2]
        loaded = mid.bytes_loaded
        results.append({
            "tier": kind, "ratio": ratio, "ttft_s": round(ttft, 4), "speedup": round(full_ttft / ttft, 3),
            "ideal_speedup": round(ideal_speedup(layer_s, blend_rows_per_layer(mid, num_layers, n), n), 3),
            "exposed_load_s": round(statistics.median(r.exposed_load_s for r in runs), 4),
            "load_s": round(statistics.median(r.load_s for r in runs), 4),
            "bytes_loaded": int(loaded),
            "load_gbps": round(loaded / mid.load_s / 1e9, 3) if mid.load_s > 0 else None,
            "recomputed_tokens": mid.recomputed_tokens, "hit_rate": round(mid.documents.hit_rate or 0.0, 3),
        })
    for kind, err in errors.items():
        results.append({"tier": kind, "error": err})
    for engine in engines.values():
        engine.close()
    return {
        "full_ttft_s": round(full_ttft, 4), "context_tokens": n, "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens, "io_block_bytes": entry_layer_bytes * args.chunk_tokens,
        "prefetch_depth": config.engine.prefetch_depth, "queue_depth": config.store.write_queue,
        "kv_dtype": config.store.kv_dtype, "repeats": args.repeats, "page_cache_dropped": dropped,
        "device": str(lm.device), "torch_threads": torch.get_num_threads(),
        "full_layer_ms": [round(t * 1000, 2) for t in layer_s], "results": results,
    }


def write_report(summary: dict[str, Any], out: Path) -> None:
    """summary.json, summary.md and two PNG plots under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "ttft.json").write_text(json.dumps(summary, indent=2))
    rows = [r for r in summary["results"] if "error" not in r]
    lines = [f"full prefill TTFT: {summary['full_ttft_s']:.3f} s over {summary['context_tokens']} tokens "
             f"({summary['chunks']} x {summary['chunk_tokens']}-token chunks, kv {summary['kv_dtype']}, "
             f"I/O block {summary['io_block_bytes']} B, prefetch depth {summary['prefetch_depth']})", "",
             "| tier | ratio | TTFT s | speedup | ideal | exposed load s | load s | bytes loaded | load GB/s | hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['ratio']} | {r['ttft_s']:.3f} | {r['speedup']:.2f} | {r['ideal_speedup']:.2f} | "
                     f"{r['exposed_load_s']:.3f} | {r['load_s']:.3f} | {r['bytes_loaded']} | {r['load_gbps']} | {r['hit_rate']} |")
    for r in summary["results"]:
        if "error" in r:
            lines.append(f"\n{r['tier']}: {r['error']}")
    (out / "ttft.md").write_text("\n".join(lines) + "\n")
    tiers = sorted({r["tier"] for r in rows})
    fig, ax = plt.subplots(figsize=(6, 4))
    for tier in tiers:
        pts = sorted((r["ratio"], r["ttft_s"]) for r in rows if r["tier"] == tier)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"blend ({tier})")
    ax.axhline(summary["full_ttft_s"], color="black", linestyle="--", label="full prefill")
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel("TTFT (s)")
    ax.set_title(f"TTFT, {summary['context_tokens']} context tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_ratio.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for tier in tiers:
        pts = sorted((r["ratio"], r["speedup"], r["ideal_speedup"]) for r in rows if r["tier"] == tier and r["ratio"] > 0)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"measured ({tier})")
    pts = sorted({(r["ratio"], r["ideal_speedup"]) for r in rows if r["ratio"] > 0 and r["tier"] == tiers[0]})
    ax.plot([p[0] for p in pts], [p[1] for p in pts], color="black", linestyle=":", label="ideal (compute-bound)")
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel("speedup over full prefill")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_ideal.png", dpi=120)
    plt.close(fig)
