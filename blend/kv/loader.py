"""Pipelined layerwise retrieval: while layer i is computed, a background thread fetches
layer i+1 (up to `depth` layers ahead) of every cached segment from the tier stack and
places it into the request's KVCache: converted to the compute dtype, keys re-rotated
to the segment's prompt positions.

The compute path calls `wait(layer)` before it needs a layer; only the time it waits
there is exposed load time. A segment whose layer cannot be read (entry vanished, partly
evicted or corrupt) fails the load (`LoadFailed`): its entry is deleted from the store (the next
request misses it and computes it the usual way) and the request computes without the store
(its plan's full fallback). No model work ever runs inside a load or its wait.

Two ways to place a layer, chosen by the cache's device:

An entry a tier holds encoded (storage.codec: int8, int4) travels as its encoded bytes and is
decoded where the cache is, straight into the cache slice (CPU) or the device buffer (CUDA);
re-rotation, and every later correction of the stale K/V, works on the decoded values. Keys
stored before RoPE (int4) are rotated by their whole prompt position instead of the shift.

host (CPU caches): per segment, the tier's read (a view of cpu-tier memory, or a disk /
Redis read into a reused scratch buffer) is copied (or decoded) into the cache slice with
dtype conversion, and its keys are re-rotated there in place.

staged (CUDA caches): every segment's layer bytes reach the device with as few copies
as possible, then one batched step places them all.
  - cpu-tier entries in pinned memory are copied straight from the tier's views (one
    DMA per segment: K and V are adjacent there); the loader keeps those views until
    the request ends, so the tier cannot reuse that memory under a copy in flight;
  - disk and Redis layers are read into a slot of a small ring of pinned staging
    buffers (disk: preadv straight into it, several reads in flight from a thread
    pool; Redis: the reply copied once), entries computed in this request are copied
    into it; segments adjacent in the slot go up in one copy; a slot is reused only
    after its copy event has completed; encoded entries are staged and copied encoded
    (the bytes that cross PCIe are the compressed ones);
  - the copies land in a device buffer laid out segment after segment (encoded ones in
    a second buffer, decoded from there into the first on the device, in the storage
    dtype: the precision a `none` entry has); one gather per
    K and V, one re-rotation by each token's position shift (float32 math) and one
    write into the cache slots place every segment of the layer at once;
  - all of it runs on a dedicated copy stream and ends with an event per layer:
    `wait(layer)` makes the compute stream wait for exactly that event.
Both produce the same cache contents (bit-identical in float32).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from blend.model.cache import KVCache
from blend.model.native import native_decode_codes
from blend.model.runner import Runner
from blend.stats import LoadReport
from storage.codec import decode_into
from storage.entry import EntryHeader, KVEntry
from storage.memory import CpuTier
from storage.openmp import single_threaded
from storage.serialization import layer_views
from storage.stack import Located, TieredStore
from storage.tier import Layer

log = logging.getLogger(__name__)
LOADER_NICE = 5
STAGING_SLOTS = 3  # pinned staging buffers per device: a layer being read, one being copied, one spare
STAGING_SLOT_MAX = 256 << 20  # a layer whose staged bytes exceed this is staged in several fills
READ_THREADS = 4  # disk / Redis reads in flight per layer
DEVICE_BUFFERS = 3  # device-side landing buffers per request, reused round robin on the copy stream
FORCE_STAGED: bool | None = None  # tests: run the staged path on CPU caches (None: by device)


@dataclass
class Placement:
    """One cached segment to place into the request's cache.

    Exactly one of `located` (read from the store) and `entry` (already in memory, e.g.
    computed on a miss during this request) is set.
    """

    start: int  # prompt position of the first token
    length: int
    pos_start: int  # the positions the stored keys were rotated at start here
    located: Located | None
    entry: KVEntry | None
    # the cache layers the entry holds, in its layer order (None: every layer, entry layer i =
    # cache layer i); a hybrid model's session entries hold one layer type each (blend.kv.windowed)
    layers: tuple[int, ...] | None = None

    def holds(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers

    def entry_layer(self, layer: int) -> int:
        """The entry's index of cache layer `layer`."""
        return layer if self.layers is None else self.layers.index(layer)

    @property
    def source(self) -> str:
        return self.located.tier_name if self.entry is None and self.located is not None else "computed"

    @property
    def header(self) -> EntryHeader:
        if self.entry is not None:
            return self.entry.header
        assert self.located is not None
        return self.located.header

    @property
    def layer_nbytes(self) -> int:
        """Bytes one layer of its entry reads (as stored)."""
        return self.header.layer_nbytes


@dataclass(frozen=True)
class PlannedLoad:
    """A segment a plan would place but that is not there yet (a missing document, priced before
    it is computed): what the cost models read of a `Placement`."""

    start: int
    length: int
    pos_start: int
    source: str  # "computed": an entry in memory
    layer_nbytes: int


