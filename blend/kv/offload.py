"""Preemption by offload: a running sequence's KV parked in the tier stack, and restored.

When the scheduler needs device memory back it parks the newest running sequence: the
KV of every position it holds is written to the tiers as a chain of blocks (the prefix
block machinery: `EntryMaker.from_cache`, write-behind `TieredStore.put`), in the compute
dtype and in no tier's codec (`exact`) so that the restored cache is the one parked (bit for
bit), under keys private to
this parking (`storage.keys.parked_block_key`: blended KV is not exact for its tokens and
must never be found by a prefix lookup). The cache's stale-key bias (blend's
`KVCache.bias`, a few hundred bytes per token) stays with the sequence on the host.
`restore` reads the chain back through a `LayerLoader` into a new cache; a block the
tiers lost (evicted, a tier down, a stall) makes it None: the caller recomputes.
`release` deletes the parked blocks once they are not needed.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend.kv.loader import LayerLoader, LoadStalled, Placement
from blend.kv.prefix import EntryMaker
from blend.model.cache import KVCache
from blend.model.runner import Runner
from storage.dtypes import dtype_name
from storage.keys import parked_block_key
from storage.stack import LookupBudget, TieredStore
from storage.tier import StoreUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParkedKV:
    """What a parking left in the tiers: the blocks of positions 0..len(token_ids)-1."""

    owner: str
    token_ids: tuple[int, ...]
    blocks: tuple[tuple[str, int, int], ...]  # (key, start, end)
    bias: tuple[torch.Tensor, ...] | None  # per layer (kv_heads, n) float32 on the host, or None
    nbytes: int  # KV bytes written (compute dtype)


class KVParking:
    """Parks and restores whole sequences' KV in one engine's tier stack."""

    def __init__(self, store: TieredStore, runner: Runner, fingerprint: str, *, namespace: str, block_tokens: int,
                 prefetch_depth: int, stall_s: float | None = None):
        self.store, self.runner = store, runner
        self.dtype = dtype_name(runner.dtype)  # exact: the compute dtype
        self.maker = EntryMaker(runner, fingerprint, self.dtype)
        self.namespace, self.block_tokens = namespace, block_tokens
        self.prefetch_depth, self.stall_s = prefetch_depth, stall_s

    def _key(self, ids: Sequence[int], owner: str, start: int, end: int) -> str:
        return parked_block_key(self.maker.fingerprint, ids[:end], self.dtype, self.namespace, owner=owner,
                                start=start)

    def park(self, token_ids: Sequence[int], cache: KVCache) -> ParkedKV:
        """Queue the KV of `cache`'s positions 0..cache.length-1 (holding `token_ids`) for the
        tiers. The cache is not modified (the caller drops it)."""
        n = cache.length
        ids = [int(t) for t in token_ids[:n]]
        if len(ids) != n:
            raise ValueError(f"parking {n} positions needs their {n} token ids, got {len(token_ids)}")
        owner = secrets.token_hex(8)
        blocks = []
        for start in range(0, n, self.block_tokens):
            end = min(start + self.block_tokens, n)
            key = self._key(ids, owner, start, end)
            self.store.put(key, self.maker.from_cache(cache, ids[start:end], start), exact=True)
            blocks.append((key, start, end))
        bias = None if cache.bias is None else tuple(b[:, :n].to("cpu", copy=True) for b in cache.bias)
        return ParkedKV(owner, tuple(ids), tuple(blocks), bias, cache.nbytes())

    def restore(self, parked: ParkedKV, capacity: int) -> KVCache | None:
        """A new cache of `capacity` positions holding the parked KV (and bias), or None when
        some block cannot be read back (the caller recomputes)."""
        ids = list(parked.token_ids)
        try:
            self.store.flush()  # the parked blocks may still be in the write-behind queue
        except (OSError, StoreUnavailable) as err:
            log.warning("parked KV: flushing the store failed (%s); recomputing", err)
        budget = LookupBudget(self.stall_s)
        placements = []
        for key, start, end in parked.blocks:
            located = self.store.lookup(key, self.maker.expected(ids[start:end], start), budget)
            if located is None:
                log.info("parked KV block %s is gone from the tiers; the sequence is recomputed", key[:20])
                return None
            placements.append(Placement(start, end - start, start, located, None, _unrecoverable))
        cache = self.runner.new_cache(max(capacity, len(ids)))
        cache.length = len(ids)
        try:
            with LayerLoader(self.store, self.runner, cache, placements, range(self.runner.num_layers),
                             self.prefetch_depth, stall_s=self.stall_s) as loader:
                for layer in range(self.runner.num_layers):
                    loader.wait(layer)
        except (LoadStalled, _Unrecoverable, StoreUnavailable, OSError) as err:
            log.info("parked KV could not be read back (%s); the sequence is recomputed", err)
            return None
        if parked.bias is not None:
            cache.restore_bias(list(parked.bias))
        return cache

    def release(self, parked: ParkedKV) -> None:
        """Delete the parked blocks from every tier (best effort: a tier out of reach ages them out)."""
        for key, _start, _end in parked.blocks:
            try:
                self.store.delete(key)
            except (OSError, StoreUnavailable) as err:  # pragma: no cover - a tier gone mid-delete
                log.debug("parked block %s not deleted: %s", key[:20], err)


class _Unrecoverable(RuntimeError):
    """A parked block's layer was unreadable: parked KV cannot be recomputed from its tokens."""


def _unrecoverable():
    raise _Unrecoverable("a parked layer was unreadable")
