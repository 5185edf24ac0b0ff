"""One request's prefill: planned into data, then run as steps the scheduler drives.

    request -> `PromptWork` (the prompt, its block keys, mode, ratio) or a chat `Turn`
            -> `DocumentCache.lookup`: where each cached segment is (`Resolution`; another plan
               computing the same documents is waited for: `DocumentCache.claim`)
            -> the documents that missed, their passes as items of the scheduler's steps
               (`compute_misses`: beside running sequences' decode rows)
            -> placements -> the split, which returns the recompute plan it priced
            -> a plan: `FullPlan` (every token), `PrefixPlan` (an exact chain loaded, the rest
               computed) or `BlendPlan` (what is loaded, what each layer recomputes, what is
               harvested after)
            -> `Prefiller.run(plan)`: its model work as data for the executor (`Rows`: the
               scheduler runs them in pieces beside the decode rows; a blend's `BlendPass`, a
               cursor whose layer ranges the steps run) -> `Prefilled`

`Prefiller.plan(work)` returns the request's plan as a cursor (blend.model.plan): its progress
is data (`stage`, the fields it has made, the `sub` plan it runs first), `want` is what it asks
of the next step (`Rows`, a list of them, a model-work cursor, a pause) and `take` hands it the
step's output and plans to its next want; its last want is `Done(Prefilled)`. The cursors, by
stage: `PromptPrefill` (the mode's plan, then teacher forcing), `BlendPrefill` (claims ->
calibrated -> misses -> run), `PrefixPrefill` (calibrated -> resolved -> run), and the
runs of the three plans (`FullRun`, `PrefixRun`, `BlendRun`) each inside a `TimedRun`. A load
that stalls (a tier too slow to wait for, now suspended; raised in the plan or handed to it by
the executor) runs the plan's `FullPlan` of the same tokens instead, in one place (`TimedRun`);
a load that fails (an unreadable entry, dropped) plans a blend again with its documents
computed on their own (`BlendPrefill`). A chat turn's exact KV is `SessionManager.prefill_plan`
(`TurnPrefill`), a plan of its own shape. Teacher forcing (`answer`, `follow`, used by eval)
runs right after the prefill, before any decode step touches the cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from blend.config import BlendConfig, Selection
from blend.decode.forcing import answer_nll, forced_logprobs
from blend.decode.generation import Prefilled
from blend.kv.documents import Block, DocumentCache, Resolution
from blend.kv.loader import LayerLoader, LoadFailed, LoadStalled, Placement
from blend.kv.prefix import PrefixCache
from blend.model.cache import KVCache
from blend.model.plan import PAUSE, Clock, Done, PlanCursor, Timed, Want
from blend.model.runner import Rows, Runner
from blend.planning.misses import HARVEST, MIXED, MissPlan, plan_misses
from blend.planning.split import Split, Splitter
from blend.prompt.builder import Prompt
from blend.recompute.layers import BlendPass
from blend.recompute.stale import shift_applies
from blend.session.manager import SessionManager, Turn, turn_stats
from blend.stats import LookupTally, MissReport, RequestStats, SplitReport, tally_fields
from storage.entry import KVEntry
from storage.stack import TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PromptWork:
    """A `generate` request's prefill: the prompt laid out, its blocks (keys hashed once),
    the mode, what to teacher-force after it, and the request's own split mode (`split`,
    None: the engine's `engine.blend.split`)."""

    prompt: Prompt
    blocks: dict[int, list[Block]]  # per cacheable segment index (DocumentCache.segment_blocks)
    mode: str
    ratio: float
    selection: str | None
    capacity: int  # cache positions allocated up front
    answer: str | None = None
    follow: tuple[int, ...] | None = None
    split: str | None = None
    submitted: float = field(default_factory=time.monotonic)  # when the request was made (deduplication counts)


@dataclass(frozen=True)
class FullPlan:
    """Every token computed: the reference, a harvest, every fallback. One `Rows` of the whole
    prompt (the executor runs it in chunks beside the decode rows)."""

    ids: tuple[int, ...]
    capacity: int
    stats: RequestStats  # what the result's stats start from


