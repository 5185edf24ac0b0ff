"""`kvblend bench workload`: a stream of RAG requests over a corpus larger than the cache, where
misses, writes and evictions count.

The corpus is every passage of a dataset `kvblend eval` reads. A request is a question with its
own first K passages (`passages`: the examples in a seeded order, cycled), or K passages drawn by
Zipf popularity over the whole corpus (`zipf`: the passages ranked in a seeded order, passage of
rank r drawn with weight r^-alpha, K distinct per request, asked with the question of the example
the first one comes from). Requests arrive from N clients in a closed loop (each sends its next
request when the last one finished) or in an open loop at R requests/s (Poisson, seeded).

Each (mode, codec) runs the same stream against a fresh engine over the same loaded model, with a
fresh, empty store: the config's tiers, every tier in that codec for documents and prefix blocks alike
(`codecs`; else as configured),
budgets scaled to `cache_fraction` of the corpus' uncompressed KV when asked (tiers that have a
budget: cpu, disk), disk tiers in a scratch directory beside the configured one, Redis tiers under
a namespace of their own (cleared afterwards). Cold misses are part of the run.

Requests run concurrently: `BlendEngine.generate` is called from every client thread at once and
the engine's scheduler interleaves their prefills and batches their decode steps. Per request: the
time it arrived, started (its first prefill step: arrival + the scheduler's `queued_s`) and finished;
its TTFT as a user sees it (waiting included: start - arrival + the engine's TTFT) and end to end;
its lookups and where they hit; the queue depth (requests submitted and not yet started: the
scheduler's waiting queue) and the store's write-behind queue at each arrival and completion. Every n-th request (`fidelity_every`) is also
answered with full prefill before the stream starts (full prefill reads nothing from the store:
the same answer whenever it runs), giving a first-token KL(full || mode) sample.

With `passes` > 1 each (mode, codec) runs the stream that many times on the same engine and
store: pass 1 starts cold, later passes find what the earlier ones stored (and evicted). Every
results row names its `pass`; its store counters are that pass's own (differences of the store's
counters), its hit rate and latencies those of that pass's requests. Blend rows also give how the
misses were paid (blend.planning.misses): `miss_compute_s` (compute spent on misses on the
requests' own paths), `harvested` (documents stored from the requests' own prefills), `miss_plans`
(requests per plan), `deduplicated` (misses served by another request's computation), and
`background_s` (the scheduler's recompute of harvested documents during that pass: all idle
time and `engine.scheduler.background_share` of busy time; `background_steps` of them) and
`harvested_left` (documents whose entries are still the harvested ones when the pass ends: waiting
for their standalone recompute, or dropped from its queue), beside `write_s` (seconds the store's writer spent encoding and
writing, per tier) and `bytes_written`.

Reading TTFT in a closed loop: each client's cycle is its request's TTFT (queue included) then
the rest of its answer (`after_first_token_mean_s`), so on a busy engine TTFT mean +
after_first_token_mean ~ clients / requests_per_s. A mode whose answers finish sooner after their
first token sends its next request sooner and waits longer for it: at the same requests/s its TTFT
mean rises. Compare modes' `requests_per_s` (the work per request) beside their TTFT; an open loop
(`rate`) has no such coupling.

`EngineGate` counts the requests submitted and can also hold them to one at a time in arrival order
(`SERIALIZE = True`: the engine as it was before its scheduler, for a comparison).

Hygiene (`eval.bench.common`): the load average is watched from start to end, and a CPU probe (a
fixed float32 matrix product) is timed at both ends (`probe_gflops_start` / `_end`; `unsteady` when
it moved by more than 25%): the modes run one after the other, so a machine that changed speed
between them skews their ratio. Each results row also has the probe's rate just before its pass
(`probe_gflops`): on a VM whose speed moves (seen: 189 -> 136 GFLOP/s over one run, with no
pattern a steady load explains), the rows say which pass ran on a slower machine. (The modes cannot take
turns pass by pass: two engines open at once keep two OpenMP pools, more threads than 2 cores,
which slows the one running; `blend.model.loading.in_own_thread`.)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.bench.common import LoadWatch, Steadiness, probe_gflops
from eval.results import save_figure, write_file

log = logging.getLogger(__name__)

SERIALIZE = False  # True: one request in the engine at a time, in arrival order (the scheduler batches otherwise)
REPORT_FILES = WORKLOAD_JSON, WORKLOAD_MD, HIT_RATE_PLOT, TTFT_CDF_PLOT = (
    "workload.json", "workload.md", "hit_rate_over_time.png", "ttft_cdf.png")
QUESTION_FOR_SIZING = "?"


# ---------------------------------------------------------------------------- the stream
@dataclass(frozen=True)
class WorkloadRequest:
    """One request of the stream: a question over passages; `arrival_s` after the start (open loop)."""

    index: int
    question: str
    passages: tuple[str, ...]
    arrival_s: float | None = None


def corpus(examples: Sequence[Any], passages: int | None = None) -> list[str]:
    """The distinct passages a stream can draw from, in first-seen order (each example's first
    `passages` when given)."""
    seen: dict[str, None] = {}
    for ex in examples:
        for p in ex.passages[:passages] if passages else ex.passages:
            seen.setdefault(p, None)
    return list(seen)


def request_stream(examples: Sequence[Any], requests: int, *, passages: int | None = None, zipf: float | None = None,
                   docs_per_request: int | None = None, seed: int = 0) -> list[WorkloadRequest]:
    """`requests` requests (see the module doc): with `passages`, each example's question over its
    first `passages` passages, examples in a seeded order, cycled; with `zipf` (and
    `docs_per_request`), passages drawn by popularity. Deterministic for a seed."""
    if not examples:
        raise ValueError("the dataset has no usable examples; check --dataset and --split")
    rng = random.Random(seed)
    if zipf is None:
        if passages is None:
            raise ValueError("give --passages K (each question over its own passages) or --zipf ALPHA "
                             "--docs-per-request K (passages drawn by popularity)")
        order = list(range(len(examples)))
        rng.shuffle(order)
        return [WorkloadRequest(i, examples[order[i % len(order)]].question,
                                tuple(examples[order[i % len(order)]].passages[:passages])) for i in range(requests)]
    if docs_per_request is None:
        raise ValueError("--zipf needs --docs-per-request K: the passages of one request")
    pool = corpus(examples)
    if docs_per_request > len(pool):
        raise ValueError(f"--docs-per-request {docs_per_request} is more than the {len(pool)} passages of the "
                         "dataset; ask for fewer")
    question_of: dict[str, str] = {}
    for ex in examples:
        for p in ex.passages:
            question_of.setdefault(p, ex.question)
    ranked = list(pool)
    rng.shuffle(ranked)  # popularity rank: a seeded order, unrelated to the dataset's own
    weights = [1.0 / (rank + 1) ** zipf for rank in range(len(ranked))]
    stream = []
    for i in range(requests):
        chosen: list[int] = []
        while len(chosen) < docs_per_request:
            pick = rng.choices(range(len(ranked)), weights)[0]
            if pick not in chosen:
                chosen.append(pick)
        docs = tuple(ranked[j] for j in chosen)
        stream.append(WorkloadRequest(i, question_of[docs[0]] or "What do these passages say?", docs))
    return stream


def poisson_arrivals(stream: Sequence[WorkloadRequest], rate: float, seed: int = 0) -> list[WorkloadRequest]:
    """The stream with open-loop arrival times: exponential gaps of mean 1/rate, seeded."""
    rng = random.Random(seed + 1)
    t = 0.0
    out = []
    for req in stream:
        t += rng.expovariate(rate)
        out.append(dataclasses.replace(req, arrival_s=t))
    return out


# --------------------------------------------------------------------------- the gate
class EngineGate:
    """Counts the requests submitted and not yet handed to the engine; with `serialize`, lets them
    in one at a time, in ticket (arrival) order."""

    def __init__(self, serialize: bool = SERIALIZE):
        self.serialize = serialize
        self._cond = threading.Condition()
        self._next = 0
        self.waiting = 0

    def arrive(self) -> int:
        """One more request submitted; returns the queue depth (submitted, not started)."""
        with self._cond:
            self.waiting += 1
            return self.waiting

    def enter(self, ticket: int) -> int:
        """Wait for `ticket`'s turn (when serialising); returns the queue depth after it started."""
        with self._cond:
            if self.serialize:
                self._cond.wait_for(lambda: self._next == ticket)
            self.waiting -= 1
            return self.waiting

    def leave(self) -> None:
        with self._cond:
            self._next += 1
            self._cond.notify_all()


