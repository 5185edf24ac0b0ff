"""TieredStore: the tiers in configured order behind one lookup / read / write API.

Request flow: `lookup(key, expected)` walks the tiers fastest-first and returns a
`Located` for the first header that matches everything the reader expects (model,
tokens, positions, dims, dtype, sizes: `storage.entry.Expected`) and, in a store with a
secret, carries a valid tag (`storage.signature`). Any other header is a miss, counted
per tier (`mismatches`, `unauthenticated`), and deleted from that tier, so no tensor is
ever built from a header the reader did not expect; an entry that fails authentication is
left in place (another engine with another secret may own it). `get_layer` / `get_layers` read from
that tier, falling back to a lower tier holding an identical header if the entry
vanished meanwhile. A request that still finds a layer missing recomputes the segment and
hands it to `repair`, which rewrites the entry once. `put` writes to every tier through a
bounded background writer: encoded in each tier's codec (`storage.codec`; once per codec,
an entry already encoded is written as it is; `exact` puts and promotions are written as
they are), then sealed when the store has a secret. The codec follows the entry's kind,
read from its key (`storage.keys.key_kind`): a document's block in the tier's `codec`, a
prefix block (prefix mode, chat sessions: KV users expect back exactly) in its
`exact_codec` (`none` by default).
Reads return what the tier holds (an encoded entry's K and V parts: the reader decodes, on
its device; `storage.entry.decode_layer`). A lookup of a key whose put still waits in the
write-behind queue (or is being written) is served from that put, in memory: the entry sealed
in the top tier's codec, as the top tier will hold it (`Located.held`; `queued_hits`). So a
lookup never waits for the writer (a hung write stalls no request) and hits exactly what it
would hit once the write lands. A `put` that finds the queue full waits at most `put_wait_s`
(None: as long as it takes), then the write is dropped (`puts_dropped`; computed again when
next needed). A hit in
a lower tier is promoted: the layers the request reads are collected and, once all are
seen, written to the tiers above in the background; `flush` (or overflow of the pending
table) completes partially read promotions by reading the remaining layers.
A delete wins over every write of its key planned before it: `delete` records when the key
was deleted, drops a queued write of it, and every write carries the time it was planned
(`put(planned=)`: by default when `put` is called; a request's document blocks pass the time
their keys were laid out, a repair or a promotion the time the entry was found); the writer
skips a write planned before the key's last delete and, when the delete came while the write
was under way, deletes what it wrote. So nothing deleted comes back from a write queued or
planned before the delete, however late it runs.
Tiers are built for the store's namespace: listing, stats, clearing and budgets never
reach another namespace's entries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from storage.codec import NONE, Codec, codec_named
from storage.config import SHARED_KINDS, StoreConfig, TierConfig
from storage.entry import EntryHeader, Expected, KVEntry
from storage.exit_hooks import ClosedAtExit
from storage.keys import key_kind
from storage.openmp import single_threaded
from storage.serialization import layer_views
from storage.signature import seal, verify
from storage.tier import Layer, StoreUnavailable, Tier, tier_class

log = logging.getLogger("kvblend.storage")

MAX_PENDING_PROMOTIONS = 16
# keys whose delete time is remembered (writes planned before it are dropped); past this, the
# oldest are forgotten and every write planned before the newest forgotten delete is dropped
DELETES_KEPT = 65536
# at interpreter exit, queued writes are flushed for at most this long; what is still queued
# then is dropped (with a warning): a process never hangs at exit on a store that stopped answering
EXIT_FLUSH_S = 30.0
LOOKUP_COUNTERS = ("lookup_hits", "lookup_misses", "mismatches", "unauthenticated", "repairs", "promotions",
                   "promotions_dropped", "write_s")  # write_s: seconds the writer spent encoding and writing here


def build_tier(config: TierConfig, namespace: str = "") -> Tier:
    """Instantiate the tier for `config.kind` (storage.tier.tier_class), scoped to `namespace`;
    ValueError lists the valid kinds."""
    return tier_class(config.kind)(config, namespace=namespace)


def tier_codec(tier: Tier) -> Codec:
    """The codec a tier writes document entries in (its config's `codec`; `none` for a tier without one)."""
    return codec_named(getattr(getattr(tier, "config", None), "codec", "none"))


def tier_exact_codec(tier: Tier) -> Codec:
    """The codec a tier writes exact entries in: prefix blocks and chat sessions (its config's
    `exact_codec`; `none` for a tier without one)."""
    return codec_named(getattr(getattr(tier, "config", None), "exact_codec", "none"))


@dataclass
class LookupBudget:
    """The time one request (an ingest: one document) may spend in each tier's header
    lookups (`seconds`; None: no limit). A tier whose lookups add up to more is suspended
    by the store (skipped for its backoff, where it has one): the remaining lookups there
    miss at once, so a server that answers, but slowly, costs a request about `seconds`,
    not one slow reply per block. `spent`: seconds per tier name so far."""

    seconds: float | None
    spent: dict[str, float] = field(default_factory=dict)
    suspended: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Located:
    """Where `lookup` found an entry: the tier and the verified header. `found_at`
    (time.monotonic): when; a repair or promotion of it is a write planned then."""

    key: str
    tier_index: int
    tier_name: str
    header: EntryHeader
    found_at: float = field(default_factory=time.monotonic, compare=False)
    # the entry itself, when found in the write-behind queue (sealed in the top tier's codec:
    # what that tier will hold); its reads are served from it
    held: KVEntry | None = field(default=None, compare=False, repr=False)


@dataclass
class _Promotion:
    located: Located
    layers: dict[int, Layer] = field(default_factory=dict)


_STOP = object()


class _Put:
    """One queued `put`: its write (planned at `planned`, time.monotonic), and the event a
    lookup of its key waits on (set once it is written, failed or dropped)."""

    def __init__(self, store: TieredStore, key: str, entry: KVEntry, exact: bool, planned: float):
        self.store, self.key, self.entry, self.exact, self.planned = store, key, entry, exact, planned
        self.done = threading.Event()
        self._sealed: dict[Codec, KVEntry] = {}  # the entry encoded and sealed, per codec (once)
        self._sealing = threading.Lock()

    def sealed(self, codec: Codec) -> KVEntry:
        """The entry in `codec`, sealed: encoded once, whoever asks first (the writer, or a lookup
        served from this put)."""
        with self._sealing:
            if codec not in self._sealed:
                self._sealed[codec] = self.store._seal(self.key, self.entry.encode(codec))
            return self._sealed[codec]

    def __call__(self) -> None:
        try:
            self.store._write(self.key, self.entry, self.exact, self.planned, self.sealed)
        finally:
            self.drop()

    def drop(self) -> None:
        """Done with (written, or dropped unwritten): a lookup waiting for it goes on to the tiers."""
        self.done.set()
        store = self.store
        with store._lock:
            if store._queued.get(self.key) is self:
                del store._queued[self.key]


# every open store is closed at interpreter exit (storage.exit_hooks), its queued writes flushed
# within EXIT_FLUSH_S, after the engines (blend.engine.engine, whose registry is filled later)
_OPEN_STORES: ClosedAtExit[TieredStore] = ClosedAtExit("KV store", lambda store: store.close(timeout=EXIT_FLUSH_S))


def _read_into(tier: Tier, located: Located, layer: int, out: torch.Tensor) -> bool:
    """One tier's read of a layer into `out`, through its `read_layer_into` where it has one."""
    reader = getattr(tier, "read_layer_into", None)
    if reader is not None:
        return bool(reader(located.key, layer, located.header, out))
    got = tier.get_layer(located.key, layer, located.header)
    if got is None:
        return False
    k, v = layer_views(out, located.header)
    k.copy_(got[0])
    v.copy_(got[1])
    return True


class TieredStore:
    """Tiers in order, fastest first. Thread-safe; owns a background writer thread."""

    def __init__(
        self,
        tiers: Sequence[Tier],
        *,
        write_queue: int = 64,
        put_wait_s: float | None = None,
        promote: bool = True,
        namespace: str = "",
        kv_dtype: str = "float16",
        secret: str | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("TieredStore needs at least one tier")
        if secret is not None and not secret:
            raise ValueError("store secret is empty; set a long random string or leave it unset")
        self.tiers: list[Tier] = list(tiers)
        self.codecs: list[Codec] = [tier_codec(t) for t in self.tiers]  # document entries
        self.exact_codecs: list[Codec] = [tier_exact_codec(t) for t in self.tiers]  # prefix blocks, sessions
        self.namespace = namespace
        self._secret = secret
        self.kv_dtype = kv_dtype
        self.promote = promote
        self._queue: queue.Queue = queue.Queue(maxsize=write_queue)
        self.put_wait_s = put_wait_s  # the longest a `put` waits for room in a full queue (None: no limit)
        self.puts_dropped = 0  # puts dropped after waiting put_wait_s for room (a writer stuck in a slow tier)
        self.queued_hits = 0  # lookups served from a put still in the write-behind queue
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._error: BaseException | None = None
        self._pending: OrderedDict[str, _Promotion] = OrderedDict()
        self._queued: dict[str, _Put] = {}  # the last queued put of each key not yet written
        self._deleted: OrderedDict[str, float] = OrderedDict()  # key -> time.monotonic() of its last delete
        self._deleted_floor = float("-inf")  # the newest delete time forgotten (DELETES_KEPT)
        self.puts_superseded = 0  # writes dropped because their key was deleted after they were planned
        self._lock = threading.Lock()
        self._counts: dict[str, Counter] = {t.name: Counter() for t in self.tiers}
        self.puts_deduplicated = 0  # puts of a key whose write was already queued (not queued again)
        self._closed = False
        shared = [t.name for t in self.tiers if getattr(getattr(t, "config", None), "kind", "") in SHARED_KINDS]
        if shared and secret is None:
            log.warning("%s tier%s shared without store.secret: anyone who can write to the server can plant "
                        "entries with valid checksums, and this engine serves them as KV; set store.secret "
                        "(KVBLEND_STORE_SECRET, the same on every engine sharing it) to accept only entries "
                        "sealed with it", ", ".join(shared), "s are" if len(shared) > 1 else " is")
        _OPEN_STORES.add(self)

    @classmethod
    def from_config(cls, config: StoreConfig, *, min_entry_bytes: int | None = None,
                    put_wait_s: float | None = None) -> TieredStore:
        """Build the tiers of `config` (connecting to servers). With `min_entry_bytes`, first
        check that every budget holds one entry (ValueError naming the tier otherwise).
        `put_wait_s`: see the class (an engine passes its `load_stall_s`)."""
        if min_entry_bytes is not None:
            config.validate_for(min_entry_bytes)
        tiers: list[Tier] = []
        try:
            for tier_config in config.tiers:
                tiers.append(build_tier(tier_config, config.key_namespace))
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        return cls(
            tiers,
            write_queue=config.write_queue,
            put_wait_s=put_wait_s,
            promote=config.promote,
            namespace=config.key_namespace,
            kv_dtype=config.kv_dtype,
            secret=config.secret,
        )

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, tier_index: int, **deltas: float) -> None:
        with self._lock:
            self._counts[self.tiers[tier_index].name].update(deltas)

    # ------------------------------------------------------------------ lookup
    @property
    def signed(self) -> bool:
        """True when this store has a secret (entries are sealed and verified)."""
        return self._secret is not None

    def lookup(self, key: str, expected: Expected, budget: LookupBudget | None = None) -> Located | None:
        """First tier whose header for `key` matches `expected` (and has a valid tag when the
        store has a secret).

        Any other header is a miss counted in that tier's `mismatches` (or
        `unauthenticated`) and deleted from that tier (the recompute rewrites it). A hit
        below the top tier registers a promotion. With `budget`, each tier's time is
        charged to it (see LookupBudget). A key whose put still waits in the write-behind
        queue (or is being written) is served from that put, never waited for (see the module
        docstring): it hits whatever the writer is doing, and hits what the top tier will hold,
        so whether it hits does not depend on how busy the machine or the store is.
        """
        with self._lock:
            queued = self._queued.get(key)
        if queued is not None:
            return self._queued_hit(queued, expected)
        for i, tier in enumerate(self.tiers):
            t0 = time.monotonic()
            header = tier.get_header(key)
            if budget is not None:
                self._charge(budget, tier, time.monotonic() - t0)
            if header is None:
                self._count(i, lookup_misses=1)
                continue
            problem = expected.mismatch(header)
            if problem is None and self._secret is not None and not verify(header, key, self._secret):
                # left in place: an engine with another secret may share this tier (deleting would
                # let two of them wipe each other's entries); a recompute here overwrites it
                self._count(i, lookup_misses=1, unauthenticated=1)
                log.warning("%s tier: entry %s has no valid tag for this store's secret (written by an engine "
                            "with another secret, or forged); a miss, left in place", tier.name, key)
                continue
            if problem is not None:
                self._count(i, lookup_misses=1, mismatches=1)
                log.warning("%s tier: entry %s does not match the request (%s); deleted", tier.name, key, problem)
                tier.delete(key)
                continue
            self._count(i, lookup_hits=1)
            located = Located(key=key, tier_index=i, tier_name=tier.name, header=header)
            if i > 0 and self.promote:
                self._register_promotion(located)
            return located
        return None

    def _queued_hit(self, queued: _Put, expected: Expected) -> Located | None:
        """A lookup served from a queued put: its entry sealed in the codec the top tier writes
        it in (encoded here if the writer has not yet: CPU work, no I/O), checked like a header
        read from a tier (a mismatch is a miss; the put stays queued)."""
        codecs = self.exact_codecs if key_kind(queued.key) == "prefix" else self.codecs
        entry = queued.sealed(NONE if queued.exact else codecs[0])
        problem = expected.mismatch(entry.header)
        if problem is not None:
            self._count(0, lookup_misses=1, mismatches=1)
            log.warning("%s: queued entry %s does not match the request (%s); a miss", self.tiers[0].name,
                        queued.key, problem)
            return None
        self._count(0, lookup_hits=1)
        with self._lock:
            self.queued_hits += 1
        return Located(key=queued.key, tier_index=0, tier_name=self.tiers[0].name, header=entry.header, held=entry)

    def _charge(self, budget: LookupBudget, tier: Tier, seconds: float) -> None:
        """Add one lookup's time to `budget`; past its limit, suspend the tier (once)."""
        spent = budget.spent[tier.name] = budget.spent.get(tier.name, 0.0) + seconds
        if budget.seconds is None or spent <= budget.seconds or tier.name in budget.suspended:
            return
        budget.suspended.add(tier.name)
        if hasattr(tier, "suspend"):
            self.suspend([tier.name], f"{tier.name} tier: header lookups took {spent:.1f} s for one request (or "
                                      f"ingested document), over the {budget.seconds:g} s allowed "
                                      "(engine.blend.load_stall_s); skipped for its backoff, the request computes what it lacks")

    def contains(self, key: str) -> str | None:
        """Name of the first tier holding `key` (unverified), or None."""
        for tier in self.tiers:
            if tier.contains(key):
                return tier.name
        return None

    # ------------------------------------------------------------------- reads
    def get_layer(self, located: Located, layer: int) -> Layer | None:
        """Layer `layer` of a located entry as (K, V), each (kv_heads, num_tokens, head_dim).

        Returns None only if no tier can serve it any more (the caller recomputes).
        """
        return self.get_layers(located, [layer])[0]

    def get_layers(self, located: Located, layers: Sequence[int]) -> list[Layer | None]:
        """Several layers in one round trip where the tier supports it (redis tiers)."""
        layers = list(layers)
        if located.held is not None:
            return [located.held.layers[i] for i in layers]
        tier = self.tiers[located.tier_index]
        out = tier.get_layers(located.key, layers, located.header)
        for n, (i, got) in enumerate(zip(layers, out, strict=True)):
            if got is None:
                out[n] = self._fallback(located, i)
        self._collect(located, layers, out)
        return out

    def read_layer_into(self, located: Located, layer: int, out: torch.Tensor) -> bool:
        """Read layer `layer` of a located entry straight into `out`, a contiguous
        (layer_nbytes,) uint8 CPU tensor (K bytes then V bytes), verified; False only if no
        tier can serve it any more. Tiers without their own `read_layer_into` are read with
        `get_layer` and copied. A promotion keeps its own copy (`out` is the caller's buffer)."""
        if located.held is not None:
            k, v = layer_views(out, located.header)
            held_k, held_v = located.held.layers[layer]
            k.copy_(held_k)
            v.copy_(held_v)
            return True
        tiers = [(located.tier_index, self.tiers[located.tier_index])]
        tiers += [(i, t) for i, t in enumerate(self.tiers) if i > located.tier_index]
        for i, tier in tiers:
            if i != located.tier_index and tier.get_header(located.key) != located.header:
                continue
            if _read_into(tier, located, layer, out):
                if located.tier_index > 0 and self.promote:
                    k, v = layer_views(out, located.header)
                    self._collect(located, [layer], [(k.clone(), v.clone())])
                return True
        return False

    def _fallback(self, located: Located, layer: int) -> Layer | None:
        """Read `layer` from a lower tier holding the identical entry."""
        for tier in self.tiers[located.tier_index + 1 :]:
            if tier.get_header(located.key) == located.header:
                got = tier.get_layer(located.key, layer, located.header)
                if got is not None:
                    return got
        return None

    def repair(self, located: Located, entry: KVEntry) -> None:
        """Rewrite the entry `located` points at with `entry` (recomputed by a request that
        found a layer missing or corrupt), in the background; counted in `repairs`."""
        self._count(located.tier_index, repairs=1)
        with self._lock:
            self._pending.pop(located.key, None)  # the broken entry is not worth promoting
        self.put(located.key, entry, planned=located.found_at)

    def get(self, located: Located) -> KVEntry | None:
        """The whole located entry, or None if any layer is gone."""
        layers = self.get_layers(located, range(located.header.num_layers))
        if any(x is None for x in layers):
            return None
        return KVEntry(header=located.header, layers=list(layers))  # type: ignore[arg-type]

    # --------------------------------------------------------------- promotion
    def _register_promotion(self, located: Located) -> None:
        overflow: list[_Promotion] = []
        with self._lock:
            if located.key not in self._pending:
                self._pending[located.key] = _Promotion(located)
            while len(self._pending) > MAX_PENDING_PROMOTIONS:
                overflow.append(self._pending.popitem(last=False)[1])
        for promotion in overflow:
            self._submit_promotion(promotion)

    def _collect(self, located: Located, layers: list[int], got: list[Layer | None]) -> None:
        """Remember copies of promoted layers; submit the promotion once all are seen."""
        if located.tier_index == 0 or not self.promote:
            return
        with self._lock:
            promotion = self._pending.get(located.key)
            if promotion is None or promotion.located != located:
                return
            for i, layer in zip(layers, got, strict=True):
                if layer is not None and i not in promotion.layers:
                    promotion.layers[i] = layer  # reads are read-only: readers never modify them
            if len(promotion.layers) < located.header.num_layers:
                return
            del self._pending[located.key]
        self._submit_promotion(promotion)

    def _submit_promotion(self, promotion: _Promotion) -> None:
        """Queue the write of a promotion to the tiers above its source; dropped if the queue is full."""
        located = promotion.located

        def job() -> None:
            if self.deleted_since(located.key, located.found_at):
                return  # deleted after it was found: never written back
            missing = [i for i in range(located.header.num_layers) if i not in promotion.layers]
            if missing:
                source = self.tiers[located.tier_index]
                for i, layer in zip(missing, source.get_layers(located.key, missing, located.header), strict=True):
                    if layer is None:
                        return  # the source lost it meanwhile: nothing to promote
                    promotion.layers[i] = layer
            entry = KVEntry(located.header, [promotion.layers[i] for i in range(located.header.num_layers)])
            for i in range(located.tier_index):  # as it is: never encoded twice, exact entries stay exact
                self.tiers[i].put(located.key, entry)
                self._count(i, promotions=1)
            self._undo_if_deleted(located.key, located.found_at)

        self._ensure_writer()
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self._count(located.tier_index, promotions_dropped=1)

    # ------------------------------------------------------------------ writes
    def put(self, key: str, entry: KVEntry, *, sync: bool = False, exact: bool = False,
            planned: float | None = None) -> None:
        """Write `entry` under `key` to every tier, encoded in each tier's codec: `exact_codec`
        for a prefix block's key (`storage.keys.key_kind`), `codec` for any other.

        `planned` (time.monotonic; None: now): when the write was decided, e.g. when a request
        laid out the block's key. A write planned before the key's last `delete` is dropped
        (counted in `puts_superseded`), here or when the writer reaches it.

        sync=False (default) queues the write for the background writer and returns;
        it blocks while the queue (write_queue jobs) is full. Do not modify `entry`
        afterwards. sync=True writes inline. exact=True stores the entry as given in
        every tier, whatever its codec (KV that must come back bit for bit, e.g. a
        parked sequence). Errors of a `required` tier raise StoreUnavailable: inline,
        or for background writes at the next put/flush.
        """
        self._raise_background_error()
        planned = time.monotonic() if planned is None else planned
        if self.deleted_since(key, planned):
            with self._lock:
                self.puts_superseded += 1
            return
        if sync:
            self._write(key, entry, exact, planned)
            return
        self._ensure_writer()
        job = _Put(self, key, entry, exact, planned)
        with self._lock:
            queued = self._queued.get(key)
            if queued is not None and not exact and queued.entry.header.origin == entry.header.origin:
                self.puts_deduplicated += 1  # the same content address, computed alike, already on its way
                return
            self._queued[key] = job
        try:
            self._queue.put(job, timeout=self.put_wait_s)
        except queue.Full:  # the writer is stuck in a tier: the write is dropped, not the caller held
            job.drop()
            with self._lock:
                self.puts_dropped += 1
                first = self.puts_dropped == 1
            (log.warning if first else log.debug)(
                "the KV store's write queue stayed full for %g s (a tier slow to write); dropped the write of %s "
                "(computed again when next needed; later drops are counted in puts_dropped)", self.put_wait_s, key)

    def _write(self, key: str, entry: KVEntry, exact: bool = False, planned: float | None = None,
               sealed: Callable[[Codec], KVEntry] | None = None) -> None:
        """Put `entry` into every tier, encoded in the tier's codec for the key's kind (once per
        codec, by `sealed` when given: a queued put's shared copies; not when `exact`) and sealed;
        nothing when the key was deleted after `planned`, and what was written is deleted again
        when the delete came while it was written."""
        if planned is not None and self.deleted_since(key, planned):
            with self._lock:
                self.puts_superseded += 1
            return
        ready: dict[Codec, KVEntry] = {}
        codecs = self.exact_codecs if key_kind(key) == "prefix" else self.codecs
        for i, (tier, codec) in enumerate(zip(self.tiers, codecs, strict=True)):
            t0 = time.monotonic()
            codec = NONE if exact else codec
            if codec not in ready:
                ready[codec] = sealed(codec) if sealed is not None else self._seal(key, entry.encode(codec))
            try:
                tier.put(key, ready[codec])
            finally:
                self._count(i, write_s=time.monotonic() - t0)
        if planned is not None:
            self._undo_if_deleted(key, planned)

    def deleted_since(self, key: str, planned: float) -> bool:
        """Whether `key` was deleted after `planned` (time.monotonic): a write planned then is void."""
        with self._lock:
            return planned < self._deleted_floor or self._deleted.get(key, float("-inf")) > planned

    def _undo_if_deleted(self, key: str, planned: float) -> None:
        """After a write planned at `planned`: when `key` was deleted meanwhile (the delete may have
        reached the tiers before this write did), delete it again."""
        if self.deleted_since(key, planned):
            with self._lock:
                self.puts_superseded += 1
            for tier in self.tiers:
                tier.delete(key)

    def _seal(self, key: str, entry: KVEntry) -> KVEntry:
        """`entry` with a tag for `key` when the store has a secret (sha256 checksums: ~1.4 GB/s)."""
        return seal(entry, key, self._secret) if self._secret is not None else entry

    def _ensure_writer(self) -> None:
        if self._closed:
            raise RuntimeError("TieredStore is closed; create a new one with TieredStore.from_config")
        with self._writer_lock:
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="kvblend-store-writer", daemon=True)
                self._writer.start()

    def _write_loop(self) -> None:
        single_threaded()  # encoding here must not start an OpenMP pool beside the engine's (storage.openmp)
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                job()
            except StoreUnavailable as e:
                self._error = self._error or e
            except Exception as e:  # keep the writer alive; surfaced by the next flush()/put()
                log.exception("background store write failed")
                self._error = self._error or e
            finally:
                self._queue.task_done()

    def pending_writes(self) -> int:
        """Write-behind jobs queued and not yet taken by the writer (puts, promotions); no side effects."""
        return self._queue.qsize()

    def _raise_background_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def check(self) -> None:
        """Re-raise the error a background write met since the last check (a `required` tier's
        StoreUnavailable), without waiting for the queued writes (`flush` waits)."""
        self._raise_background_error()

    def flush(self) -> None:
        """Complete pending promotions and wait for every queued write; re-raises a background error."""
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for promotion in pending:
            self._submit_promotion(promotion)
        if self._writer is not None:
            self._queue.join()
        self._raise_background_error()

    def close(self, timeout: float | None = None) -> None:
        """Flush, stop the writer thread and close every tier. Idempotent.

        `timeout` (seconds; None: as long as it takes) bounds the flush and the writer's end:
        the writes still queued then are dropped unwritten, with a warning (at interpreter
        exit: EXIT_FLUSH_S)."""
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            if deadline is None:
                self.flush()
            else:
                self._flush_until(deadline)
        finally:
            self._closed = True
            if self._writer is not None:
                self._queue.put(_STOP)
                self._writer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if self._writer.is_alive():
                    log.warning("the KV store's writer is still in a tier's write after %.0f s; leaving it", timeout)
            for tier in self.tiers:
                tier.close()
            _OPEN_STORES.discard(self)

    def _flush_until(self, deadline: float) -> None:
        """`flush`, but waiting for the writer only until `deadline`: what is still queued then is
        dropped (its lookups released) and counted in a warning."""
        with self._lock:
            pending = list(self._pending.values())
            self._pending.clear()
        for promotion in pending:
            self._submit_promotion(promotion)
        if self._writer is None:
            return
        done = self._queue.all_tasks_done  # the queue's own condition, notified by task_done
        with done:
            while self._queue.unfinished_tasks and (left := deadline - time.monotonic()) > 0:
                done.wait(left)
        dropped = 0
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(job, _Put):
                job.drop()
            dropped += job is not _STOP
            self._queue.task_done()
        if dropped:
            log.warning("the KV store could not write %d queued entr%s in time (a slow or unreachable tier); "
                        "dropped: they are computed again when next needed", dropped, "y" if dropped == 1 else "ies")
        self._raise_background_error()

    # ------------------------------------------------------------- management
    def suspend(self, names: Sequence[str], reason: str) -> None:
        """Skip the named tiers for their backoff (those that have one: Redis), e.g. after
        a read too slow to wait for; logs `reason` once. A required tier raises
        StoreUnavailable instead."""
        log.warning("%s", reason)
        for tier in self.tiers:
            if tier.name in names and hasattr(tier, "suspend"):
                tier.suspend(reason)

    def delete(self, key: str) -> list[str]:
        """Remove `key` from every tier; returns the names of the tiers that could not be
        reached (the entry may stay there). Wins over every write of `key` planned before it:
        a queued one is dropped, one under way is undone, a later one planned earlier is
        skipped (see `put`). Does not wait for the writer."""
        with self._lock:
            self._deleted[key] = time.monotonic()
            self._deleted.move_to_end(key)
            while len(self._deleted) > DELETES_KEPT:
                self._deleted_floor = max(self._deleted_floor, self._deleted.popitem(last=False)[1])
            self._pending.pop(key, None)
            queued = self._queued.pop(key, None)
        if queued is not None:
            queued.done.set()  # a lookup waiting for it goes on to the tiers (the writer skips it)
        return [tier.name for tier in self.tiers if not tier.delete(key)]

    def clear(self) -> list[str]:
        """Wait for queued writes, then empty every tier; returns the names of the tiers
        that could not be reached (their entries stay)."""
        self.flush()
        return [tier.name for tier in self.tiers if not tier.clear()]

    def keys(self) -> Iterator[str]:
        """Distinct keys over all tiers, top tier first."""
        seen: set[str] = set()
        for tier in self.tiers:
            for key in tier.keys():
                if key not in seen:
                    seen.add(key)
                    yield key

    def stats(self) -> dict[str, dict]:
        """{tier name: tier counters + LOOKUP_COUNTERS}, for this store's namespace only."""
        out: dict[str, dict] = {}
        for tier in self.tiers:
            with self._lock:
                counts = dict(self._counts[tier.name])
            extra = {k: counts.get(k, 0) for k in LOOKUP_COUNTERS}
            out[tier.name] = ({"kind": getattr(tier.config, "kind", tier.name), "codec": tier_codec(tier).name,
                               "exact_codec": tier_exact_codec(tier).name}
                              | tier.stats() | extra)
        return out