@dataclass(frozen=True)
class PrefixPlan:
    """Prefix mode: an exact cached prefix (`chain`) loaded layer by layer while the rest is
    computed as rows (`computed`: the split's computed first tokens; `boundary`: where the
    rows a later request will load end), then its new full blocks stored (from `stored_below`)."""

    prompt: Prompt
    capacity: int
    chain: tuple[Placement, ...]
    computed: int
    boundary: int
    stored_below: int
    split: SplitReport
    tally: LookupTally


@dataclass(frozen=True)
class BlendPlan:
    """Blend or reuse: what is loaded and what each layer recomputes (`split.plan`, the recompute
    plan the split priced), and the missing documents harvested from the computed prefix after
    the pass (`harvest`: indices into `resolution`'s segments)."""

    prompt: Prompt
    capacity: int
    mode: str
    ratio: float
    selection: Selection
    split: Split
    tally: LookupTally
    report: MissReport
    resolution: Resolution | None = None
    harvest: tuple[int, ...] = ()
    split_mode: str | None = None


class Prefiller:
    """Plans prefills and runs the plans, for one engine: its runner, document and prefix
    caches, split, sessions. Each entry point returns a plan cursor (blend.model.plan): the
    scheduler advances it between its steps."""

    def __init__(self, config: BlendConfig, runner: Runner, store: TieredStore, documents: DocumentCache,
                 prefixes: PrefixCache, splitter: Splitter, sessions: SessionManager, tokenizer,
                 stall_s: float | None):
        self.config, self.runner, self.store = config, runner, store
        self.documents, self.prefixes, self.splitter, self.sessions = documents, prefixes, splitter, sessions
        self.tokenizer, self.stall_s = tokenizer, stall_s
        self.tier_names = [t.name for t in store.tiers]
        self._warm = False  # set after the first prefill (not a cost sample: see `_observe`)

    # ------------------------------------------------------------- entry points
    def plan(self, work: PromptWork) -> PromptPrefill:
        """The prefill of a `generate` request, as a plan (see the module docstring); teacher
        forcing (`answer`, `follow`) comes back in the result (`stats.answer_nll`,
        `Prefilled.follow_logprobs`)."""
        return PromptPrefill(self, work)

    def turn_plan(self, turn: Turn, work: PromptWork | None) -> PlanCursor:
        """A chat turn's prefill: its documents blended in (`work`, when the turn blends and
        they are not all on the device), else its exact KV (device copy, stored prefix chain,
        the rest computed: `SessionManager.prefill_plan`)."""
        capacity = len(turn.ids) + turn.max_new_tokens
        if work is not None and turn.blends():  # (such a turn is not exact from its start: `SessionManager.begin`)
            return self.plan(work)
        fallback = FullPlan(tuple(turn.ids), capacity, turn_stats(turn.ids, "computed", 0))
        return TimedRun(self, self.sessions.prefill_plan(turn, capacity), fallback)

    def run(self, plan: FullPlan | PrefixPlan | BlendPlan) -> PlanCursor:
        """A plan's execution, as a cursor: its rows asked of the executor, its layer loop paused."""
        if isinstance(plan, FullPlan):
            return FullRun(self, plan)
        if isinstance(plan, PrefixPlan):
            return PrefixRun(self, plan)
        if isinstance(plan, BlendPlan):
            return self._run_blend(plan)
        raise TypeError(f"no executor for {type(plan).__name__}")

    def _run_blend(self, plan: BlendPlan) -> PlanCursor:
        return BlendRun(self, plan)

    # ----------------------------------------------------------------- helpers
    def calibrate(self, split: str | None) -> bool:
        """Under `engine.blend.split: auto`, the split's cost model is calibrated once, before the
        first prefill that consults it: a unit of its own (running sequences decode around it),
        outside that prefill's timing. Whether it ran."""
        if self.splitter.calibrates(split):
            self.splitter.cost_model(split)
            return True
        return False

    def _fallback(self, plan: PrefixPlan | BlendPlan) -> FullPlan:
        """The stall fallback: every token of the plan's prompt computed."""
        return FullPlan(plan.prompt.token_ids, plan.capacity, self._stats(plan.prompt, "full"))

    def _observe(self, pre: Prefilled, tuned: int) -> None:
        # the engine's first prefill pays one-time costs (kernel selection, allocator, lazy
        # init: often several times slower), and a request that timed attention kernels
        # measured them: neither is a sample of the model's speed
        if self._warm and len(self.runner.tuner.tunings) == tuned and pre.stats.mode != "chat":
            self.splitter.observe(pre.stats, self.runner.num_layers)
        self._warm = True

    def _stats(self, prompt: Prompt, mode: str, ratio: float = 1.0, **fields) -> RequestStats:
        context = prompt.query.start
        fields.setdefault("loaded_tokens", 0)
        fields.setdefault("recomputed_tokens", context)
        return RequestStats(mode=mode, recompute_ratio=ratio, context_tokens=context,
                            query_tokens=len(prompt) - context, **fields)

    def _plan_prefix(self, prompt: Prompt, capacity: int, split_mode: str | None, found: list[Placement],
                     chain: list[Placement] | None, tally: LookupTally) -> PrefixPlan:
        """Prefix mode's plan from its chain (`chain`: the exact segments resolved, `PrefixPrefill`;
        None: `found`, the longest chain of prefix blocks)."""
        ids = prompt.token_ids
        limit = len(ids) - 1  # at least the last token is computed
        chain_len = sum(pl.length for pl in found)
        if chain is None:
            chain = found
            for pl in chain:
                tally.hit_from("prefix_blocks", pl.source)
        # the load-or-compute split (blend.split) may compute the chain's first blocks instead
        split = self.splitter.plan_prefix(len(ids), chain, self.runner.num_layers, split_mode)
        # the tail computed apart from the blocks a later request will load: the same numbers either way
        return PrefixPlan(prompt, capacity, tuple(chain), split.computed_tokens, self.prefixes.aligned_end(limit),
                          chain_len, split.report, tally)


