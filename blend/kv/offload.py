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

A cache whose sliding-window layers are rings (a hybrid model decoding, blend.model.cache)
parks its other layers as those blocks and its ring layers as one entry of the positions
the rings hold; `restore` places both into a cache with rings again, the same cache.
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
from storage.entry import Expected, KVEntry
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
    bias: tuple[torch.Tensor, ...] | None  # per layer (kv_heads, n) float32 on the host (a ring layer: its positions)
    nbytes: int  # KV bytes written (compute dtype)
    # a cache with ring layers: (linear layers, ring layers); the blocks hold the linear layers,
    # `window` = (key, start, end) the ring layers' positions start..end-1
    split: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    window: tuple[str, int, int] | None = None


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
        if any(cache.rings):
            return self._park_split(ids, cache, owner)
        blocks = []
        for start in range(0, n, self.block_tokens):
            end = min(start + self.block_tokens, n)
            key = self._key(ids, owner, start, end)
            self.store.put(key, self.maker.from_cache(cache, ids[start:end], start), exact=True)
            blocks.append((key, start, end))
        bias = None if cache.bias is None else tuple(b[:, :n].to("cpu", copy=True) for b in cache.bias)
        return ParkedKV(owner, tuple(ids), tuple(blocks), bias, cache.nbytes())

    def _entry(self, cache: KVCache, layers: Sequence[int], ids: Sequence[int], start: int, end: int) -> KVEntry:
        kv = [cache.window(i, start, end) for i in layers]  # (Hkv, end - start, D) each, position order
        return KVEntry.from_tensors(kv, fingerprint=self.maker.fingerprint, token_ids=list(ids[start:end]),
                                    pos_start=start, kv_dtype=self.dtype)

    def _expected(self, layers: Sequence[int], ids: Sequence[int], start: int) -> Expected:
        r = self.runner
        return Expected.of(list(ids), fingerprint=self.maker.fingerprint, num_layers=len(layers),
                           kv_heads=r.kv_heads, head_dim=r.head_dim, kv_dtype=self.dtype, pos_start=start)

    def _park_split(self, ids: list[int], cache: KVCache, owner: str) -> ParkedKV:
        """Park a cache with ring layers: its linear layers as blocks, its rings as one entry."""
        n = len(ids)
        linear = tuple(i for i, r in enumerate(cache.rings) if r is None)
        rings = tuple(i for i, r in enumerate(cache.rings) if r is not None)
        blocks = []
        for start in range(0, n, self.block_tokens) if linear else ():
            end = min(start + self.block_tokens, n)
            key = self._key(ids, owner, start, end)
            self.store.put(key, self._entry(cache, linear, ids, start, end), exact=True)
            blocks.append((key, start, end))
        lo = max(0, n - min(cache.k[i].shape[1] for i in rings))  # the positions every ring holds
        window = (self._key(ids, f"{owner}-rings", lo, n), lo, n)  # its own key: it may span a block exactly
        self.store.put(window[0], self._entry(cache, rings, ids, lo, n), exact=True)
        bias = None
        if cache.bias is not None:
            bias = tuple((cache.window_bias(i, lo, n) if i in rings else cache.bias[i][:, :n]).to("cpu", copy=True)
                         for i in range(len(cache.k)))
        return ParkedKV(owner, tuple(ids), tuple(blocks), bias, cache.nbytes(), (linear, rings), window)

    def restore(self, parked: ParkedKV, capacity: int) -> KVCache | None:
        """A new cache of `capacity` positions holding the parked KV (and bias), or None when
        some block cannot be read back (the caller recomputes)."""
        ids = list(parked.token_ids)
        # blocks still in the write-behind queue are read from it (TieredStore.lookup): no wait for the writer
        budget = LookupBudget(self.stall_s)
        placements = []
        linear, rings = parked.split if parked.split is not None else (None, ())
        entries = [(key, start, end, linear) for key, start, end in parked.blocks]
        if parked.window is not None:
            entries.append((*parked.window, rings))
        for key, start, end, layers in entries:
            expected = (self.maker.expected(ids[start:end], start) if layers is None
                        else self._expected(layers, ids[start:end], start))
            located = self.store.lookup(key, expected, budget)
            if located is None:
                log.info("parked KV block %s is gone from the tiers; the sequence is recomputed", key[:20])
                return None
            placements.append(Placement(start, end - start, start, located, None, layers=layers))
        cache = self.runner.new_cache(max(capacity, len(ids)), ring=parked.split is not None)
        cache.length = len(ids)
        try:
            with LayerLoader(self.store, self.runner, cache, placements, range(self.runner.num_layers),
                             self.prefetch_depth, stall_s=self.stall_s) as loader:
                for layer in range(self.runner.num_layers):
                    loader.wait(layer)
        except (LoadStalled, StoreUnavailable, OSError) as err:
            log.info("parked KV could not be read back (%s); the sequence is recomputed", err)
            return None
        if parked.bias is not None and parked.split is None:
            cache.restore_bias(list(parked.bias))
        elif parked.bias is not None:
            n, (lo, end) = len(ids), parked.window[1:]  # type: ignore[index]
            cache.bias = [torch.zeros((t.shape[0], t.shape[1]), dtype=torch.float32, device=t.device) for t in cache.k]
            for i, b in enumerate(parked.bias):
                where = cache.slots(i, lo, end) if i in rings else slice(0, n)
                cache.bias[i][:, where] = b.to(cache.bias[i].device)
        return cache

    def release(self, parked: ParkedKV) -> None:
        """Delete the parked blocks from every tier (best effort: a tier out of reach ages them out)."""
        for key, _start, _end in (*parked.blocks, *((parked.window,) if parked.window is not None else ())):
            try:
                self.store.delete(key)
            except (OSError, StoreUnavailable) as err:  # pragma: no cover - a tier gone mid-delete
                log.debug("parked block %s not deleted: %s", key[:20], err)

