"""One command for a CUDA machine: smoke tests of the GPU path, `make bench-gpu`, and a
profile of one 8B blend request. Every stage runs under its own time limit and in its
own try/except, writing what it got (or its error) to the output directory, so a
failure in one stage does not lose the others. At most 8 files are written:

    check.json   environment, stage status / durations / errors, smoke results
    log.txt      output of the subprocesses (pytest, the benchmark)
    bench.json   `make bench-gpu`'s combined summary   bench.md    its table
    ttft_6.png, ttft_24.png                            TTFT vs ratio per context size
    profile.txt  torch.profiler table of one blend request (random:llama-3-8b, bf16, 24 x 512
                 tokens from the cpu tier, ratio 0.15) and the attention variants
    profile.json copies, kernel launches, exposed load, request stats, attention timings

    python -m eval.bench.gpu_check --out DIR      (at most --budget seconds, default 470)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. " * 3,
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels. " * 2,
    "The Carrow Point light uses a rotating lens that flashes white every twelve seconds.",
]
QUESTION = "Who built the lighthouse at Carrow Point?"


class StageTimeout(Exception):
    pass


class Check:
    """The output directory and check.json, rewritten after every stage. `budget_s` bounds
    the whole run: a stage's limit shrinks to what is left (a stage with under 10 s left is
    skipped)."""

    def __init__(self, out: Path, budget_s: int):
        self.out = out
        self.deadline = time.monotonic() + budget_s
        out.mkdir(parents=True, exist_ok=True)
        self.doc: dict[str, Any] = {"stages": {}, "errors": {}}
        self.log = (out / "log.txt").open("a", encoding="utf-8")

    def save(self) -> None:
        (self.out / "check.json").write_text(json.dumps(self.doc, indent=2, default=str) + "\n")

    def left(self) -> int:
        return int(self.deadline - time.monotonic())

    def stage(self, name: str, fn: Callable[[], Any], limit_s: int) -> Any:
        """Run `fn` with an alarm after `limit_s`; record status, duration, result or error."""
        limit_s = min(limit_s, self.left())
        if limit_s < 10:
            self.doc["stages"][name] = {"status": "skipped: out of time", "seconds": 0}
            self.save()
            return None
        t0 = time.perf_counter()
        print(f"== {name} (limit {limit_s} s)", flush=True)

        def alarm(_sig: int, _frame: Any) -> None:
            raise StageTimeout(f"stage {name} exceeded {limit_s} s")

        old = signal.signal(signal.SIGALRM, alarm)
        signal.alarm(limit_s)
        result, status = None, "ok"
        try:
            result = fn()
        except BaseException as err:  # noqa: BLE001 - one stage's failure must not lose the others
            status = "timeout" if isinstance(err, StageTimeout) else "error"
            self.doc["errors"][name] = "".join(traceback.format_exception(err))[-4000:]
            print(f"   {status}: {err}", flush=True)
            if isinstance(err, KeyboardInterrupt):
                raise
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
        self.doc["stages"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 1)}
        if result is not None:
            self.doc[name] = result
        self.save()
        return result

    def run(self, cmd: list[str], timeout: int) -> int:
        """A subprocess from the repository root, its output appended to log.txt."""
        self.log.write(f"\n$ {' '.join(cmd)}\n")
        self.log.flush()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            self.log.write(f"\n(timed out after {timeout} s)\n")
            return 124
        return proc.returncode


# -------------------------------------------------------------------- stages
def environment() -> dict[str, Any]:
    import torch

    from eval.bench.common import cpu_cores, load_average
    from eval.bench.gpu import driver_version

    return {"device_name": torch.cuda.get_device_name(0), "driver": driver_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "capability": list(torch.cuda.get_device_capability(0)),
            "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
            "cpu_cores": cpu_cores(), "load_average": load_average(), "python": sys.version.split()[0]}


def smoke() -> dict[str, Any]:
    """Pinned pool, staging reuse after events, staged == host placement, ratio 1 == full,
    16 greedy tokens equal, every mode on random:tiny in bf16 and fp32."""
    import torch

    from blend.config import EngineConfig
    from blend.engine.engine import BlendEngine
    from blend.kv.loader import LayerLoader, StagingRing, copy_stream
    from blend.model.loading import load_model
    from blend.stats import LookupTally
    from eval.bench.load import ChunkShape, random_entry
    from storage.config import CpuTierConfig
    from storage.memory import CpuTier

    out: dict[str, Any] = {}
    shape = ChunkShape(layers=4, kv_heads=8, head_dim=128, tokens=512, kv_dtype="bfloat16")
    tier = CpuTier(CpuTierConfig(budget=256 << 20))
    _, entry = random_entry(shape, seed=0)
    tier.put("k", entry)
    k, v = tier.get_layer("k", 1)
    out["pinned_pool"] = {"pinned": bool(k.is_pinned()), "kv_adjacent": v.data_ptr() == k.data_ptr() + k.nbytes,
                          "view": tier.get_layer("k", 1)[0].data_ptr() == k.data_ptr(),
                          "equal": bool(torch.equal(k, entry.layers[1][0])), "stats": tier.stats()}
    device = torch.device("cuda")
    ring = StagingRing(1, pinned=True)
    slot = ring.acquire(64 << 20)
    dst = torch.empty(slot.buf.numel(), dtype=torch.uint8, device=device)
    with torch.cuda.stream(copy_stream(device)):
        torch.cuda._sleep(100_000_000)
        dst.copy_(slot.buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    pending = not event.query()
    ring.release(slot, event)
    again = ring.acquire(16)
    out["staging"] = {"pending_before": pending, "reused_same_slot": again is slot, "event_done": event.query(),
                      "waits": ring.waits}
    ring.release(again, None)

    for dtype in ("float32", "bfloat16"):
        work = Path(tempfile.mkdtemp(prefix="kvblend-gpu-check-"))
        try:
            lm = load_model("random:tiny", device="cuda", dtype=dtype)
            cfg = EngineConfig(model="random:tiny", device="cuda", dtype=dtype).with_overrides(
                store={"kv_dtype": dtype, "tiers": [{"kind": "cpu", "budget": "256MiB"},
                                                    {"kind": "disk", "path": str(work / "d"), "budget": "1GiB"}]},
                chunk_tokens=24, sessions_dir=str(work / "sessions"))
            with BlendEngine(cfg, model=lm) as engine:
                engine.ingest(DOCS)
                full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=16)
                one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=16)
                row: dict[str, Any] = {
                    "ratio1_max_logprob_diff": float((one.first_token_logprobs - full.first_token_logprobs).abs().max()),
                    "greedy16_equal": one.token_ids == full.token_ids}
                for mode, ratio in (("reuse", 0.0), ("blend", 0.15), ("prefix", 0.0)):
                    r = engine.generate(QUESTION, DOCS, mode=mode, recompute_ratio=ratio, max_new_tokens=4)
                    row[f"{mode}_ok"] = bool(torch.isfinite(r.first_token_logprobs).all())
                    row[f"{mode}_copies_per_layer"] = (r.stats.load.copies / r.stats.load.layers_loaded
                                                       if r.stats.load.layers_loaded else None)
                row["chat_ok"] = bool(engine.chat("s", "Hello, who are you?", max_new_tokens=3).token_ids)
                # staged vs host placement of the same placements: identical caches
                prompt = engine.build_prompt(QUESTION, DOCS)
                placements = engine.document_kv.resolve(prompt, [s for s in prompt.segments if s.kind != "query"],
                                                        LookupTally([t.name for t in engine.store.tiers]))
                caches = []
                for staged in (False, True):
                    cache = engine.runner.new_cache(len(prompt))
                    for t in cache.k + cache.v:
                        t.zero_()
                    with LayerLoader(engine.store, engine.runner, cache, placements, range(engine.runner.num_layers),
                                     32, staged=staged) as ld:
                        for layer in range(engine.runner.num_layers):
                            ld.wait(layer)
                    torch.cuda.synchronize()
                    caches.append(cache)
                n = prompt.query.start
                row["staged_vs_host_max_diff"] = max(
                    float((a[:, :n].float() - b[:, :n].float()).abs().max())
                    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v, strict=True))
            out[f"tiny_{dtype}"] = row
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def pytest_stage(check: Check, timeout: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "tests/test_gpu_path.py",
           "tests/test_pipeline.py", "tests/test_split.py", "-k", "not redis"]
    return {"returncode": check.run(cmd, timeout)}


def bench_stage(check: Check, timeout: int) -> dict[str, Any]:
    scratch = Path(tempfile.mkdtemp(prefix="kvblend-bench-gpu-"))
    try:
        rc = check.run([sys.executable, "-m", "eval.bench.gpu", "--out", str(scratch)], timeout)
        copied = []
        for src, dst in (("summary.json", "bench.json"), ("summary.md", "bench.md"),
                         ("chunks6/ttft_vs_ratio.png", "ttft_6.png"), ("chunks24/ttft_vs_ratio.png", "ttft_24.png")):
            if (scratch / src).is_file():
                shutil.copy(scratch / src, check.out / dst)
                copied.append(dst)
        partial = {}
        for sub in sorted(scratch.glob("chunks*/ttft.json")):  # runs that finished before a timeout
            partial[sub.parent.name] = json.loads(sub.read_text())
        if "bench.json" not in copied and partial:
            (check.out / "bench.json").write_text(json.dumps({"partial": partial}, indent=2) + "\n")
            copied.append("bench.json")
        return {"returncode": rc, "files": copied}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_stage(check: Check, timeout: int) -> dict[str, Any]:
    """`kvblend bench load` of the disk and cpu tiers with the 8B KV shape (32 layers, 8 KV heads,
    head_dim 128, 512-token chunks, bf16): tier read bandwidth against raw cold reads of the
    same bytes on this machine's disk (page cache dropped)."""
    scratch = Path(tempfile.mkdtemp(prefix="kvblend-bench-load-"))
    try:
        out = scratch / "load.json"
        cmd = [sys.executable, "-m", "blend.cli", "bench", "load", "--tier", "disk,cpu", "--size-mb", "512",
               "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--chunk-tokens", "512",
               "--kv-dtype", "bfloat16", "--rounds", "3", "--json"]
        with out.open("w") as fh:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=check.log, timeout=timeout).returncode
        lines = [line for line in out.read_text().splitlines() if line.strip()]
        return {"returncode": rc, "result": json.loads(lines[-1]) if lines else None}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def profile_stage(check: Check) -> dict[str, Any]:
    """Profile one blend request of random:llama-3-8b (bf16, 24 x 512 tokens, cpu tier)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from blend.config import load_config
    from blend.engine.engine import BlendEngine
    from blend.model.loading import load_model
    from eval.bench.common import one_tier_store
    from eval.bench.ttft import QUESTION as BENCH_QUESTION
    from eval.bench.ttft import bench_documents

    result: dict[str, Any] = {}
    lm = load_model("random:llama-3-8b", device="cuda", dtype="bfloat16")
    config = load_config(ROOT / "configs/default.yaml", model="random:llama-3-8b", device="cuda", dtype="bfloat16")
    work = Path(tempfile.mkdtemp(prefix="kvblend-profile-"))
    store = one_tier_store("cpu", dataclasses.replace(config.store, kv_dtype="bfloat16", namespace="profile"),
                           scratch=work, budget=4 << 30)
    text: list[str] = []
    try:
        with BlendEngine(config.with_overrides(store=store), model=lm) as engine:
            docs = bench_documents(lm.tokenizer, 24, 512)
            engine.ingest(docs)
            for _ in range(2):
                engine.generate(BENCH_QUESTION, docs, mode="full", max_new_tokens=1)
                engine.generate(BENCH_QUESTION, docs, mode="blend", recompute_ratio=0.15, max_new_tokens=1)
                engine.generate(BENCH_QUESTION, docs, mode="reuse", max_new_tokens=1)
            for mode, ratio in (("full", 1.0), ("blend", 0.15), ("reuse", 0.0)):
                engine.runner.strategies.clear()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    r = engine.generate(BENCH_QUESTION, docs, mode=mode, recompute_ratio=ratio, max_new_tokens=1)
                    torch.cuda.synchronize()
                events = prof.key_averages()
                counts = {e.key: e.count for e in events}

                def count(*names: str, counts: dict[str, int] = counts) -> int:
                    return sum(c for k, c in counts.items() if any(n in k for n in names))

                kernels = sum(e.count for e in events if getattr(e, "device_type", None) is not None
                              and str(e.device_type).endswith("CUDA") and "Memcpy" not in e.key
                              and "Memset" not in e.key)
                s = r.stats
                result[f"{mode}_{ratio}"] = {
                    "ttft_s": round(r.ttft_s, 4), "exposed_load_s": round(s.exposed_load_s, 4),
                    "exposed_share": round(s.exposed_load_s / r.ttft_s, 3) if r.ttft_s else None,
                    "load_s": round(s.load_s, 4), "bytes_loaded": s.bytes_loaded,
                    "load_gbps": round(s.bytes_loaded / s.load_s / 1e9, 2) if s.load_s else None,
                    "loader_copies": s.load.copies, "layers_loaded": s.load.layers_loaded,
                    "cudaMemcpyAsync": count("cudaMemcpyAsync"), "memcpy_HtoD": count("Memcpy HtoD"),
                    "cudaLaunchKernel": count("cudaLaunchKernel", "cuLaunchKernel"), "kernels": kernels,
                    "stream_syncs": count("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"),
                    "split": s.split.to_dict(), "recomputed_tokens": s.recomputed_tokens,
                    "context_tokens": s.context_tokens, "attention": dict(engine.runner.strategies)}
                sort_key = "device_time_total" if hasattr(events[0], "device_time_total") else "cuda_time_total"
                text.append(f"=== {mode} (ratio {ratio}): {json.dumps(result[f'{mode}_{ratio}'])}\n")
                text.append(events.table(sort_by=sort_key, row_limit=30))
                text.append(f"--- {mode}: by host (CPU) time")
                text.append(events.table(sort_by="self_cpu_time_total", row_limit=25))
                (check.out / "profile.txt").write_text("\n".join(text))
                (check.out / "profile.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
            result["attention_ms"] = attention_variants(engine.runner, len(engine.build_prompt(BENCH_QUESTION, docs)))
            text.append(f"\n=== attention variants (ms per layer call): {json.dumps(result['attention_ms'], indent=1)}\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
        (check.out / "profile.txt").write_text("\n".join(text))
        (check.out / "profile.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    return {k: v for k, v in result.items()}


def attention_variants(runner: Any, n: int, share: float = 0.15, tail: int = 40) -> dict[str, Any]:
    """Attention calls over n keys of the shapes a request makes, per exact strategy the
    runner can take on this device: `blend` (`share` of the rows scattered, plus the last
    20) and `reuse` (the last `tail` rows). Per strategy: milliseconds (median of 5,
    host-synchronized wall time, and CUDA-event time) and max abs difference against a
    float32 reference of the same rows; what the runner picks itself (`auto`), and every
    bucket its tuner has measured so far (the profile's warm-ups included)."""
    import torch

    g = torch.Generator().manual_seed(0)
    rows = torch.sort(torch.randperm(n, generator=g)[: int(share * n)]).values
    out: dict[str, Any] = {
        "blend": _attention_case(runner, n, torch.unique(torch.cat([rows, torch.arange(n - 20, n)]))),
        "reuse": _attention_case(runner, n, torch.arange(n - tail, n))}
    out["tunings"] = {str(t.bucket): t.to_dict() for t in runner.tuner.tunings.values()}
    return out


def _attention_case(runner: Any, n: int, rows: Any) -> dict[str, Any]:
    import torch

    from blend.model.attention import candidates, is_tail

    dev, dt = runner.device, runner.dtype
    q = torch.randn(runner.num_heads, rows.numel(), runner.head_dim, device=dev, dtype=dt)
    k = torch.randn(runner.kv_heads, n, runner.head_dim, device=dev, dtype=dt)
    v = torch.randn(runner.kv_heads, n, runner.head_dim, device=dev, dtype=dt)
    group = runner.num_heads // runner.kv_heads
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out: dict[str, Any] = {"rows": rows.numel(), "keys": n, "strategies": {}}
    with torch.inference_mode():
        hidden = (torch.arange(n, device=dev)[None, :] > rows.to(dev)[:, None])  # (Tq, n) keys after the row
        ref = torch.empty(rows.numel(), runner.num_heads, runner.head_dim, device=dev)
        for h in range(runner.kv_heads):  # float32 math per KV head: (g, Tq, n) scores at a time
            s = (q[h * group:(h + 1) * group].float() @ k[h].float().T) * runner.scaling
            p = s.masked_fill_(hidden, float("-inf")).softmax(-1)
            ref[:, h * group:(h + 1) * group] = (p @ v[h].float()).transpose(0, 1)
            del s, p
        ref = ref.reshape(rows.numel(), -1)
        for name in candidates(dev, dt, group, is_tail(rows, n)):
            try:
                plan = runner.plan_attention(rows, n, strategy=name)
                y = runner.attend(q, rows, k, v, plan)
                walls, events = [], []
                for _ in range(5):
                    sync()
                    t0 = time.perf_counter()
                    if cuda:
                        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        begin.record()
                    runner.attend(q, rows, k, v, plan)
                    if cuda:
                        end.record()
                    sync()
                    walls.append((time.perf_counter() - t0) * 1e3)
                    if cuda:
                        events.append(begin.elapsed_time(end))
                out["strategies"][name] = {"ms": round(statistics.median(walls), 3),
                                           "event_ms": round(statistics.median(events), 3) if events else None,
                                           "max_diff_vs_fp32": float((y.float() - ref).abs().max())}
            except Exception as err:  # noqa: BLE001 - report the variant as failed
                out["strategies"][name] = {"error": f"{type(err).__name__}: {err}"[:300]}
        y = runner.attend(q, rows, k, v, runner.plan_attention(rows, n))  # measures the bucket if not yet
        out["auto"] = {"strategy": runner.plan_attention(rows, n).strategy,
                       "max_diff_vs_fp32": float((y.float() - ref).abs().max())}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m eval.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for the (at most 8) result files")
    p.add_argument("--skip", default="", help="comma-separated stages to skip: pytest, smoke, bench, profile, load")
    p.add_argument("--budget", type=int, default=470, help="seconds for the whole run (default 470)")
    args = p.parse_args(argv)
    os.chdir(ROOT)
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    check = Check(Path(args.out), args.budget)
    skip = set(filter(None, args.skip.split(",")))
    check.stage("environment", environment, 30)
    if "smoke" not in skip:
        check.stage("smoke", smoke, 90)
    if "bench" not in skip:  # leaves ~2.5 minutes for the profile and the tests
        limit = max(30, min(300, check.left() - 150))
        check.stage("bench", lambda: bench_stage(check, limit - 10), limit)
    if "profile" not in skip:
        check.stage("profile", lambda: profile_stage(check), 100)
    if "load" not in skip:
        check.stage("load", lambda: load_stage(check, max(10, check.left() - 40)), 90)
    if "pytest" not in skip:
        check.stage("pytest", lambda: pytest_stage(check, max(10, check.left() - 5)), 90)
    failed = [name for name, s in check.doc["stages"].items() if s["status"] != "ok"]
    print(f"done: {len(check.doc['stages']) - len(failed)} stage(s) ok, failed: {failed or 'none'}; see {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