class PromptPrefill(PlanCursor):
    """A `generate` request's prefill as a cursor: its mode's plan (`TimedRun` of a `FullPlan`,
    `PrefixPrefill`, `BlendPrefill`), then its teacher forcing (`answer`, `follow`)."""

    def __init__(self, prefiller: Prefiller, work: PromptWork):
        super().__init__()
        self.prefiller, self.work = prefiller, work

    def _next(self, output: Any, error: BaseException | None) -> Want:
        pf, work = self.prefiller, self.work
        if self.stage == "start":
            prompt, mode = work.prompt, work.mode
            capacity = max(work.capacity, len(prompt))
            self.stage = "prefill"
            if mode == "full":
                return self.run(TimedRun(pf, FullPlan(prompt.token_ids, capacity, pf._stats(prompt, "full"))))
            if mode == "prefix":
                return self.run(PrefixPrefill(pf, prompt, capacity, work.split))
            ratio = 0.0 if mode == "reuse" else work.ratio
            selection = pf.config.blend.selection.with_policy(work.selection)
            return self.run(BlendPrefill(pf, prompt, work.blocks, ratio, capacity, mode, selection, work.submitted,
                                         work.split))
        pre: Prefilled = output
        if work.answer is not None:
            pre.stats = pre.stats.replace(answer_nll=answer_nll(pf.runner, pf.tokenizer, pre.cache, pre.logits,
                                                                work.answer))
        if work.follow:
            pre.follow_logprobs = forced_logprobs(pf.runner, pre.cache, pre.logits, work.follow).cpu()
        self.stage = "done"
        return Done(pre)


