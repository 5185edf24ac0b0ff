"""CacheBlend's selective recompute: plan which rows each layer computes, then run the
layers over the loaded KV.

`plan_recompute` fixes, before any compute, which context rows are candidates (those
whose cached KV is not exact at its prompt position: not the system part, nor a
document computed after exactly the tokens that precede it), the rows always
recomputed (`forced`: the first `sink_tokens` of each candidate document), how many
candidates are recomputed (`ceil(r x context tokens)`, at most every candidate, nested
under gradual filtering) and the first layer that needs loaded KV. `run_layers` runs one
of two algorithms.

Check-layer policies (deviation, hybrid, attention):

    for each layer:
        wait until the loader has placed this layer's cached K/V
        compute q/k/v for the active rows (all rows before the first check layer)
        at a check layer: rank the active candidates (selector.select), keep the top ones
        write the fresh K/V of the active rows into the cache at their positions
        attend the active rows over the merged K/V (exact causal mask by position)
        finish the layer (o_proj, MLP) for the active rows only
    logits of the last row

Query-driven selection (`query`), no full early layers:

    query pass: for each layer, wait for its loaded K/V, run the query rows only over it
        (a reuse pass) and add their attention to the context (selector.QueryAttention)
    keep the forced rows and the top-scored candidates
    for each layer from 0: the same loop over the selected rows plus the query rows
        (with `query_pool` > 1 the query pass keeps a larger pool, narrowed at the check
        layers by query attention x KV deviation)

The query pass waits for the loads of the layers it runs before layer 0 is recomputed;
they overlap the query pass layer by layer, the rest of their time is exposed
(LoadReport). With `query_layers` < the model's layers, the query pass stops early and
the loads of the later layers overlap the recompute.

`reuse` is the loop with no selection (only the query rows are computed); a plan that
recomputes every candidate (ratio 1) is a full prefill with no loads.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from blend.kv.loader import LayerLoader
from blend.model.cache import KVCache
from blend.model.runner import Runner
from blend.recompute.plan import RecomputePlan
from blend.recompute.selector import (
    CheckLayerKV,
    QueryAttention,
    deviation,
    normalised,
    query_probs,
    select,
    select_top,
)
from blend.recompute.stale import StaleKeys
from blend.stats import SelectionReport


class Pacer:
    """Where a layer loop pauses: once `rows_per_step` rows were computed (summed over its
    layers) or `step_s` seconds passed since it last resumed, a step ends (the generator
    yields) so the scheduler can run other sequences' decode steps between; None never
    pauses. The pauses split the loop, never its numbers."""

    def __init__(self, rows_per_step: int | None, step_s: float | None = None):
        self.budget, self.step_s, self.spent, self.pauses = rows_per_step, step_s, 0, 0
        self.paused_s = 0.0  # time between a pause and the resumption (other sequences' work)
        self._since = time.perf_counter()

    def pause(self) -> Generator[None, None, None]:
        t0 = time.perf_counter()
        yield
        self._since = time.perf_counter()
        self.paused_s += self._since - t0

    def due(self, rows: int) -> bool:
        """Count `rows` computed (a layer's); whether the step is full."""
        if self.budget is None:
            return False
        self.spent += rows
        timed_out = self.step_s is not None and time.perf_counter() - self._since >= self.step_s
        if self.spent < self.budget and not timed_out:
            return False
        self.spent, self.pauses = 0, self.pauses + 1
        return True


def run_layers(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan, loader: LayerLoader,
               *, policy: str, deviation_kind: str, value_weighted: bool = False, stale_bias: bool = False,
               stale_shift: bool = False) -> tuple[torch.Tensor, SelectionReport]:
    """`layer_steps` run to the end in one go."""
    return runner.run(layer_steps(runner, cache, token_ids, plan, loader, policy=policy, deviation_kind=deviation_kind,
                                  value_weighted=value_weighted, stale_bias=stale_bias, stale_shift=stale_shift))


@torch.inference_mode()
def layer_steps(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan, loader: LayerLoader,
                *, policy: str, deviation_kind: str, value_weighted: bool = False, stale_bias: bool = False,
                stale_shift: bool = False, pacer: Pacer | None = None
                ) -> Generator[None, None, tuple[torch.Tensor, SelectionReport]]:
    """Run every layer over `cache` (filled by `loader`) computing only the planned rows,
    pausing (a yield) where `pacer` says a step is full.

    `stale_shift`, `stale_bias`: correct the K/V and the scores of the keys left stale
    (`StaleKeys`). Returns the last row's logits (vocab,) and what was selected.
    """
    pacer = pacer or Pacer(None)
    stale = StaleKeys(plan.cand_rows, plan.n, runner.device, stale_bias and not plan.full,
                      shift=stale_shift and not plan.full)
    if plan.query_pass:
        return (yield from _run_query_driven(runner, cache, token_ids, plan, loader, value_weighted, deviation_kind,
                                             stale, pacer))
    return (yield from _run_check_layers(runner, cache, token_ids, plan, loader, policy, deviation_kind, stale, pacer))


def _run_check_layers(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan,
                      loader: LayerLoader, policy: str, deviation_kind: str, stale: StaleKeys, pacer: Pacer
                      ) -> Generator[None, None, tuple[torch.Tensor, SelectionReport]]:
    n, dev = plan.n, runner.device
    is_cand = torch.zeros(n, dtype=torch.bool)
    is_cand[plan.cand_rows] = True
    is_forced = torch.zeros(n, dtype=torch.bool)
    is_forced[plan.forced_rows] = True
    cos_all, sin_all = runner.rope(torch.arange(n))
    active = plan.first_active  # (T,) prompt rows computed at this layer, sorted
    h = runner.embed(token_ids[active])  # (T, hidden)
    selected: list[torch.Tensor] = []
    recomputed, selection_s = 0, 0.0
    # the active rows change only at check layers: their device copy, RoPE rows and attention
    # plan (runner.attend caches it for this `active` tensor) are made once per change
    rows = active.to(dev)
    cos, sin = cos_all[rows], sin_all[rows]
    computed: list[int] = []  # rows whose q/k/v each layer computes
    for layer in range(runner.num_layers):
        loader.wait(layer)
        computed.append(int(active.numel()))
        q, k, v = runner.qkv(layer, h, cos, sin)  # (H, T, D), (Hkv, T, D) x2
        if stale.rows.numel():  # rows were dropped at an earlier check layer
            rec = is_cand[active].to(dev)  # (T,) the recomputed candidates among the active rows
            q_idx = torch.searchsorted(active, plan.query_rows).to(dev)
            stale.correct(runner, cache, layer, q[:, q_idx], k[:, rec], v[:, rec], rows[rec])
        else:
            stale.skip()
        changed = False
        if layer in plan.check_layers:
            t0 = time.perf_counter()
            cand = is_cand[active]  # (T,) which active rows are candidates
            cand_rows = active[cand]
            count = plan.counts[plan.check_layers.index(layer)]
            if count < cand_rows.numel():
                cand_dev = cand.to(dev)
                rows_dev = cand_rows.to(dev)
                prior = (cache.k[layer][:, rows_dev], cache.v[layer][:, rows_dev])  # copies, before overwriting
                cache.write(layer, rows, k, v, n)
                q_rows = torch.searchsorted(active, plan.query_rows).to(dev)
                kv = CheckLayerKV(k[:, cand_dev], v[:, cand_dev], *prior, q[:, q_rows], cache.k[layer][:, :n],
                                  runner.scaling, runner.windows[layer])
                chosen = select(policy, kv, rows_dev, count, deviation_kind, is_forced[cand_rows]).cpu()
            else:  # every candidate kept: no scores needed
                cache.write(layer, rows, k, v, n)
                chosen = cand_rows.clone()
            selected.append(chosen)
            recomputed = int(chosen.numel())
            # exact rows stay active until the loads start (their cached K/V is placed from load_from on)
            others = active[~cand] if layer < plan.load_from else torch.cat([plan.fresh_rows, plan.query_rows])
            keep = torch.searchsorted(active, torch.cat([chosen, others]).unique(sorted=True))
            keep_dev = keep.to(dev)
            q, h, active, changed = q[:, keep_dev], h[keep_dev], active[keep], True
            selection_s += time.perf_counter() - t0
            if layer >= plan.load_from:  # from the next layer on, the dropped candidates are stale
                stale.update(active)
        else:
            cache.write(layer, rows, k, v, n)
        if layer == runner.num_layers - 1:  # only the last row's output is needed
            q, h, active, changed = q[:, -1:], h[-1:], active[-1:], True
        attn = runner.attend(q, active, cache.k[layer][:, :n], cache.v[layer][:, :n],  # host positions: no sync
                             bias=cache.layer_bias(layer, n), window=runner.windows[layer])
        h = runner.finish(layer, h, attn)
        if changed:
            rows = active.to(dev)
            cos, sin = cos_all[rows], sin_all[rows]
        if layer < runner.num_layers - 1 and pacer.due(computed[-1]):
            yield from pacer.pause()
    if plan.full:
        recomputed = int(plan.ctx_rows.numel())
    report = SelectionReport(plan.check_layers, tuple(int(c.numel()) for c in selected), recomputed,
                             selection_s, tuple(selected), key_bias=stale.per_layer(), layer_rows=tuple(computed))
    return runner.logits(h[-1:])[0], report



def query_pass_steps(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan,
                     loader: LayerLoader, value_weighted: bool = False, computed: list[int] | None = None,
                     pacer: Pacer | None = None) -> Generator[None, None, torch.Tensor]:
    """Run the query rows through layers 0..plan.query_layers-1 over the loaded K/V
    (waiting for each layer's loads) and return the fused attention score of every
    context position 0..q_start-1, (q_start,) float32.

    The split's fresh rows (a prefix, `plan.fresh_rows`) run along: they see only each
    other, so their K/V is exact here and written for every layer (the plan then runs the
    query pass over every layer). Side effect: writes the query rows' K/V (of this
    approximate pass) and the fresh rows' K/V into the cache.
    """
    n, dev = plan.n, runner.device
    fresh = plan.fresh_rows  # (F,) host positions 0..F-1
    nf = fresh.numel()
    rows = torch.cat([fresh, plan.query_rows])  # (F+Q,)
    rows_dev = rows.to(dev)
    q_start = int(plan.query_rows[0])
    cos, sin = runner.rope(rows)
    h = runner.embed(token_ids[rows])  # (F+Q, hidden)
    fused = QueryAttention(q_start, value_weighted=value_weighted)
    if computed is not None:
        computed.extend([int(rows.numel())] * plan.query_layers)
    for layer in range(plan.query_layers):
        loader.wait(layer)
        q, k, v = runner.qkv(layer, h, cos, sin)  # (H, F+Q, D), (Hkv, F+Q, D) x2
        cache.write(layer, rows_dev, k, v, n)
        keys, values = cache.k[layer][:, :n], cache.v[layer][:, :n]
        # a CPU's native kernel: the query rows' output and each key's summed probability in one call
        both = runner.attend_with_sums(q[:, nf:], plan.query_rows, keys, values, runner.windows[layer])
        if both is not None:
            out, sums = both  # (Q, H*D), (Hkv, N)
            fused.add_sums(layer, sums, values)
        else:
            probs = query_probs(q[:, nf:], keys, runner.scaling, q_start, runner.windows[layer])  # (Hkv, g*Q, N)
            fused.add(layer, probs, values)
        if layer < plan.query_layers - 1:
            if both is None:
                heads, tq, d = q[:, nf:].shape
                out = (probs.to(values.dtype) @ values).reshape(heads, tq, d)  # (H, Q, D)
                out = out.transpose(0, 1).reshape(tq, -1)  # (Q, H*D)
            if nf:
                out = torch.cat([runner.attend(q[:, :nf], fresh, keys[:, :nf], values[:, :nf],
                                               window=runner.windows[layer]), out])
            h = runner.finish(layer, h, out)
            if pacer is not None and pacer.due(int(rows.numel())):
                yield from pacer.pause()
    return fused.scores()



def _run_query_driven(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan,
                      loader: LayerLoader, value_weighted: bool, deviation_kind: str, stale: StaleKeys, pacer: Pacer
                      ) -> Generator[None, None, tuple[torch.Tensor, SelectionReport]]:
    t0 = time.perf_counter()
    passed: list[int] = []  # rows each layer of the query pass computes
    scores = (yield from query_pass_steps(runner, cache, token_ids, plan, loader, value_weighted, passed,
                                          pacer)).cpu()  # (q_start,)
    cand = plan.cand_rows
    forced = torch.zeros(plan.n, dtype=torch.bool)
    forced[plan.forced_rows] = True
    chosen = select_top(scores[cand], cand, plan.counts[0], forced[cand])
    selected = [chosen]
    selection_s = time.perf_counter() - t0 - pacer.paused_s  # not the time other sequences' steps took
    n, dev = plan.n, runner.device
    # the fresh rows were computed in the query pass, at every layer
    active = torch.cat([chosen, plan.query_rows])  # (T,) sorted: context rows precede the query
    rows = active.to(dev)
    cos, sin = runner.rope(active)  # (T, D), kept for the rows that stay active
    h = runner.embed(token_ids[active])  # (T, hidden)
    last = runner.num_layers - 1
    nq = plan.query_rows.numel()
    stale.update(active)
    computed: list[int] = []  # rows whose q/k/v each layer computes
    for layer in range(runner.num_layers):
        if layer >= plan.query_layers:  # layers the query pass did not wait for
            loader.wait(layer)
        computed.append(int(active.numel()))
        q, k, v = runner.qkv(layer, h, cos, sin)
        m = active.numel() - nq  # the recomputed context rows come first
        stale.correct(runner, cache, layer, q[:, m:], k[:, :m], v[:, :m], rows[:m])
        if layer in plan.check_layers[1:]:  # refine the pool: query attention x KV deviation
            t1 = time.perf_counter()
            pool = active[: chosen.numel()]
            pool_dev = rows[: pool.numel()]  # the same positions, already on the device
            prior = (cache.k[layer][:, pool_dev], cache.v[layer][:, pool_dev])  # copies, before overwriting
            dev_score = deviation(k[:, :m], v[:, :m], *prior, deviation_kind).cpu()
            score = normalised(dev_score) * normalised(scores[pool])
            chosen = select_top(score, pool, plan.counts[plan.check_layers.index(layer)], forced[pool])
            selected.append(chosen)
            cache.write(layer, rows, k, v, n)
            keep = torch.searchsorted(active, torch.cat([chosen, plan.query_rows]))
            keep_dev = keep.to(dev)
            active, rows = active[keep], rows[keep_dev]
            q, h, cos, sin = q[:, keep_dev], h[keep_dev], cos[keep_dev], sin[keep_dev]
            selection_s += time.perf_counter() - t1
            narrowed = True
        else:
            cache.write(layer, rows, k, v, n)
            narrowed = False
        keys, values = cache.k[layer][:, :n], cache.v[layer][:, :n]
        bias, window = cache.layer_bias(layer, n), runner.windows[layer]
        if layer == last:  # only the last row's output is needed
            h = runner.finish(layer, h[-1:], runner.attend(q[:, -1:], active[-1:], keys, values, bias=bias,
                                                           window=window))
        else:  # host positions: no sync; the plan is reused while `active` stays the same tensor
            h = runner.finish(layer, h, runner.attend(q, active, keys, values, bias=bias, window=window))
        if narrowed:  # the pool was narrowed: the dropped rows are stale from the next layer on
            stale.update(active)
        if layer < last and pacer.due(computed[-1]):
            yield from pacer.pause()
    report = SelectionReport(plan.check_layers, tuple(int(c.numel()) for c in selected), int(chosen.numel()),
                             selection_s, tuple(selected), query_pass=True, key_bias=stale.per_layer(),
                             pass_rows=tuple(passed), layer_rows=tuple(computed))
    return runner.logits(h[-1:])[0], report

