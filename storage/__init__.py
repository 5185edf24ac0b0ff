"""kvblend.storage: the tiered KV store.

Modules, one concept each:
  keys           content addresses: document_block_key, prefix_block_key, tokens_digest
  entry          EntryHeader, KVEntry (per-layer K/V tensors), CorruptEntry
  checksum       per-layer checksum (xxh3_64 when available, crc32 otherwise)
  serialization  header/layer <-> bytes and verification (no pickle)
  tier           the Tier protocol, TierStats, StoreUnavailable
  memory         CpuTier: LRU in process memory
  disk           DiskTier: one file per entry, atomic writes, LRU on mtime
  redis_tier     RedisTier: per-layer keys, pipelining, down/backoff handling
  cluster        RedisClusterTier: the same on Redis Cluster (hash-tagged keys)
  stack          TieredStore: lookup / read / write / promotion over the tiers
  config         StoreConfig and the per-tier configs (from the YAML `store:` section)
  units          byte sizes: parse "2GiB", format for messages
  dtypes         the dtype table (names, bytes, torch dtypes) and KV bytes per token
"""

from typing import Any

_EXPORTS = {
    "LAYOUT_VERSION": "storage.keys", "document_block_key": "storage.keys", "prefix_block_key": "storage.keys",
    "tokens_digest": "storage.keys", "StoreConfig": "storage.config", "CorruptEntry": "storage.entry",
    "EntryHeader": "storage.entry", "KVEntry": "storage.entry", "entry_nbytes": "storage.entry",
    "Located": "storage.stack", "LookupBudget": "storage.stack", "TieredStore": "storage.stack", "build_tier": "storage.stack",
    "StoreUnavailable": "storage.tier", "Tier": "storage.tier",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:  # lazy: importing a light submodule does not import torch or redis
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'storage' has no attribute {name!r}")