class PrefixPrefill(PlanCursor):
    """Prefix mode: the split calibrated (a pause of its own), the longest exactly cached prefix
    found, then its `PrefixPlan` run (`TimedRun`). That prefix is the prompt's own prefix blocks,
    or the cached segments that are exact at their position (the system part, and the first
    document when documents are computed after it) when their entries are exact too: stored in
    the compute dtype and in no codec (else loading them would not equal computing them: prefix
    mode is exact). Those segments' misses are computed as the plan's wants
    (`DocumentCache.resolve_plan`), before the prefill's own."""

    def __init__(self, prefiller: Prefiller, prompt: Prompt, capacity: int, split: str | None):
        super().__init__()
        self.prefiller, self.prompt, self.capacity, self.split = prefiller, prompt, capacity, split
        self.tally = LookupTally(prefiller.tier_names)
        self.found: list[Placement] = []  # the longest chain of this prompt's own prefix blocks

    def _next(self, output: Any, error: BaseException | None) -> Want:
        pf, prompt = self.prefiller, self.prompt
        if self.stage == "start":
            self.stage = "calibrated"
            if pf.calibrate(self.split):
                return PAUSE
        if self.stage == "calibrated":
            limit = len(prompt.token_ids) - 1
            exact = [prompt.prefix]
            if (pf.config.blend.chunk_context == "system" and len(prompt.segments) > 2
                    and prompt.segments[1].kind == "document"):
                exact.append(prompt.segments[1])
            exact_len = exact[-1].end if exact[-1].end <= limit else 0
            self.found = pf.prefixes.lookup(prompt.token_ids, limit)
            chain_len = sum(pl.length for pl in self.found)
            if exact_len > chain_len and pf.documents.maker.kv_dtype == pf.prefixes.maker.kv_dtype:
                self.stage = "resolved"
                return self.run(pf.documents.resolve_plan(prompt, [s for s in exact if s.end <= limit], self.tally,
                                                          raw_only=True))
            self.stage, output = "resolved", None
        if self.stage == "resolved":  # `output`: the exact segments' placements (None: prefix blocks)
            plan = pf._plan_prefix(prompt, self.capacity, self.split, self.found, output, self.tally)
            self.stage = "run"
            return self.run(TimedRun(pf, plan))
        self.stage = "done"
        return Done(output)