# ------------------------------------------------------------ shared per device
_shared_lock = threading.Lock()
_copy_streams: dict[torch.device, torch.cuda.Stream] = {}
_rings: dict[tuple[str, int | None], StagingRing] = {}
_read_pool: ThreadPoolExecutor | None = None
# loader threads whose request gave them up (a stalled read): they end in their own time; at
# interpreter exit the engine waits for them (`join_abandoned`), so that none is in torch's
# code while the interpreter finalises (blend.engine.engine)
_abandoned: set[threading.Thread] = set()


def join_abandoned(timeout: float) -> int:
    """Wait up to `timeout` seconds in all for the loader threads given up by their requests;
    returns how many are still running."""
    deadline = time.monotonic() + timeout
    with _shared_lock:
        threads = list(_abandoned)
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with _shared_lock:
        _abandoned.difference_update(t for t in threads if not t.is_alive())
        return sum(t.is_alive() for t in _abandoned)


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every loader of this process copies to `device` on."""
    with _shared_lock:
        stream = _copy_streams.get(device)
        if stream is None:
            stream = _copy_streams[device] = torch.cuda.Stream(device=device)
        return stream


def staging_ring(device: torch.device) -> StagingRing:
    """The staging ring shared by the loaders copying to `device` (pinned where it is CUDA)."""
    key = (device.type, device.index)
    with _shared_lock:
        ring = _rings.get(key)
        if ring is None:
            ring = _rings[key] = StagingRing(STAGING_SLOTS, pinned=device.type == "cuda")
        return ring


def read_pool() -> ThreadPoolExecutor:
    global _read_pool
    with _shared_lock:
        if _read_pool is None:
            _read_pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvblend-read")
        return _read_pool


class _Slot:
    __slots__ = ("buf", "event", "busy", "uses")

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None  # (capacity,) uint8
        self.event: torch.cuda.Event | None = None  # the last copy out of it
        self.busy = False
        self.uses = 0


class StagingRing:
    """A few host buffers (pinned for CUDA) that reads land in before going to the device.

    `acquire(n)` hands out a free slot of at least n bytes after waiting for the event of
    its previous copy, so a slot is never overwritten under a copy in flight; `release`
    returns it with the event of the copy just issued from it. Slots grow on demand.
    Thread-safe (loaders of several engines may share one ring).
    """

    def __init__(self, slots: int, *, pinned: bool):
        self.pinned = pinned
        self._slots = [_Slot() for _ in range(max(1, slots))]
        self._next = 0
        self._cond = threading.Condition()
        self.waits = 0  # acquisitions that had to wait for a copy event (for tests and stats)

    def acquire(self, nbytes: int) -> _Slot:
        with self._cond:
            while True:
                for i in range(len(self._slots)):
                    slot = self._slots[(self._next + i) % len(self._slots)]
                    if not slot.busy:
                        self._next = (self._next + i + 1) % len(self._slots)
                        slot.busy = True
                        break
                else:
                    self._cond.wait()
                    continue
                break
        if slot.event is not None:
            if not slot.event.query():
                self.waits += 1
                slot.event.synchronize()
            slot.event = None
        if slot.buf is None or slot.buf.numel() < nbytes:
            size = 1 << max(20, (nbytes - 1).bit_length())  # powers of two: what the pinned allocator hands out
            slot.buf = None
            slot.buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)  # (size,)
        slot.uses += 1
        return slot

    def release(self, slot: _Slot, event: torch.cuda.Event | None) -> None:
        with self._cond:
            slot.event = event
            slot.busy = False
            self._cond.notify()


# ------------------------------------------------------------------ the loader
class LoadStalled(RuntimeError):
    """Compute waited longer than the loader's `stall_s` for one layer (a tier that answers,
    but too slowly). The loader is abandoned and those tiers suspended (TieredStore.suspend):
    the request's cache is not usable; compute the request without the store. `tiers`: the
    tiers it was reading from."""

    def __init__(self, message: str, tiers: tuple[str, ...]):
        super().__init__(message)
        self.tiers = tiers


class LoadFailed(LoadStalled):
    """A stored layer was unreadable (vanished, partly evicted, corrupt): its entry was deleted
    from the store (a miss for the next request) and this request computes without the store,
    as after a stall. `tiers`: the tier it was read from."""


class LayerLoader:
    """Background loader for one request. Use as a context manager or call close().

    staged: None picks by the cache's device (CUDA: staged, else host); True/False force
    a path (tests run the staged path on the CPU). stall_s: the longest compute waits for
    one layer before giving the loads up (`LoadStalled`); None waits as long as it takes.
    """

    def __init__(self, store: TieredStore | None, runner: Runner, cache: KVCache, placements: Sequence[Placement],
                 layers: Sequence[int], depth: int = 2, *, staged: bool | None = None,
                 stall_s: float | None = None):
        self.store, self.runner, self.cache = store, runner, cache
        self.placements = sorted(placements, key=lambda p: p.start)
        self.layers = list(layers)
        self.device = cache.k[0].device
        self._cuda = self.device.type == "cuda"
        self._ready = {layer: threading.Event() for layer in self.layers}
        self._slots = threading.Semaphore(max(1, depth))
        self._stop = False
        self._closed = False
        self.stall_s = stall_s
        self._abandoned = False  # compute gave the loads up: the thread may still be writing into `cache`
        self._error: BaseException | None = None
        self._stream = copy_stream(self.device) if self._cuda else None
        self._cuda_events: dict[int, torch.cuda.Event] = {}
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._start_event: torch.cuda.Event | None = None
        self._begin: torch.cuda.Event | None = None
        self._last_event: torch.cuda.Event | None = None
        self.load_s = 0.0  # time the loader spent fetching, converting, placing
        self.exposed_load_s = 0.0  # time compute waited for a layer
        self.bytes_by_tier: Counter[str] = Counter()
        self.read_s_by_tier: Counter[str] = Counter()  # host time spent reading, per tier
        self.place_s = 0.0  # time spent moving bytes into the cache (device time on CUDA)
        self.computed_bytes = 0  # bytes of entries in hand (computed, not read) placed beside the loaded ones
        self.copies = 0  # copy operations into the cache or onto the device
        self.layers_done = 0
        self._waited: set[int] = set()
        dtypes = {p.header.dtype for p in self.placements}
        if staged is None:
            staged = self._cuda if FORCE_STAGED is None else FORCE_STAGED
        # entries of one layer type each, or a cache with ring layers: placed per segment (host path)
        per_layer = any(p.layers is not None for p in self.placements) or any(r is not None for r in cache.rings)
        self.staged = staged and len(dtypes) == 1 and not per_layer
        self._scratch: torch.Tensor | None = None
        self._held: list[object] = []  # tier views copied asynchronously: kept until close()
        self._thread = threading.Thread(target=self._run, name="kvblend-loader", daemon=True)
        if self._cuda:  # the cache was allocated on the compute stream: copies must come after that
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if self.layers and self.placements:
            self._thread.start()
        else:
            for event in self._ready.values():
                event.set()

    # ------------------------------------------------------------- loader side
    def _count_read(self, p: Placement, nbytes: int, seconds: float) -> None:
        self.bytes_by_tier[p.source] += nbytes
        self.read_s_by_tier[p.source] += seconds

    def _unreadable(self, p: Placement, layer: int) -> KVEntry:
        """The in-memory entry of `p` (computed in this request); a stored layer that could not be
        read fails the load: its entry is deleted (the next request misses it) and `LoadFailed`
        reaches the compute side in `wait`."""
        if p.entry is not None:
            return p.entry
        assert p.located is not None
        key, tier = p.located.key, p.located.tier_name
        if self.store is not None and self._replaced(p.located):
            # a newer entry took the key after the lookup (the write-behind queue: a harvested document's
            # standalone recompute): the load fails, the new entry stays
            log.info("cached layer %d of %s was replaced in %s while loading; the request computes without "
                     "the store", layer, key[:16], tier)
            raise LoadFailed(f"cached layer {layer} of {key[:16]} replaced in {tier} while loading", (tier,))
        log.warning("cached layer %d of %s unreadable in %s; the entry is dropped and the request computes "
                    "without the store", layer, key[:16], tier)
        if self.store is not None:
            try:
                self.store.delete(key)
            except Exception as err:  # noqa: BLE001 - the tier that failed the read may fail the delete too
                log.warning("could not delete the unreadable entry %s: %s", key[:16], err)
        raise LoadFailed(f"cached layer {layer} of {key[:16]} unreadable in {tier}", (tier,))

    def _replaced(self, located: Located) -> bool:
        """Whether a tier now holds another entry (another header) under `located`'s key."""
        for tier in self.store.tiers:
            try:
                header = tier.get_header(located.key)
            except Exception:  # noqa: BLE001 - a tier that cannot answer tells nothing
                continue
            if header is not None and header != located.header:
                return True
        return False

    def _begin_span(self) -> None:
        """Mark where this layer's device work (copies, placement) starts on the copy stream."""
        if self._cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()

    def _run(self) -> None:
        try:  # a lower priority keeps this thread from stalling the compute threads' parallel regions
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOADER_NICE)
        except (AttributeError, OSError):
            pass
        single_threaded()  # no OpenMP pool of its own beside the scheduler's (storage.openmp)
        try:
            with torch.inference_mode():
                if self._stream is not None:
                    with torch.cuda.stream(self._stream):
                        self._loop()
                else:
                    self._loop()
        except BaseException as err:  # surfaced to the compute thread in wait()
            self._error = err
        finally:
            for event in self._ready.values():
                event.set()

    def _loop(self) -> None:
        if self._cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        placer = _StagedPlacer(self) if self.staged else _HostPlacer(self)
        for layer in self.layers:
            self._slots.acquire()
            if self._stop:
                return
            t0 = time.perf_counter()
            self._begin = None
            placer.place(layer)
            if self._cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                if self._begin is not None:
                    self._spans.append((self._begin, event))
                self._cuda_events[layer] = self._last_event = event
            self.load_s += time.perf_counter() - t0
            self.layers_done += 1
            self._ready[layer].set()

    # ------------------------------------------------------------ compute side
    def report(self) -> LoadReport:
        """What the loader did so far (call after close() for the final figures).

        On CUDA this waits for the loader's copies to finish (the caller is about to
        synchronise for the logits anyway) so that device-side times are known."""
        load_s, exposed, place_s = self.load_s, self.exposed_load_s, self.place_s
        if self._cuda and self._last_event is not None and self._start_event is not None:
            self._last_event.synchronize()
            load_s = self._start_event.elapsed_time(self._last_event) / 1e3
            place_s = sum(a.elapsed_time(b) for a, b in self._spans) / 1e3
        if self._cuda and self._stalls:
            self._stalls[-1][1].synchronize()
            exposed = sum(a.elapsed_time(b) for a, b in self._stalls) / 1e3
        return LoadReport(load_s, exposed, dict(self.bytes_by_tier), copies=self.copies,
                          layers_loaded=self.layers_done, read_s_by_tier=dict(self.read_s_by_tier), place_s=place_s,
                          computed_bytes=self.computed_bytes)

    def ready(self, layer: int) -> bool:
        """Whether `wait(layer)` would not block: the layer is placed (or not loaded), or the
        load failed (then `wait` raises at once)."""
        event = self._ready.get(layer)
        return event is None or layer in self._waited or event.is_set() or self._error is not None

    def wait(self, layer: int) -> None:
        """Block until `layer` is placed in the cache (no-op for layers not loaded).

        On CUDA the compute stream is made to wait for that layer's copies (the host does
        not block on them); the GPU time it idles there is the exposed load."""
        event = self._ready.get(layer)
        if event is None or layer in self._waited:  # (a plan's rows run in chunks: each waits)
            return
        before = None
        if self._cuda:
            before = torch.cuda.Event(enable_timing=True)
            before.record()
        if not event.is_set():
            t0 = time.perf_counter()
            if not self._wait_for(event):
                self._abandoned = self._stop = True
                with _shared_lock:
                    _abandoned.difference_update([t for t in _abandoned if not t.is_alive()])
                    _abandoned.add(self._thread)
                tiers = tuple(dict.fromkeys(p.source for p in self.placements if p.entry is None))
                stalled = LoadStalled(f"layer {layer} did not arrive within {self.stall_s:g} s from "
                                      f"{', '.join(tiers)}; computing without the store", tiers)
                if self.store is not None:
                    self.store.suspend(tiers, str(stalled))  # skipped for a while (where a tier has a backoff)
                raise stalled
            if not self._cuda:
                self.exposed_load_s += time.perf_counter() - t0
        if self._error is not None:
            raise self._error
        self._waited.add(layer)
        if layer in self._cuda_events:
            torch.cuda.current_stream(self.device).wait_event(self._cuda_events.pop(layer))
            if before is not None:
                after = torch.cuda.Event(enable_timing=True)
                after.record()
                self._stalls.append((before, after))
        self._slots.release()

    def _wait_for(self, event: threading.Event) -> bool:
        """Wait for `event`; False after `stall_s` of waiting."""
        return event.wait(self.stall_s)

    def close(self) -> None:
        """Stop the loader thread; on CUDA, order the compute stream after every copy issued and
        release the tier memory the copies read. Once: a second call does nothing."""
        if self._closed:
            return
        self._closed = self._stop = True
        for _ in self.layers:
            self._slots.release()
        if self._abandoned:  # a read that stalled ends in its own time; the thread keeps what it reads from
            return
        if self._thread.is_alive():
            self._thread.join()
        if self._cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            if self._last_event is not None:
                self._last_event.synchronize()  # DMA from the held tier views has finished
        self._held.clear()

    def __enter__(self) -> LayerLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ------------------------------------------------------------------ host path
