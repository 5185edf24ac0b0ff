"""What the benchmarks share: dropping files from the page cache so a disk tier reads a
disk, building a store that holds exactly one tier of a kind, and hygiene: the spread of
repeated timings and whether the machine was busy while they were taken (a number
measured on a contended machine says so in its JSON and in a warning line), and whether
its speed held steady (`Steadiness`: the spread of each setting's repeats, and a fixed
matrix product timed at the start and the end; a VM's host can slow it down while its
own load average shows nothing)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage.config import StoreConfig, TierConfig, tier_config_class

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def drop_page_cache(paths: Path | Iterable[Path]) -> bool:
    """Evict files (or every file under a directory) from the OS page cache: fsync, then
    POSIX_FADV_DONTNEED (no root needed). Returns False where the OS has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    if isinstance(paths, Path):
        paths = paths.rglob("*") if paths.is_dir() else [paths]
    for path in paths:
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    return True


def one_tier(kind: str, configured: StoreConfig | None = None, *, scratch: Path, redis_url: str | None = None,
             cluster_urls: list[str] | None = None, key_prefix: str = "kvblend-bench:",
             budget: int | None = None) -> TierConfig:
    """The config of one benchmark tier of `kind`: the configured tier of that kind if any
    (else the defaults), pointed at scratch space (a disk directory under `scratch`, a
    private Redis key prefix) and `required`, so an unusable tier fails loudly.
    """
    cls = tier_config_class(kind)  # ValueError listing the kinds
    base = next((t for t in configured.tiers if t.kind == kind), None) if configured is not None else None
    changes: dict[str, Any] = {}
    if budget is not None and "budget" in {f.name for f in dataclasses.fields(cls)}:
        changes["budget"] = budget
    if kind == "cpu":
        return dataclasses.replace(base or cls(), **changes)
    if kind == "disk":
        return dataclasses.replace(base or cls(path=str(scratch)), path=str(scratch), required=True, **changes)
    if kind == "redis":
        base = base or cls()
        return dataclasses.replace(base, url=redis_url or base.url, key_prefix=key_prefix, required=True, ttl_s=None)
    urls = tuple(cluster_urls or (base.urls if base is not None else ()))
    if not urls:
        raise ValueError("a redis-cluster tier needs node URLs: pass --cluster-urls U,U,U or configure one")
    return dataclasses.replace(base or cls(urls=urls), urls=urls, key_prefix=key_prefix, required=True, ttl_s=None)


def one_tier_store(kind: str, config: StoreConfig, **kwargs: Any) -> StoreConfig:
    """`config` (namespace, kv_dtype) with `one_tier(kind, config, ...)` as its only tier, no promotion."""
    return dataclasses.replace(config, tiers=(one_tier(kind, config, **kwargs),), promote=False)


# ------------------------------------------------------------------ hygiene
def spread(values: Sequence[float], digits: int = 5) -> dict[str, float | None]:
    """{"median", "min", "max"} of repeated timings (None for no values), rounded."""
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


UNSTEADY_SPREAD = 0.25  # (max - min) / median of one setting's repeats above which a run is unsteady
PROBE_SHAPE = (1024, 576, 1536)  # rows, in, out of the probe's float32 matrix product (~1.8 GFLOP a call)
PROBE_S = 0.6  # seconds the probe runs each time


def probe_gflops(seconds: float = PROBE_S, *, engine: Any = None) -> float:
    """This machine's float32 matrix-product rate on the CPU (GFLOP/s) with torch's threads:
    after a warm-up of a third of `seconds` (thread start-up, clock ramp), the best of five
    windows over the rest, so one descheduled moment does not decide it. The same figure on
    two days means the same compute speed. Runs in a thread of its own that ends with it: an
    OpenMP pool left on the caller's thread would slow the engine measured next (see
    BlendEngine.run_exclusive). With an open `engine`, on its scheduler's thread between two
    steps instead: its background work then waits rather than sharing the cores with the probe."""
    from blend.model.loading import in_own_thread

    if engine is not None:
        return engine.run_exclusive(lambda: _probe(seconds), "cpu-probe")
    return in_own_thread(lambda: _probe(seconds), "kvblend-cpu-probe")


def _probe(seconds: float) -> float:
    import time

    import torch

    rows, d_in, d_out = PROBE_SHAPE
    gen = torch.Generator().manual_seed(0)
    a, w = torch.randn(rows, d_in, generator=gen), torch.randn(d_out, d_in, generator=gen)

    def rate(window: float) -> float:
        calls, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < window or calls == 0:
            a @ w.T
            calls += 1
        return 2 * rows * d_in * d_out * calls / elapsed / 1e9

    rate(seconds / 3)  # warm-up
    return round(max(rate(seconds * 2 / 15) for _ in range(5)), 1)