# ------------------------------------------------------------------------ one run
@dataclass
class RequestRecord:
    """What one request of the stream did (times in seconds from the run's start)."""

    index: int
    arrival: float
    start: float
    end: float
    engine_ttft_s: float
    hits: int
    misses: int
    hits_by_tier: dict[str, int]
    misses_by_tier: dict[str, int]
    kl: float | None = None
    error: str | None = None
    miss_plan: str | None = None  # how its misses were paid (None: none missed)
    miss_compute_s: float = 0.0
    harvested: int = 0
    deduplicated: int = 0

    @property
    def ttft_s(self) -> float:
        """Time to first token as the user sees it: waiting for the engine, then its TTFT."""
        return self.start - self.arrival + self.engine_ttft_s

    @property
    def e2e_s(self) -> float:
        return self.end - self.arrival


@dataclass
class RunTrace:
    """Everything one (mode, codec) run recorded."""

    records: list[RequestRecord] = field(default_factory=list)
    queue_depth: list[tuple[float, int]] = field(default_factory=list)  # (time, requests waiting)
    write_queue: list[tuple[float, int]] = field(default_factory=list)  # (time, write-behind jobs queued)
    wall_s: float = 0.0


def run_stream(engine: Any, stream: Sequence[WorkloadRequest], *, mode: str, ratio: float | None,
               max_new_tokens: int, clients: int | None = None, references: dict[int, Any] | None = None,
               serialize: bool = SERIALIZE) -> RunTrace:
    """Send `stream` to `engine` in `mode`: from `clients` closed-loop clients, or at each request's
    `arrival_s` (open loop, when clients is None). `references`: full prefill results of the
    requests to sample first-token KL on. Side effects: the engine computes and stores KV."""
    from eval.metrics import kl_divergence

    gate = EngineGate(serialize)
    trace = RunTrace()
    # first-token log-probs to compare with the references once the stream is over: torch work on
    # the client threads would slow the engine's own (see BlendEngine.run_exclusive)
    sampled: dict[int, Any] = {}
    lock = threading.Lock()
    t0 = time.perf_counter()

    def now() -> float:
        return time.perf_counter() - t0

    def depth() -> int:
        """Requests submitted and not yet started: held by the gate, or waiting in the scheduler."""
        return gate.waiting + int(getattr(getattr(engine, "scheduler", None), "waiting", 0))

    def sample(t: float) -> None:
        with lock:
            trace.queue_depth.append((t, depth()))
            trace.write_queue.append((t, engine.store.pending_writes()))

    def serve(req: WorkloadRequest, arrival: float) -> None:
        gate.arrive()
        sample(arrival)
        gate.enter(req.index)
        entered = now()
        try:
            result = engine.generate(req.question, list(req.passages), mode=mode, recompute_ratio=ratio,
                                     max_new_tokens=max_new_tokens, temperature=0.0)
            error = None
        except Exception as err:  # noqa: BLE001 - one failed request is a row of the run, not its end
            result, error = None, f"{type(err).__name__}: {err}"
        finally:
            gate.leave()
        end = now()
        if result is None:
            record = RequestRecord(req.index, arrival, entered, end, end - entered, 0, 0, {}, {}, error=error)
        else:
            seg = result.stats.cached_segments
            if references and req.index in references and mode != "full":
                sampled[req.index] = result.first_token_logprobs
            start = entered + float(getattr(result.stats, "queued_s", 0.0))  # its first prefill step
            miss = result.stats.miss
            record = RequestRecord(req.index, arrival, start, end, result.ttft_s, seg.hits, seg.misses,
                                   dict(result.stats.hits_by_tier), dict(result.stats.misses_by_tier),
                                   miss_plan=miss.plan, miss_compute_s=miss.compute_s, harvested=miss.harvested,
                                   deduplicated=miss.deduplicated)
        sample(end)
        with lock:
            trace.records.append(record)

    threads: list[threading.Thread] = []
    if clients is not None:
        feed = iter(stream)
        feed_lock = threading.Lock()

        def client() -> None:
            while True:
                with feed_lock:  # the next request of the stream (its index is its ticket)
                    req = next(feed, None)
                    arrival = now()
                if req is None:
                    return
                serve(req, arrival)

        threads = [threading.Thread(target=client, name=f"kvblend-client-{i}", daemon=True) for i in range(clients)]
        for thread in threads:
            thread.start()
    else:
        for req in stream:
            assert req.arrival_s is not None
            delay = req.arrival_s - now()
            if delay > 0:
                time.sleep(delay)
            thread = threading.Thread(target=serve, args=(req, req.arrival_s), name=f"kvblend-request-{req.index}",
                                      daemon=True)
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()
    engine.store.flush()  # the write-behind work of the run is part of it
    trace.wall_s = now()
    trace.records.sort(key=lambda r: r.index)

    def score() -> None:  # on the engine's thread (this thread's own OpenMP pool would outlive the run)
        for record in trace.records:
            if record.index in sampled and references is not None:
                record.kl = kl_divergence(references[record.index].first_token_logprobs, sampled[record.index])

    if sampled:
        engine.run_exclusive(score)
    trace.queue_depth.sort()
    trace.write_queue.sort()
    return trace