class _HostPlacer:
    """Per segment: read, copy (or decode) into the cache slice (dtype conversion), re-rotate in place;
    into a bfloat16 / float16 cache on a CPU, rotated in float32 from the source instead
    (`Runner.rotate_into`)."""

    def __init__(self, loader: LayerLoader):
        self.loader = loader
        self._rotations: dict[tuple[int, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}  # pre-RoPE
        self._decoded: torch.Tensor | None = None  # float32 scratch an encoded segment decodes into (reused)

    def _fetch(self, p: Placement, layer: int) -> tuple[EntryHeader, torch.Tensor, torch.Tensor]:
        """What `p` holds for the entry's layer `layer` (its own index: Placement.entry_layer): the
        header it is read under and its K and V (or, encoded, its K part and V part)."""
        ld = self.loader
        if p.entry is None and p.located is not None and ld.store is not None:
            t0 = time.perf_counter()
            header = p.located.header
            tier = ld.store.tiers[p.located.tier_index]
            if not isinstance(tier, CpuTier) and hasattr(tier, "read_layer_into"):
                # disk / Redis: into a reused buffer (no allocation and page faults per layer)
                if ld._scratch is None or ld._scratch.numel() < header.layer_nbytes:
                    ld._scratch = torch.empty(max(p.header.layer_nbytes for p in ld.placements), dtype=torch.uint8)
                buf = ld._scratch[: header.layer_nbytes]
                if ld.store.read_layer_into(p.located, layer, buf):
                    ld._count_read(p, header.layer_nbytes, time.perf_counter() - t0)
                    k, v = layer_views(buf, header)
                    return header, k, v
            else:
                kv = ld.store.get_layer(p.located, layer)
                if kv is not None:
                    ld._count_read(p, header.layer_nbytes, time.perf_counter() - t0)
                    return header, kv[0], kv[1]
        entry = ld._unreadable(p, layer)
        k, v = entry.layers[layer]
        ld.computed_bytes += k.numel() * k.element_size() + v.numel() * v.element_size()
        return entry.header, k, v

    def place(self, layer: int) -> None:
        ld = self.loader
        runner, cache = ld.runner, ld.cache
        ld._begin_span()
        for p in ld.placements:
            if ld._stop:
                return
            if not p.holds(layer):
                continue
            header, k, v = self._fetch(p, p.entry_layer(layer))
            t0 = time.perf_counter()
            where = cache.slots(layer, p.start, p.start + p.length)
            ring = isinstance(where, torch.Tensor)  # a ring's slots: placed through a converted copy
            if ring:
                dst_k = torch.empty(k.shape if header.codec.raw else header.shape, dtype=cache.k[layer].dtype,
                                    device=cache.k[layer].device)
                dst_v = torch.empty_like(dst_k)
            else:
                dst_k, dst_v = cache.k[layer][:, where], cache.v[layer][:, where]
            if dst_k.dtype != torch.float32 and dst_k.device.type == "cpu":
                # a narrower cache on a CPU: decoded to float32 where encoded, rotated in float32
                # straight from the source into the cache (one rounding; see Runner.rotate_into)
                if not header.codec.raw:  # k, v: the K part and V part (uint8)
                    kf, vf = self._scratch(dst_k.shape)  # (H, T, D) float32 x2
                    codec = header.codec
                    if not (runner.native_blend and native_decode_codes(
                            codec.bits, codec.key_group, codec.key_zero, codec.value_group_for(kf.shape[-1]),
                            codec.value_zero, k, v, kf, vf)):  # the same bits, one pass
                        decode_into(codec, k, v, kf, vf)
                    k, v = kf, vf
                dst_v.copy_(v)
                table = self._table(p.start, p.length, layer, torch.float32) if header.keys_pre_rope else None
                runner.rotate_into(dst_k, k, p.start - p.pos_start, layer, table)
            else:
                if header.codec.raw:
                    dst_k.copy_(k, non_blocking=True)  # converts to the compute dtype in place
                    dst_v.copy_(v, non_blocking=True)
                else:
                    decode_into(header.codec, k.to(dst_k.device), v.to(dst_k.device), dst_k, dst_v)
                if header.keys_pre_rope:
                    self._rotate_(dst_k, p.start, p.length, layer)
                else:
                    runner.rerotate_(dst_k, p.start - p.pos_start, layer)  # the layer's own RoPE
            if ring:
                cache.k[layer][:, where] = dst_k
                cache.v[layer][:, where] = dst_v
            ld.copies += 2
            ld.place_s += time.perf_counter() - t0

    def _scratch(self, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
        """Two float32 tensors of `shape` in one buffer kept across segments and layers: a fresh
        one per segment cost a page-faulting allocation each (60 ms of a 0.35 s blend on a CPU)."""
        n = math.prod(shape)
        if self._decoded is None or self._decoded.numel() < 2 * n:
            self._decoded = torch.empty(2 * n)
        return self._decoded[:n].view(shape), self._decoded[n:2 * n].view(shape)

    def _table(self, start: int, length: int, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (length, D/2) in `dtype` rotating keys at position 0 to positions start..
        with `layer`'s RoPE (kept per segment, RoPE kind and dtype: every layer asks again)."""
        runner = self.loader.runner
        key = (start, length, runner.layer_rope[layer], dtype)
        cs = self._rotations.get(key)
        if cs is None:
            cos, sin = runner.rotation(torch.arange(start, start + length), layer)  # (T, D) float32
            half = cos.shape[-1] // 2
            cs = self._rotations[key] = (cos[:, :half].to(dtype), sin[:, :half].to(dtype))
        return cs

    def _rotate_(self, k: torch.Tensor, start: int, length: int, layer: int) -> None:
        """Rotate keys decoded at position 0 (H, length, D), in place, to positions start.. with
        `layer`'s RoPE."""
        c, s = self._table(start, length, layer, k.dtype)
        half = k.shape[-1] // 2
        x1, x2 = k[..., :half], k[..., half:]
        first = x1.clone()
        x1.mul_(c).addcmul_(x2, s, value=-1)  # x1 cos - x2 sin
        x2.mul_(c).addcmul_(first, s)  # x2 cos + x1 sin


# ---------------------------------------------------------------- staged path
class _StagedPlacer:
    """All segments of a layer: bytes to the device in few copies, then one batched placement.

    Encoded segments (a tier's codec) are staged and copied encoded into `packed`, a device byte
    buffer, and decoded from there into their place in `raw` on the device."""

    def __init__(self, loader: LayerLoader):
        self.loader = ld = loader
        ps = ld.placements
        self.dtype = ps[0].header.dtype
        self.elem = torch.empty(0, dtype=self.dtype).element_size()
        h, d = ld.runner.kv_heads, ld.runner.head_dim
        self.heads, self.head_dim = h, d
        self.numel = [2 * h * p.length * d for p in ps]  # K and V elements per segment
        self.offset = [sum(self.numel[:i]) for i in range(len(ps))]  # element offsets in the device buffer
        self.total = sum(self.numel)
        # encoded segments: byte offsets in the device buffer of encoded bytes (as located: a segment
        # recomputed on a bad read is placed from its computed entry instead)
        self.poff: dict[int, int] = {}
        packed = 0
        for i, p in enumerate(ps):
            if p.entry is None and not p.header.codec.raw:
                self.poff[i] = packed
                packed += p.header.layer_nbytes
        dev = ld.device
        # gather rows (rows of head_dim elements in the device buffer) of K and V, in prompt order
        k_rows, v_rows, positions = [], [], []
        for p, off in zip(ps, self.offset, strict=True):
            base = off // d
            grid = (torch.arange(h)[:, None] * p.length + torch.arange(p.length)[None, :])  # (H, T)
            k_rows.append(base + grid)
            v_rows.append(base + h * p.length + grid)
            positions.append(torch.arange(p.start, p.start + p.length))
        self.k_idx = torch.cat(k_rows, dim=1).reshape(-1).to(dev)  # (H * N,)
        self.v_idx = torch.cat(v_rows, dim=1).reshape(-1).to(dev)  # (H * N,)
        pos = torch.cat(positions)  # (N,)
        self.n = pos.numel()
        first = int(pos[0])
        self.span = (first, first + self.n) if bool((pos == torch.arange(first, first + self.n)).all()) else None
        self.pos = None if self.span is not None else pos.to(dev)
        self._pre_rope: tuple[bool, ...] | None = None  # per segment: its placed keys decode before RoPE
        self.rotate = False
        # direct sources: pinned cpu-tier views, read once for every layer and kept until close()
        self.direct: dict[int, list[torch.Tensor]] = {}
        if ld.store is not None:
            for i, p in enumerate(ps):
                tier = ld.store.tiers[p.located.tier_index] if p.entry is None and p.located is not None else None
                if isinstance(tier, CpuTier) and tier.pool is not None:
                    views = tier.get_views(p.located.key, ld.layers)  # one call for every layer
                    if not views or (ld._cuda and not views[0][0].is_pinned()):  # one block: pinned or not
                        continue
                    flats = [_flat_kv(kv) for kv in views]
                    if all(f is not None for f in flats):
                        self.direct[i] = flats  # type: ignore[assignment]
                        ld._held.append(flats)
        count = min(DEVICE_BUFFERS, len(ld.layers))
        self.buffers = [torch.empty(self.total, dtype=self.dtype, device=dev) for _ in range(count)]
        self.packed = [torch.empty(packed, dtype=torch.uint8, device=dev) for _ in range(count if packed else 0)]
        self.turn = 0
        self.ring = staging_ring(dev if ld._cuda else torch.device("cpu"))

    def _encoded(self, i: int) -> bool:
        """Whether segment i is placed from its encoded stored bytes (not recomputed meanwhile)."""
        return i in self.poff and self.loader.placements[i].entry is None

    def _nbytes(self, i: int) -> int:
        """Bytes segment i stages this layer: encoded, or K and V in the storage dtype."""
        return self.loader.placements[i].header.layer_nbytes if self._encoded(i) else self.numel[i] * self.elem

    def place(self, layer: int) -> None:
        ld = self.loader
        raw = self.buffers[self.turn % len(self.buffers)]  # (E,) in the storage dtype
        packed = self.packed[self.turn % len(self.packed)] if self.packed else None  # (P,) uint8
        self.turn += 1
        staged = [i for i in range(len(ld.placements)) if i not in self.direct]
        fills = self._fills(staged)
        # the first fill is read before the layer's device work starts: the device span measures copies only
        first = self._fill(layer, fills[0]) if fills else None
        ld._begin_span()
        li = ld.layers.index(layer) if self.direct else 0
        raw_bytes = raw.view(torch.uint8)
        for i, flats in self.direct.items():
            t0 = time.perf_counter()
            buf, at = self._destination(i, raw_bytes, packed)
            buf[at : at + flats[li].numel()].copy_(flats[li], non_blocking=True)
            ld.copies += 1
            ld._count_read(ld.placements[i], flats[li].numel(), time.perf_counter() - t0)
        for n, fill in enumerate(fills):
            slot, where, computed = first if n == 0 and first is not None else self._fill(layer, fill)
            self._upload(fill, slot, where, raw_bytes, packed, computed)
            for i, (k, v) in computed.items():  # recomputed on a bad read: K and V straight into place
                self._raw_kv(i, raw)[0].copy_(k)
                self._raw_kv(i, raw)[1].copy_(v)
                ld.copies += 2
        for i in self.poff:
            if self._encoded(i):
                assert packed is not None
                p = ld.placements[i]
                kn, vn = p.header.part_nbytes
                at = self.poff[i]
                k, v = self._raw_kv(i, raw)
                decode_into(p.header.codec, packed[at : at + kn], packed[at + kn : at + kn + vn], k, v)
        self._spread(layer, raw)

    def _raw_kv(self, i: int, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment i's K and V (H, T, D) in the device buffer `raw`."""
        h, d, length = self.heads, self.head_dim, self.loader.placements[i].length
        half = self.numel[i] // 2
        seg = raw[self.offset[i] : self.offset[i] + self.numel[i]]
        return seg[:half].view(h, length, d), seg[half:].view(h, length, d)

    def _destination(self, i: int, raw_bytes: torch.Tensor, packed: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """Where segment i's staged bytes land on the device: (byte buffer, offset) of its encoded
        region, or of its K and V."""
        if self._encoded(i):
            assert packed is not None
            return packed, self.poff[i]
        return raw_bytes, self.offset[i] * self.elem

    def _fills(self, staged: list[int]) -> list[list[int]]:
        """The staged segments in slot-sized groups (in order)."""
        fills: list[list[int]] = []
        size = 0
        for i in staged:
            nbytes = self._nbytes(i)
            if not fills or size + nbytes > STAGING_SLOT_MAX:
                fills.append([])
                size = 0
            fills[-1].append(i)
            size += nbytes
        return fills

    def _fill(self, layer: int, fill: list[int]) -> tuple[_Slot, dict[int, int], dict[int, Layer]]:
        """A staging slot holding the layer bytes of every segment of `fill`, their offsets there,
        and the K and V of encoded segments that had to be recomputed (they do not fit their bytes)."""
        slot = self.ring.acquire(sum(self._nbytes(i) for i in fill))
        try:
            assert slot.buf is not None
            where, computed = self._read(layer, fill, slot.buf)
            return slot, where, computed
        except BaseException:
            self.ring.release(slot, None)
            raise

    def _upload(self, fill: list[int], slot: _Slot, where: dict[int, int], raw_bytes: torch.Tensor,
                packed: torch.Tensor | None, skip: dict[int, Layer]) -> None:
        """Copy a filled slot to the device, one copy per run of segments adjacent in both; release
        the slot with the event of those copies."""
        event = None
        try:
            assert slot.buf is not None
            sizes = {i: self._nbytes(i) for i in fill}
            dests = {i: self._destination(i, raw_bytes, packed) for i in fill if i not in skip}
            for run in _runs([i for i in fill if i not in skip], where, sizes, dests):
                a, b = run[0], run[-1]
                src = slot.buf[where[a] : where[b] + sizes[b]]
                buf, at = dests[a]
                buf[at : at + src.numel()].copy_(src, non_blocking=True)
                self.loader.copies += 1
            if self.loader._cuda:
                event = torch.cuda.Event()
                event.record()
        finally:
            self.ring.release(slot, event)

    def _read(self, layer: int, fill: list[int], buf: torch.Tensor) -> tuple[dict[int, int], dict[int, Layer]]:
        """Bytes of every segment of `fill` into `buf`, back to back; their byte offsets there, and
        the K and V of the encoded segments recomputed on a bad read (placed by the caller)."""
        ld = self.loader
        sizes = {i: self._nbytes(i) for i in fill}
        where: dict[int, int] = {}
        at = 0
        for i in fill:
            where[i] = at
            at += sizes[i]
        stored = [i for i in fill if ld.placements[i].entry is None and ld.placements[i].located is not None
                  and ld.store is not None]

        def read(i: int) -> bool:
            p = ld.placements[i]
            assert ld.store is not None and p.located is not None
            return ld.store.read_layer_into(p.located, layer, buf[where[i] : where[i] + sizes[i]])

        t0 = time.perf_counter()
        results = list(read_pool().map(read, stored)) if len(stored) > 1 else [read(i) for i in stored]
        wall = time.perf_counter() - t0  # reads overlap: each is charged its share of the wall time
        ok = dict(zip(stored, results, strict=True))
        total = sum(sizes[i] for i in stored) or 1
        for i, good in ok.items():
            if good:
                ld._count_read(ld.placements[i], sizes[i], wall * sizes[i] / total)
        computed: dict[int, Layer] = {}
        for i in fill:
            if ok.get(i):
                continue
            entry = ld._unreadable(ld.placements[i], layer)  # in memory: computed this request
            k, v = entry.layers[layer]
            if sizes[i] != self.numel[i] * self.elem:  # its encoded bytes were to come here
                computed[i] = (k, v)
                continue
            view = buf[where[i] : where[i] + sizes[i]].view(self.dtype)
            half = self.numel[i] // 2
            view[:half].view(k.shape).copy_(k)
            view[half:].view(v.shape).copy_(v)
        return where, computed

    def _rotation(self) -> None:
        """The per-token rotation tables for where each segment's placed keys are rotated at now
        (encoded keys stored before RoPE: position 0; a segment recomputed meanwhile: pos_start)."""
        ld = self.loader
        pre_rope = tuple(i in self.poff and p.entry is None and p.header.keys_pre_rope
                         for i, p in enumerate(ld.placements))
        if pre_rope == self._pre_rope:
            return
        self._pre_rope = pre_rope
        # token t of a segment goes from position pos_start + t (keys as computed) or 0 (keys stored
        # before RoPE) to start + t
        delta = torch.cat([torch.arange(p.start, p.start + p.length) if pre else torch.full((p.length,), p.start - p.pos_start)
                           for p, pre in zip(ld.placements, pre_rope, strict=True)])
        self.rotate = bool(delta.any())
        if self.rotate:
            half = self.head_dim // 2
            dtype = ld.cache.k[0].dtype
            # float32 caches: the host path's math exactly; half-precision ones: float32 math, rounded once
            math = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
            self.rotations: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per RoPE kind: cos, sin (N, D/2)
            for layer in ld.layers:
                kind = ld.runner.layer_rope[layer]
                if kind not in self.rotations:
                    cos, sin = ld.runner.rotation(delta, layer)  # (N, D) float32 each, on the device
                    self.rotations[kind] = (cos[:, :half].to(math), sin[:, :half].to(math))
            self.math = math

    def _spread(self, layer: int, raw: torch.Tensor) -> None:
        """Gather every segment's K and V from `raw`, convert, re-rotate K, write into the cache."""
        ld = self.loader
        self._rotation()
        h, d, n = self.heads, self.head_dim, self.n
        rows = raw.view(-1, d)  # (E / D, D)
        k = rows.index_select(0, self.k_idx).view(h, n, d)  # (H, N, D) storage dtype
        v = rows.index_select(0, self.v_idx).view(h, n, d)  # (H, N, D)
        cache_k, cache_v = ld.cache.k[layer], ld.cache.v[layer]
        if self.span is not None:
            a, b = self.span
            dst_k, dst_v = cache_k[:, a:b], cache_v[:, a:b]  # (H, N, D) views of the cache
        else:
            dst_k = torch.empty((h, n, d), dtype=cache_k.dtype, device=cache_k.device)
            dst_v = v
        if self.rotate:
            half = d // 2
            cos, sin = self.rotations[ld.runner.layer_rope[layer]]  # (N, D/2) of this layer's RoPE
            x = k.to(self.math)  # (H, N, D)
            x1, x2 = x[..., :half], x[..., half:]
            first = torch.mul(x1, cos)
            torch.addcmul(first, x2, sin, value=-1, out=dst_k[..., :half])  # x1 cos - x2 sin
            second = torch.mul(x2, cos)
            torch.addcmul(second, x1, sin, out=dst_k[..., half:])  # x2 cos + x1 sin
        else:
            dst_k.copy_(k)
        if self.span is not None:
            dst_v.copy_(v)
        else:
            cache_k[:, self.pos] = dst_k
            cache_v[:, self.pos] = dst_v.to(cache_v.dtype)


def _flat_kv(kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor | None:
    """The bytes of one layer's K and V (or K part and V part) as one flat uint8 tensor when they are
    adjacent in memory, else None."""
    k, v = kv
    kb, vb = k.numel() * k.element_size(), v.numel() * v.element_size()
    if not (k.is_contiguous() and v.is_contiguous() and v.data_ptr() == k.data_ptr() + kb):
        return None
    return torch.as_strided(k.reshape(-1).view(torch.uint8), (kb + vb,), (1,))  # K bytes then V bytes


def _runs(fill: list[int], where: dict[int, int], sizes: dict[int, int],
          dests: dict[int, tuple[torch.Tensor, int]]) -> list[list[int]]:
    """The segments of `fill` in runs that are adjacent both in the slot and in one device buffer
    (`dests`: per segment its (buffer, byte offset)); each run is one copy."""
    runs: list[list[int]] = []
    for i in fill:
        if runs:
            j = runs[-1][-1]
            (buf_j, at_j), (buf_i, at_i) = dests[j], dests[i]
            if where[j] + sizes[j] == where[i] and buf_j is buf_i and at_j + sizes[j] == at_i:
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs
