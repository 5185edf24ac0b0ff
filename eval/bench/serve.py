"""`kvblend bench serve`: RAG requests through the real HTTP server at several levels of
concurrency and scheduler settings, and the server's TTFT against the in-process API's.

With `max_num_seqs` (e.g. 1,8) the same requests run under each setting in one run, one
server per setting (`kvblend serve --max-num-seqs N`); every level's row names its
setting, the decode steps' mean batch size and the preemptions the server counted during
that level (its /metrics, read before and after).

Method: a `kvblend serve` process is started on a free loopback port (or `--url` names a
running one) and the fixed document pool (the shipped sample documents, optionally cut
to `doc_chars`) is ingested through POST /v1/documents. Every request is a streamed chat
completion over `docs_per_request` documents of the pool (a fixed, seeded choice) and one
of the sample questions. For each number of clients, that many threads send `requests`
requests in all, each waiting for its previous answer; TTFT is measured by the client
(send -> first non-empty content chunk), as are end-to-end time and throughput; the
server's own TTFT, queue time and cache hits come from each response's `kvblend` stats.

At 1 client the same requests also run in this process on a `BlendEngine` over the same
config, interleaved with the HTTP ones (one HTTP request, then the same request
in-process): in-process TTFT is call -> first non-empty `TextDelta`, the same definition.
The target: server TTFT p50 <= 1.05 x in-process p50 + 20 ms.

Hygiene (`eval.bench.common`): the load average is watched from start to end; the
benchmark keeps every core busy on purpose (the server's threads, then the in-process
engine's), so it counts as contended only when the load at its peak exceeds the cores by
more than half of them (or the start already exceeds them). A CPU probe is timed before
the server starts and after it stops, and the per-request ratio of HTTP to in-process
TTFT at 1 client (the same request, back to back) is its steady figure: `unsteady` when
the probe moved or those ratios spread by more than 25% of their median.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from eval.bench.common import LoadWatch, Steadiness, cpu_cores
from eval.bench.peer import Peer, peer_model, peer_props, prompt_texts, send_completion
from eval.bench.sample import BenchRequest, Sample, answers_equal
from eval.results import save_figure, write_file

TARGET_RATIO, TARGET_SLACK_S = 1.05, 0.020
# what write_report writes under --out: the JSON, the curves over clients, one panel per level
REPORT_FILES = SERVE_JSON, SERVE_PLOT, LEVELS_PLOT = ("serve.json", "serve.png", "serve-levels.png")
KVBLEND = "kvblend"  # the `server` of kvblend's rows
__all__ = ["BenchRequest", "Level", "Sample"]  # BenchRequest and Sample live in eval.bench.sample


@dataclass
class Level:
    clients: int
    samples: list[Sample] = field(default_factory=list)
    wall_s: float = 0.0
    max_num_seqs: int | None = None  # the server's setting
    prefill_chunk_tokens: int | None = None  # the server's setting (engine.prefill_chunk_tokens, from /health)
    scheduler: dict[str, float] = field(default_factory=dict)  # the server's counters over this level
    server: str = KVBLEND  # kvblend, or the peer's name
    mode: str | None = None  # kvblend's mode (None: a peer)
    peer_settings: dict[str, Any] | None = None  # a peer's own settings

    def summary(self, full: dict[int, str] | None = None, alone: dict[int, str] | None = None,
                prompt_tokens: list[int] | None = None) -> dict[str, Any]:
        """The row: `full` (kvblend's full-prefill answers, one request at a time) and `alone` (this
        mode's, the same way, on the same server) by request index give `answers_equal_full` /
        `answers_equal_alone`;
        `prompt_tokens` (kvblend's count per request) gives a peer's `prompt_tokens_equal`."""
        ok = [s for s in self.samples if s.ok]
        hits, misses = sum(s.hits for s in ok), sum(s.misses for s in ok)
        tokens = sum(s.tokens for s in ok)
        steps = self.scheduler.get("decode_steps", 0.0)
        counted = [s for s in ok if s.prompt_tokens is not None and 0 <= s.index < len(prompt_tokens or [])]
        return {
            "server": self.server, "mode": self.mode, "peer_settings": self.peer_settings,
            "answers_equal_full": answers_equal(self.samples, full),
            "answers_equal_alone": answers_equal(self.samples, alone),
            "prompt_tokens_equal": sum(1 for s in counted if s.prompt_tokens == prompt_tokens[s.index])
            if counted and prompt_tokens else None,
            "max_num_seqs": self.max_num_seqs,
            "prefill_chunk_tokens": self.prefill_chunk_tokens,
            "mean_batch_size": round(self.scheduler["batch_sum"] / steps, 3) if steps else None,
            "preemptions": int(self.scheduler["preemptions"]) if "preemptions" in self.scheduler else None,
            # decode rows computed in the same forward pass as a prefill chunk (they waited for no prefill)
            "decode_rows_in_prefill_steps": int(self.scheduler["decode_rows_in_prefill_steps"])
            if "decode_rows_in_prefill_steps" in self.scheduler else None,
            # where the server's scheduler spent the level: prefills do not batch, decode steps do
            "prefill_busy_s": round(self.scheduler["prefill_s"], 3) if "prefill_s" in self.scheduler else None,
            "decode_busy_s": round(self.scheduler["decode_s"], 3) if "decode_s" in self.scheduler else None,
            # a decode step that carried nothing else (decode_busy_s also holds the decode rows' share of
            # mixed steps, which `steps` does not count)
            "decode_ms_per_step": round(1000 * self.scheduler["decode_only_s"] / steps, 2)
            if steps and "decode_only_s" in self.scheduler else None,
            "clients": self.clients, "requests": len(self.samples), "ok": len(ok),
            "lost": len(self.samples) - len(ok), "errors": sorted({s.error for s in self.samples if not s.ok}),
            "wall_s": round(self.wall_s, 3),
            "requests_per_s": round(len(ok) / self.wall_s, 3) if self.wall_s else None,
            "tokens_per_s": round(tokens / self.wall_s, 2) if self.wall_s else None,
            "ttft_p50_s": _pct([s.ttft_s for s in ok], 50), "ttft_p99_s": _pct([s.ttft_s for s in ok], 99),
            "server_ttft_p50_s": _pct([s.server_ttft_s for s in ok], 50),
            "queue_p50_s": _pct([s.queue_s for s in ok], 50), "e2e_p50_s": _pct([s.e2e_s for s in ok], 50),
            "e2e_p99_s": _pct([s.e2e_s for s in ok], 99),
            # inter-token latency as a client sees it: gaps between a stream's consecutive content chunks
            "itl_p50_s": _pct([g for s in ok for g in s.gaps_s], 50),
            "itl_p99_s": _pct([g for s in ok for g in s.gaps_s], 99),
            "hit_rate": round(hits / (hits + misses), 4) if hits + misses else None,
        }


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def bench_requests(n: int, pool: list[dict[str, str]], per_request: int, seed: int = 0) -> list[BenchRequest]:
    """`n` requests: sample questions in turn, each over a seeded choice of documents."""
    from eval.samples import sample_questions

    questions = [q["question"] for q in sample_questions()]
    rng = random.Random(seed)
    k = min(per_request, len(pool))
    return [BenchRequest(questions[i % len(questions)], tuple(rng.sample(pool, k))) for i in range(n)]


def document_pool(size: int | None, doc_chars: int | None) -> list[dict[str, str]]:
    """The shipped sample documents as request documents (id = file name)."""
    from eval.samples import sample_documents

    docs = sample_documents()[: size or None]
    return [{"id": name, "text": text[:doc_chars] if doc_chars else text} for name, text in docs]


# ------------------------------------------------------------------ server
class ServerProcess:
    """A `kvblend serve` process on a free loopback port (SIGTERM on close). Its output goes
    to `log_path`; with `remove_log_dir`, a clean close removes the log's directory (a server
    that fails to start keeps it: the error names the file)."""

    def __init__(self, config: str | None, queue_size: int, log_path: Path, max_num_seqs: int | None = None,
                 remove_log_dir: bool = False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.log_path = log_path
        self.remove_log_dir = remove_log_dir
        self._log = log_path.open("w")
        with_config = ["--config", str(config)] if config is not None else []  # None: serve's own default
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from blend.cli import main; raise SystemExit(main())", "serve", *with_config,
             "--port", str(port), "--queue-size", str(queue_size), "--served-model-name", "bench",
             *(["--max-num-seqs", str(max_num_seqs)] if max_num_seqs is not None else [])],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"kvblend serve exited with {self.proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.remove_log_dir = False
                self.close()
                raise RuntimeError(f"kvblend serve did not start within 600 s; see {log_path}")
            time.sleep(0.25)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if self.remove_log_dir:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)


def send(http: httpx.Client, url: str, req: BenchRequest, max_tokens: int, kvblend: dict[str, Any],
         model: str | None = None, index: int = -1) -> Sample:
    """One streamed, greedy chat completion; the client's timings, the answer and the server's stats."""
    body = {"model": model, "messages": [{"role": "user", "content": req.question}], "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "documents": list(req.documents), "kvblend": kvblend}
    t0 = time.perf_counter()
    ttft = None
    stats: dict[str, Any] = {}
    arrivals: list[float] = []  # when each content chunk arrived
    parts: list[str] = []
    try:
        with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                return Sample(False, error=f"HTTP {response.status_code}", index=index)
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(False, error=chunk["error"].get("type", "error"), index=index)
                choice = chunk["choices"][0] if chunk.get("choices") else {}
                if choice.get("delta", {}).get("content"):
                    arrivals.append(time.perf_counter())
                    parts.append(choice["delta"]["content"])
                if ttft is None and (choice.get("delta", {}).get("content") or choice.get("finish_reason")):
                    ttft = time.perf_counter() - t0
                if "kvblend" in chunk:
                    stats = chunk["kvblend"]
    except httpx.HTTPError as err:
        return Sample(False, error=type(err).__name__, index=index)
    e2e = time.perf_counter() - t0
    if not stats:
        return Sample(False, error="no final chunk", index=index)
    return Sample(True, ttft_s=ttft if ttft is not None else e2e, e2e_s=e2e, tokens=int(stats["new_tokens"]),
                  server_ttft_s=float(stats["ttft_s"]), queue_s=float(stats["queue_s"]),
                  hits=int(stats["documents"]["hits"]), misses=int(stats["documents"]["misses"]),
                  gaps_s=[b - a for a, b in zip(arrivals, arrivals[1:], strict=False)], index=index,
                  text="".join(parts))


def scheduler_counters(http: httpx.Client, base: str) -> dict[str, float]:
    """The server's scheduler counters from its /metrics: decode steps, the sum of their batch
    sizes, preemptions (empty when the server has none of them)."""
    try:
        text = http.get(base + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    wanted = {"kvblend_decode_batch_size_count": "decode_steps", "kvblend_decode_batch_size_sum": "batch_sum",
              "kvblend_preemptions_total": "preemptions",
              "kvblend_decode_rows_in_prefill_steps_total": "decode_rows_in_prefill_steps",
              'kvblend_scheduler_busy_seconds_total{step="prefill"}': "prefill_s",
              'kvblend_scheduler_busy_seconds_total{step="decode"}': "decode_s",
              "kvblend_decode_step_seconds_total": "decode_only_s"}
    found: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            found[wanted[name]] = float(value)
    return found


def server_health(http: httpx.Client, base: str) -> dict[str, Any]:
    """The running server's /health object (its settings), or {}."""
    try:
        health = http.get(base + "/health", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}
    return health if isinstance(health, dict) else {}


def server_setting(http: httpx.Client, base: str) -> int | None:
    """The running server's max_num_seqs (from /health), or None."""
    value = server_health(http, base).get("max_num_seqs")
    return value if isinstance(value, int) else None


Sender = Callable[[httpx.Client, int, BenchRequest], Sample]  # sends request i, measures its answer


def kvblend_sender(url: str, max_tokens: int, kvblend: dict[str, Any], model: str | None) -> Sender:
    """Requests as kvblend chat completions with their documents (`send`)."""
    return lambda http, i, req: send(http, url, req, max_tokens, kvblend, model, index=i)


def run_level(url: str, clients: int, requests: list[BenchRequest], max_tokens: int, kvblend: dict[str, Any],
              after_each: Callable[[int, BenchRequest], None] | None = None, model: str | None = None,
              sender: Sender | None = None) -> Level:
    """`clients` threads share `requests` (each sends its next one when the previous is answered),
    through `sender` (default: kvblend's chat endpoint at `url`)."""
    sender = sender or kvblend_sender(url, max_tokens, kvblend, model)
    level = Level(clients)
    lock = threading.Lock()
    queue = list(enumerate(requests))

    def client() -> None:
        with httpx.Client(timeout=httpx.Timeout(600.0)) as http:
            while True:
                with lock:
                    if not queue:
                        return
                    i, req = queue.pop(0)
                sample = sender(http, i, req)
                with lock:
                    level.samples.append(sample)
                if after_each is not None:
                    after_each(i, req)

    threads = [threading.Thread(target=client, name=f"bench-client-{c}") for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.wall_s = time.perf_counter() - t0
    return level


def in_process_ttft(engine, req: BenchRequest, max_tokens: int, kvblend: dict[str, Any]) -> float:
    """Call -> first non-empty TextDelta of `engine.generate_stream` (the API's TTFT)."""
    from blend.decode.result import TextDelta
    from blend.prompt.document import Document

    docs = [Document(d["text"], id=d.get("id"), title=d.get("title")) for d in req.documents]
    t0 = time.perf_counter()
    ttft = None
    for item in engine.generate_stream([{"role": "user", "content": req.question}], docs, max_new_tokens=max_tokens,
                                       mode=kvblend["mode"], recompute_ratio=kvblend.get("recompute_ratio")):
        if ttft is None and (not isinstance(item, TextDelta) or item.text):
            ttft = time.perf_counter() - t0
    return ttft if ttft is not None else time.perf_counter() - t0


def compare_ttft(server_p50: float, in_process: Sequence[float],
                 pairs: Sequence[tuple[float, float]] = ()) -> dict[str, Any]:
    """The 1-client comparison: server TTFT p50 against the in-process p50 and the target;
    `pairs`: (HTTP, in-process) TTFT of the same request back to back, whose ratios give
    `pair_ratio` {median, min, max} (None without pairs)."""
    local_p50 = statistics.median(in_process)
    target = TARGET_RATIO * local_p50 + TARGET_SLACK_S
    ratios = [http / local for http, local in pairs if local > 0]
    pair_ratio = ({"median": round(statistics.median(ratios), 4), "min": round(min(ratios), 4),
                   "max": round(max(ratios), 4)} if ratios else None)
    return {"server_ttft_p50_s": server_p50, "in_process_ttft_p50_s": round(local_p50, 4),
            "ratio": round(server_p50 / local_p50, 4) if local_p50 else None, "target_s": round(target, 4),
            "within_target": server_p50 <= target, "in_process_samples": len(in_process), "pair_ratio": pair_ratio}


def server_model(http: httpx.Client, base: str) -> str:
    """The model id a kvblend server at `base` serves; ValueError naming the fix when
    nothing answers there or what answers is not a kvblend/OpenAI server."""
    try:
        response = http.get(base + "/v1/models", timeout=30)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except httpx.HTTPError as err:
        reason = " ".join(str(err).split())  # httpx's messages span lines; an error is one
        raise ValueError(f"no kvblend server answers at {base} ({type(err).__name__}: {reason}); start `kvblend serve` "
                         "there or fix --url") from None
    except (ValueError, KeyError, IndexError, TypeError):
        raise ValueError(f"{base}/v1/models did not answer with a model list; is --url a kvblend server?") from None


def run_serve_bench(config: str | None, *, clients: list[int], requests: int, pool_size: int | None, docs_per_request: int,
                    max_tokens: int, doc_chars: int | None, mode: str | Sequence[str], ratio: float | None,
                    url: str | None = None, compare: bool = True, max_num_seqs: Sequence[int | None] = (None,),
                    peer: Peer | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """The benchmark; returns the summary (see the module docstring). `mode`: one mode or several
    (a row per mode, the same requests); `peer`: the same requests to an OpenAI-compatible server."""
    if peer is not None:  # a peer that does not answer fails now, not after kvblend's levels
        with httpx.Client(timeout=30) as http:
            peer_model(http, peer.url)
    watch = LoadWatch.begin()
    steady = Steadiness.begin()  # before the server starts: its threads would share the cores
    pool = document_pool(pool_size, doc_chars)
    reqs = bench_requests(requests, pool, docs_per_request)
    modes = [mode] if isinstance(mode, str) else list(dict.fromkeys(mode))
    options = {m: {"mode": m} | ({"recompute_ratio": ratio} if ratio is not None else {}) for m in modes}
    settings = [None] if url else list(dict.fromkeys(max_num_seqs)) or [None]
    levels: list[dict[str, Any]] = []
    alone: dict[str, dict[int, str]] = {}  # per mode (and full): each request's answer, sent one at a time
    comparison = None
    model = None
    engine = None
    try:
        if compare and 1 in clients:
            from blend.engine.engine import BlendEngine
            from blend.prompt.document import Document

            engine = BlendEngine.from_config(config)
            engine.warmup()
            engine.ingest([Document(d["text"], id=d["id"]) for d in pool])
            for req in reqs[:2]:
                in_process_ttft(engine, req, max_tokens, options[modes[0]])
        for setting in settings:
            server = None if url else ServerProcess(
                config, queue_size=max(clients) * 2, max_num_seqs=setting,
                log_path=Path(tempfile.mkdtemp(prefix="kvblend-bench-serve-")) / "server.log", remove_log_dir=True)
            base = url or server.url
            try:
                with httpx.Client(timeout=600) as http:
                    model = server_model(http, base)
                    setting = server_setting(http, base) if setting is None else setting
                    ingested = http.post(base + "/v1/documents", json={"documents": pool})
                    ingested.raise_for_status()
                    cached = sum(d["cached"] for d in ingested.json()["data"])
                    log(f"pool: {len(pool)} documents ingested ({cached} already cached); server {base}, "
                        f"max_num_seqs {setting}")
                    # every request alone, one at a time, on each server (this warms its request path too): a
                    # later server reads the documents the first one stored from the disk tier, whose codec
                    # (int8 by default) gives other KV than the float16 entries the first one blended from,
                    # so its own answers alone are what its levels must equal; full prefill reads no
                    # entry: once, on the first server
                    asked = [m for m in dict.fromkeys([*modes, "full"]) if m != "full" or "full" not in alone]
                    for m in asked:
                        opts = options.get(m, {"mode": m})
                        alone[m] = alone_answers(kvblend_sender(base, max_tokens, opts, model), reqs)
                    for m in (m for m in modes if m not in asked):  # full on a later server: its request path warmed
                        for req in reqs[:2]:
                            send(http, base, req, max_tokens, options[m], model)
                    log(f"alone: {len(reqs)} requests one at a time in {', '.join(asked)} (max_num_seqs {setting})")
                    for m in modes:
                        for n in clients:
                            local: list[float] = []
                            after = None
                            if n == 1 and engine is not None and comparison is None:
                                def after(_i: int, req: BenchRequest, local: list[float] = local,
                                          opts: dict[str, Any] = options[m]) -> None:
                                    local.append(in_process_ttft(engine, req, max_tokens, opts))
                            before = scheduler_counters(http, base)
                            level = run_level(base, n, reqs, max_tokens, options[m], after_each=after, model=model)
                            after_counts = scheduler_counters(http, base)
                            level.max_num_seqs, level.mode = setting, m
                            level.prefill_chunk_tokens = server_health(http, base).get("prefill_chunk_tokens")
                            level.scheduler = {k: after_counts[k] - before.get(k, 0.0) for k in after_counts}
                            if after is not None:  # the in-process runs took turns with the HTTP ones: not in the wall time
                                level.wall_s = sum(s.e2e_s for s in level.samples)
                            summary = level.summary(full=alone["full"], alone=alone[m])
                            levels.append(summary)
                            log(f"{m}, max_num_seqs {setting}, {n:>3} clients: {summary['ok']}/{summary['requests']} ok, "
                                f"{summary['requests_per_s']} req/s, TTFT p50 {summary['ttft_p50_s']} s p99 "
                                f"{summary['ttft_p99_s']} s, {summary['tokens_per_s']} tok/s, mean batch "
                                f"{summary['mean_batch_size']}, preemptions {summary['preemptions']}, "
                                f"busy prefill {summary['prefill_busy_s']} s / decode {summary['decode_busy_s']} s "
                                f"({summary['decode_ms_per_step']} ms a step), hit rate {summary['hit_rate']}, "
                                f"answers equal alone {summary['answers_equal_alone']} / full "
                                f"{summary['answers_equal_full']}")
                            if local and summary["ttft_p50_s"] is not None:
                                # at 1 client the samples and the in-process runs alternate: the k-th of each is one request
                                pairs = [(s.ttft_s, t) for s, t in zip(level.samples, local, strict=False) if s.ok]
                                comparison = compare_ttft(summary["ttft_p50_s"], local, pairs) | {
                                    "max_num_seqs": setting, "mode": m}
                                log(f"  1 client: server TTFT p50 {comparison['server_ttft_p50_s']} s vs in-process "
                                    f"{comparison['in_process_ttft_p50_s']} s (target <= {comparison['target_s']} s: "
                                    f"{'met' if comparison['within_target'] else 'missed'})")
            finally:
                if server is not None:
                    server.close()
    finally:
        if engine is not None:
            engine.close()
    if peer is not None:
        levels += peer_levels(peer, config, reqs, clients, max_tokens, alone["full"], log)
    import torch

    summary = {"config": config, "url": url, "model": model, "mode": modes[0] if len(modes) == 1 else modes,
               "modes": modes, "recompute_ratio": ratio, "pool": len(pool), "docs_per_request": docs_per_request,
               "doc_chars": doc_chars, "requests_per_level": requests, "max_tokens": max_tokens,
               "max_num_seqs": settings, "peer": None if peer is None else {"name": peer.name, "url": peer.url, "prompt": peer.prompt},
               "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
               "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "levels": levels, "in_process": comparison,
               "speedups": setting_ratios(levels)}
    # its own work fills every core (server, then in-process engine): only more than that is contention
    summary.update(watch.finish("serve benchmark", own_threads=cpu_cores()))
    spreads = {}
    if comparison is not None and comparison["pair_ratio"] is not None:
        r = comparison["pair_ratio"]
        spreads["HTTP / in-process TTFT of one request (1 client)"] = (r["median"], r["min"], r["max"])
    summary.update(steady.finish(spreads, "serve benchmark"))
    return summary


def alone_answers(sender: Sender, requests: list[BenchRequest]) -> dict[int, str]:
    """Each request sent alone (one at a time, nothing else in flight): its answer by index
    (a failed one left out)."""
    with httpx.Client(timeout=httpx.Timeout(600.0)) as http:
        samples = [sender(http, i, req) for i, req in enumerate(requests)]
    return {s.index: s.text for s in samples if s.ok}


def peer_levels(peer: Peer, config: str | None, requests: list[BenchRequest], clients: list[int], max_tokens: int,
                full: dict[int, str], log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The same requests, as prompt texts, to the peer at each number of clients: its rows."""
    prompts = prompt_texts(config, requests)
    with httpx.Client(timeout=600) as http:
        model = peer_model(http, peer.url)
        settings = peer_props(http, peer.url) | peer.settings

    def sender(http: httpx.Client, i: int, _req: BenchRequest) -> Sample:
        prompt = prompts.texts[i] if peer.prompt == "text" else prompts.ids[i]
        return send_completion(http, peer.url, i, prompt, max_tokens, model)

    with httpx.Client(timeout=httpx.Timeout(600.0)) as http:
        for i in range(min(2, len(requests))):  # warm its request path, as kvblend's server was
            sender(http, i, requests[i])
    rows = []
    for n in clients:
        level = run_level(peer.url, n, requests, max_tokens, {}, sender=sender)
        level.server, level.peer_settings = peer.name, settings
        row = level.summary(full=full, prompt_tokens=prompts.tokens)
        rows.append(row)
        log(f"{peer.name}, {n:>3} clients: {row['ok']}/{row['requests']} ok, {row['requests_per_s']} req/s, TTFT p50 "
            f"{row['ttft_p50_s']} s p99 {row['ttft_p99_s']} s, {row['tokens_per_s']} tok/s, answers equal full "
            f"{row['answers_equal_full']}, prompts tokenized as kvblend's {row['prompt_tokens_equal']}")
    return rows


def setting_ratios(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per number of clients and kvblend mode, each setting's tokens/s and TTFT p50 as ratios to the
    smallest setting's (the same requests in the same run)."""
    out = []
    for n, mode in dict.fromkeys((lv["clients"], lv.get("mode")) for lv in levels):
        rows = sorted((lv for lv in levels if lv["clients"] == n and lv.get("mode") == mode
                       and lv.get("server", KVBLEND) == KVBLEND and lv["max_num_seqs"] is not None),
                      key=lambda lv: lv["max_num_seqs"])
        if len(rows) < 2:
            continue
        base = rows[0]
        for row in rows[1:]:
            out.append({"clients": n, "mode": mode, "max_num_seqs": row["max_num_seqs"], "versus": base["max_num_seqs"],
                        "tokens_per_s_ratio": _ratio(row["tokens_per_s"], base["tokens_per_s"]),
                        "ttft_p50_ratio": _ratio(row["ttft_p50_s"], base["ttft_p50_s"])})
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def row_label(row: dict[str, Any], modes: int = 1) -> str:
    """A row's name in the plots: the peer's name, else kvblend (its mode when several ran, and its
    max_num_seqs when it has one)."""
    if row.get("server", KVBLEND) != KVBLEND:
        return str(row["server"])
    parts = [KVBLEND] + ([str(row["mode"])] if modes > 1 or row.get("mode") is None else [])
    if row.get("max_num_seqs") is not None:
        parts.append(f"max_num_seqs {row['max_num_seqs']}")
    return " ".join(parts)


def write_report(summary: dict[str, Any], out: Path) -> None:
    """serve.json, serve.png (TTFT p50/p99 and tokens/s per number of clients, a line per row
    kind) and serve-levels.png (one panel per level: every server's row side by side) under `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    write_file(out / SERVE_JSON, json.dumps(summary, indent=2))
    modes = len(summary.get("modes") or [summary["mode"]])
    levels = [lv for lv in summary["levels"] if lv["ok"]]
    xs = sorted({lv["clients"] for lv in levels})
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(row_label(lv, modes) for lv in levels):
        rows = sorted((lv for lv in levels if row_label(lv, modes) == label), key=lambda lv: lv["clients"])
        cx = [lv["clients"] for lv in rows]
        left.plot(cx, [lv["ttft_p50_s"] for lv in rows], marker="o", label=f"{label}: p50")
        left.plot(cx, [lv["ttft_p99_s"] for lv in rows], marker="x", linestyle="--", label=f"{label}: p99")
        right.plot(cx, [lv["tokens_per_s"] for lv in rows], marker="o", label=label)
    if summary.get("in_process"):
        left.axhline(summary["in_process"]["in_process_ttft_p50_s"], color="black", linestyle=":",
                     label="in-process p50 (1 client)")
    left.set_xscale("log", base=2)
    left.set_ylim(bottom=0)
    left.set_xlabel("concurrent clients")
    left.set_ylabel("seconds")
    left.set_title("time to first token (client)")
    left.legend(fontsize=7)
    right.set_xscale("log", base=2)
    right.set_ylim(bottom=0)
    right.set_xlabel("concurrent clients")
    right.set_ylabel("output tokens / s")
    right.set_title(f"throughput ({', '.join(summary.get('modes') or [summary['mode']])})")
    right.legend(fontsize=7)
    for ax in (left, right):
        ax.set_xticks(xs, [str(x) for x in xs])
    fig.tight_layout()
    save_figure(fig, out / SERVE_PLOT, dpi=120)
    plt.close(fig)
    write_levels_plot(summary, out / LEVELS_PLOT, modes)


def write_levels_plot(summary: dict[str, Any], path: Path, modes: int) -> None:
    """One panel per level (number of clients): every row's tokens/s as a bar, its TTFT p50 / p99
    and answers equal to kvblend's full prefill written on it."""
    import matplotlib.pyplot as plt

    xs = sorted({lv["clients"] for lv in summary["levels"]}) or [0]
    fig, axes = plt.subplots(1, len(xs), figsize=(4.5 * len(xs), 4), squeeze=False)
    for ax, n in zip(axes[0], xs, strict=True):
        rows = [lv for lv in summary["levels"] if lv["clients"] == n]
        labels = [row_label(lv, modes).replace(" max_num_seqs ", "\nmax ") for lv in rows]
        bars = ax.bar(range(len(rows)), [lv["tokens_per_s"] or 0 for lv in rows],
                      color=["tab:blue" if lv.get("server", KVBLEND) == KVBLEND else "tab:orange" for lv in rows])
        for bar, lv in zip(bars, rows, strict=True):
            equal = lv.get("answers_equal_full")
            note = (f"TTFT {lv['ttft_p50_s']}/{lv['ttft_p99_s']} s" if lv["ok"] else f"{lv['lost']} lost") + (
                f"\n= full {equal}/{lv['requests']}" if equal is not None else "")
            ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                        fontsize=6)
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=20)
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"{n} client{'s' if n != 1 else ''}")
        ax.margins(y=0.25)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