class BlendPrefill(PlanCursor):
    """Blend or reuse as a cursor, its stages in order:

        claims      another plan under way computes some of these documents: it waits (pauses)
                    for their entries rather than computing them a second time; then its
                    segments are looked up and its misses claimed (released on every exit);
        calibrated  the split's cost model calibrated once (a pause of its own);
        misses      its misses priced (blend.planning.misses): a harvest runs one full prefill and
                    cuts the missing documents out of it (`harvest`); else the standalone ones
                    are computed as its wants (`MissPasses`, timed on their own);
        run         placements, the load-or-compute split (which returns the recompute plan it
                    priced) and the `BlendPlan` run (`TimedRun`).

    A load that fails (an unreadable entry, dropped) plans it again, every document a miss
    computed on its own as its entry was (nothing of the store trusted); a second failure runs
    the full plan."""

    handles = (LoadFailed,)  # an unreadable entry: planned again (its run's; any other stage's is raised)

    def __init__(self, prefiller: Prefiller, prompt: Prompt, blocks: dict[int, list[Block]] | None, ratio: float,
                 capacity: int, mode: str, selection: Selection, submitted: float | None = None,
                 split: str | None = None):
        super().__init__()
        self.prefiller, self.prompt, self.ratio, self.capacity = prefiller, prompt, ratio, capacity
        self.mode, self.selection, self.submitted, self.split = mode, selection, submitted, split
        self.cached = [i for i, s in enumerate(prompt.segments) if s.kind != "query"]
        self.blocks = blocks if blocks is not None else prefiller.documents.segment_blocks(prompt)
        self.stage = "claims"
        self.failed: LoadFailed | None = None  # the load that failed (its second plan trusts no stored entry)
        self.tally = LookupTally(prefiller.tier_names)
        self.resolution: Resolution | None = None
        self.claimed: list[str] = []
        self.misses: MissPlan | None = None
        self.report = MissReport()
        self.computed: dict[int, list[KVEntry]] = {}
        self.clock: Clock | None = None  # the misses' own time

    def _next(self, output: Any, error: BaseException | None) -> Want:
        pf = self.prefiller
        if error is not None:
            if self.stage != "run":
                raise error
            self._release()
            if self.failed is not None:  # a second failure: the full plan
                self.failed, self.stage = error, "fallback"
                return self.run(TimedRun(pf, FullPlan(self.prompt.token_ids, self.capacity,
                                                      pf._stats(self.prompt, "full"))))
            # after an unreadable entry (dropped by the loader) the plan again, every document a miss computed
            # on its own as its entry was: the answer intact entries give, and every entry rewritten
            self.failed, self.tally, self.stage = error, LookupTally(pf.tier_names), "claims"
            self.computed, self.misses, self.report = {}, None, MissReport()
        if self.stage == "claims":
            return self._claim()
        if self.stage == "calibrated":
            return self._price()
        if self.stage == "harvest":  # one full prefill ran: the missing documents cut out of it
            assert self.resolution is not None and self.misses is not None
            t0 = time.perf_counter()
            pf.documents.harvest(self.resolution, self.misses.harvested, output.cache)
            output.stats = output.stats.replace(miss=self.report.replace(compute_s=time.perf_counter() - t0))
            return self._done(output)
        if self.stage == "misses":  # their entries, by index into the resolution
            assert self.clock is not None
            self.computed, self.report = output, self.report.replace(compute_s=self.clock.own_s)
            return self._split()  # (under a millisecond: in the same advance, not a step later)
        if self.stage == "fallback":
            assert self.failed is not None
            output.stats = output.stats.replace(stalled_tiers=self.failed.tiers)
        return self._done(output)

    def _done(self, pre: Prefilled) -> Want:
        self._release()
        self.stage = "done"
        return Done(pre)

    def _claim(self) -> Want:
        pf, docs = self.prefiller, self.prefiller.documents
        if docs.computing([b.key for i in self.cached for b in self.blocks[i]]):
            return PAUSE  # another plan under way computes some of these documents: their entries, not a second pass
        # after a failed load, nothing of the store is trusted: every document computed again on its own
        self.resolution = docs.lookup(self.prompt, self.cached, self.blocks, self.submitted,
                                      use_store=self.failed is None)
        self.claimed = [b.key for looked in self.resolution.looked if looked.missed for b in looked.rebuild.block_list]
        docs.claim(self.claimed)
        self.report = MissReport(deduplicated=self.resolution.deduplicated)
        self.stage = "calibrated"
        if pf.calibrate(self.split):
            return PAUSE
        return self._price()

    def _price(self) -> Want:
        pf, resolution = self.prefiller, self.resolution
        assert resolution is not None
        if not resolution.misses:
            return self._split()
        # priced (blend.planning.misses), then paid as the cheapest plan runs
        policy = "standalone" if self.failed is not None else pf.config.blend.miss_policy
        plan = self.misses = plan_misses(policy, pf.splitter.cost_model(self.split), self.prompt, resolution,
                                         pf.documents, self.ratio, self.selection, pf.runner.num_layers)
        self.report = MissReport(plan.kind, plan.reason, resolution.misses, len(plan.standalone), len(plan.harvested),
                                 resolution.deduplicated, 0.0, dict(plan.predicted))
        if plan.kind == HARVEST:  # one full prefill; the missing documents cut out of it
            pf.documents.placements(resolution, self.tally, skip=plan.harvested)  # the lookups counted
            self.stage = "harvest"
            return self.run(TimedRun(pf, FullPlan(self.prompt.token_ids, self.capacity,
                                                  pf._stats(self.prompt, self.mode, self.ratio,
                                                            **tally_fields(self.tally)))))
        if plan.standalone:  # their own passes, as their own wants (not inside the timed prefill)
            self.clock = Clock()  # their own time, not the other sequences' steps between the passes
            self.stage = "misses"
            return self.run(Timed(pf.documents.compute_misses(resolution, plan.standalone), self.clock))
        return self._split()

    def _split(self) -> Want:
        pf, resolution, plan = self.prefiller, self.resolution, self.misses
        assert resolution is not None
        placements = pf.documents.placements(resolution, self.tally, self.computed,
                                             skip=plan.harvested if plan else ())
        # the load-or-compute split (blend.planning.split) may compute a prefix instead of loading it;
        # a mixed miss plan fixes that prefix (its missing documents are harvested from it)
        fresh = plan.fresh if plan is not None and plan.kind == MIXED else None
        chosen = pf.splitter.plan(self.prompt, placements, self.ratio, self.selection, pf.runner.num_layers,
                                  fresh=fresh, mode=self.split)
        blend = BlendPlan(self.prompt, self.capacity, self.mode, self.ratio, self.selection, chosen, self.tally,
                          self.report, resolution, plan.harvested if plan is not None else (), self.split)
        self.stage = "run"
        return self.run(TimedRun(pf, blend))

    def _release(self) -> None:
        claimed, self.claimed = self.claimed, []
        if claimed:
            self.prefiller.documents.release(claimed)
            if self.stage == "harvest":  # ended (cancelled, shut down) before its prefill: nothing cut out of it
                log.warning("a blend ended before its prefill finished: %d blocks of its missing documents were not "
                         "stored (computed again when next needed)", len(claimed))


