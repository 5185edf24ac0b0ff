"""CPU-memory tier: entries kept as tensors in an LRU dict under a byte budget.

Ownership: entries are read-only once put. Reads hand out views of the stored memory,
never copies: a caller copies what it needs (to the device, into its own cache) and
must not modify what it got (re-rotation and dtype conversion happen on the
destination). Memory is trusted: layers are not re-checksummed on read.

Where CUDA is available the tier keeps entries in page-locked (pinned) memory from a
`PinnedPool` sized to the budget, one contiguous block per entry laid out layer by
layer (each layer's K then V), so the GPU copies a layer of an entry with one DMA at
full link speed. A block returns to the pool only when no tensor refers to it any more:
a reader that copies asynchronously keeps its views until the copy has completed. When
the pool cannot place an entry (fragmented, or pinning failed) the entry is kept in
ordinary memory; it still works, only its copies are slower. CPU-only machines keep
entries by reference as put (no pool, no copy).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from storage.config import CpuTierConfig, tier_display_name
from storage.entry import EntryHeader, KVEntry
from storage.serialization import layer_views
from storage.tier import Layer, TierStats, over_budget, read_entry

log = logging.getLogger("kvblend.storage")

MIB = 1 << 20
SLAB_BYTES = 256 * MIB  # pinned memory is taken from the OS in slabs of this size, lazily
BLOCK_ALIGN = 512  # block offsets inside a slab


def _align(n: int, to: int = BLOCK_ALIGN) -> int:
    return (n + to - 1) // to * to


class PinnedPool:
    """Page-locked host memory under a byte budget, carved into blocks from slabs.

    `allocate(n)` returns a uint8 tensor of n bytes with its own storage; the block goes
    back to the pool when the last tensor (or view) referring to it is gone. Slabs are
    allocated on first need up to the budget rounded up to whole slabs (below one slab: to
    a power of two). Thread-safe.

    pin=False uses ordinary memory with the same bookkeeping (tests on CPU-only machines).
    """

    def __init__(self, budget: int, *, slab_bytes: int = SLAB_BYTES, pin: bool = True):
        if budget <= 0:
            raise ValueError(f"pinned pool budget must be > 0, got {budget}")
        self.budget = budget
        self.slab_bytes = slab_bytes
        self.pin = pin
        self._slabs: list[torch.Tensor] = []  # (slab_bytes,) uint8 each
        self._free: list[list[tuple[int, int]]] = []  # per slab: sorted (offset, size) free ranges
        self._lock = threading.RLock()  # a block's release may run inside another pool call's thread
        self._used = 0
        self._failed = False

    @property
    def capacity(self) -> int:
        """Bytes of slabs allocated so far."""
        with self._lock:
            return sum(s.numel() for s in self._slabs)

    @property
    def used(self) -> int:
        """Bytes in live blocks (including blocks of evicted entries still referenced by a reader)."""
        with self._lock:
            return self._used

    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A (nbytes,) uint8 tensor in the pool, or None when it does not fit (the caller evicts or
        falls back to ordinary memory). Never raises for lack of memory."""
        size = _align(max(1, nbytes))
        with self._lock:
            for i, ranges in enumerate(self._free):
                for j, (off, free) in enumerate(ranges):
                    if free >= size:
                        ranges[j:j + 1] = [(off + size, free - size)] if free > size else []
                        return self._block(i, off, size, nbytes)
            slab = self._new_slab(size)
            if slab is None:
                return None
            rest = self._slabs[slab].numel() - size
            self._free[slab] = [(size, rest)] if rest else []
            return self._block(slab, 0, size, nbytes)

    def _new_slab(self, size: int) -> int | None:
        """Index of a newly allocated slab holding at least `size` bytes, or None (budget, pinning)."""
        if self._failed:
            return None
        # slabs are powers of two (the host allocator behind pin_memory rounds every request up to
        # one): the budget rounded up to whole slabs, or to one power of two below a slab
        limit = (1 << (self.budget - 1).bit_length() if self.budget < self.slab_bytes
                 else -(-self.budget // self.slab_bytes) * self.slab_bytes)
        room = limit - self.capacity
        want = max(self.slab_bytes if self.budget >= self.slab_bytes else limit, 1 << (size - 1).bit_length())
        if want > room:
            return None
        try:
            slab = torch.empty(want, dtype=torch.uint8, pin_memory=self.pin)  # (want,)
        except RuntimeError as err:  # page-locking refused (ulimit -l, no memory): ordinary memory from now on
            log.warning("cpu tier: cannot pin %d MiB of host memory (%s); keeping entries in ordinary memory, "
                        "GPU copies from this tier will be slower", want // MIB, err)
            self._failed = True
            return None
        self._slabs.append(slab)
        self._free.append([])
        return len(self._slabs) - 1

    def _block(self, slab: int, off: int, size: int, nbytes: int) -> torch.Tensor:
        """A tensor over [off, off + nbytes) of a slab whose range returns to the pool when it dies."""
        self._used += size
        array = self._slabs[slab].numpy()[off:off + nbytes]  # numpy view: its lifetime is the block's
        block = torch.from_numpy(array)  # (nbytes,) uint8; a storage of its own that keeps `array` alive
        weakref.finalize(array, self._release, slab, off, size)
        return block

    def _release(self, slab: int, off: int, size: int) -> None:
        with self._lock:
            self._used -= size
            if slab >= len(self._free):
                return  # the pool was closed meanwhile
            ranges = self._free[slab]
            ranges.append((off, size))
            ranges.sort()
            merged: list[tuple[int, int]] = []
            for o, s in ranges:
                if merged and merged[-1][0] + merged[-1][1] == o:
                    merged[-1] = (merged[-1][0], merged[-1][1] + s)
                else:
                    merged.append((o, s))
            self._free[slab] = merged

    def close(self) -> None:
        """Drop the pool's references to its slabs (memory held by live blocks stays valid)."""
        with self._lock:
            self._slabs.clear()
            self._free.clear()


def pinned_entry(entry: KVEntry, pool: PinnedPool) -> KVEntry | None:
    """A copy of `entry` in one pool block (layer by layer, K then V, or an encoded entry's K part
    then V part), or None when it does not fit."""
    header = entry.header
    block = pool.allocate(header.nbytes)
    if block is None:
        return None
    n = header.layer_nbytes
    layers = []
    for i, (k, v) in enumerate(entry.layers):
        dst_k, dst_v = layer_views(block[i * n : (i + 1) * n], header)  # (H, T, D) each, or flat parts
        dst_k.copy_(k)
        dst_v.copy_(v)
        layers.append((dst_k, dst_v))
    return KVEntry(header, layers)


class CpuTier:
    """LRU tier in process memory; thread-safe.

    pinned: None (default) pins entries where CUDA is available; True/False force it
    (False: entries by reference, today's CPU behaviour).
    """

    def __init__(self, config: CpuTierConfig, *, namespace: str = "", pinned: bool | None = None) -> None:
        self.config = config
        self.namespace = namespace  # process memory is private: nothing to separate
        self.name = tier_display_name(config)
        self.budget = config.budget
        if pinned is None:
            pinned = torch.cuda.is_available()
        self.pool = PinnedPool(self.budget, pin=torch.cuda.is_available()) if pinned else None
        self._entries: OrderedDict[str, KVEntry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._stats = TierStats()

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._entries

    def _touch(self, key: str) -> KVEntry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def peek_header(self, key: str) -> EntryHeader | None:
        with self._lock:
            entry = self._entries.get(key)
        return entry.header if entry is not None else None

    def get_header(self, key: str) -> EntryHeader | None:
        entry = self._touch(key)
        if entry is None:
            self._stats.add(misses=1)
            return None
        self._stats.add(hits=1)
        return entry.header

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None) -> Layer | None:
        """Layer `layer` as (K, V) views of the stored memory (do not modify them); None on miss
        or if the entry is not `header`'s. Refreshes recency. The views keep the memory alive
        after an eviction."""
        t0 = time.perf_counter()
        entry = self._touch(key)
        if entry is None or (header is not None and entry.header != header):
            self._stats.add(layer_misses=1)
            return None
        if not 0 <= layer < entry.header.num_layers:
            raise IndexError(f"layer {layer} out of range: entry has {entry.header.num_layers} layers")
        out = entry.layers[layer]  # (H, T, D) each, views
        self._stats.add(
            layer_reads=1, bytes_read=entry.header.layer_nbytes, read_seconds=time.perf_counter() - t0
        )
        return out

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None) -> list[Layer | None]:
        return [self.get_layer(key, i, header) for i in layers]

    def get_views(self, key: str, layers: Sequence[int]) -> list[Layer] | None:
        """(K, V) views of the stored memory for several layers of one entry, in one call (the
        loader's zero-copy path); None on a miss. Counts the layer reads; refreshes recency."""
        t0 = time.perf_counter()
        entry = self._touch(key)
        if entry is None:
            self._stats.add(layer_misses=len(layers))
            return None
        out = [entry.layers[i] for i in layers]
        self._stats.add(layer_reads=len(out), bytes_read=entry.header.layer_nbytes * len(out),
                        read_seconds=time.perf_counter() - t0)
        return out

    def read_layer_into(self, key: str, layer: int, header: EntryHeader | None, out: torch.Tensor) -> bool:
        """Copy layer `layer` (K bytes then V bytes, or an encoded entry's K part then V part) into
        `out`, a (layer_nbytes,) uint8 CPU tensor. False on a miss (out untouched)."""
        entry = self._touch(key)
        got = self.get_layer(key, layer, header)
        if got is None or entry is None:
            return False
        dst_k, dst_v = layer_views(out, header or entry.header)
        dst_k.copy_(got[0])
        dst_v.copy_(got[1])
        return True

    def get(self, key: str) -> KVEntry | None:
        return read_entry(self, key)

    def put(self, key: str, entry: KVEntry) -> None:
        """Store `entry`, evicting least recently used entries past the budget.

        Pinned: the entry is copied into one pool block (a fragmented pool evicts further
        entries first; failing that the entry is kept as given). Otherwise it is kept by
        reference: do not modify it afterwards. An entry larger than the whole budget is
        not stored (warning + `errors`).
        """
        t0 = time.perf_counter()
        size = entry.nbytes
        if over_budget(self, self._stats, key, size, self.budget):
            return
        evicted: list[KVEntry] = []  # dropped outside the lock: a pool block may be released with them
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
                evicted.append(old)
            while self._bytes + size > self.budget and self._entries:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                evicted.append(victim)
        count = len(evicted) - (old is not None)
        if self.pool is not None:
            stored, more = self._pin(entry, evicted)
            count += more
        else:
            stored = entry
        evicted.clear()
        with self._lock:
            while self._bytes + size > self.budget and self._entries:  # other threads put meanwhile
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                evicted.append(victim)
                count += 1
            self._entries[key] = stored
            self._bytes += size
        evicted.clear()
        self._stats.add(puts=1, bytes_written=size, evictions=count, write_seconds=time.perf_counter() - t0)

    def _pin(self, entry: KVEntry, evicted: list[KVEntry]) -> tuple[KVEntry, int]:
        """`entry` copied into the pool, evicting LRU entries while the pool cannot place it;
        (the entry as given, ...) when nothing helps. Returns the stored entry and the extra evictions."""
        assert self.pool is not None
        evicted.clear()  # their blocks return to the pool unless a reader still holds views
        more = 0
        while True:
            pinned = pinned_entry(entry, self.pool)
            if pinned is not None:
                return pinned, more
            with self._lock:
                if not self._entries:
                    victim = None
                else:
                    _, victim = self._entries.popitem(last=False)
                    self._bytes -= victim.nbytes
            if victim is None:
                log.debug("cpu tier: pinned pool cannot place %d bytes; kept in ordinary memory", entry.nbytes)
                return entry, more
            more += 1
            del victim

    def delete(self, key: str) -> bool:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
        del old
        return True

    def keys(self) -> Iterator[str]:
        with self._lock:
            snapshot = list(self._entries)
        return iter(snapshot)

    def clear(self) -> bool:
        with self._lock:
            entries, self._entries = self._entries, OrderedDict()
            self._bytes = 0
        entries.clear()
        return True

    def close(self) -> None:
        self.clear()
        if self.pool is not None:
            self.pool.close()

    def stats(self) -> dict:
        with self._lock:
            entries, used = len(self._entries), self._bytes
        out = self._stats.snapshot(entries, used) | {"budget": self.budget}
        if self.pool is not None:
            out |= {"pinned_bytes": self.pool.capacity, "pinned_used": self.pool.used}
        return out
