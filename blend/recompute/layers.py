"""CacheBlend's selective recompute as a cursor of the one executor: which rows each layer
computes over the loaded KV, asked of `Runner.forward` a layer range at a time.

`plan_recompute` (blend.recompute.plan) fixes, before any compute, the candidate rows (those
whose cached KV is not exact at its prompt position), the rows always recomputed (`forced`),
how many candidates are recomputed at each selection and the first layer that reads loaded
KV. A `BlendPass` runs that plan as passes, each one item of a step (`Rows` with a layer range
and `LayerNeeds`), all its rows layer-synchronous (they finish layer l before any reads layer
l+1's corrections), so a step advances a blend by whole layers, never by a subset of its rows:

Check-layer policies (deviation, hybrid, attention): one pass over every layer.

    wait until the loader has placed this layer's cached K/V          LayerNeeds.wait
    compute q/k/v of the active rows (all rows before the first check layer)
    correct the stale rows' K/V and bias from the recomputed ones     LayerNeeds.before_write
    write the active rows' K/V; at a check layer rank the candidates   LayerNeeds.keep
        (selector.select) and keep the top ones
    attend the kept rows over the merged K/V (causal by position), finish the layer

Query-driven selection (`query`), no full early layers: a query pass (the query rows, and the
split's computed prefix, through layers 0..query_layers-1 over the loaded K/V, each key's
attention from the query summed: `LayerNeeds.summed`), the top-scored candidates kept
(selector.select_top), then the recompute pass over every layer (with `query_pool` > 1 the
pool narrowed at the check layers by query attention x KV deviation).

`reuse` is a pass with no selection (only the query rows computed); a plan that recomputes
every candidate (ratio 1) is a full prefill with no loads. The loads of layer l+1 overlap the
compute of layer l: a pass asks only for layers whose loads have arrived while other work can
run (`want(ready_only=True)`), so a slow tier never holds another sequence's step.
"""

from __future__ import annotations

import time
import weakref

import torch

from blend.kv.loader import LayerLoader
from blend.model.cache import KVCache
from blend.model.runner import LayerNeeds, Output, Rows, Runner, key_weight
from blend.recompute.plan import RecomputePlan
from blend.recompute.selector import (
    CheckLayerKV,
    QueryAttention,
    deviation,
    normalised,
    select,
    select_top,
)
from blend.recompute.stale import StaleKeys
from blend.stats import SelectionReport


def run_layers(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan, loader: LayerLoader,
               *, policy: str, deviation_kind: str, value_weighted: bool = False, stale_bias: bool = False,
               stale_shift: bool = False) -> tuple[torch.Tensor, SelectionReport]:
    """A `BlendPass` run alone to its end, each pass in one step. Returns the last row's logits
    (vocab,) and what was selected."""
    cursor = BlendPass(runner, cache, token_ids, plan, loader, policy=policy, deviation_kind=deviation_kind,
                       value_weighted=value_weighted, stale_bias=stale_bias, stale_shift=stale_shift)
    with torch.inference_mode():
        while not cursor.done:
            cursor.take(runner.forward(cursor.want()))
    return cursor.result()


