"""`kvblend bench ttft`: time-to-first-token of full prefill vs CacheBlend at several
recompute ratios, with chunk KV loaded from each storage tier.

Method: documents of `chunk_tokens` tokens are cut from the shipped sample text and
ingested into a store holding only the tier under test. After a warm-up, every repeat
runs full prefill and then blend at each (tier, ratio), interleaved, in one process;
medians are reported, and speedups are ratios within this run. The disk tier's files
are dropped from the page cache before each blend run (posix_fadvise) so reads are
real reads where the kernel honours it. Two compute-bound references per blend row:
`ideal_speedup` weights the measured per-layer time of the full prefill by the share of
rows each layer computes in blend (as if a row cost the same wherever it sits);
`bound_speedup` also prices attention by the (query, key) pairs it computes: each full
prefill layer's time is split into attention (timed on its own over the same keys) and
the rest (linear layers, per row); blend's rows, with their positions, and the query
pass's rows pay the full prefill's rate for each. A row late in the prompt attends over
more keys, so a selection that favours late rows is bounded below `ideal_speedup`; what
`bound_speedup` leaves out is only overhead (selection, masks, small-matrix efficiency,
loads).

Hygiene: two untimed full prefills and one untimed blend per (tier, ratio) first; each
TTFT is reported as the median with min and max over the repeats; the load average at
start and end is recorded and `contended: true` (plus a warning line) marks a run taken
while it exceeded the core count; `unsteady: true` (plus a warning line) marks a run whose
repeats of one setting spread by more than 25% or whose CPU probe (`probe_gflops_start` /
`_end`: a fixed float32 matrix product) moved by as much. `--model random:<shape>` runs a random-weight model
(timing only: `random_weights: true` in the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from blend.stats import RequestStats
from eval.bench.common import LoadWatch, Steadiness, drop_page_cache, one_tier_store, spread
from eval.results import save_figure, write_file
from storage.dtypes import dtype_bytes

log = logging.getLogger(__name__)

QUESTION = "Which of these passages mentions a railway, and in what year did it open?"
REPORT_FILES = TTFT_JSON, TTFT_MD, TTFT_PLOT, SPEEDUP_PLOT = (
    "ttft.json", "ttft.md", "ttft_vs_ratio.png", "speedup_vs_ideal.png")  # what write_report writes under --out


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


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work before reading the clock (nothing to wait for on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layer_times_full(engine, prompt) -> tuple[float, list[float]]:
    """TTFT of a full prefill and the time spent in each layer (via the runner's hook).

    On CUDA the layer times come from a second prefill synchronised before every layer;
    the TTFT is that of a plain one (synchronised at the end only), as a request runs.
    Use `attention_time` for the attention part of a layer."""
    runner = engine.runner
    ids = torch.tensor(prompt.token_ids)
    cuda = runner.device.type == "cuda"
    marks: list[float] = []

    class Marks:  # a LayerWaiter: the time each layer starts (once per layer, whatever pieces the prompt is cut in)
        def __init__(self) -> None:
            self.seen: set[int] = set()

        def wait(self, layer: int) -> None:
            if layer not in self.seen:
                self.seen.add(layer)
                _sync(runner.device)
                marks.append(time.perf_counter())

    def timed(hook: Marks | None) -> tuple[float, float]:
        cache = runner.new_cache(len(prompt))
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.prefill(ids, cache, loads=hook)
        _sync(runner.device)
        return t0, time.perf_counter()

    t0, end = timed(Marks() if not cuda else None)
    ttft = end - t0
    if cuda:
        _, end = timed(Marks())
    marks.append(end)
    return ttft, [b - a for a, b in zip(marks, marks[1:], strict=False)]


def attention_time(engine, prompt, repeats: int = 3) -> float:
    """Seconds one layer of a full prefill of `prompt` spends in attention: every row over
    its causal keys, timed alone (the median of `repeats`, as the layer times are) on random
    queries, keys and values of the model's shapes (its cost depends on the shapes only)."""
    runner = engine.runner
    n = len(prompt)
    gen = torch.Generator(device=runner.device).manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn((heads, n, runner.head_dim), generator=gen, device=runner.device, dtype=runner.dtype)

    q, k, v = rand(runner.num_heads), rand(runner.kv_heads), rand(runner.kv_heads)
    positions = torch.arange(n)

    def once() -> float:
        _sync(runner.device)
        t0 = time.perf_counter()
        runner.attend(q, positions, k, v)
        _sync(runner.device)
        return time.perf_counter() - t0

    with torch.inference_mode():
        once()  # plans and warms up
        return statistics.median(once() for _ in range(repeats))


def ideal_speedup(layer_s: list[float], rows_per_layer: list[int], n: int) -> float:
    """Full-prefill time over the compute-bound blend time sum_l t_l * rows_l / n."""
    ideal = sum(t * r / n for t, r in zip(layer_s, rows_per_layer, strict=True))
    return sum(layer_s) / ideal if ideal > 0 else float("inf")


def causal_pairs(rows: torch.Tensor) -> int:
    """(query, key) pairs that rows at positions `rows` (R,) attend over: sum of (p + 1)."""
    return int((rows.long() + 1).sum())


def bound_speedup(layer_s: list[float], attention_s: list[float], work: list[tuple[int, int]], n: int) -> float:
    """Full-prefill time over blend's compute-bound time with attention priced per pair.

    layer_s: each layer's full-prefill time; attention_s: the attention part of it; work:
    per layer, the rows blend computes there and the (query, key) pairs they attend over
    (`blend_work`). A full prefill layer computes n rows over n(n+1)/2 pairs, except the
    last, which attends only its last row. Each blend layer costs (layer - attention) x
    rows / n + attention x pairs / (the full layer's pairs)."""
    total = 0.0
    last = len(layer_s) - 1
    for layer, (t, attn, (rows, pairs)) in enumerate(zip(layer_s, attention_s, work, strict=True)):
        full_pairs = n if layer == last else n * (n + 1) // 2
        attn = min(attn, t)
        total += (t - attn) * rows / n + attn * pairs / full_pairs
    return sum(layer_s) / total if total > 0 else float("inf")


def always_computed(stats: RequestStats, n: int) -> torch.Tensor:
    """Positions (R,) a blend run computes whatever it selects: the split's computed prefix
    and the query rows (the rows a query pass runs)."""
    return torch.cat([torch.arange(stats.split.computed_tokens), torch.arange(stats.context_tokens, n)])


def blend_rows(stats: RequestStats, num_layers: int, n: int) -> list[torch.Tensor]:
    """Per layer, the positions (R,) whose hidden states a blend run computes there (the
    query pass not counted), from the request's statistics.

    A plan without a selection computes only the query rows and the split's computed
    prefix (reuse), or every row when it loads nothing (ratio 1); a selection keeps
    `selected_rows[i]` (plus the query and the computed prefix) from check layer i on,
    every row before the first check layer."""
    sel = stats.selection
    base = always_computed(stats, n)
    if not sel.check_layers:
        return [torch.arange(n) if stats.loaded_tokens == 0 else base] * num_layers
    starts = dict(zip(sel.check_layers, sel.selected_rows, strict=False))
    current = torch.arange(n)
    plan = []
    for layer in range(num_layers):
        if layer in starts:
            current = torch.cat([starts[layer].long(), base]).unique(sorted=True)
        plan.append(current)
    return plan


def blend_rows_per_layer(stats: RequestStats, num_layers: int, n: int) -> list[int]:
    """How many rows each layer computes in a blend run (`blend_rows`; the query pass's rows
    not counted: `ideal_speedup`'s definition)."""
    return [int(rows.numel()) for rows in blend_rows(stats, num_layers, n)]


def blend_work(stats: RequestStats, num_layers: int, n: int, query_layers: int = 0) -> list[tuple[int, int]]:
    """Per layer, the rows a blend run computes (`blend_rows`) and the (query, key) pairs they
    attend over. A query pass (selection `query`) adds the query rows and the split's computed
    prefix over its `query_layers` (0: every layer). The last layer attends only the last row
    (its K/V are computed for every kept row)."""
    base = always_computed(stats, n)
    passes = num_layers if query_layers <= 0 else min(query_layers, num_layers)
    work = []
    for layer, rows in enumerate(blend_rows(stats, num_layers, n)):
        count = int(rows.numel())
        pairs = n if layer == num_layers - 1 else causal_pairs(rows)
        if stats.selection.query_pass and layer < passes:
            count += int(base.numel())
            pairs += causal_pairs(base)
        work.append((count, pairs))
    return work


def bench_config(args: argparse.Namespace):
    """The engine config of a run: the YAML file with the command line's overrides
    (chunk tokens; model, dtype, device and kv dtype when given)."""
    from blend.config import load_config

    overrides: dict[str, Any] = {"chunk_tokens": args.chunk_tokens}
    for name in ("model", "dtype", "device"):
        if getattr(args, name, None):
            overrides[name] = getattr(args, name)
    config = load_config(args.config, **overrides)
    if getattr(args, "kv_dtype", None):
        config = config.with_overrides(store=dataclasses.replace(config.store, kv_dtype=args.kv_dtype))
    return config


def run_ttft(args: argparse.Namespace, lm: Any = None) -> dict[str, Any]:
    """Measure full prefill against blend per (tier, ratio); see the module doc. `lm`: an
    already loaded model to reuse (it must be the one the config names)."""
    from blend.engine.engine import BlendEngine
    from blend.model.loading import load_model

    watch = LoadWatch.begin()
    steady = Steadiness.begin()
    config = bench_config(args)
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]  # as the CLI checked them
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if lm is None:
        lm = load_model(config.model, device=config.device, dtype=config.dtype, weights=config.weights)
    tokens = args.chunks * args.chunk_tokens
    if tokens + 64 > lm.dims.max_positions:  # the documents plus the system part and the question
        raise ValueError(f"--chunks {args.chunks} x --chunk-tokens {args.chunk_tokens} = {tokens} tokens does not fit "
                         f"the model's {lm.dims.max_positions} positions with a question; use fewer or smaller chunks")
    workdir = Path(tempfile.mkdtemp(prefix="kvblend-bench-"))
    entry_bytes = lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) * args.chunk_tokens
    budget = max(2 << 30, int(entry_bytes * (args.chunks + 2) * 1.25))  # every chunk fits its tier
    engines: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        for kind in tiers:
            try:
                store = one_tier_store(kind, dataclasses.replace(config.store, namespace="bench"),
                                       scratch=workdir / "disk", redis_url=args.redis_url, budget=budget,
                                       cluster_urls=[u for u in (args.cluster_urls or "").split(",") if u] or None)
                engines[kind] = BlendEngine(config.with_overrides(store=store), model=lm)
            except Exception as err:  # noqa: BLE001 - an unreachable tier becomes an error row, not a crash
                errors[kind] = f"{type(err).__name__}: {err}"
                log.warning("tier %s unavailable: %s", kind, err)
        if not engines:
            raise ValueError(f"no tier could be opened: {errors}")
        summary = _measure(args, config, lm, engines, ratios, workdir)
    finally:
        for engine in engines.values():
            engine.close()
        shutil.rmtree(workdir, ignore_errors=True)
    for kind, err in errors.items():
        summary["results"].append({"tier": kind, "error": err})
    summary.update(watch.finish("ttft benchmark"))
    spreads = {"full prefill": (summary["full_ttft_s"], summary["full_ttft_min_s"], summary["full_ttft_max_s"])}
    spreads |= {f"{r['tier']} r={r['ratio']}": (r["ttft_s"], r["ttft_min_s"], r["ttft_max_s"])
                for r in summary["results"] if "error" not in r}
    summary.update(steady.finish(spreads, "ttft benchmark"))
    return summary


