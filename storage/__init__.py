"""kvblend.storage: the tiered KV store.

Modules, one concept each:
  keys           content addresses: chunk_key, prefix_block_key, tokens_digest
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
  bench          `kvblend bench load`: tier read/write throughput vs raw reads
  cli            `kvblend store stats|ls|clear` and `bench load` registration
"""

from storage.config import StoreConfig
from storage.entry import CorruptEntry, EntryHeader, KVEntry, entry_nbytes
from storage.keys import LAYOUT_VERSION, chunk_key, prefix_block_key, tokens_digest
from storage.stack import Located, TieredStore, build_tier
from storage.tier import StoreUnavailable, Tier

__all__ = [
    "LAYOUT_VERSION",
    "CorruptEntry",
    "EntryHeader",
    "KVEntry",
    "Located",
    "StoreConfig",
    "StoreUnavailable",
    "Tier",
    "TieredStore",
    "build_tier",
    "chunk_key",
    "entry_nbytes",
    "prefix_block_key",
    "tokens_digest",
]
