"""Exact prefix caching: a token sequence's KV stored as a chain of fixed-size blocks.

Block b covers tokens [b*B, (b+1)*B) of a sequence (B = `block_tokens`) and is keyed by
the digest of ALL tokens from the start of the sequence to its end, so a block is only
ever reused after exactly the same tokens: its KV is exact, no recompute needed. A chat
turn also stores its partial tail block, so a resumed conversation computes only its
new tokens. Used by `prefix` mode and by chat sessions.

`compute_entry` (KV of some tokens computed after a context) is the one place where a
cache entry is made from the model.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from blend.kv.loader import LayerLoader, Placement
from blend.model.cache import KVCache
from blend.model.plan import Done, PlanCursor, Want
from blend.model.runner import Rows, Runner
from blend.stats import LoadReport
from storage.entry import Expected, KVEntry
from storage.keys import prefix_block_key
from storage.stack import LookupBudget, TieredStore

CONTEXT_KEEP_BYTES = 64 << 20  # a context's KV above this is not kept between documents
PACK_TOKENS = 2048  # documents ingested together are prefilled in passes of at most this many tokens ...
PACK_KEYS = 16384  # ... and at most this many padded keys (documents x (context + the longest)) per pass
# A longer document is prefilled alone: its rows already keep the linear layers busy, and a packed pass's
# masked attention visits the whole padded block where a causal kernel skips the upper triangle (2 CPU
# cores: ~650-token documents gained nothing measurable packed; 100 one-sentence passages went from 281 to
# 92 ms each with the context kept and packing).
PACK_DOCUMENT_TOKENS = 256


class EntryMaker:
    """Computes cache entries of one model in the storage dtype.

    Documents computed after the same context (the prompt's system part) share its KV:
    the context is prefilled once and kept (in the compute dtype, up to
    CONTEXT_KEEP_BYTES) while the next document comes with the same context; each
    document then prefills only its own tokens after a copy of it. Causal attention makes
    this the same computation as one pass over context + document.
    """

    def __init__(self, runner: Runner, fingerprint: str, kv_dtype: str):
        self.runner, self.fingerprint, self.kv_dtype = runner, fingerprint, kv_dtype
        self._context: tuple[tuple[int, ...], KVCache] | None = None  # the last context and its KV
        self._lock = threading.Lock()

    def expected(self, token_ids: Sequence[int], pos_start: int) -> Expected:
        """What a stored entry of `token_ids` (keys rotated from `pos_start`) must look like."""
        r = self.runner
        return Expected.of(token_ids, fingerprint=self.fingerprint, num_layers=r.num_layers, kv_heads=r.kv_heads,
                           head_dim=r.head_dim, kv_dtype=self.kv_dtype, pos_start=pos_start)

    def compute(self, token_ids: Sequence[int], context: Sequence[int] = ()) -> KVEntry:
        """KV of `token_ids` computed after `context` (positions len(context)..), as an entry."""
        ids = list(context) + list(token_ids)
        cache = self.runner.new_cache(len(ids))
        self.runner.prefill(torch.tensor(ids), cache, logit_rows=())
        return self.from_cache(cache, list(token_ids), len(context))

    def compute_blocks(self, token_ids: Sequence[int], context: Sequence[int],
                       bounds: Sequence[tuple[int, int]]) -> list[KVEntry]:
        """KV of `token_ids` computed as one sequence after `context`, cut into one entry per
        (start, end) range of `bounds` (offsets into token_ids). The context's KV is
        computed once for consecutive calls with the same context (`context_kv`)."""
        own, start = list(token_ids), len(context)
        cache = self.runner.new_cache(start + len(own))
        if start:
            kept = self.context_kv(context)
            for layer in range(self.runner.num_layers):
                cache.k[layer][:, :start] = kept.k[layer][:, :start]
                cache.v[layer][:, :start] = kept.v[layer][:, :start]
            cache.length = start
        self.runner.prefill(torch.tensor(own), cache, start=start, logit_rows=())
        return [self.from_cache(cache, own[a:b], start + a) for a, b in bounds]

    def document_passes(self, documents: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]]]],
                        context: Sequence[int]) -> DocumentPasses:
        """Several documents after the same context computed together, one forward pass per step
        (`pack_groups` passes), as a plan (`DocumentPasses`): its value, each document's entries."""
        return DocumentPasses(self, documents, context)

    def context_kv(self, context: Sequence[int]) -> KVCache:
        """The KV of `context` prefilled alone from position 0 (compute dtype): the kept one
        when the last context was the same, else computed now (and kept when small enough).
        The returned cache is shared: read it, never write to it."""
        ids = tuple(context)
        with self._lock:
            if self._context is not None and self._context[0] == ids:
                return self._context[1]
        cache = self.runner.new_cache(len(ids))
        self.runner.prefill(torch.tensor(ids), cache, logit_rows=())
        with self._lock:
            self._context = (ids, cache) if cache.nbytes() <= CONTEXT_KEEP_BYTES else None
        return cache

    def from_cache(self, cache: KVCache, token_ids: Sequence[int], start: int) -> KVEntry:
        """Slots start..start+len(token_ids)-1 of `cache` (keys rotated at those positions)
        as an entry (copied, storage dtype)."""
        return self.from_slots(cache, token_ids, start, start)

    def from_slots(self, cache: KVCache, token_ids: Sequence[int], slot: int, pos_start: int) -> KVEntry:
        """Slots slot..slot+len(token_ids)-1 of `cache`, whose keys are rotated at positions
        pos_start.., as an entry (copied, storage dtype; it carries the model's RoPE frequencies, so
        a tier's codec may quantize the keys before RoPE)."""
        end = slot + len(token_ids)
        layers = [(cache.k[i][:, slot:end], cache.v[i][:, slot:end]) for i in range(self.runner.num_layers)]
        return KVEntry.from_tensors(layers, fingerprint=self.fingerprint, token_ids=list(token_ids),
                                    pos_start=pos_start, kv_dtype=self.kv_dtype, rope=self.rope())

    def harvest(self, cache: KVCache, token_ids: Sequence[int], slot: int, pos_start: int) -> KVEntry:
        """Slots slot..slot+len(token_ids)-1 of a prompt's cache (slot = position: keys rotated at
        their prompt positions) as an entry whose keys are rotated at `pos_start`, the position
        the segment's standalone entry has: each layer's keys turned back by pos_start - slot in
        float32 (`Runner.rotate_into`), rounded once into the storage dtype. Its K/V are the
        tokens' K/V in that prompt's context (a full prefill's), not computed standalone: its
        header says so (`origin: harvested`)."""
        end, delta = slot + len(token_ids), pos_start - slot
        layers = []
        for i in range(self.runner.num_layers):
            k = cache.k[i][:, slot:end]
            turned = torch.empty(k.shape, dtype=torch.float32, device=k.device)
            self.runner.rotate_into(turned, k, delta, i)
            layers.append((turned, cache.v[i][:, slot:end]))
        return KVEntry.from_tensors(layers, fingerprint=self.fingerprint, token_ids=list(token_ids),
                                    pos_start=pos_start, kv_dtype=self.kv_dtype, rope=self.rope(), origin="harvested")

    def rope(self, layers: Sequence[int] | None = None) -> tuple[torch.Tensor, ...]:
        """The RoPE frequencies of each of `layers` (default: every layer), for an entry's `rope`."""
        r = self.runner
        return tuple(r.inv_freqs[r.layer_rope[i]] for i in (range(r.num_layers) if layers is None else layers))


def pack_groups(lengths: Sequence[int], context: int) -> list[list[int]]:
    """Consecutive indices of documents of `lengths` tokens (after `context` tokens) grouped
    into packed passes: each group holds at most PACK_TOKENS tokens and, padded to its
    longest, at most PACK_KEYS keys (the context is repeated per document); an item over
    the budget or over PACK_DOCUMENT_TOKENS, and the item after it, start a group of their
    own. Sorted lengths waste the least padding."""
    groups: list[list[int]] = []
    size = longest = 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        if (not groups or size + n > PACK_TOKENS or (len(groups[-1]) + 1) * (context + wider) > PACK_KEYS
                or wider > PACK_DOCUMENT_TOKENS):
            groups.append([])
            size, wider = 0, n
        groups[-1].append(i)
        size += n
        longest = wider
    return groups


class PrefixCache:
    """Prefix-block chains of one model over a tier stack. Thread-safe as the store is."""

    def __init__(self, store: TieredStore, maker: EntryMaker, *, namespace: str, block_tokens: int,
                 prefetch_depth: int, stall_s: float | None = None):
        self.store, self.maker = store, maker
        self.runner = maker.runner
        self.namespace, self.block_tokens, self.prefetch_depth = namespace, block_tokens, prefetch_depth
        # LayerLoader: the longest wait for one layer; also one lookup's header reads per tier (None: no limit)
        self.stall_s = stall_s

    def blocks(self, n: int) -> list[tuple[int, int]]:
        """(start, end) of the full blocks of a sequence of n tokens."""
        b = self.block_tokens
        return [(s, s + b) for s in range(0, n - b + 1, b)]

    def key(self, ids: Sequence[int], start: int, end: int) -> str:
        """The key of the block ids[start:end] (a full block, or a chat turn's partial tail)."""
        return prefix_block_key(self.maker.fingerprint, ids[:end], self.maker.kv_dtype, self.namespace, start=start)

    # ------------------------------------------------------------------ lookup
    def lookup(self, token_ids: Sequence[int], limit: int, tail_ends: Sequence[int] = ()) -> list[Placement]:
        """The chain of cached blocks covering token_ids[:p], longest p <= limit.

        Full blocks come first; then a partial tail block (stored by a chat turn) ending at
        one of `tail_ends` may extend the chain. The chain stops at the first block that is
        missing or fails verification.
        """
        ids = list(token_ids)
        chain: list[Placement] = []
        reached = 0
        budget = LookupBudget(self.stall_s)
        for start, end in self.blocks(len(ids)):
            if end > limit:
                break
            placement = self._find(ids, start, end, budget)
            if placement is None:
                break
            chain.append(placement)
            reached = end
        for end in sorted(set(tail_ends), reverse=True):
            if reached < end <= min(limit, reached + self.block_tokens - 1):
                placement = self._find(ids, reached, end, budget)
                if placement is not None:
                    chain.append(placement)
                    break
        return chain

    def _find(self, ids: list[int], start: int, end: int, budget: LookupBudget) -> Placement | None:
        """The stored block ids[start:end], verified, or None."""
        located = self.store.lookup(self.key(ids, start, end), self.maker.expected(ids[start:end], start), budget)
        if located is None:
            return None
        return Placement(start, end - start, start, located, None)

    # ------------------------------------------------------------------- store
    def store_blocks(self, token_ids: Sequence[int], cache: KVCache, *, skip_below: int = 0,
                     tail: bool = False) -> int:
        """Queue the full blocks of `token_ids` (whose KV is in `cache`) for the store; with
        `tail`, also the partial block after the last full one. Blocks ending at or below
        `skip_below` are known cached. Returns the number queued."""
        ids = list(token_ids)[: cache.length]
        blocks = self.blocks(len(ids))
        full_end = blocks[-1][1] if blocks else 0
        if tail and len(ids) > full_end:
            blocks.append((full_end, len(ids)))
        queued = 0
        for start, end in blocks:
            if end <= skip_below:
                continue
            self.store.put(self.key(ids, start, end), self.maker.from_cache(cache, ids[start:end], start))
            queued += 1
        return queued

    # ----------------------------------------------------------------- prefill
    def aligned_end(self, limit: int) -> int:
        """Where the longest chain of full blocks that a lookup up to `limit` could find ends."""
        return limit - limit % self.block_tokens

    def prefill_plan(self, token_ids: Sequence[int], chain: list[Placement], cache: KVCache, computed: int = 0, *,
                     boundary: int = 0) -> PrefixLoad:
        """Load `chain` (an exact cached prefix) layer by layer while computing the rest, as a plan
        (`PrefixLoad`) whose value is the last position's logits (vocab,) and the loader's report."""
        return PrefixLoad(self, token_ids, chain, cache, computed, boundary)


class DocumentPasses(PlanCursor):
    """Several documents after the same context computed together, one forward pass at a time
    (`pack_groups` passes): each want is a pass's items (one per document: its rows in a cache of
    its own after the context's K/V, only their K/V wanted; the scheduler decodes running
    sequences in the same steps); its value, each document's block entries (by `bounds`). A
    document's rows see the context and themselves only, and the executor's rows never depend
    on the other items of a step: an entry has the same bits whatever it was computed with."""

    def __init__(self, maker: EntryMaker, documents: Sequence[tuple[Sequence[int], Sequence[tuple[int, int]]]],
                 context: Sequence[int]):
        super().__init__()
        self.maker, self.documents, self.context = maker, list(documents), list(context)
        self.groups = pack_groups([len(ids) for ids, _ in self.documents], len(self.context))
        self.group = 0  # the pass under way
        self.caches: list[KVCache] = []  # its documents' caches
        self.entries: list[list[KVEntry]] = []  # per document, in order

    def _next(self, output: object, error: BaseException | None) -> Want:
        maker, start = self.maker, len(self.context)
        if self.stage == "pass":  # the pass ran: its documents' entries cut from their caches
            for i, cache in zip(self.groups[self.group], self.caches, strict=True):
                ids, bounds = list(self.documents[i][0]), self.documents[i][1]
                self.entries.append([maker.from_cache(cache, ids[a:b], start + a) for a, b in bounds])
            self.group, self.caches = self.group + 1, []
        if self.group == len(self.groups):
            self.stage = "done"
            return Done(self.entries)
        kept = maker.context_kv(self.context) if start else None
        for i in self.groups[self.group]:
            cache = maker.runner.new_cache(start + len(self.documents[i][0]))
            if kept is not None:
                for layer in range(maker.runner.num_layers):
                    cache.k[layer][:, :start] = kept.k[layer][:, :start]
                    cache.v[layer][:, :start] = kept.v[layer][:, :start]
                cache.length = start
            self.caches.append(cache)
        self.stage = "pass"
        return [Rows(torch.tensor(list(self.documents[i][0])), cache, start, ())
                for i, cache in zip(self.groups[self.group], self.caches, strict=True)]


class PrefixLoad(PlanCursor):
    """An exact cached prefix (`chain`) loaded layer by layer while the rest is computed: each
    want is `Rows` (the executor runs them in chunks beside other sequences' rows; the first
    pass waits for each layer's loads); its value, the last position's logits (vocab,) and the
    loader's report.

    `computed` (a block boundary, from the load-or-compute split in blend.split): the tokens
    before it are computed with a plain prefill while the rest of the chain loads, instead of
    being loaded (the whole chain: a plain prefill). `boundary` (a block end, `aligned_end`):
    the tokens from the chain's end up to it are computed in a pass of their own before the
    rest, as a later request loads them once they are stored, so that the rest is computed the
    same way whether the chain was found or not (one pass over more rows changes the numbers at
    the compute dtype's precision: bfloat16 log-probs by tenths)."""

    def __init__(self, prefixes: PrefixCache, token_ids: Sequence[int], chain: list[Placement], cache: KVCache,
                 computed: int = 0, boundary: int = 0):
        super().__init__()
        self.ids, self.cache = list(token_ids), cache
        p = max((pl.start + pl.length for pl in chain), default=0)
        whole = bool(chain) and computed >= p  # the whole chain computed: nothing loaded
        loaded = [] if whole else [pl for pl in chain if pl.start >= computed]
        start = 0 if whole else p  # the first position computed after the loads
        self.passes: list[tuple[int, int]] = []  # (first, end) of each pass of rows, in order
        if computed and not whole:
            self.passes.append((0, computed))
        first = len(self.passes)
        self.passes += [(start, boundary), (max(start, boundary), len(self.ids))] if start < boundary < len(
            self.ids) else [(start, len(self.ids))]
        self.loads_at = first  # the pass that waits for the loads
        self.n = 0  # passes asked for
        self.loader = LayerLoader(prefixes.store, prefixes.runner, cache, loaded, range(prefixes.runner.num_layers),
                                  prefixes.prefetch_depth, stall_s=prefixes.stall_s)

    def _next(self, output: object, error: BaseException | None) -> Want:
        if self.n == len(self.passes):
            self.loader.close()
            self.stage = "done"
            assert isinstance(output, torch.Tensor)
            return Done((output[0], self.loader.report()))
        a, b = self.passes[self.n]
        last = self.n == len(self.passes) - 1
        self.stage = f"pass {self.n}"
        self.n += 1
        return Rows(torch.tensor(self.ids[a:b]), self.cache, a, None if last else (),
                    loads=self.loader if self.n - 1 == self.loads_at else None)

    def _release(self) -> None:
        self.loader.close()


def intact_end(chain: Sequence[Placement], load: LoadReport) -> int:
    """End of the leading blocks of `chain` that were loaded from the store (`load`: the loader's
    report; an unreadable block fails the load instead)."""
    end = 0
    for pl in chain:
        if pl.entry is not None:
            break
        end = pl.start + pl.length
    return end