class BlendPass:
    """A blend's selective recompute as data: the pass under way (query pass, recompute pass or
    the check-layer pass), the next layer, the rows going on and their hidden states. The
    scheduler asks `want` for the next layer range and hands the step's `Output` to `take`; by
    hand, `run_layers` does the same. Side effects: writes the computed rows' K/V (and the stale
    rows' corrections) into `cache`."""

    def __init__(self, runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan,
                 loader: LayerLoader, *, policy: str, deviation_kind: str, value_weighted: bool = False,
                 stale_bias: bool = False, stale_shift: bool = False):
        self.runner, self.cache, self.ids, self.plan, self.loader = runner, cache, token_ids, plan, loader
        self.policy, self.deviation_kind, self.value_weighted = policy, deviation_kind, value_weighted
        self.stale = StaleKeys(plan.cand_rows, plan.n, runner.device, stale_bias and not plan.full,
                               shift=stale_shift and not plan.full)
        self.selected: list[torch.Tensor] = []
        self.selection_s = 0.0  # scoring and choosing (with a query pass: the query pass's steps too)
        self.computed: list[int] = []  # rows whose q/k/v each layer of the (recompute) loop computed
        self.passed: list[int] = []  # ... each layer of the query pass
        self.steps = 0
        self._logits: torch.Tensor | None = None
        self._asked: tuple[int, int] | None = None
        self._asked_at = 0.0
        self.layer = 0
        self.hidden: torch.Tensor | None = None
        if plan.query_pass:
            self.phase = "query"
            self.positions = torch.cat([plan.fresh_rows, plan.query_rows])  # (F+Q,)
            self.end = plan.query_layers
            self.fused = QueryAttention(int(plan.query_rows[0]), value_weighted=value_weighted)
            self.needs: LayerNeeds = _QueryPassNeeds(self)
        else:
            self.phase = "layers"
            self.positions = plan.first_active  # (T,) sorted
            self.end = runner.num_layers
            self.needs = _CheckLayerNeeds(self)

    @property
    def done(self) -> bool:
        return self._logits is not None

    def rows(self) -> int:
        """Rows its next layer range computes (its cost per layer)."""
        return int(self.positions.numel())

    def want(self, budget: int | None = None, *, ready_only: bool = False) -> list[Rows]:
        """The next layer range of the pass under way, all its rows: as many layers as `budget`
        row-layers allow (at least one; None: to the pass's end). `ready_only`: only layers whose
        loads have arrived ([] when the next one has not: other work runs meanwhile)."""
        if self.done:
            raise RuntimeError("this blend pass has ended")
        first, n = self.layer, self.rows()
        # a row's cost per layer grows with the keys it attends (`Runner.key_rows`): the query rows
        # attend the whole prompt, the recomputed rows all keys before them
        per_layer = n * key_weight(float(self.positions.float().mean()) + 1, self.runner.key_rows)
        end = self.end if budget is None else min(self.end, first + max(1, int(budget // per_layer)))
        if ready_only:
            ready = first
            while ready < end and self._loaded(ready):
                ready += 1
            if ready == first:
                return []
            end = ready
        self._asked, self._asked_at = (first, end), time.perf_counter()
        final = end == self.runner.num_layers
        return [Rows(self.ids[self.positions] if first == 0 else None, self.cache, positions=self.positions,
                     hidden=self.hidden if first > 0 else None, layers=(first, end), needs=self.needs,
                     logit_rows=() if final and self.phase == "query" else None)]

    def _loaded(self, layer: int) -> bool:
        if self.phase == "recompute" and layer < self.plan.query_layers:
            return True  # the query pass waited for these
        return self.loader.ready(layer)

    def take(self, outs: list[Output]) -> None:
        """The step's output for the range `want` gave: its rows' hidden states (or the logits).
        Raises the item's error (its loads stalled or failed: the plan falls back)."""
        if self._asked is None:
            raise RuntimeError("take without want")
        (_first, end), self._asked = self._asked, None
        (out,) = outs
        self.steps += 1
        if self.phase == "query":
            self.selection_s += time.perf_counter() - self._asked_at
        if out.error is not None:
            raise out.error
        self.layer, self.hidden, self.positions = end, out.hidden, out.positions
        if end < self.end:
            return
        if self.phase == "query":
            self._select()
        else:
            assert out.logits is not None
            self._logits = out.logits[-1]

    def _select(self) -> None:
        """After the query pass: the top-scored candidates (and the forced rows) and the query rows
        start the recompute pass at layer 0."""
        t0 = time.perf_counter()
        plan = self.plan
        self.scores = self.fused.scores().cpu()  # (q_start,)
        cand = plan.cand_rows
        self.forced = torch.zeros(plan.n, dtype=torch.bool)
        self.forced[plan.forced_rows] = True
        self.chosen = select_top(self.scores[cand], cand, plan.counts[0], self.forced[cand])
        self.selected.append(self.chosen)
        self.positions = torch.cat([self.chosen, plan.query_rows])  # sorted: context rows precede the query
        self.stale.update(self.positions)
        self.phase, self.layer, self.end, self.hidden = "recompute", 0, self.runner.num_layers, None
        self.needs = _RecomputeNeeds(self)
        self.selection_s += time.perf_counter() - t0

    def result(self) -> tuple[torch.Tensor, SelectionReport]:
        """The last row's logits (vocab,) and what was selected."""
        if self._logits is None:
            raise RuntimeError("this blend pass has not ended")
        plan = self.plan
        if plan.query_pass:
            report = SelectionReport(plan.check_layers, tuple(int(c.numel()) for c in self.selected),
                                     int(self.chosen.numel()), self.selection_s, tuple(self.selected), query_pass=True,
                                     key_bias=self.stale.per_layer(), pass_rows=tuple(self.passed),
                                     layer_rows=tuple(self.computed))
        else:
            recomputed = int(plan.ctx_rows.numel()) if plan.full else \
                (int(self.selected[-1].numel()) if self.selected else 0)
            report = SelectionReport(plan.check_layers, tuple(int(c.numel()) for c in self.selected), recomputed,
                                     self.selection_s, tuple(self.selected), key_bias=self.stale.per_layer(),
                                     layer_rows=tuple(self.computed))
        return self._logits, report


class _QueryPassNeeds(LayerNeeds):
    """The query pass: each layer waits for its loads; the query rows' attention to each key is
    summed (selector.QueryAttention); the split's fresh rows run along (they see each other
    only, so their K/V is exact and written at every layer)."""

    def __init__(self, bp: BlendPass):
        self.bp = weakref.proxy(bp)  # no cycle: the pass and its tensors go when their last user drops them
        nf, nq = bp.plan.fresh_rows.numel(), bp.plan.query_rows.numel()
        self._summed = torch.arange(nf, nf + nq)

    def wait(self, layer: int) -> None:
        self.bp.loader.wait(layer)

    def before_write(self, layer, positions, q, k, v) -> None:
        self.bp.passed.append(int(positions.numel()))

    def summed(self, layer: int) -> torch.Tensor:
        return self._summed

    def take_sums(self, layer: int, sums: torch.Tensor, values: torch.Tensor) -> None:
        self.bp.fused.add_sums(layer, sums, values)


class _RecomputeNeeds(LayerNeeds):
    """The recompute pass after a query pass: the layers the query pass did not run wait for their
    loads; the stale rows are corrected from the recomputed ones; at the refinement check layers
    the pool narrows (query attention x KV deviation)."""

    def __init__(self, bp: BlendPass):
        self.bp = weakref.proxy(bp)  # no cycle: the pass and its tensors go when their last user drops them
        self._keep: torch.Tensor | None = None

    def wait(self, layer: int) -> None:
        if layer >= self.bp.plan.query_layers:
            self.bp.loader.wait(layer)

    def before_write(self, layer, positions, q, k, v) -> None:
        bp, plan = self.bp, self.bp.plan
        bp.computed.append(int(positions.numel()))
        m = int(positions.numel()) - plan.query_rows.numel()  # the recomputed context rows come first
        rows_dev = positions[:m].to(bp.runner.device)
        bp.stale.correct(bp.runner, bp.cache, layer, q[:, m:], k[:, :m], v[:, :m], rows_dev)
        self._keep = None
        if layer in plan.check_layers[1:]:  # refine the pool: query attention x KV deviation
            t0 = time.perf_counter()
            pool = positions[:m]
            prior = (bp.cache.k[layer][:, rows_dev], bp.cache.v[layer][:, rows_dev])  # copies, before overwriting
            dev_score = deviation(k[:, :m], v[:, :m], *prior, bp.deviation_kind).cpu()
            score = normalised(dev_score) * normalised(bp.scores[pool])
            bp.chosen = select_top(score, pool, plan.counts[plan.check_layers.index(layer)], bp.forced[pool])
            bp.selected.append(bp.chosen)
            self._keep = torch.searchsorted(positions, torch.cat([bp.chosen, plan.query_rows]))
            bp.selection_s += time.perf_counter() - t0

    def keep(self, layer, positions, q, k, v) -> torch.Tensor | None:
        keep, self._keep = self._keep, None
        if keep is not None:  # the dropped rows are stale from the next layer on
            self.bp.stale.update(positions[keep])
        return keep


class _CheckLayerNeeds(LayerNeeds):
    """The check-layer pass: layers from `load_from` wait for their loads; once rows were dropped
    the stale ones are corrected; at each check layer the active candidates are ranked
    (selector.select) and the top ones kept."""

    def __init__(self, bp: BlendPass):
        self.bp = weakref.proxy(bp)  # no cycle: the pass and its tensors go when their last user drops them
        plan = bp.plan
        self.is_cand = torch.zeros(plan.n, dtype=torch.bool)
        self.is_cand[plan.cand_rows] = True
        self.is_forced = torch.zeros(plan.n, dtype=torch.bool)
        self.is_forced[plan.forced_rows] = True
        self._prior: tuple[torch.Tensor, torch.Tensor] | None = None

    def wait(self, layer: int) -> None:
        self.bp.loader.wait(layer)

    def before_write(self, layer, positions, q, k, v) -> None:
        bp, plan, dev = self.bp, self.bp.plan, self.bp.runner.device
        bp.computed.append(int(positions.numel()))
        if bp.stale.rows.numel():  # rows were dropped at an earlier check layer
            rec = self.is_cand[positions]  # (T,) the recomputed candidates among the active rows
            q_idx = torch.searchsorted(positions, plan.query_rows).to(dev)
            rec_dev = rec.to(dev)
            bp.stale.correct(bp.runner, bp.cache, layer, q[:, q_idx], k[:, rec_dev], v[:, rec_dev],
                             positions[rec].to(dev))
        else:
            bp.stale.skip()
        self._prior = None
        if layer in plan.check_layers:
            cand_rows = positions[self.is_cand[positions]]
            if plan.counts[plan.check_layers.index(layer)] < cand_rows.numel():
                rows_dev = cand_rows.to(dev)
                self._prior = (bp.cache.k[layer][:, rows_dev], bp.cache.v[layer][:, rows_dev])  # before the write

    def keep(self, layer, positions, q, k, v) -> torch.Tensor | None:
        bp, plan = self.bp, self.bp.plan
        if layer not in plan.check_layers:
            return None
        t0 = time.perf_counter()
        dev = bp.runner.device
        cand = self.is_cand[positions]  # (T,) which active rows are candidates
        cand_rows = positions[cand]
        count = plan.counts[plan.check_layers.index(layer)]
        if self._prior is not None:
            cand_dev = cand.to(dev)
            q_rows = torch.searchsorted(positions, plan.query_rows).to(dev)
            n = int(positions[-1]) + 1
            kv = CheckLayerKV(k[:, cand_dev], v[:, cand_dev], *self._prior, q[:, q_rows], bp.cache.k[layer][:, :n],
                              bp.runner.scaling, bp.runner.windows[layer])
            chosen = select(bp.policy, kv, cand_rows.to(dev), count, bp.deviation_kind,
                            self.is_forced[cand_rows]).cpu()
            self._prior = None
        else:  # every candidate kept: no scores needed
            chosen = cand_rows.clone()
        bp.selected.append(chosen)
        # exact rows stay active until the loads start (their cached K/V is placed from load_from on)
        others = positions[~cand] if layer < plan.load_from else torch.cat([plan.fresh_rows, plan.query_rows])
        keep = torch.searchsorted(positions, torch.cat([chosen, others]).unique(sorted=True))
        if layer >= plan.load_from:  # from the next layer on, the dropped candidates are stale
            bp.stale.update(positions[keep])
        bp.selection_s += time.perf_counter() - t0
        return keep
