"""Pipelined layerwise retrieval: while layer i is computed, a background thread fetches
layer i+1 (up to `depth` layers ahead) of every cached segment from the tier stack,
verifies it (the tiers check checksums), converts it to the compute dtype, re-rotates
its keys to the segment's prompt positions and writes it into the request's KVCache.

The compute path calls `wait(layer)` before it needs a layer; only the time spent
there is exposed load time. A segment whose layer cannot be read (entry vanished, partly
evicted or corrupt) is recomputed standalone once, in the loader thread, and the request
goes on; the recomputed entry is written back (`TieredStore.repair`), so the next request
hits a whole entry instead of recomputing again.
On CUDA the copies run on a separate stream and `wait` orders the compute stream after them.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from blend.runner import KVCache, Runner
from blend.stats import LoadReport
from storage.entry import KVEntry
from storage.stack import Located, TieredStore

log = logging.getLogger(__name__)
LOADER_NICE = 5


@dataclass
class Placement:
    """One cached segment to place into the request's cache.

    Exactly one of `located` (read from the store) and `entry` (already in memory, e.g.
    computed on a miss during this request) is set. `recompute` rebuilds the entry when
    a stored layer turns out to be unreadable.
    """

    start: int  # prompt position of the first token
    length: int
    pos_start: int  # the positions the stored keys were rotated at start here
    located: Located | None
    entry: KVEntry | None
    recompute: Callable[[], KVEntry]

    @property
    def source(self) -> str:
        return self.located.tier_name if self.entry is None and self.located is not None else "computed"


class LayerLoader:
    """Background loader for one request. Use as a context manager or call close()."""

    def __init__(self, store: TieredStore | None, runner: Runner, cache: KVCache, placements: Sequence[Placement],
                 layers: Sequence[int], depth: int = 2):
        self.store, self.runner, self.cache = store, runner, cache
        self.placements = list(placements)
        self.layers = list(layers)
        self._ready = {layer: threading.Event() for layer in self.layers}
        self._slots = threading.Semaphore(max(1, depth))
        self._stop = False
        self._error: BaseException | None = None
        self._cuda = cache.k[0].device.type == "cuda"
        self._stream = torch.cuda.Stream(device=cache.k[0].device) if self._cuda else None
        self._cuda_events: dict[int, torch.cuda.Event] = {}
        self.load_s = 0.0  # time the loader spent fetching, converting, placing
        self.exposed_load_s = 0.0  # time compute waited for a layer
        self.bytes_by_tier: Counter[str] = Counter()
        self.recomputed_segments = 0
        self._thread = threading.Thread(target=self._run, name="kvblend-loader", daemon=True)
        if self.layers and self.placements:
            self._thread.start()
        else:
            for event in self._ready.values():
                event.set()

    # ------------------------------------------------------------- loader side
    def _fetch(self, p: Placement, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if p.entry is None and p.located is not None and self.store is not None:
            kv = self.store.get_layer(p.located, layer)
            if kv is not None:
                self.bytes_by_tier[p.located.tier_name] += kv[0].numel() * kv[0].element_size() * 2
                return kv
            log.warning("cached layer %d of %s unreadable; recomputing that chunk and rewriting its entry",
                        layer, p.located.key[:16])
        if p.entry is None:
            p.entry = p.recompute()
            self.recomputed_segments += 1
            if p.located is not None and self.store is not None:
                self.store.repair(p.located, p.entry)
        return p.entry.layers[layer]

    def _place(self, layer: int) -> None:
        runner, cache = self.runner, self.cache
        for p in self.placements:
            k, v = self._fetch(p, layer)
            dst_k = cache.k[layer][:, p.start : p.start + p.length]
            dst_k.copy_(k, non_blocking=True)  # converts to the compute dtype in place
            runner.rerotate_(dst_k, p.start - p.pos_start)
            cache.v[layer][:, p.start : p.start + p.length].copy_(v, non_blocking=True)

    def _run(self) -> None:
        try:  # a lower priority keeps this thread from stalling the compute threads' parallel regions
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICE)
        except (AttributeError, OSError):
            pass
        try:
            with torch.inference_mode():
                for layer in self.layers:
                    self._slots.acquire()
                    if self._stop:
                        return
                    t0 = time.perf_counter()
                    if self._stream is not None:
                        with torch.cuda.stream(self._stream):
                            self._place(layer)
                            event = torch.cuda.Event()
                            event.record(self._stream)
                            self._cuda_events[layer] = event
                    else:
                        self._place(layer)
                    self.load_s += time.perf_counter() - t0
                    self._ready[layer].set()
        except BaseException as err:  # surfaced to the compute thread in wait()
            self._error = err
        finally:
            for event in self._ready.values():
                event.set()

    # ------------------------------------------------------------ compute side
    def report(self) -> LoadReport:
        """What the loader did so far (call after close() for the final figures)."""
        return LoadReport(self.load_s, self.exposed_load_s, dict(self.bytes_by_tier), self.recomputed_segments)

    def wait(self, layer: int) -> None:
        """Block until `layer` is placed in the cache (no-op for layers not loaded)."""
        event = self._ready.get(layer)
        if event is None:
            return
        if not event.is_set():
            t0 = time.perf_counter()
            event.wait()
            self.exposed_load_s += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        if layer in self._cuda_events:
            torch.cuda.current_stream().wait_event(self._cuda_events.pop(layer))
        self._slots.release()

    def close(self) -> None:
        self._stop = True
        for _ in self.layers:
            self._slots.release()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> LayerLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