# ------------------------------------------------------------------------ summaries
def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def hit_rate_series(records: Sequence[RequestRecord], window: int) -> list[float | None]:
    """Per request, the hit rate of the lookups of the last `window` requests (the cold start shows
    as its rise)."""
    out: list[float | None] = []
    for i in range(len(records)):
        part = records[max(0, i + 1 - window) : i + 1]
        total = sum(r.hits + r.misses for r in part)
        out.append(sum(r.hits for r in part) / total if total else None)
    return out


# store counters that add up over a run (a pass's own are differences); the others are levels
STORE_COUNTERS = ("lookup_hits", "lookup_misses", "bytes_read", "bytes_written", "puts", "evictions", "corrupt",
                  "errors", "write_s")


def store_delta(after: dict[str, dict], before: dict[str, dict] | None) -> dict[str, dict]:
    """Per tier, `after`'s counters less `before`'s (levels such as entries and bytes as they are)."""
    if before is None:
        return after
    out = {}
    for name, s in after.items():
        prior = before.get(name, {})
        out[name] = {k: (v - (prior.get(k) or 0) if k in STORE_COUNTERS and isinstance(v, (int, float)) else v)
                     for k, v in s.items()}
    return out


def summarize_run(trace: RunTrace, *, mode: str, codec: str, ratio: float | None, store: dict[str, dict],
                  io_block_bytes: dict[str, int], kv_block_tokens: int, window: int, pass_: int = 1,
                  background: tuple[int, float] = (0, 0.0), harvested_left: int = 0) -> dict[str, Any]:
    """One row of `results`: the run's (or one pass's) counters (from its requests and its store)
    and latencies."""
    done = [r for r in trace.records if r.error is None]
    hits, misses = sum(r.hits for r in done), sum(r.misses for r in done)
    ttfts, e2es = [r.ttft_s for r in done], [r.e2e_s for r in done]
    kls = [r.kl for r in done if r.kl is not None]
    series = hit_rate_series(done, window)
    tiers = {name: {k: s.get(k) for k in ("kind", "codec", "lookup_hits", "lookup_misses", "bytes_read",
                                           "bytes_written", "write_s", "puts", "evictions", "entries", "bytes_used",
                                           "budget", "corrupt", "errors")}
             for name, s in store.items()}
    for name, s in tiers.items():
        s["entry_bytes_mean"] = round(s["bytes_used"] / s["entries"]) if s.get("entries") else None
        s["io_block_bytes"] = io_block_bytes.get(name)
    first = next((x for x in series if x is not None), None)
    plans: dict[str, int] = {}
    for r in done:
        if r.miss_plan is not None:
            plans[r.miss_plan] = plans.get(r.miss_plan, 0) + 1
    return {
        "pass": pass_, "mode": mode, "codec": codec, "ratio": ratio if mode == "blend" else None,
        "requests": len(trace.records), "completed": len(done), "errors": [r.error for r in trace.records if r.error],
        "lookups": hits + misses, "hits": hits, "misses": misses, "misses_computed": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "hit_rate_first_window": first, "hit_rate_last_window": series[-1] if series else None,
        "hits_by_tier": _sum_dicts(r.hits_by_tier for r in done),
        "misses_by_tier": _sum_dicts(r.misses_by_tier for r in done),
        "tiers": tiers,
        "bytes_read": {n: s["bytes_read"] for n, s in tiers.items()},
        "bytes_written": {n: s["bytes_written"] for n, s in tiers.items()},
        "write_s": {n: round(s["write_s"] or 0.0, 4) for n, s in tiers.items()},
        "miss_compute_s": sum(r.miss_compute_s for r in done), "harvested": sum(r.harvested for r in done),
        "deduplicated": sum(r.deduplicated for r in done), "miss_plans": plans, "background_steps": background[0], "background_s": background[1],
        "harvested_left": harvested_left,
        "evictions": sum(s["evictions"] or 0 for s in tiers.values()),
        "write_queue_max": max((d for _, d in trace.write_queue), default=0),
        "queue_depth_max": max((d for _, d in trace.queue_depth), default=0),
        "io_block_bytes": list(io_block_bytes.values())[-1] if io_block_bytes else None,  # the last tier's reads
        "kv_block_tokens": kv_block_tokens,
        "ttft_mean_s": statistics.fmean(ttfts) if ttfts else None,
        "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
        "e2e_p50_s": percentile(e2es, 0.5), "e2e_p99_s": percentile(e2es, 0.99),
        "after_first_token_mean_s": statistics.fmean(e - t for e, t in zip(e2es, ttfts, strict=True)) if done else None,
        "engine_ttft_mean_s": statistics.fmean(r.engine_ttft_s for r in done) if done else None,
        "queue_wait_mean_s": statistics.fmean(r.start - r.arrival for r in done) if done else None,
        "requests_per_s": len(done) / trace.wall_s if trace.wall_s > 0 else None,
        "wall_s": trace.wall_s,
        "kl_mean": statistics.fmean(kls) if kls else None, "kl_samples": len(kls),
        "hit_rate_window": window, "hit_rate_series": series,
        "queue_depth_series": [[round(t, 4), d] for t, d in trace.queue_depth],
        "write_queue_series": [[round(t, 4), d] for t, d in trace.write_queue],
        "ttft_samples_s": ttfts,
    }


