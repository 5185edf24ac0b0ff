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

`Prefiller.steps(work)` is a generator: each advance yields model work (`Rows`, a list of them,
a cursor) or None (a unit it computed itself: planning), and the last one returns the
`Prefilled`. A load that stalls (a tier too slow to wait for, now suspended; raised in the plan
or thrown into it by the executor) runs the plan's `FullPlan` of the same tokens instead, in one
place (`_timed`); a load that fails (an unreadable entry, dropped) plans a blend again with its
documents computed on their own (`_blend_steps`). A chat turn's exact KV is
`SessionManager.prefill_steps`, a plan of its own shape. Teacher forcing (`answer`, `follow`,
used by eval) runs right after the prefill, before any decode step touches the cache.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from blend.config import BlendConfig, Selection
from blend.decode.forcing import answer_nll, forced_logprobs
from blend.decode.generation import Prefilled
from blend.kv.documents import Block, DocumentCache, Resolution
from blend.kv.loader import LayerLoader, LoadFailed, LoadStalled, Placement
from blend.kv.prefix import PrefixCache
from blend.model.runner import Rows, Runner
from blend.planning.misses import HARVEST, MIXED, plan_misses
from blend.planning.split import Split, Splitter
from blend.prompt.builder import Prompt
from blend.recompute.layers import BlendPass
from blend.recompute.stale import shift_applies
from blend.session.manager import SessionManager, Turn, turn_stats
from blend.stats import LookupTally, MissReport, RequestStats, SplitReport, tally_fields
from storage.stack import TieredStore

