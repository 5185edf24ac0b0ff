"""Documents in the tier stack: each document's KV computed as one sequence and stored as
a chain of fixed-size blocks; lookup, compute on a miss, ingest.

A document (a `document` segment of the prompt) is prefilled as one sequence after its
context - nothing (`chunk_context: none`, positions 0..n-1) or the prompt's fixed system
part (`chunk_context: system`) - so later tokens see earlier ones. Its KV is stored as
blocks of `block_tokens` tokens: block b covers tokens [b*B, min((b+1)*B, n)) and is
keyed by the context's digest and every document token up to the block end
(`storage.keys.document_block_key`). A long document is stored and loaded block by
block, and documents that share their leading blocks share those entries. Each block
entry records the position its keys were rotated at (`pos_start` = context length +
block start); the loader re-rotates them to the document's position in the prompt.

The system part itself is cached the same way with no context (it is exact at position
0).

A delete wins over every write planned before it (storage.stack.TieredStore.delete): each
`Block` records when it was planned (`planned`: when a request laid out its key, or an ingest
or lookup began) and every write of it here (a request's misses, a harvest, the background
recompute of a harvested document) passes that time to the store, which drops the write when
the key was deleted since; `forget` also takes deleted documents off the background queue.
So a deleted document is stored again only by a request or ingest made after the delete. A block hit verifies the stored tokens and `pos_start`; entries of another layout
(e.g. the 512-token independent chunks of layout 1) have other keys and are never hit.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from blend.kv.loader import Placement
from blend.kv.prefix import EntryMaker, pack_groups
from blend.model.cache import KVCache
from blend.model.plan import Done, PlanCursor, Want, drive
from blend.prompt.builder import Prompt, Segment
from blend.stats import LookupTally
from storage.dtypes import dtype_bytes
from storage.entry import KVEntry
from storage.keys import document_block_key, tokens_digest
from storage.stack import Located, LookupBudget, TieredStore

COMPUTED_KEYS_KEPT = 65536  # block keys remembered as computed for a request (deduplication counts)
BACKGROUND_DOCUMENTS = 256  # harvested documents waiting for their standalone recompute, at most


@dataclass
class BackgroundCounts:
    """The standalone recompute of harvested documents (DocumentCache.background_plan)."""

    queued: int = 0  # documents queued (a harvested document not already waiting)
    done: int = 0  # recomputed and queued for the store
    dropped: int = 0  # the oldest waiting ones dropped when more than BACKGROUND_DOCUMENTS waited
    seconds: float = 0.0

    @property
    def left(self) -> int:
        """Documents whose stored entries are still the harvested ones (waiting, or dropped)."""
        return self.queued - self.done


class IngestStopped(RuntimeError):
    """An ingest was asked to stop (`stop()` turned true) before its last document; the
    segments done before that (`stored`) stay stored."""

    def __init__(self, message: str, stored: list[StoredSegment]):
        super().__init__(message)
        self.stored = stored


@dataclass(frozen=True)
class StoredSegment:
    """What `DocumentCache.ingest` did with one document segment."""

    segment: Segment
    keys: tuple[str, ...]  # its block keys, in order
    cached: bool  # every block had a valid entry in some tier before the ingest


@dataclass(frozen=True)
class _Looked:
    segment: Segment
    rebuild: _Rebuild
    found: list[Located | None]  # per block: where it was found (None: a miss)

    @property
    def missed(self) -> bool:
        """A segment is one lookup: a miss unless every block was found."""
        return any(loc is None for loc in self.found)


@dataclass(frozen=True)
class Resolution:
    """The cacheable segments of one prompt, looked up (`DocumentCache.lookup`)."""

    looked: list[_Looked]
    # segments found whose entries this engine computed for another request after this one was
    # submitted: misses served by that computation (the two requests wanted them at once)
    deduplicated: int = 0

    @property
    def misses(self) -> int:
        """Segments that missed (computed by `compute_misses`)."""
        return sum(looked.missed for looked in self.looked)


@dataclass(frozen=True)
class Block:
    """One stored block of a document segment."""

    key: str
    start: int  # offset of the block's first token inside the document
    end: int
    pos_start: int  # position its keys are rotated at in the entry (context length + start)
    # time.monotonic() when its key was laid out: every write of it is planned then (a delete of
    # the key after this time wins over it: storage.stack.TieredStore.put)
    planned: float = field(default_factory=time.monotonic, compare=False)


class DocumentCache:
    """Document block chains of one model and one layout over a tier stack."""

    def __init__(self, store: TieredStore, maker: EntryMaker, *, namespace: str, chunk_context: str,
                 block_tokens: int, stall_s: float | None = None):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.store, self.maker = store, maker
        self.namespace, self.chunk_context, self.block_tokens = namespace, chunk_context, block_tokens
        self.stall_s = stall_s  # header lookups per tier of a request (ingest: of a document); None: no limit
        # block keys this engine computed for a request's misses, and when (time.monotonic): a later
        # request submitted before then that finds them was served by that computation
        self._computed_at: OrderedDict[str, float] = OrderedDict()
        self._computed_lock = threading.Lock()
        self._claimed: dict[str, int] = {}  # block keys a plan under way computes (claims of each)
        self._bg_keys: frozenset[str] = frozenset()  # ... of them, the background plan's
        self._bg_awaited = False  # a plan waits for the background plan's entries (`background_awaited`)
        # harvested documents to recompute on their own when the scheduler is idle: (context, ids) -> blocks
        self._background: OrderedDict[tuple[tuple[int, ...], tuple[int, ...]], list[Block]] = OrderedDict()
        self.background = BackgroundCounts()

    def context(self, seg: Segment, prompt: Prompt) -> list[int]:
        """The token ids `seg` is computed after: the system part for a document under
        `chunk_context: system`, else none."""
        if seg.kind == "document" and self.chunk_context == "system":
            return list(prompt.prefix.token_ids)
        return []

    def blocks(self, ids: Sequence[int], context: Sequence[int]) -> list[Block]:
        """The blocks of a document of token ids `ids` computed after `context`."""
        digest = tokens_digest(context) if context else ""
        fingerprint, kv_dtype = self.maker.fingerprint, self.maker.kv_dtype
        planned = time.monotonic()
        out = []
        for start in range(0, len(ids), self.block_tokens):
            end = min(start + self.block_tokens, len(ids))
            key = document_block_key(fingerprint, ids[:end], kv_dtype, self.namespace, digest, start=start)
            out.append(Block(key, start, end, len(context) + start, planned))
        return out

    def keys(self, seg: Segment, prompt: Prompt) -> list[str]:
        """The block keys of a cacheable segment of `prompt`, in order."""
        return [b.key for b in self.blocks(list(seg.token_ids), self.context(seg, prompt))]

    def _find(self, ids: Sequence[int], block: Block, budget: LookupBudget) -> Located | None:
        return self.store.lookup(block.key, self.maker.expected(ids[block.start:block.end], block.pos_start), budget)

    def store_block(self, block: Block, entry: KVEntry) -> None:
        """Queue the write of one block's entry, planned when the block was (`Block.planned`): a
        delete of its key since then wins (the write is dropped). Every document write goes
        through here (a request's misses, a harvest, the background recompute, an ingest)."""
        self.store.put(block.key, entry, planned=block.planned)

    def segment_blocks(self, prompt: Prompt) -> dict[int, list[Block]]:
        """The blocks (and their keys, hashed here once) of every cacheable segment of
        `prompt`, by segment index: what a request looks up and what a document id records.
        Their writes are planned now: call it before the documents' ids are recorded, so a
        delete of an id recorded by this request also wins over this request's writes."""
        return {i: self.blocks(list(seg.token_ids), self.context(seg, prompt))
                for i, seg in enumerate(prompt.segments) if seg.kind != "query"}

    def _computed(self, blocks: Sequence[Block]) -> None:
        """Record that these blocks were just computed for a request (bounded: the oldest forgotten)."""
        now = time.monotonic()
        with self._computed_lock:
            for b in blocks:
                self._computed_at[b.key] = now
                self._computed_at.move_to_end(b.key)
            while len(self._computed_at) > COMPUTED_KEYS_KEPT:
                self._computed_at.popitem(last=False)

    def claim(self, keys: Sequence[str], *, background: bool = False) -> None:
        """A plan computes these blocks (its misses; `background`: the background plan's rewrite)
        until `release`: another plan that needs any of them waits for their entries rather than
        computing them a second time (`computing`)."""
        with self._computed_lock:
            if background:
                self._bg_keys = frozenset(keys)
            for key in keys:
                self._claimed[key] = self._claimed.get(key, 0) + 1

    def release(self, keys: Sequence[str], *, background: bool = False) -> None:
        """The blocks a plan claimed are computed and queued for the store (or it ended)."""
        with self._computed_lock:
            if background:
                self._bg_keys, self._bg_awaited = frozenset(), False
            for key in keys:
                left = self._claimed.get(key, 0) - 1
                if left > 0:
                    self._claimed[key] = left
                else:
                    self._claimed.pop(key, None)

    def computing(self, keys: Sequence[str]) -> bool:
        """Whether a plan under way computes one of these blocks (asked by a plan that then waits:
        when the background plan computes one, it is `background_awaited`)."""
        with self._computed_lock:
            if self._bg_keys and not self._bg_keys.isdisjoint(keys):
                self._bg_awaited = True
            return any(key in self._claimed for key in keys)

    def background_awaited(self) -> bool:
        """Whether a plan waits for the entries the background plan under way computes: the scheduler
        then runs it first, whatever its share (else a request would wait at background priority)."""
        return self._bg_awaited

    def lookup(self, prompt: Prompt, segments: Sequence[int], blocks: dict[int, list[Block]] | None = None,
               submitted: float | None = None, *, use_store: bool = True) -> Resolution:
        """Look up every block of the segments at these indices of `prompt` (blocks: from
        `segment_blocks`, computed if not given); nothing is computed or written. `submitted`
        (time.monotonic() of the request's submission): found segments computed for another
        request since then are counted as `deduplicated`. `use_store=False`: nothing is looked up,
        every segment a miss (a plan again after one of its loads failed)."""
        blocks = blocks if blocks is not None else self.segment_blocks(prompt)
        budget = LookupBudget(self.stall_s)
        looked = []
        for i in segments:
            seg = prompt.segments[i]
            ids, context = list(seg.token_ids), self.context(seg, prompt)
            seg_blocks = blocks[i]
            looked.append(_Looked(seg, _Rebuild(ids, context, seg_blocks),
                                  [self._find(ids, b, budget) if use_store else None for b in seg_blocks]))
        shared = 0
        if submitted is not None:
            with self._computed_lock:
                shared = sum(not lk.missed and any(self._computed_at.get(b.key, -1.0) > submitted
                                                   for b in lk.rebuild.block_list) for lk in looked)
        return Resolution(looked, shared)

    def entry_layer_nbytes(self, tokens: int) -> int:
        """Bytes one layer of a computed (unencoded) document entry of `tokens` tokens holds: K and V."""
        r = self.maker.runner
        return 2 * r.kv_heads * tokens * r.head_dim * dtype_bytes(self.maker.kv_dtype)

    def compute_misses(self, resolution: Resolution, only: Sequence[int] | None = None) -> MissPasses:
        """The documents that missed (`only`: those at these indices of `resolution.looked`)
        computed, as a plan (`MissPasses`) whose value is their block entries by index into
        `resolution.looked` (for `placements`)."""
        return MissPasses(self, resolution, only)

    def harvest(self, resolution: Resolution, indices: Sequence[int], cache: KVCache) -> int:
        """The missing documents at these indices of `resolution.looked` cut out of a prompt's
        `cache` (slot = prompt position; their K/V computed exactly there: a full prefill, or the
        computed prefix of a blend), keys turned back to their standalone position
        (`EntryMaker.harvest`), and their blocks queued for the store. Returns how many."""
        queued: set[str] = set()
        for index in indices:
            looked = resolution.looked[index]
            seg, rebuild = looked.segment, looked.rebuild
            entries = [self.maker.harvest(cache, rebuild.ids[b.start:b.end], seg.start + b.start, b.pos_start)
                       for b in rebuild.block_list]
            self._computed(rebuild.block_list)
            self._queue_standalone(rebuild)
            self._write_missed(looked, entries, queued)
        return len(indices)

    def _write_missed(self, looked: _Looked, entries: Sequence[KVEntry], queued: set[str]) -> None:
        """Queue the writes of a missed segment's blocks that no tier holds (each key once per request)."""
        for b, loc, entry in zip(looked.rebuild.block_list, looked.found, entries, strict=True):
            if loc is None and b.key not in queued:
                self.store_block(b, entry)
                queued.add(b.key)

    # ------------------------------------------------------ background recompute
    def _queue_standalone(self, rebuild: _Rebuild) -> None:
        """A harvested document (K/V computed after other documents) is recomputed on its own later,
        when the scheduler is idle: harvested entries blend measurably worse (docs/EVAL.md). Its
        writes keep the plan time of its blocks (the latest request's when it waits already)."""
        key = (tuple(rebuild.context), tuple(rebuild.ids))
        waiting = self._background.get(key)
        if waiting is not None:
            if rebuild.block_list[0].planned > waiting[0].planned:
                self._background[key] = rebuild.block_list
            return
        self._background[key] = rebuild.block_list
        self.background.queued += 1
        while len(self._background) > BACKGROUND_DOCUMENTS:
            self._background.popitem(last=False)
            self.background.dropped += 1

    def forget(self, keys: Sequence[str]) -> int:
        """Take the harvested documents holding any of these (deleted) block keys off the
        background queue; returns how many. (Their writes would be dropped anyway: planned before
        the delete.) Scheduler thread or any: the queue is only popped under the GIL."""
        gone = set(keys)
        doomed = [k for k, blocks in list(self._background.items()) if any(b.key in gone for b in blocks)]
        for k in doomed:
            self._background.pop(k, None)
        return len(doomed)

    def background_pending(self) -> bool:
        """Whether a harvested document waits for its standalone recompute."""
        return bool(self._background)

    def drop_background(self) -> int:
        """Take every harvested document waiting for its standalone recompute off the queue (the
        engine stops: their harvested entries stay); returns how many there were."""
        left = len(self._background)
        self._background.clear()
        return left

    def background_plan(self) -> Standalone | None:
        """The oldest waiting harvested document recomputed on its own, as a plan of the scheduler
        (`Standalone`); None when none waits. Scheduler thread only."""
        try:
            (context, ids), blocks = self._background.popitem(last=False)
        except KeyError:  # empty (or emptied by `forget` meanwhile)
            return None
        return Standalone(self, list(context), list(ids), blocks)

    def placements(self, resolution: Resolution, tally: LookupTally,
                   computed: Mapping[int, list[KVEntry]] | None = None, skip: Sequence[int] = ()) -> list[Placement]:
        """Placements of every looked-up block, in prompt order, and each segment's hit or miss
        counted in `tally`. A missed segment is placed from `computed` (what `compute_misses`
        returned, by index into `resolution.looked`: no model work and no write here). A block that
        turns out unreadable while loading fails the load (`LoadFailed`). The segments at indices
        `skip` (missing documents this request computes in place and harvests) are counted but get
        no placement."""
        computed = computed or {}
        placements: list[Placement] = []
        for index, looked in enumerate(resolution.looked):
            seg, rebuild, found = looked.segment, looked.rebuild, looked.found
            kind = "system" if seg.kind == "prefix" else "documents"
            blocks = rebuild.block_list
            if index in skip:
                tally.miss(kind)
                continue
            if not looked.missed:
                tally.hit(kind, max(loc.tier_index for loc in found))
                for b, loc in zip(blocks, found, strict=True):
                    placements.append(Placement(seg.start + b.start, b.end - b.start, b.pos_start, loc, None))
                continue
            tally.miss(kind)
            entries = computed.get(index)
            if entries is None:
                raise RuntimeError(f"segment {index} missed and was neither computed (compute_misses) nor skipped")
            for b, entry in zip(blocks, entries, strict=True):
                placements.append(Placement(seg.start + b.start, b.end - b.start, b.pos_start, None, entry))
        return placements

    def resolve(self, prompt: Prompt, segments: Sequence[Segment], tally: LookupTally) -> list[Placement]:
        """`resolve_plan` run alone to its end (a tool's call: no scheduler around it)."""
        placements = drive(self.maker.runner, self.resolve_plan(prompt, segments, tally))
        assert placements is not None
        return placements

    def resolve_plan(self, prompt: Prompt, segments: Sequence[Segment], tally: LookupTally, *,
                     raw_only: bool = False) -> Resolve:
        """Placements of every block of `segments`, in prompt order, as a plan (`Resolve`)."""
        return Resolve(self, prompt, segments, tally, raw_only)

    def ingest_plan(self, prompt: Prompt, stop: Callable[[], bool] | None = None) -> IngestPasses:
        """Every block of every cacheable segment of `prompt` that is not stored yet computed and
        stored, as a plan (`IngestPasses`)."""
        return IngestPasses(self, prompt, stop)


class MissPasses(PlanCursor):
    """The documents that missed computed, one forward pass per step (those after the same
    context together, `EntryMaker.document_passes`; a repeated document once). Its value: their
    block entries by index into `resolution.looked` (for `placements`); their writes are queued
    as soon as their pass ran (what was computed is stored, even if the request then ends early)."""

    def __init__(self, cache: DocumentCache, resolution: Resolution, only: Sequence[int] | None = None):
        super().__init__()
        self.cache, self.resolution = cache, resolution
        missed: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
        for index, looked in enumerate(resolution.looked):
            if looked.missed and (only is None or index in only):
                r = looked.rebuild
                missed.setdefault((tuple(r.context), tuple(r.ids)), []).append(index)
        # documents after the same context together: per context, its documents' indices (a repeated one once)
        self.groups = [[indices for (c, _ids), indices in missed.items() if c == context]
                       for context in dict.fromkeys(c for c, _ids in missed)]
        self.group = 0  # the context whose passes run
        self.queued: set[str] = set()  # keys whose writes are queued (each once)
        self.computed: dict[int, list[KVEntry]] = {}

    def _next(self, output: Any, error: BaseException | None) -> Want:
        if self.stage == "passes":  # a context's documents computed (`output`: their entries)
            for indices, entries in zip(self.groups[self.group], output, strict=True):
                for index in indices:
                    looked = self.resolution.looked[index]
                    self.computed[index] = entries
                    self.cache._write_missed(looked, entries, self.queued)
                    self.cache._computed(looked.rebuild.block_list)
            self.group += 1
        if self.group == len(self.groups):
            self.stage = "done"
            return Done(self.computed)
        self.stage = "passes"
        first = [self.resolution.looked[g[0]].rebuild for g in self.groups[self.group]]
        return self.run(self.cache.maker.document_passes(
            [(r.ids, [(b.start, b.end) for b in r.block_list]) for r in first], first[0].context))


class Resolve(PlanCursor):
    """Placements of every block of `segments`, in prompt order: `lookup`, the misses computed
    (`MissPasses`: their passes as the plan's wants), then `placements`. `raw_only`: None
    (nothing computed, written or counted) when a found block is held in a codec (not exact)."""

    def __init__(self, cache: DocumentCache, prompt: Prompt, segments: Sequence[Segment], tally: LookupTally,
                 raw_only: bool = False):
        super().__init__()
        self.cache, self.prompt, self.segments, self.tally, self.raw_only = cache, prompt, segments, tally, raw_only
        self.resolution: Resolution | None = None

    def _next(self, output: Any, error: BaseException | None) -> Want:
        if self.stage == "misses":
            assert self.resolution is not None
            self.stage = "done"
            return Done(self.cache.placements(self.resolution, self.tally, output))
        index = {id(seg): i for i, seg in enumerate(self.prompt.segments)}
        self.resolution = self.cache.lookup(self.prompt, [index[id(seg)] for seg in self.segments])
        if self.raw_only and any(loc is not None and not loc.header.codec.raw
                                 for looked in self.resolution.looked for loc in looked.found):
            self.stage = "done"
            return Done(None)
        self.stage = "misses"
        return self.run(self.cache.compute_misses(self.resolution))


class Standalone(PlanCursor):
    """A harvested document recomputed on its own, its passes as steps (`EntryMaker.document_passes`),
    its standalone entries then queued for the store over the harvested ones (planned when the
    request that harvested it laid them out: a delete since then wins). Its blocks are claimed while
    it runs: a request meanwhile waits for these entries rather than meeting a rewrite."""

    def __init__(self, cache: DocumentCache, context: list[int], ids: list[int], blocks: list[Block]):
        super().__init__()
        self.cache, self.context, self.ids, self.blocks = cache, context, ids, blocks
        self.keys = [b.key for b in blocks]
        self.claimed = False
        self.t0 = 0.0

    def _next(self, output: Any, error: BaseException | None) -> Want:
        if self.stage == "start":
            self.t0 = time.perf_counter()
            self.cache.claim(self.keys, background=True)
            self.claimed = True
            self.stage = "passes"
            return self.run(self.cache.maker.document_passes(
                [(self.ids, [(b.start, b.end) for b in self.blocks])], self.context))
        for b, entry in zip(self.blocks, output[0], strict=True):
            self.cache.store_block(b, entry)
        self._release()
        self.cache.background.done += 1
        self.cache.background.seconds += time.perf_counter() - self.t0
        self.stage = "done"
        return Done(None)

    def _release(self) -> None:
        if self.claimed:
            self.claimed = False
            self.cache.release(self.keys, background=True)


class IngestPasses(PlanCursor):
    """Every block of every cacheable segment of `prompt` that is not stored yet computed and
    stored; its value, what was found for each document segment, in order (`StoredSegment`).

    Every segment is looked up before anything is written, so `cached` says what the tiers held
    before this plan; a segment whose missing blocks an earlier segment of this plan already wrote
    (the same document twice) is not computed again. Consecutive documents after the same context
    are prefilled together, in passes of `pack_groups` (`EntryMaker.document_passes`), one pass
    per step. `stop` is asked before each pass; when it answers True, `IngestStopped` (holding
    the segments stored so far)."""

    def __init__(self, cache: DocumentCache, prompt: Prompt, stop: Callable[[], bool] | None = None):
        super().__init__()
        self.cache, self.prompt, self.stop = cache, prompt, stop
        self.found: list[tuple[Segment, list[int], list[int], list[Block], list[int]]] = []
        self.packs: list[list[tuple[int, list[int]]]] = []  # (index into found, blocks to store) per pass
        self.pack = 0  # the pass under way
        self.stored_at: set[int] = set()  # indices into `found` stored (or found whole)

    def _plan(self) -> None:
        cache = self.cache
        for seg in self.prompt.segments:
            if seg.kind == "query":
                continue
            ids, context = list(seg.token_ids), cache.context(seg, self.prompt)
            blocks = cache.blocks(ids, context)
            # a budget per document: an ingest of thousands of documents must not add up to a
            # healthy tier's suspension, and a slow tier still costs at most one budget (then misses)
            budget = LookupBudget(cache.stall_s)
            self.found.append((seg, ids, context, blocks,
                               [i for i, b in enumerate(blocks) if cache._find(ids, b, budget) is None]))
        jobs: list[tuple[int, list[int]]] = []
        planned: set[str] = set()
        for n, (_seg, _ids, _context, blocks, missing) in enumerate(self.found):
            todo = [i for i in missing if blocks[i].key not in planned]
            planned.update(blocks[i].key for i in todo)
            if todo:
                jobs.append((n, todo))
        self.stored_at = set(range(len(self.found))) - {n for n, _ in jobs}
        # documents after the same context are computed together (packed passes)
        runs: list[list[tuple[int, list[int]]]] = []
        for job in jobs:
            if runs and self.found[runs[-1][0][0]][2] == self.found[job[0]][2]:
                runs[-1].append(job)
            else:
                runs.append([job])
        for run in runs:
            run.sort(key=lambda job: len(self.found[job[0]][1]))  # similar lengths pack with little padding
            self.packs += _chunks(run, [len(self.found[n][1]) for n, _ in run], len(self.found[run[0][0]][2]))

    def stored(self) -> list[StoredSegment]:
        """What was found for each document segment stored so far, in order."""
        return [StoredSegment(seg, tuple(b.key for b in blocks), not missing)
                for n, (seg, _ids, _context, blocks, missing) in enumerate(self.found)
                if seg.kind == "document" and n in self.stored_at]

    def _next(self, output: Any, error: BaseException | None) -> Want:
        if self.stage == "start":
            self._plan()
        elif self.stage == "passes":  # a pass ran (`output`: its documents' entries)
            found = self.found
            for (n, todo), made in zip(self.packs[self.pack], output, strict=True):
                for i in todo:
                    self.cache.store_block(found[n][3][i], made[i])
                self.stored_at.add(n)
            self.pack += 1
        if self.pack == len(self.packs):
            self.stage = "done"
            return Done(self.stored())
        if self.stop is not None and self.stop():
            left = sum(len(p) for p in self.packs[self.pack:])
            raise IngestStopped(f"ingest stopped with {left} documents left to compute; those computed stay stored",
                                self.stored())
        pack = self.packs[self.pack]
        self.stage = "passes"
        return self.run(self.cache.maker.document_passes(
            [(self.found[n][1], [(b.start, b.end) for b in self.found[n][3]]) for n, _ in pack],
            self.found[pack[0][0]][2]))


def _chunks(jobs: list, lengths: list[int], context: int) -> list[list]:
    """`jobs` in consecutive groups of one packed pass each (`pack_groups`), so that `stop`
    is asked between passes."""
    return [[jobs[i] for i in group] for group in pack_groups(lengths, context)]


@dataclass(frozen=True)
class _Rebuild:
    """What a missed document is computed from: its ids after its context, and its blocks."""

    ids: list[int]
    context: list[int]
    block_list: list[Block]