def _measure(args: argparse.Namespace, config: Any, lm: Any, engines: dict[str, Any], ratios: list[float],
             workdir: Path) -> dict[str, Any]:
    first = next(iter(engines.values()))
    docs = bench_documents(lm.tokenizer, args.chunks, args.chunk_tokens)
    prompt = first.build_prompt(QUESTION, docs)
    n = len(prompt)
    for engine in engines.values():
        engine.store.clear()
        engine.ingest(docs)
    # warm-up: every path once (kernels, allocator, pinned pools, the engine's cost model), not timed
    for _ in range(2):
        first.run_exclusive(lambda: layer_times_full(first, prompt))  # on the model's thread: see run_exclusive
        first.generate(QUESTION, docs, mode="full", max_new_tokens=1)
    for kind, engine in engines.items():
        for ratio in ratios:
            if kind == "disk":
                drop_page_cache(workdir / "disk")
            engine.generate(QUESTION, docs, mode="blend", recompute_ratio=ratio, max_new_tokens=1)
    full_ttfts: list[float] = []
    layer_runs: list[list[float]] = []
    samples: dict[tuple[str, float], list[Any]] = {(k, r): [] for k in engines for r in ratios}
    dropped = False
    for _ in range(args.repeats):
        ttft, layer_s = first.run_exclusive(lambda: layer_times_full(first, prompt))
        full_ttfts.append(ttft)
        layer_runs.append(layer_s)
        for kind, engine in engines.items():
            for ratio in ratios:
                if kind == "disk":
                    dropped = drop_page_cache(workdir / "disk") or dropped
                result = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=ratio, max_new_tokens=1)
                samples[(kind, ratio)].append(result.stats)
    full = spread(full_ttfts)
    full_ttft = full["median"]
    layer_s = [statistics.median(col) for col in zip(*layer_runs, strict=True)]
    num_layers = len(layer_s)
    attn = first.run_exclusive(lambda: attention_time(first, prompt))
    attention_s = [attn] * (num_layers - 1) + [0.0]  # the last layer attends one row
    entry_layer_bytes = lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) // num_layers
    results = []
    for (kind, ratio), runs in samples.items():
        ttfts = spread([r.ttft_s for r in runs])
        ttft = ttfts["median"]
        mid = sorted(runs, key=lambda r: r.ttft_s)[len(runs) // 2]
        loaded = mid.bytes_loaded
        results.append({
            "tier": kind, "ratio": ratio, "ttft_s": round(ttft, 4), "ttft_min_s": ttfts["min"],
            "ttft_max_s": ttfts["max"], "speedup": round(full_ttft / ttft, 3),
            "ideal_speedup": round(ideal_speedup(layer_s, blend_rows_per_layer(mid, num_layers, n), n), 3),
            "bound_speedup": round(bound_speedup(layer_s, attention_s,
                                                 blend_work(mid, num_layers, n, config.engine.blend.selection.query_layers), n), 3),
            "exposed_load_s": round(statistics.median(r.exposed_load_s for r in runs), 4),
            "load_s": round(statistics.median(r.load_s for r in runs), 4),
            "bytes_loaded": int(loaded),
            "load_gbps": round(loaded / mid.load_s / 1e9, 3) if mid.load_s > 0 else None,
            "load_copies": mid.load.copies,
            "recomputed_tokens": mid.recomputed_tokens, "hit_rate": round(mid.documents.hit_rate or 0.0, 3),
            "split_taken": sum(r.split.taken for r in runs), "split_computed_tokens": mid.split.computed_tokens,
            "split_reason": mid.split.reason,
        })
    return {
        "full_ttft_s": round(full_ttft, 4), "full_ttft_min_s": full["min"], "full_ttft_max_s": full["max"],
        "context_tokens": n, "chunks": args.chunks,
        "chunk_tokens": args.chunk_tokens, "io_block_bytes": entry_layer_bytes * args.chunk_tokens,
        "prefetch_depth": config.engine.blend.prefetch_depth, "queue_depth": config.store.write_queue,
        "kv_dtype": config.store.kv_dtype, "repeats": args.repeats, "page_cache_dropped": dropped,
        "model": config.model, "random_weights": bool(getattr(lm, "random_weights", False)),
        "dtype": str(lm.dtype).removeprefix("torch."), "split": config.engine.blend.split,
        "device": str(lm.device), "device_name": _device_name(lm.device), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # which attention blend's rows ran on (a CPU: the native kernel, or torch's where it is off)
        "blend_attention": "native" if any(getattr(e.runner, "native_blend", False) for e in engines.values())
        else "torch",
        "full_layer_ms": [round(t * 1000, 2) for t in layer_s], "attention_layer_ms": round(attn * 1000, 2),
        "results": results,
    }


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return platform.processor() or platform.machine()


def write_report(summary: dict[str, Any], out: Path) -> None:
    """summary.json, summary.md and two PNG plots under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    write_file(out / TTFT_JSON, json.dumps(summary, indent=2))
    rows = [r for r in summary["results"] if "error" not in r]
    lines = [f"full prefill TTFT: {summary['full_ttft_s']:.3f} s over {summary['context_tokens']} tokens "
             f"({summary['chunks']} x {summary['chunk_tokens']}-token chunks, kv {summary['kv_dtype']}, "
             f"I/O block {summary['io_block_bytes']} B, prefetch depth {summary['prefetch_depth']})", "",
             "| tier | ratio | TTFT s | speedup | ideal | bound | exposed load s | load s | bytes loaded | load GB/s | hit rate |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tier']} | {r['ratio']} | {r['ttft_s']:.3f} | {r['speedup']:.2f} | {r['ideal_speedup']:.2f} | "
                     f"{r['bound_speedup']:.2f} | "
                     f"{r['exposed_load_s']:.3f} | {r['load_s']:.3f} | {r['bytes_loaded']} | {r['load_gbps']} | {r['hit_rate']} |")
    for r in summary["results"]:
        if "error" in r:
            lines.append(f"\n{r['tier']}: {r['error']}")
    write_file(out / TTFT_MD, "\n".join(lines) + "\n")
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
    save_figure(fig, out / TTFT_PLOT, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for tier in tiers:
        pts = sorted((r["ratio"], r["speedup"], r["ideal_speedup"]) for r in rows if r["tier"] == tier and r["ratio"] > 0)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"measured ({tier})")
    pts = sorted({(r["ratio"], r["ideal_speedup"], r["bound_speedup"]) for r in rows
                  if r["ratio"] > 0 and r["tier"] == tiers[0]})
    ax.plot([p[0] for p in pts], [p[1] for p in pts], color="black", linestyle=":", label="ideal (rows only)")
    ax.plot([p[0] for p in pts], [p[2] for p in pts], color="gray", linestyle="--",
            label="bound (rows + attention pairs)")
    ax.set_xlabel("recompute ratio")
    ax.set_ylabel("speedup over full prefill")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out / SPEEDUP_PLOT, dpi=120)
    plt.close(fig)
