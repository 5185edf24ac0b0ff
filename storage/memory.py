"""CPU-memory tier: entries kept as tensors in an LRU dict under a byte budget.

Ownership: `put` keeps references to the entry's tensors (KVEntry.from_tensors already
made private copies); do not modify an entry after putting it. Reads return fresh
copies, so callers may modify what they get (e.g. re-rotate K) without touching the
cache. Memory is trusted: layers are not re-checksummed on read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from storage.config import CpuTierConfig, tier_display_name
from storage.entry import EntryHeader, KVEntry
from storage.tier import Layer, TierStats, over_budget, read_entry

log = logging.getLogger("kvblend.storage")


class CpuTier:
    """LRU tier in process memory; thread-safe."""

    def __init__(self, config: CpuTierConfig, *, namespace: str = "") -> None:
        self.config = config
        self.namespace = namespace  # process memory is private: nothing to separate
        self.name = tier_display_name(config)
        self.budget = config.budget
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

    def get_header(self, key: str) -> EntryHeader | None:
        entry = self._touch(key)
        if entry is None:
            self._stats.add(misses=1)
            return None
        self._stats.add(hits=1)
        return entry.header

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None) -> Layer | None:
        """A copy of layer `layer` (K, V); None on miss or if the entry is not `header`'s. Refreshes recency."""
        t0 = time.perf_counter()
        entry = self._touch(key)
        if entry is None or (header is not None and entry.header != header):
            self._stats.add(layer_misses=1)
            return None
        if not 0 <= layer < entry.header.num_layers:
            raise IndexError(f"layer {layer} out of range: entry has {entry.header.num_layers} layers")
        k, v = entry.layers[layer]
        out = (k.clone(), v.clone())  # (H, T, D) each
        self._stats.add(
            layer_reads=1, bytes_read=entry.header.layer_nbytes, read_seconds=time.perf_counter() - t0
        )
        return out

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None) -> list[Layer | None]:
        return [self.get_layer(key, i, header) for i in layers]

    def get(self, key: str) -> KVEntry | None:
        return read_entry(self, key)

    def put(self, key: str, entry: KVEntry) -> None:
        """Store `entry` (by reference), evicting least recently used entries past the budget.

        An entry larger than the whole budget is not stored (warning + `errors`).
        """
        t0 = time.perf_counter()
        size = entry.nbytes
        if over_budget(self, self._stats, key, size, self.budget):
            return
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._bytes + size > self.budget and self._entries:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                evicted += 1
            self._entries[key] = entry
            self._bytes += size
        self._stats.add(
            puts=1, bytes_written=size, evictions=evicted, write_seconds=time.perf_counter() - t0
        )

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes

    def keys(self) -> Iterator[str]:
        with self._lock:
            snapshot = list(self._entries)
        return iter(snapshot)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def close(self) -> None:
        self.clear()

    def stats(self) -> dict:
        with self._lock:
            entries, used = len(self._entries), self._bytes
        return self._stats.snapshot(entries, used) | {"budget": self.budget}