@dataclass
class Steadiness:
    """Whether a benchmark's machine kept one speed: `begin()` times the probe, `finish(spreads)`
    times it again and takes the spread of each setting's repeated timings. Unsteady: a
    setting whose repeats spread by more than `limit` of their median, or a probe that moved by
    more than `limit` between start and end; then one warning line goes to stderr. Either way
    the JSON carries the probe rates and the widest spread, so runs on different days compare."""

    probe_start: float
    limit: float = UNSTEADY_SPREAD

    @classmethod
    def begin(cls, limit: float = UNSTEADY_SPREAD) -> Steadiness:
        return cls(probe_gflops(), limit)

    def finish(self, spreads: dict[str, tuple[float, float, float]], what: str = "benchmark") -> dict[str, Any]:
        """`spreads`: per setting, (median, min, max) seconds of its repeats."""
        probe_end = probe_gflops()
        widest, widest_name = 0.0, None
        for name, (mid, low, high) in spreads.items():
            width = (high - low) / mid if mid > 0 else 0.0
            if width > widest:
                widest, widest_name = width, name
        drift = abs(probe_end - self.probe_start) / max(self.probe_start, probe_end, 1e-9)
        reasons = []
        if widest > self.limit:
            reasons.append(f"the repeats of {widest_name} spread by {widest:.0%} of their median")
        if drift > self.limit:
            reasons.append(f"a fixed matrix product ran at {self.probe_start} GFLOP/s at the start and "
                           f"{probe_end} at the end")
        if reasons:
            print(f"warning: this {what}'s machine changed speed while it ran ({'; '.join(reasons)}): its "
                  f"timings and speedups are uncertain by about that much; rerun when the machine is steady",
                  file=sys.stderr)
        return {"probe_gflops_start": self.probe_start, "probe_gflops_end": probe_end,
                "widest_spread": round(widest, 3), "widest_spread_of": widest_name, "unsteady": bool(reasons)}


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _busy_threads() -> int:
    """Compute threads this process keeps busy: torch's pool when torch is loaded, else one."""
    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 1


LOAD_SAMPLE_S = 5.0  # how often a LoadWatch reads the load average while a measurement runs


def _sample_load(watch: weakref.ref[LoadWatch], stop: threading.Event, every_s: float) -> None:
    """A LoadWatch's sampler: one load-average reading every `every_s` until `stop` is set or
    the watch is gone."""
    while not stop.wait(every_s):
        current = watch()
        if current is None:
            return
        value = load_average()
        if value is not None:
            current.samples.append(value)
        del current


@dataclass
class LoadWatch:
    """The machine's load average at the start, during and at the end of a measurement.

    `begin()` also starts a daemon thread that reads the load average every `every_s`
    seconds until `finish()`: other work that came and went in the middle of a long run
    (a test suite, a second benchmark) is caught by its peak, not only by the two ends.
    `finish()` returns the JSON fields (load_average_start / _end / _peak, cpu_cores,
    contended) and, when other work was running, prints one warning line to stderr:
    timings taken then are contended. Other work means a load average above the core count
    at the start, or, at its peak or at the end, more than half the cores busy besides the
    benchmark's own threads (`own_threads`: a 2-thread benchmark alone on 2 cores stays near
    2.0).
    """

    start: float | None
    cores: int
    samples: list[float] = field(default_factory=list)  # load averages read during the run
    _stop: threading.Event | None = field(default=None, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)

    @classmethod
    def begin(cls, every_s: float = LOAD_SAMPLE_S) -> LoadWatch:
        watch = cls(load_average(), cpu_cores())
        if watch.start is not None:
            watch._stop = threading.Event()
            # the thread holds the watch weakly: a run that fails before finish() drops its
            # watch, and the thread ends at its next reading
            watch._thread = threading.Thread(target=_sample_load, args=(weakref.ref(watch), watch._stop, every_s),
                                             name="kvblend-loadwatch", daemon=True)
            watch._thread.start()
        return watch

    def finish(self, what: str = "benchmark", own_threads: int | None = None) -> dict[str, Any]:
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            self._thread.join()
        end = load_average()
        seen = [v for v in (*self.samples, end) if v is not None]
        peak = max(seen) if seen else None
        own = min(self.cores, own_threads if own_threads is not None else _busy_threads())
        contended = ((self.start is not None and self.start > self.cores)
                     or (peak is not None and peak - own > self.cores / 2))
        if contended:
            print(f"warning: load average {self.start} at start, {peak} at its peak, {end} at end (this {what} keeps "
                  f"{own} thread(s) busy) shows other work on the {self.cores} cores: its timings are contended",
                  file=sys.stderr)
        return {"load_average_start": self.start, "load_average_end": end, "load_average_peak": peak,
                "cpu_cores": self.cores, "contended": contended}