def _sum_dicts(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in items:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


# ----------------------------------------------------------------------- the bench
@dataclass(frozen=True)
class WorkloadSettings:
    """The command line of one `bench workload` (checked by the CLI)."""

    dataset: str
    requests: int
    modes: tuple[str, ...] = ("full", "blend")
    codecs: tuple[str, ...] | None = None  # None: the config's tiers as configured
    passages: int | None = None
    zipf: float | None = None
    docs_per_request: int | None = None
    clients: int | None = 1
    rate: float | None = None
    seed: int = 0
    cache_fraction: float | None = None
    fidelity_every: int = 0
    ratio: float | None = None
    max_new_tokens: int = 8
    split: str | None = None
    limit: int | None = None
    field_map: dict[str, str] | None = None
    passes: int = 1  # the stream run this many times on the same store (pass 1 cold)


def corpus_kv_bytes(engine: Any, passages: Sequence[str]) -> tuple[int, int]:
    """(tokens, bytes) of the uncompressed KV of `passages` as documents (storage dtype), with the
    system part once: what a cache holding all of it would need in `none`."""
    from storage.dtypes import dtype_bytes

    per_token = engine.lm.dims.kv_bytes_per_token(dtype_bytes(engine.kv_dtype))
    tokens = 0
    system = 0
    for text in passages:
        prompt = engine.build_prompt(QUESTION_FOR_SIZING, [text])
        system = len(prompt.prefix.token_ids)
        tokens += sum(len(s.token_ids) for s in prompt.segments if s.kind == "document")
    tokens += system
    return tokens, tokens * per_token


def run_store_config(store: Any, *, codec: str | None, budget: int | None, scratch: Path, namespace: str) -> Any:
    """The store of one run: `store`'s tiers in `codec` (when given: documents and exact entries,
    prefix blocks, alike), with `budget` (tiers that have one), disk tiers in `scratch`, under
    `namespace` (a fresh Redis key space)."""
    tiers = []
    for i, tier in enumerate(store.tiers):
        changes: dict[str, Any] = {}
        if codec is not None:
            changes["codec"] = changes["exact_codec"] = codec
        if budget is not None and hasattr(tier, "budget"):
            changes["budget"] = budget
        if tier.kind == "disk":
            changes["path"] = str(scratch / f"tier{i}")
        tiers.append(dataclasses.replace(tier, **changes))
    return dataclasses.replace(store, tiers=tuple(tiers), namespace=namespace)


def io_blocks(engine: Any) -> dict[str, int]:
    """Per tier (in stack order), the bytes of one read: one layer of a full block in the tier's codec."""
    from storage.stack import tier_codec

    dims, tokens = engine.lm.dims, engine.config.engine.blend.chunk_tokens
    return {t.name: tier_codec(t).layer_nbytes(dims.kv_heads, tokens, dims.head_dim, engine.kv_dtype)
            for t in engine.store.tiers}


def run_workload(settings: WorkloadSettings, config: Any, *, lm: Any = None,
                 log_line: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every (mode, codec) of `settings` over one stream; the summary JSON (see the module doc).
    `lm`: an already loaded model (the one `config` names)."""
    from blend.engine.engine import BlendEngine
    from blend.model.loading import load_model
    from eval.loaders import load_examples
    from storage.dtypes import dtype_bytes

    watch = LoadWatch.begin()
    steady = Steadiness.begin()  # the modes run one after the other: a machine that changed speed skews their ratio
    examples = load_examples(settings.dataset, split=settings.split, limit=settings.limit, field_map=settings.field_map)
    stream = request_stream(examples, settings.requests, passages=settings.passages, zipf=settings.zipf,
                            docs_per_request=settings.docs_per_request, seed=settings.seed)
    if settings.rate is not None:
        stream = poisson_arrivals(stream, settings.rate, settings.seed)
    pool = corpus(examples, None if settings.zipf is not None else settings.passages)
    if lm is None:
        lm = load_model(config.model, device=config.device, dtype=config.dtype)
    disk = next((t for t in config.store.tiers if t.kind == "disk"), None)
    parent = Path(disk.path).parent if disk is not None else None
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="kvblend-workload-", dir=parent))
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    try:
        sizing = BlendEngine(config.with_overrides(store=run_store_config(
            config.store, codec=None, budget=None, scratch=scratch / "sizing", namespace="sizing")), model=lm)
        try:
            corpus_tokens, corpus_bytes = corpus_kv_bytes(sizing, pool)
            sizing.warmup()
            references = _references(sizing, stream, settings)
        finally:
            sizing.close()
        budget = None
        if settings.cache_fraction is not None:
            budget = int(settings.cache_fraction * corpus_bytes)
            entry = lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) * config.engine.blend.chunk_tokens
            if budget < entry:
                raise ValueError(f"--cache-fraction {settings.cache_fraction:g} of the corpus' {corpus_bytes} bytes of KV "
                                 f"is {budget} bytes, less than one block entry ({entry} bytes); raise it")
        asked = sum(len(r.passages) for r in stream)  # documents over the stream ...
        distinct = len({p for r in stream for p in r.passages})  # ... the compulsory misses of any cache
        log_line(f"corpus: {len(pool)} passages, {corpus_tokens} tokens, {corpus_bytes / 2**20:.1f} MiB of KV "
                 f"uncompressed; {len(stream)} requests asking for {asked} passages, {distinct} distinct"
                 + (f"; tier budgets {budget / 2**20:.1f} MiB" if budget else ""))
        codecs: Sequence[str | None] = settings.codecs or (None,)
        run = 0
        for codec in codecs:
            for mode in settings.modes:
                run += 1
                store_cfg = run_store_config(config.store, codec=codec, budget=budget, scratch=scratch / f"run{run}",
                                             namespace=f"workload{run}x{int(time.time()) % 100000}")
                engine = BlendEngine(config.with_overrides(store=store_cfg), model=lm)
                try:
                    engine.warmup()  # full mode: nothing read from or written to the store
                    before = None
                    metrics = engine.scheduler.metrics
                    idle_before = (metrics.background_steps, metrics.background_s)
                    for pass_ in range(1, settings.passes + 1):
                        probe = probe_gflops(engine=engine)  # this pass's machine speed (modes and passes run in turn)
                        trace = run_stream(engine, stream, mode=mode, ratio=settings.ratio,
                                           max_new_tokens=settings.max_new_tokens, clients=settings.clients,
                                           references=references)
                        name = codec or "+".join(t.codec for t in store_cfg.tiers)
                        after = engine.store.stats()
                        row = summarize_run(trace, mode=mode, codec=name, ratio=settings.ratio
                                            if settings.ratio is not None else config.engine.blend.recompute_ratio,
                                            store=store_delta(after, before), io_block_bytes=io_blocks(engine),
                                            kv_block_tokens=config.engine.blend.chunk_tokens,
                                            window=max(5, len(stream) // 10), pass_=pass_,
                                            background=(metrics.background_steps - idle_before[0],
                                                        metrics.background_s - idle_before[1]),
                                            harvested_left=engine.document_kv.background.left)
                        row["probe_gflops"] = probe
                        before, idle_before = after, (metrics.background_steps, metrics.background_s)
                        rows.append(row)
                        log_line(f"{mode:>6} {row['codec']:<10} pass {pass_} hit rate {_fmt(row['hit_rate'])}  TTFT "
                                 f"mean {_fmt(row['ttft_mean_s'], 's')} p50 {_fmt(row['ttft_p50_s'], 's')} p99 "
                                 f"{_fmt(row['ttft_p99_s'], 's')}  e2e p50 {_fmt(row['e2e_p50_s'], 's')}  "
                                 f"{_fmt(row['requests_per_s'])} req/s  evictions {row['evictions']}  KL "
                                 f"{_fmt(row['kl_mean'])}  probe {probe} GFLOP/s" + (f"  misses: {row['miss_plans']}, harvested "
                                                              f"{row['harvested']}, compute "
                                                              f"{row['miss_compute_s']:.2f} s" if mode != "full" else ""))
                    engine.store.clear()
                finally:
                    engine.close()
        summary = {
            "dataset": settings.dataset, "settings": dataclasses.asdict(settings),
            "arrivals": "closed" if settings.rate is None else "open",
            "corpus_passages": len(pool), "corpus_tokens": corpus_tokens, "corpus_kv_bytes": corpus_bytes,
            "tier_budget": budget, "model": config.model, "device": config.device,
            # a document is a block or more: per-block lookups differ
            "stream_documents": asked, "distinct_documents": distinct,
            "serialized": SERIALIZE, "results": rows,
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary.update(watch.finish("workload benchmark"))
    summary.update(steady.finish({}, "workload benchmark"))
    return summary


def _references(engine: Any, stream: Sequence[WorkloadRequest], settings: WorkloadSettings) -> dict[int, Any]:
    """Full prefill results of every `fidelity_every`-th request (full mode touches no store)."""
    if settings.fidelity_every <= 0:
        return {}
    return {req.index: engine.generate(req.question, list(req.passages), mode="full", max_new_tokens=1,
                                       temperature=0.0)
            for req in stream if req.index % settings.fidelity_every == 0}


def _fmt(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.3f}{unit}"


# ------------------------------------------------------------------------- report
def write_report(summary: dict[str, Any], out: Path) -> None:
    """workload.json, workload.md, and the plots of hit rate over time and of TTFT CDFs under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    write_file(out / WORKLOAD_JSON, json.dumps(summary, indent=2))
    rows = summary["results"]
    lines = [f"{summary['dataset']}: {summary['corpus_passages']} passages ({summary['corpus_kv_bytes'] / 2**20:.1f} MiB "
             f"of KV uncompressed), {summary['settings']['requests']} requests, {summary['arrivals']} loop, tier "
             f"budget {summary['tier_budget']}", "",
             "| pass | mode | codec | hit rate | first / last window | evictions | TTFT mean s | p50 | p99 | e2e p50 "
             "| p99 | req/s | KL | harvested | miss compute s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('pass', 1)} | {r['mode']} | {r['codec']} | {_fmt(r['hit_rate'])} | "
                     f"{_fmt(r['hit_rate_first_window'])} / "
                     f"{_fmt(r['hit_rate_last_window'])} | {r['evictions']} | {_fmt(r['ttft_mean_s'])} | "
                     f"{_fmt(r['ttft_p50_s'])} | {_fmt(r['ttft_p99_s'])} | {_fmt(r['e2e_p50_s'])} | "
                     f"{_fmt(r['e2e_p99_s'])} | {_fmt(r['requests_per_s'])} | {_fmt(r['kl_mean'])} | "
                     f"{r.get('harvested', 0)} | {_fmt(r.get('miss_compute_s'))} |")
    write_file(out / WORKLOAD_MD, "\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        series = r["hit_rate_series"]
        ax.plot(range(1, len(series) + 1), [math.nan if x is None else x for x in series],
                label=_label(r, rows))
    ax.set_xlabel("request")
    ax.set_ylabel(f"hit rate (last {rows[0]['hit_rate_window'] if rows else 0} requests)")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / HIT_RATE_PLOT, dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in rows:
        values = sorted(r["ttft_samples_s"])
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post",
                label=_label(r, rows))
    ax.set_xlabel("TTFT s (waiting included)")
    ax.set_ylabel("fraction of requests")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out / TTFT_CDF_PLOT, dpi=120)
    plt.close(fig)


def _label(row: dict[str, Any], rows: Sequence[dict[str, Any]]) -> str:
    """A plot label: mode and codec, and the pass when the run has several."""
    several = any(r.get("pass", 1) > 1 for r in rows)
    return f"{row['mode']} {row['codec']}" + (f" pass {row.get('pass', 1)}" if several else "")
