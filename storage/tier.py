"""The tier protocol every storage backend implements, plus shared counters.

A tier stores entries under string keys and serves single layers. Contract:
- reads return tensors in the storage dtype, checksum-verified, or None on a miss;
- a corrupt entry is logged (warning), deleted, counted in `corrupt`, and read as a miss:
  a tier never returns bad data;
- `put` never raises for I/O trouble unless the tier is configured `required: true`
  (then StoreUnavailable); failures are logged and counted in `errors`;
- reads given a `header` serve only layers of that very entry: if the stored entry was
  replaced meanwhile, the read is a miss;
- a tier built with a `namespace` stores, lists, counts, evicts and clears only the keys
  of that namespace (tenants sharing a server or a directory never touch each other).
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Protocol, runtime_checkable

from torch import Tensor

from storage.entry import CorruptEntry, EntryHeader, KVEntry

log = logging.getLogger("kvblend.storage")

Layer = tuple[Tensor, Tensor]  # (K, V), each (kv_heads, num_tokens, head_dim)


class StoreUnavailable(RuntimeError):
    """A tier cannot be used where it must be: one configured `required: true` (server
    unreachable, disk unwritable), or any tier a delete must reach."""


@runtime_checkable
class Tier(Protocol):
    """One storage level (cpu, disk, redis, redis-cluster). Implementations are thread-safe."""

    name: str

    def contains(self, key: str) -> bool:
        """True if an entry is stored under `key` (not verified). No counters change."""
        ...

    def get_header(self, key: str) -> EntryHeader | None:
        """The entry's header or None; counts a hit or miss; refreshes LRU recency."""
        ...

    def peek_header(self, key: str) -> EntryHeader | None:
        """The entry's header, None if absent or out of reach, CorruptEntry if unreadable;
        changes nothing (no counter, no recency, no deletion): for listings."""
        ...

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None) -> Layer | None:
        """Layer `layer` as (K, V), verified; None on miss. Pass `header` to save a read."""
        ...

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None) -> list[Layer | None]:
        """Several layers, batched in one round trip where the backend allows it."""
        ...

    def get(self, key: str) -> KVEntry | None:
        """The whole entry, verified, or None."""
        ...

    def put(self, key: str, entry: KVEntry) -> None:
        """Store `entry` under `key`, replacing any previous one; may evict others."""
        ...

    def delete(self, key: str) -> bool:
        """Remove `key` if present (no error if absent); False when the tier could not be
        reached (the entry, if any, stays)."""
        ...

    def keys(self) -> Iterator[str]:
        """Iterate over stored keys (a snapshot; entries may vanish meanwhile)."""
        ...

    def clear(self) -> bool:
        """Remove every entry of this tier (only this store's keys for shared servers);
        False when the tier could not be reached (nothing was deleted)."""
        ...

    def close(self) -> None:
        """Release connections/handles; the tier is unusable afterwards."""
        ...

    def stats(self) -> dict:
        """Plain-dict counters for JSON: see TierStats; redis tiers add `down`."""
        ...


@dataclass
class TierStats:
    """Counters shared by all tiers. Update through the methods (they take a lock)."""

    hits: int = 0  # entry lookups (get_header / get) that found the entry
    misses: int = 0
    layer_reads: int = 0
    layer_misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    puts: int = 0
    evictions: int = 0
    errors: int = 0
    corrupt: int = 0
    partial: int = 0  # entries found without some of their layers (evicted or cut), deleted

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def snapshot(self, entries: int, bytes_used: int) -> dict:
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["read_gbps"] = out["bytes_read"] / out["read_seconds"] / 1e9 if out["read_seconds"] else 0.0
        out["write_gbps"] = out["bytes_written"] / out["write_seconds"] / 1e9 if out["write_seconds"] else 0.0
        out["entries"] = entries
        out["bytes_used"] = bytes_used
        return out


def tier_class(kind: str) -> type[Tier]:
    """The class implementing tier `kind`: the registry is storage.config.TIER_CONFIGS (kind ->
    config class), whose `TIER` names the implementation ("module:Class"), imported here on
    first use so that loading a config imports neither torch nor redis. ValueError lists the kinds."""
    from storage.config import tier_config_class

    module, _, name = tier_config_class(kind).TIER.partition(":")
    return getattr(importlib.import_module(module), name)


def report_corrupt(tier: Tier, stats: TierStats, key: str, err: Exception) -> None:
    """Log a corrupt entry, count it and delete it so it is recomputed. Never raises."""
    log.warning("%s tier: entry %s is corrupt (%s); deleted, it will be recomputed", tier.name, key, err)
    stats.add(corrupt=1)
    tier.delete(key)


def over_budget(tier: Tier, stats: TierStats, key: str, size: int, budget: int) -> bool:
    """True (after a warning and an `errors` count) when one entry alone exceeds the budget."""
    if size <= budget:
        return False
    from storage.config import format_bytes

    log.warning("%s tier: entry %s (%s) exceeds the budget (%s); not cached - raise budget",
                tier.name, key, format_bytes(size), format_bytes(budget))
    stats.add(errors=1)
    return True


def read_entry(tier: Tier, key: str) -> KVEntry | None:
    """Read a whole entry through `get_header` + `get_layers`; None if any part is missing."""
    header = tier.get_header(key)
    if header is None:
        return None
    layers = tier.get_layers(key, range(header.num_layers), header)
    if any(layer is None for layer in layers):
        return None
    return KVEntry(header=header, layers=list(layers))


__all__ = ["CorruptEntry", "Layer", "StoreUnavailable", "Tier", "TierStats", "read_entry", "report_corrupt",
           "tier_class"]
