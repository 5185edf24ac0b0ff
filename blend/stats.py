"""Typed per-request statistics.

Every request path builds exactly one `RequestStats` (frozen) from the typed reports of
its steps: what the lookups found (`LookupTally`), what the loader did (`LoadReport`),
what the selective recompute chose (`SelectionReport`). `to_dict` is the only place a
request's statistics become JSON; eval, benches and the CLI read fields, never keys.

Lookups are counted per kind of cached segment, never mixed:
  documents      document chunks of a RAG prompt
  system         the fixed instruction part before the documents
  prefix_blocks  exact prefix blocks (prefix mode, chat turns)
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

LookupKind = Literal["documents", "system", "prefix_blocks"]
LOOKUP_KINDS: tuple[LookupKind, ...] = ("documents", "system", "prefix_blocks")


@dataclass(frozen=True)
class LookupCounts:
    """Hits and misses of one kind of cached segment in one request."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float | None:
        total = self.hits + self.misses
        return self.hits / total if total else None


class LookupTally:
    """Mutable counter of one request's lookups; `freeze` gives the typed counts.

    Per tier: a hit in tier i counts a miss in every tier above it; a miss counts a
    miss in every tier (the lookup walked them all).
    """

    def __init__(self, tier_names: Sequence[str]):
        self.tier_names = list(tier_names)
        self.hits: Counter[str] = Counter()
        self.misses: Counter[str] = Counter()
        self.hits_by_tier: Counter[str] = Counter()
        self.misses_by_tier: Counter[str] = Counter()

    def hit(self, kind: LookupKind, tier_index: int) -> None:
        self.hits[kind] += 1
        for name in self.tier_names[:tier_index]:
            self.misses_by_tier[name] += 1
        self.hits_by_tier[self.tier_names[tier_index]] += 1

    def miss(self, kind: LookupKind) -> None:
        self.misses[kind] += 1
        for name in self.tier_names:
            self.misses_by_tier[name] += 1

    def hit_from(self, kind: LookupKind, tier_name: str) -> None:
        """A hit known by tier name only (a chain found by a prefix lookup)."""
        self.hits[kind] += 1
        self.hits_by_tier[tier_name] += 1

    def counts(self, kind: LookupKind) -> LookupCounts:
        return LookupCounts(self.hits[kind], self.misses[kind])


@dataclass(frozen=True)
class LoadReport:
    """What a request's layer loader did."""

    load_s: float = 0.0  # time the loader spent fetching, converting, placing (CUDA: first copy to last layer placed)
    exposed_load_s: float = 0.0  # time compute waited for a layer (CUDA: GPU time the compute stream idled)
    bytes_by_tier: Mapping[str, int] = field(default_factory=dict)
    copies: int = 0  # copy operations that moved KV into the cache or onto the device
    layers_loaded: int = 0
    read_s_by_tier: Mapping[str, float] = field(default_factory=dict)  # host time spent in tier reads
    place_s: float = 0.0  # time spent moving bytes into the cache (CUDA: device time)
    computed_bytes: int = 0  # bytes of entries in hand (computed in this request) placed with the loaded ones


@dataclass(frozen=True)
class MissReport:
    """How a request paid for the documents it missed (blend.planning.misses).

    `plan`: None when nothing missed, else standalone | harvest | mixed. `computed`: missing
    documents computed on their own; `harvested`: stored from this request's own computation
    (its full prefill, or the blend pass's computed prefix); `deduplicated`: lookups that found
    their entry still queued for the store by another request's computation; `compute_s`:
    seconds of compute on this request's path spent on its misses (their own passes, the
    harvest's cut); `predicted`: seconds per plan priced.
    """

    plan: str | None = None
    reason: str = ""
    missed: int = 0
    computed: int = 0
    harvested: int = 0
    deduplicated: int = 0
    compute_s: float = 0.0
    predicted: Mapping[str, float] = field(default_factory=dict)

    def replace(self, **changes: Any) -> MissReport:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan, "reason": self.reason, "missed": self.missed, "computed": self.computed,
                "harvested": self.harvested, "deduplicated": self.deduplicated, "compute_s": self.compute_s,
                "predicted_s": dict(self.predicted)}


@dataclass(frozen=True)
class SplitReport:
    """The load-or-compute split of one request (blend.split).

    When loading every cached segment would take longer than computing, a prefix of the
    prompt is computed with plain prefill while the rest loads; `computed_tokens` is that
    prefix. Predictions come from the live cost models (blend.planner: PrefillCosts, LoadCosts).
    """

    taken: bool = False
    reason: str = ""  # why it was (not) taken, one line
    computed_tokens: int = 0  # prompt tokens [0, computed_tokens) computed instead of loaded
    loaded_tokens: int = 0  # cached tokens still loaded
    predicted_s: float | None = None  # predicted prefill time of the chosen plan
    predicted_unsplit_s: float | None = None  # ... of loading every cached segment
    predicted_full_s: float | None = None  # ... of a full prefill
    predicted_load_s: float | None = None  # load time of the chosen plan
    predicted_compute_s: float | None = None  # compute time of the chosen plan

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SelectionReport:
    """What the selective recompute chose."""

    check_layers: tuple[int, ...] = ()
    selected_per_layer: tuple[int, ...] = ()  # context rows kept at each check layer
    recomputed_tokens: int = 0  # context rows recomputed through the last layer
    selection_s: float = 0.0  # time spent scoring and choosing rows
    selected_rows: tuple[Any, ...] = ()  # per check layer: the kept context positions, a (k,) CPU tensor
    query_pass: bool = False  # selected by a query pass over every layer first (policy `query`)
    # per layer: the mean over KV heads of the logit offset subtracted from the stale keys' scores
    # (`stale_bias`; 0 where no key was left stale or the correction is off)
    key_bias: tuple[float, ...] = ()
    pass_rows: tuple[int, ...] = ()  # rows each layer of the query pass computed (empty without one)
    layer_rows: tuple[int, ...] = ()  # rows each layer of the layer loop computed (RecomputePlan.layer_rows)