T = TypeVar("T")


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
    caches, split, sessions."""

    def __init__(self, config: BlendConfig, runner: Runner, store: TieredStore, documents: DocumentCache,
                 prefixes: PrefixCache, splitter: Splitter, sessions: SessionManager, tokenizer,
                 stall_s: float | None):
        self.config, self.runner, self.store = config, runner, store
        self.documents, self.prefixes, self.splitter, self.sessions = documents, prefixes, splitter, sessions
        self.tokenizer, self.stall_s = tokenizer, stall_s
        self.tier_names = [t.name for t in store.tiers]
        self._warm = False  # set after the first prefill (not a cost sample: see `_observe`)

    # ------------------------------------------------------------- entry points
    def steps(self, work: PromptWork) -> Generator[Rows | None, Any, Prefilled]:
        """The prefill of a `generate` request, step by step (see the module docstring); teacher
        forcing (`answer`, `follow`) comes back in the result (`stats.answer_nll`,
        `Prefilled.follow_logprobs`)."""
        prompt, mode = work.prompt, work.mode
        capacity = max(work.capacity, len(prompt))
        if mode == "full":
            pre = yield from self._timed(FullPlan(prompt.token_ids, capacity, self._stats(prompt, "full")))
        elif mode == "prefix":
            yield from self._calibrated(work.split)
            plan = yield from self._plan_prefix(prompt, capacity, work.split)
            pre = yield from self._timed(plan)
        else:
            ratio = 0.0 if mode == "reuse" else work.ratio
            selection = self.config.blend.selection.with_policy(work.selection)
            pre = yield from self._blend_steps(prompt, work.blocks, ratio, capacity, mode, selection, work.submitted,
                                               work.split)
        if work.answer is not None:
            pre.stats = pre.stats.replace(answer_nll=answer_nll(self.runner, self.tokenizer, pre.cache, pre.logits,
                                                                work.answer))
        if work.follow:
            pre.follow_logprobs = forced_logprobs(self.runner, pre.cache, pre.logits, work.follow).cpu()
        return pre

    def turn_steps(self, turn: Turn, work: PromptWork | None) -> Generator[Rows | None, Any, Prefilled]:
        """A chat turn's prefill: its documents blended in (`work`, when the turn blends and
        they are not all on the device), else its exact KV (device copy, stored prefix chain,
        the rest computed: `SessionManager.prefill`)."""
        capacity = len(turn.ids) + turn.max_new_tokens
        if work is not None and turn.blends():  # (such a turn is not exact from its start: `SessionManager.begin`)
            return (yield from self.steps(work))
        fallback = FullPlan(tuple(turn.ids), capacity, turn_stats(turn.ids, "computed", 0))
        return (yield from self._timed(self.sessions.prefill_steps(turn, capacity), fallback))

    # ------------------------------------------------------------------ stages
    def _blend_steps(self, prompt: Prompt, blocks: dict[int, list[Block]] | None, ratio: float, capacity: int,
                     mode: str, selection: Selection, submitted: float | None = None, split: str | None = None
                     ) -> Generator[Rows | None, Any, Prefilled]:
        tally = LookupTally(self.tier_names)
        cached = [i for i, s in enumerate(prompt.segments) if s.kind != "query"]
        blocks = blocks if blocks is not None else self.documents.segment_blocks(prompt)
        failed: LoadFailed | None = None
        for _attempt in range(2):
            while self.documents.computing([b.key for i in cached for b in blocks[i]]):
                yield  # another plan under way computes some of these documents: their entries, not a second pass
            # after a failed load, nothing of the store is trusted: every document computed again on its own
            resolution = self.documents.lookup(prompt, cached, blocks, submitted, use_store=failed is None)
            claimed = [b.key for looked in resolution.looked if looked.missed for b in looked.rebuild.block_list]
            self.documents.claim(claimed)
            try:
                # after an unreadable entry (dropped by the loader) the plan again, every document a miss computed
                # on its own as its entry was: the answer intact entries give, and every entry rewritten
                return (yield from self._resolved_steps(prompt, resolution, tally, ratio, capacity, mode, selection,
                                                        split, "standalone" if failed is not None else None))
            except LoadFailed as err:
                failed, tally = err, LookupTally(self.tier_names)
            finally:
                self.documents.release(claimed)
        assert failed is not None
        pre = yield from self._timed(FullPlan(prompt.token_ids, capacity, self._stats(prompt, "full")))
        pre.stats = pre.stats.replace(stalled_tiers=failed.tiers)
        return pre

    def _resolved_steps(self, prompt: Prompt, resolution: Resolution, tally: LookupTally, ratio: float,
                        capacity: int, mode: str, selection: Selection, split: str | None,
                        miss_policy: str | None = None) -> Generator[Any, Any, Prefilled]:
        report = MissReport(deduplicated=resolution.deduplicated)
        plan, computed = None, {}
        yield from self._calibrated(split)
        if resolution.misses:  # priced (blend.planning.misses), then paid as the cheapest plan runs
            plan = plan_misses(miss_policy or self.config.blend.miss_policy, self.splitter.cost_model(split), prompt,
                               resolution, self.documents, ratio, selection, self.runner.num_layers)
            report = MissReport(plan.kind, plan.reason, resolution.misses, len(plan.standalone), len(plan.harvested),
                                resolution.deduplicated, 0.0, dict(plan.predicted))
            if plan.kind == HARVEST:  # one full prefill; the missing documents cut out of it
                self.documents.placements(resolution, tally, skip=plan.harvested)  # the lookups counted
                pre = yield from self._timed(FullPlan(prompt.token_ids, capacity,
                                                      self._stats(prompt, mode, ratio, **tally_fields(tally))))
                t0 = time.perf_counter()
                self.documents.harvest(resolution, plan.harvested, pre.cache)
                pre.stats = pre.stats.replace(miss=report.replace(compute_s=time.perf_counter() - t0))
                return pre
            if plan.standalone:  # their own passes, as their own steps (not inside the timed prefill)
                clock = _Clock()  # their own time, not the other sequences' steps between the passes
                computed = yield from clock.relay(self.documents.compute_misses(resolution, plan.standalone))
                report = report.replace(compute_s=clock.own_s)
                yield
        placements = self.documents.placements(resolution, tally, computed, skip=plan.harvested if plan else ())
        # the load-or-compute split (blend.planning.split) may compute a prefix instead of loading it;
        # a mixed miss plan fixes that prefix (its missing documents are harvested from it)
        fresh = plan.fresh if plan is not None and plan.kind == MIXED else None
        chosen = self.splitter.plan(prompt, placements, ratio, selection, self.runner.num_layers, fresh=fresh,
                                    mode=split)
        blend = BlendPlan(prompt, capacity, mode, ratio, selection, chosen, tally, report, resolution,
                          plan.harvested if plan is not None else (), split)
        return (yield from self._timed(blend))

    def _calibrated(self, split: str | None = None) -> Generator[None, None, None]:
        """Under `engine.blend.split: auto`, the split's cost model is calibrated once, before the first
        prefill that consults it: a step of its own (running sequences decode around it), outside
        that prefill's timing."""
        if self.splitter.calibrates(split):
            self.splitter.cost_model(split)
            yield

    def _timed(self, plan: FullPlan | PrefixPlan | BlendPlan | Generator[Rows | None, Any, Prefilled],
               fallback: FullPlan | None = None) -> Generator[Rows | None, Any, Prefilled]:
        """`plan` run (`run`; a generator: its steps as they are), timed to its logits (CUDA
        synchronised): its own time, the work done inside it and the steps that computed its
        rows, not the other sequences' steps between its pauses. A `LoadStalled` runs the
        `fallback` plan instead (default: the plan's own `FullPlan` of the same tokens). Feeds
        the split's cost model."""
        tuned = len(self.runner.tuner.tunings)
        clock = _Clock()
        fallback = fallback or (self._fallback(plan) if not isinstance(plan, (FullPlan, Generator)) else None)
        try:
            pre = yield from clock.relay(self.run(plan) if not isinstance(plan, Generator) else plan)
        except LoadStalled as err:
            if fallback is None or (isinstance(err, LoadFailed) and isinstance(plan, BlendPlan)):
                raise  # (an unreadable entry of a blend: planned again, it is a miss: `_blend_steps`)
            pre = yield from clock.relay(self.run(fallback))
            pre.stats = pre.stats.replace(stalled_tiers=err.tiers)
        if pre.logits.device.type == "cuda":  # timed to the logits, as TTFT is
            t0 = time.perf_counter()
            torch.cuda.synchronize(pre.logits.device)
            clock.own_s += time.perf_counter() - t0
        pre.stats = pre.stats.replace(prefill_s=clock.own_s)
        self._observe(pre, tuned)
        return pre

    def _fallback(self, plan: PrefixPlan | BlendPlan) -> FullPlan:
        """The stall fallback: every token of the plan's prompt computed."""
        return FullPlan(plan.prompt.token_ids, plan.capacity, self._stats(plan.prompt, "full"))

    def run(self, plan: FullPlan | PrefixPlan | BlendPlan) -> Generator[Rows | None, Any, Prefilled]:
        """A plan's execution, as steps: its rows asked of the executor, its layer loop paused."""
        if isinstance(plan, FullPlan):
            return self._run_full(plan)
        if isinstance(plan, PrefixPlan):
            return self._run_prefix(plan)
        if isinstance(plan, BlendPlan):
            return self._run_blend(plan)
        raise TypeError(f"no executor for {type(plan).__name__}")

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

    def _run_full(self, plan: FullPlan) -> Generator[Rows, torch.Tensor, Prefilled]:
        ids = tuple(plan.ids)
        cache = self.runner.new_cache(max(plan.capacity, len(ids)))
        logits = (yield Rows(torch.tensor(ids), cache, 0))[0]
        stats = plan.stats.replace(loaded_tokens=0, recomputed_tokens=plan.stats.context_tokens)
        return Prefilled(logits, cache, stats, ids)

    def _run_blend(self, bp: BlendPlan) -> Generator[BlendPass, None, Prefilled]:
        runner, prompt, split, sel = self.runner, bp.prompt, bp.split, bp.selection
        plan = split.plan  # priced by the split, planned once
        assert plan is not None
        cache = runner.new_cache(bp.capacity)
        cache.length = plan.n
        with LayerLoader(self.store, runner, cache, split.loaded, range(plan.load_from, runner.num_layers),
                         self.config.blend.prefetch_depth, stall_s=self.stall_s) as loader:
            # its passes as layer ranges of the executor's steps (all its rows, layer-synchronous)
            cursor = BlendPass(runner, cache, torch.tensor(prompt.token_ids), plan, loader, policy=sel.policy,
                               deviation_kind=sel.deviation, stale_bias=sel.stale_bias,
                               stale_shift=shift_applies(sel.stale_shift, sel.policy))
            yield cursor
            logits, chosen = cursor.result()
        report = bp.report
        if bp.harvest and bp.resolution is not None:  # exact rows of the computed prefix
            t0 = time.perf_counter()
            self.documents.harvest(bp.resolution, bp.harvest, cache)
            report = report.replace(compute_s=report.compute_s + time.perf_counter() - t0)
        stats = self._stats(prompt, bp.mode, bp.ratio, loaded_tokens=0 if plan.full else int(plan.ctx_rows.numel()),
                            recomputed_tokens=chosen.recomputed_tokens + split.computed_tokens, load=loader.report(),
                            selection=chosen, split=split.report, miss=report, **tally_fields(bp.tally))
        return Prefilled(logits, cache, stats, tuple(prompt.token_ids))

    def _plan_prefix(self, prompt: Prompt, capacity: int, split_mode: str | None = None
                     ) -> Generator[list[Rows], Any, PrefixPlan]:
        """The longest exactly cached prefix: prefix blocks of this very prompt, or the
        cached segments that are exact at their position (the system part, and the first
        document when documents are computed after it) when their entries are exact too:
        stored in the compute dtype and in no codec (else loading them would not equal
        computing them: prefix mode is exact). Those segments' misses are computed as the
        plan's steps (`DocumentCache.resolve_steps`), before the prefill's own."""
        ids = prompt.token_ids
        limit = len(ids) - 1  # at least the last token is computed
        tally = LookupTally(self.tier_names)
        chain = self.prefixes.lookup(ids, limit)
        chain_len = sum(pl.length for pl in chain)
        exact = [prompt.prefix]
        if self.config.blend.chunk_context == "system" and len(prompt.segments) > 2 and prompt.segments[1].kind == "document":
            exact.append(prompt.segments[1])
        exact_len = exact[-1].end if exact[-1].end <= limit else 0
        resolved = None
        if exact_len > chain_len and self.documents.maker.kv_dtype == self.prefixes.maker.kv_dtype:
            resolved = yield from self.documents.resolve_steps(prompt, [s for s in exact if s.end <= limit], tally,
                                                               raw_only=True)
        if resolved is not None:
            chain = resolved
        else:
            for pl in chain:
                tally.hit_from("prefix_blocks", pl.source)
        # the load-or-compute split (blend.split) may compute the chain's first blocks instead
        split = self.splitter.plan_prefix(len(ids), chain, self.runner.num_layers, split_mode)
        # the tail computed apart from the blocks a later request will load: the same numbers either way
        return PrefixPlan(prompt, capacity, tuple(chain), split.computed_tokens, self.prefixes.aligned_end(limit),
                          chain_len, split.report, tally)

    def _run_prefix(self, pp: PrefixPlan) -> Generator[Rows, torch.Tensor, Prefilled]:
        prompt, ids = pp.prompt, pp.prompt.token_ids
        cache = self.runner.new_cache(pp.capacity)
        logits, load = yield from self.prefixes.prefill_steps(ids, list(pp.chain), cache, computed=pp.computed,
                                                              boundary=pp.boundary)
        end = max((pl.start + pl.length for pl in pp.chain), default=0)
        loaded = end - pp.computed
        stored = self.prefixes.store_blocks(ids, cache, skip_below=pp.stored_below)
        stats = self._stats(prompt, "prefix", 0.0, loaded_tokens=loaded,
                            recomputed_tokens=max(0, prompt.query.start - loaded), load=load, stored_blocks=stored,
                            split=pp.split, **tally_fields(pp.tally))
        return Prefilled(logits, cache, stats, tuple(ids))


class _Clock:
    """A plan's own time while it runs as steps (a prefill's, or the passes of its missing
    documents): inside its generator, and from a `Rows` it yields to the logits sent back (the
    steps that computed them); not the pauses (None)."""

    def __init__(self) -> None:
        self.own_s = 0.0

    def relay(self, plan: Generator[Rows | None, Any, T]) -> Generator[Rows | None, Any, T]:
        """`yield from plan`, timed: what is sent or thrown in (an executor's `LoadStalled`)
        reaches the plan where it paused, and closing this closes the plan."""
        reply, error = None, None
        while True:
            t0 = time.perf_counter()
            try:
                request = plan.send(reply) if error is None else plan.throw(error)
            except StopIteration as done:
                self.own_s += time.perf_counter() - t0
                return done.value
            self.own_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            reply, error = None, None
            try:
                reply = yield request
            except GeneratorExit:
                plan.close()
                raise
            except BaseException as err:  # noqa: BLE001 - delivered into the plan, which ends with it or not
                error = err
            if request is not None:
                self.own_s += time.perf_counter() - t0