class TimedRun(PlanCursor):
    """`plan` run (`Prefiller.run`; a cursor: its wants as they are), timed to its logits (CUDA
    synchronised): its own time, the work done inside it and the steps that computed its rows,
    not the other sequences' steps between its pauses (`Clock`). A `LoadStalled` runs the
    `fallback` plan instead (default: the plan's own `FullPlan` of the same tokens; a blend's
    unreadable entry, `LoadFailed`, is its planner's: `BlendPrefill`). Feeds the split's cost
    model."""

    handles = (LoadStalled,)  # its fallback runs (a blend's unreadable entry, `LoadFailed`: raised to its planner)

    def __init__(self, prefiller: Prefiller, plan: FullPlan | PrefixPlan | BlendPlan | PlanCursor,
                 fallback: FullPlan | None = None):
        super().__init__()
        self.prefiller, self.plan = prefiller, plan
        self.fallback = fallback or (prefiller._fallback(plan) if isinstance(plan, (PrefixPlan, BlendPlan)) else None)
        self.clock = Clock()
        self.tuned = 0
        self.stalled: LoadStalled | None = None

    def _next(self, output: Any, error: BaseException | None) -> Want:
        pf = self.prefiller
        if self.stage == "start":
            self.tuned = len(pf.runner.tuner.tunings)
            self.stage = "run"
            return self.run(Timed(self.plan if isinstance(self.plan, PlanCursor) else pf.run(self.plan), self.clock))
        if error is not None:
            if (self.stage != "run" or self.fallback is None
                    or (isinstance(error, LoadFailed) and isinstance(self.plan, BlendPlan))):
                raise error
            self.stalled, self.stage = error, "fallback"
            return self.run(Timed(pf.run(self.fallback), self.clock))
        pre: Prefilled = output
        if self.stalled is not None:
            pre.stats = pre.stats.replace(stalled_tiers=self.stalled.tiers)
        if pre.logits.device.type == "cuda":  # timed to the logits, as TTFT is
            t0 = time.perf_counter()
            torch.cuda.synchronize(pre.logits.device)
            self.clock.own_s += time.perf_counter() - t0
        pre.stats = pre.stats.replace(prefill_s=self.clock.own_s)
        pf._observe(pre, self.tuned)
        self.stage = "done"
        return Done(pre)


class FullRun(PlanCursor):
    """A `FullPlan` run: one `Rows` of the whole prompt."""

    def __init__(self, prefiller: Prefiller, plan: FullPlan):
        super().__init__()
        self.prefiller, self.plan = prefiller, plan
        self.cache: KVCache | None = None

    def _next(self, output: Any, error: BaseException | None) -> Want:
        ids = tuple(self.plan.ids)
        if self.stage == "start":
            self.cache = self.prefiller.runner.new_cache(max(self.plan.capacity, len(ids)))
            self.stage = "rows"
            return Rows(torch.tensor(ids), self.cache, 0)
        assert self.cache is not None
        stats = self.plan.stats.replace(loaded_tokens=0, recomputed_tokens=self.plan.stats.context_tokens)
        self.stage = "done"
        return Done(Prefilled(output[0], self.cache, stats, ids))