@dataclass(frozen=True)
class RequestStats:
    """Statistics of one request (a `generate` call or a chat turn)."""

    mode: str  # full | reuse | prefix | blend | chat
    recompute_ratio: float
    context_tokens: int  # tokens before the query (cacheable part)
    query_tokens: int
    loaded_tokens: int  # context tokens whose KV came from the store
    recomputed_tokens: int  # context tokens computed in this request
    documents: LookupCounts = LookupCounts()
    system: LookupCounts = LookupCounts()
    prefix_blocks: LookupCounts = LookupCounts()
    hits_by_tier: Mapping[str, int] = field(default_factory=dict)
    misses_by_tier: Mapping[str, int] = field(default_factory=dict)
    load: LoadReport = LoadReport()
    selection: SelectionReport = SelectionReport()
    prefill_s: float = 0.0  # wall time of the prefill (load + compute)
    ttft_s: float = 0.0
    total_s: float = 0.0
    new_tokens: int = 0
    answer_nll: float | None = None  # with generate(answer=...): mean NLL of that text
    source: str | None = None  # chat: where the history's KV came from (device | store | computed)
    stored_blocks: int = 0  # prefix blocks queued for the store by this request
    split: SplitReport = SplitReport()
    miss: MissReport = MissReport()  # how the documents it missed were paid for
    stalled_tiers: tuple[str, ...] = ()  # tiers given up mid-load (too slow): the request was computed whole
    # scheduling (blend.engine.scheduler)
    queued_s: float = 0.0  # submitted to the start of its prefill
    batch_size_mean: float = 0.0  # mean number of sequences in its decode steps
    preempted: int = 0  # times its KV was parked in the tiers to free device memory
    resume_s: float = 0.0  # time spent restoring it after preemptions

    @property
    def load_s(self) -> float:
        return self.load.load_s

    @property
    def exposed_load_s(self) -> float:
        return self.load.exposed_load_s

    @property
    def compute_s(self) -> float:
        """Prefill time not spent waiting for loads."""
        return max(0.0, self.prefill_s - self.load.exposed_load_s)

    @property
    def bytes_loaded(self) -> int:
        return int(sum(self.load.bytes_by_tier.values()))

    @property
    def cached_segments(self) -> LookupCounts:
        """Hits and misses over every kind of cached segment."""
        kinds = (self.documents, self.system, self.prefix_blocks)
        return LookupCounts(sum(c.hits for c in kinds), sum(c.misses for c in kinds))

    def replace(self, **changes: Any) -> RequestStats:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict (the one serialisation of request statistics)."""
        return {
            "mode": self.mode, "recompute_ratio": self.recompute_ratio,
            "context_tokens": self.context_tokens, "query_tokens": self.query_tokens,
            "loaded_tokens": self.loaded_tokens, "recomputed_tokens": self.recomputed_tokens,
            **{kind: {"hits": c.hits, "misses": c.misses}
               for kind, c in (("documents", self.documents), ("system", self.system),
                               ("prefix_blocks", self.prefix_blocks))},
            "hits_by_tier": dict(self.hits_by_tier), "misses_by_tier": dict(self.misses_by_tier),
            "load_s": self.load.load_s, "exposed_load_s": self.load.exposed_load_s,
            "bytes_loaded": dict(self.load.bytes_by_tier),
            "check_layers": list(self.selection.check_layers),
            "selected_per_layer": list(self.selection.selected_per_layer),
            "selection_s": self.selection.selection_s,
            "stale_key_bias": [round(b, 4) for b in self.selection.key_bias],
            "prefill_s": self.prefill_s, "compute_s": self.compute_s, "ttft_s": self.ttft_s,
            "total_s": self.total_s, "new_tokens": self.new_tokens, "answer_nll": self.answer_nll,
            "source": self.source, "stored_blocks": self.stored_blocks,
            "load_copies": self.load.copies, "place_s": self.load.place_s,
            "read_s_by_tier": dict(self.load.read_s_by_tier), "split": self.split.to_dict(),
            "miss_plan": self.miss.to_dict(),
            "stalled_tiers": list(self.stalled_tiers),
            "queued_s": self.queued_s, "batch_size_mean": self.batch_size_mean, "preempted": self.preempted,
            "resume_s": self.resume_s,
        }


def tally_fields(tally: LookupTally) -> dict[str, Any]:
    """The RequestStats fields that come from a request's lookups."""
    return {kind: tally.counts(kind) for kind in LOOKUP_KINDS} | {
        "hits_by_tier": dict(tally.hits_by_tier), "misses_by_tier": dict(tally.misses_by_tier)}
