"""Prometheus metrics of one server (its own registry, exposed at GET /metrics).

Requests are counted by endpoint, mode and HTTP status (499: the client went away).
Cache lookups are counted per tier in segments (a document chunk, the system part or
a prefix block: what `RequestStats` counts), next to the token totals (prompt,
context, loaded, recomputed, generated) and the bytes read per tier. The scheduler's
state is read at scrape time: running and waiting sequences, the decode batch sizes
(a histogram over decode steps), preemptions and resumes, output tokens per second.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from blend.engine.scheduler import Scheduler
from blend.stats import LOOKUP_KINDS, RequestStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    """The server's counters, histograms and gauges."""

    def __init__(self, scheduler: Scheduler, queue_size: int):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("kvblend_requests", "HTTP requests by endpoint, mode and status code",
                                ["endpoint", "mode", "status"], registry=r)
        self.ttft = Histogram("kvblend_ttft_seconds", "Time to first token (engine prefill) by mode", ["mode"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvblend_request_seconds", "End-to-end request time in the server (queue + prefill "
                             "+ decode) by mode", ["mode"], buckets=LATENCY_BUCKETS, registry=r)
        self.queued = Histogram("kvblend_queue_wait_seconds", "Time a request waited for the engine",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvblend_prompt_tokens", "Prompt tokens of finished requests", ["mode"],
                                     registry=r)
        self.generated_tokens = Counter("kvblend_generated_tokens", "Generated tokens (incl. cancelled requests)",
                                        ["mode"], registry=r)
        self.context_tokens = Counter("kvblend_context_tokens", "Cacheable context tokens (before the query)",
                                      ["mode"], registry=r)
        self.loaded_tokens = Counter("kvblend_loaded_tokens", "Context tokens whose KV was placed from a cache "
                                     "entry", ["mode"], registry=r)
        self.recomputed_tokens = Counter("kvblend_recomputed_tokens", "Context tokens computed in the request",
                                         ["mode"], registry=r)
        self.lookups = Counter("kvblend_cache_lookups", "Cached-segment lookups by kind (documents, system, "
                               "prefix_blocks) and result (hit, miss)", ["kind", "result"], registry=r)
        self.tier_hits = Counter("kvblend_cache_tier_hits", "Segments found in a tier", ["tier"], registry=r)
        self.tier_misses = Counter("kvblend_cache_tier_misses", "Segments not found in a tier (found below it, "
                                   "or nowhere)", ["tier"], registry=r)
        self.loaded_bytes = Counter("kvblend_loaded_bytes", "KV bytes read per tier", ["tier"], registry=r)
        self.load_seconds = Counter("kvblend_load_seconds", "Time spent loading KV (overlapped with compute)",
                                    registry=r)
        self.exposed_load_seconds = Counter("kvblend_exposed_load_seconds", "Time compute waited for a KV load",
                                            registry=r)
        self.documents = Counter("kvblend_documents_ingested", "Documents ingested, by whether they were cached",
                                 ["cached"], registry=r)
        depth = Gauge("kvblend_queue_depth", "Requests waiting for or running on the engine", registry=r)
        depth.set_function(lambda: float(scheduler.depth()))
        capacity = Gauge("kvblend_queue_capacity", "Requests that may wait for the engine", registry=r)
        capacity.set(queue_size)
        running = Gauge("kvblend_running_sequences", "Sequences in the decode batch", registry=r)
        running.set_function(lambda: float(scheduler.running))
        waiting = Gauge("kvblend_waiting_requests", "Requests queued for the scheduler (preempted ones too)",
                        registry=r)
        waiting.set_function(lambda: float(scheduler.waiting))
        active = Gauge("kvblend_active_kv_bytes", "KV bytes the running sequences hold on the compute device",
                       registry=r)
        active.set_function(lambda: float(scheduler.active_kv_bytes()))
        rate = Gauge("kvblend_output_tokens_per_second", "Generated tokens per second over the last 10 s",
                     registry=r)
        rate.set_function(lambda: scheduler.metrics.tokens_per_s())
        r.register(_SchedulerCollector(scheduler))

    def request(self, endpoint: str, mode: str, status: int) -> None:
        self.requests.labels(endpoint, mode, str(status)).inc()

    def finished(self, stats: RequestStats, prompt_tokens: int, e2e_s: float, queued_s: float) -> None:
        """Record one finished generation."""
        mode = stats.mode
        self.ttft.labels(mode).observe(stats.ttft_s)
        self.e2e.labels(mode).observe(e2e_s)
        self.queued.observe(queued_s)
        self.prompt_tokens.labels(mode).inc(prompt_tokens)
        self.generated_tokens.labels(mode).inc(stats.new_tokens)
        self.context_tokens.labels(mode).inc(stats.context_tokens)
        self.loaded_tokens.labels(mode).inc(stats.loaded_tokens)
        self.recomputed_tokens.labels(mode).inc(stats.recomputed_tokens)
        for kind in LOOKUP_KINDS:
            counts = getattr(stats, kind)
            self.lookups.labels(kind, "hit").inc(counts.hits)
            self.lookups.labels(kind, "miss").inc(counts.misses)
        for tier, n in stats.hits_by_tier.items():
            self.tier_hits.labels(tier).inc(n)
        for tier, n in stats.misses_by_tier.items():
            self.tier_misses.labels(tier).inc(n)
        for tier, n in stats.load.bytes_by_tier.items():
            self.loaded_bytes.labels(tier).inc(n)
        self.load_seconds.inc(stats.load.load_s)
        self.exposed_load_seconds.inc(stats.load.exposed_load_s)

    def cancelled(self, mode: str, generated_tokens: int) -> None:
        """Tokens generated by a request that did not finish."""
        self.generated_tokens.labels(mode).inc(generated_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _SchedulerCollector(Collector):
    """The scheduler's counters, read when /metrics is scraped (its thread never touches the registry)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler

    def collect(self) -> Iterator[HistogramMetricFamily | CounterMetricFamily]:
        m = self.scheduler.metrics
        sizes = dict(m.batch_sizes)
        buckets, seen = [], 0
        for bound in BATCH_BUCKETS:
            seen = sum(n for size, n in sizes.items() if size <= bound)
            buckets.append((str(float(bound)), seen))
        buckets.append(("+Inf", sum(sizes.values())))
        yield HistogramMetricFamily("kvblend_decode_batch_size", "Sequences per decode step",
                                    buckets=buckets, sum_value=sum(size * n for size, n in sizes.items()))
        yield CounterMetricFamily("kvblend_preemptions", "Sequences whose KV was parked in the tiers to make room",
                                  value=m.preemptions)
        yield CounterMetricFamily("kvblend_resumes", "Preempted sequences resumed", value=m.resumes)
        yield CounterMetricFamily("kvblend_resume_seconds", "Time spent resuming preempted sequences",
                                  value=m.resume_s)
        yield CounterMetricFamily("kvblend_decode_steps", "Decode steps run", value=m.decode_steps)
        yield CounterMetricFamily("kvblend_decode_step_seconds",
                                  "Forward time of the decode steps that carried no prefill work",
                                  value=m.decode_only_s)
        yield CounterMetricFamily("kvblend_prefill_chunks", "Steps that ran a chunk of a prefill's rows",
                                  value=m.prefill_chunks)
        yield CounterMetricFamily("kvblend_decode_rows_in_prefill_steps",
                                  "Decode rows computed in the same pass as a prefill chunk",
                                  value=m.decode_rows_in_prefill_steps)
        busy = CounterMetricFamily("kvblend_scheduler_busy_seconds", "Time the scheduler spent in each kind of step",
                                   labels=["step"])
        busy.add_metric(["prefill"], m.prefill_s)
        busy.add_metric(["decode"], m.decode_s)
        yield busy