class PrefixRun(PlanCursor):
    """A `PrefixPlan` run: its chain loaded while the rest is computed (`PrefixCache.prefill_plan`),
    then its new full blocks stored."""

    def __init__(self, prefiller: Prefiller, plan: PrefixPlan):
        super().__init__()
        self.prefiller, self.plan = prefiller, plan
        self.cache: KVCache | None = None

    def _next(self, output: Any, error: BaseException | None) -> Want:
        pf, pp = self.prefiller, self.plan
        prompt, ids = pp.prompt, pp.prompt.token_ids
        if self.stage == "start":
            self.cache = pf.runner.new_cache(pp.capacity)
            self.stage = "load"
            return self.run(pf.prefixes.prefill_plan(ids, list(pp.chain), self.cache, computed=pp.computed,
                                                     boundary=pp.boundary))
        assert self.cache is not None
        logits, load = output
        end = max((pl.start + pl.length for pl in pp.chain), default=0)
        loaded = end - pp.computed
        stored = pf.prefixes.store_blocks(ids, self.cache, skip_below=pp.stored_below)
        stats = pf._stats(prompt, "prefix", 0.0, loaded_tokens=loaded,
                          recomputed_tokens=max(0, prompt.query.start - loaded), load=load, stored_blocks=stored,
                          split=pp.split, **tally_fields(pp.tally))
        self.stage = "done"
        return Done(Prefilled(logits, self.cache, stats, tuple(ids)))


class BlendRun(PlanCursor):
    """A `BlendPlan` run: its loads started (`LayerLoader`), its passes as layer ranges of the
    executor's steps (`BlendPass`: all its rows, layer-synchronous), then the missing documents
    it computes in its prefix harvested."""

    def __init__(self, prefiller: Prefiller, plan: BlendPlan):
        super().__init__()
        self.prefiller, self.plan = prefiller, plan
        self.loader: LayerLoader | None = None
        self.cursor: BlendPass | None = None

    def _next(self, output: Any, error: BaseException | None) -> Want:
        pf, bp = self.prefiller, self.plan
        runner, prompt, split, sel = pf.runner, bp.prompt, bp.split, bp.selection
        plan = split.plan  # priced by the split, planned once
        assert plan is not None
        if self.stage == "start":
            cache = runner.new_cache(bp.capacity)
            cache.length = plan.n
            self.loader = LayerLoader(pf.store, runner, cache, split.loaded, range(plan.load_from, runner.num_layers),
                                      pf.config.blend.prefetch_depth, stall_s=pf.stall_s)
            self.cursor = BlendPass(runner, cache, torch.tensor(prompt.token_ids), plan, self.loader,
                                    policy=sel.policy, deviation_kind=sel.deviation, stale_bias=sel.stale_bias,
                                    stale_shift=shift_applies(sel.stale_shift, sel.policy))
            self.stage = "passes"
            return self.cursor
        assert self.cursor is not None and self.loader is not None
        logits, chosen = self.cursor.result()
        self.loader.close()
        cache = self.cursor.cache
        report = bp.report
        if bp.harvest and bp.resolution is not None:  # exact rows of the computed prefix
            t0 = time.perf_counter()
            pf.documents.harvest(bp.resolution, bp.harvest, cache)
            report = report.replace(compute_s=report.compute_s + time.perf_counter() - t0)
        stats = pf._stats(prompt, bp.mode, bp.ratio, loaded_tokens=0 if plan.full else int(plan.ctx_rows.numel()),
                          recomputed_tokens=chosen.recomputed_tokens + split.computed_tokens,
                          load=self.loader.report(), selection=chosen, split=split.report, miss=report,
                          **tally_fields(bp.tally))
        self.stage = "done"
        return Done(Prefilled(logits, cache, stats, tuple(prompt.token_ids)))

    def _release(self) -> None:
        if self.loader is not None:
            self.loader.close()
