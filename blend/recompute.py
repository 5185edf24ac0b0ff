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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend.pipeline import LayerLoader, Placement
from blend.prompt import Prompt
from blend.runner import KVCache, Runner, apply_rope
from blend.selector import (
    CheckLayerKV,
    QueryAttention,
    deviation,
    normalised,
    query_probs,
    schedule_counts,
    select,
    select_top,
    stale_key_bias,
    uses_check_layers,
)
from blend.stats import SelectionReport

_EMPTY = torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class RecomputePlan:
    """Which rows each layer computes for one prompt."""

    n: int  # prompt length
    ctx_rows: torch.Tensor  # (C,) positions of cached context rows
    cand_rows: torch.Tensor  # (N,) context rows whose cached KV is approximate: the candidates, sorted
    forced_rows: torch.Tensor  # (F,) candidates always recomputed (inside the budget), sorted
    query_rows: torch.Tensor  # (Q,) positions of the query rows (always computed)
    check_layers: tuple[int, ...]  # layers where rows are selected (policy `query`: 0 = the query pass, then refinements)
    counts: tuple[int, ...]  # candidates kept at each selection (non-increasing)
    load_from: int  # first layer whose cached K/V is read (num_layers: none)
    query_pass: bool = False  # select before layer 0 from a query pass (policy `query`)
    query_layers: int = 0  # layers 0..query_layers-1 run in the query pass (the rest load during the recompute)
    full: bool = False  # every row computed at every layer, nothing loaded (the budget covers every candidate)
    # load-or-compute split (blend.split): positions [0, fresh) are computed in every layer, never loaded
    fresh_rows: torch.Tensor = _EMPTY  # (F,)

    @property
    def first_active(self) -> torch.Tensor:
        """Rows computed at layer 0: all of them when a check layer comes or nothing is
        loaded, else the fresh rows and the query (policy `query`: the query pass's rows)."""
        if self.check_layers and not self.query_pass or self.full:
            return torch.arange(self.n)
        return torch.cat([self.fresh_rows, self.query_rows])


def _rows(segments: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in segments]) if segments else _EMPTY


def plan_recompute(prompt: Prompt, ratio: float, check_layers: tuple[int, ...], schedule: tuple[float, ...],
                   num_layers: int, *, policy: str = "deviation", placements: Sequence[Placement] = (),
                   sink_tokens: int = 0, query_layers: int = 0, query_pool: float = 1.0,
                   fresh: int = 0) -> RecomputePlan:
    """Plan blend at `ratio` (0: reuse) with selection `policy`.

    `placements` tell which cached rows are exact (their keys were computed at their
    prompt position after the very tokens that precede them: pos_start == start); those
    are loaded but never candidates. Without placements every context row is a candidate.
    Check layers beyond the model are dropped; the last one kept then takes the final budget.
    `query_layers` (policy `query`): how many layers the query pass runs (0 or more than
    the model: all); `query_pool` > 1: the query pass keeps that many times the budget,
    narrowed to the budget at the check layers (`filter_schedule`) by query attention x
    KV deviation. `fresh` (a block boundary) is the load-or-compute split's computed
    prefix: those rows are computed at every layer (in the query pass, for policy
    `query`), never loaded nor candidates; the ratio applies to the rest.
    """
    cached = [s for s in prompt.segments if s.kind != "query" and s.end > fresh]
    ctx_rows = _rows([(max(s.start, fresh), s.end) for s in cached])
    exact = torch.zeros(len(prompt), dtype=torch.bool)
    for p in placements:
        if p.pos_start == p.start:
            exact[p.start : p.start + p.length] = True
    cand_rows = ctx_rows[~exact[ctx_rows]]
    forced = torch.zeros(len(prompt), dtype=torch.bool)
    if sink_tokens > 0:
        for s in cached:
            if s.kind == "document" and not bool(exact[s.start]):
                forced[s.start : min(s.end, s.start + sink_tokens)] = True
    forced_rows = cand_rows[forced[cand_rows]]
    query_rows = torch.arange(prompt.query.start, len(prompt))
    n_cand = cand_rows.numel()

    def make(layers: Sequence[int], counts: Sequence[int], load_from: int, query_pass: bool = False) -> RecomputePlan:
        # the query pass computes the fresh rows exactly, so with a split it runs every layer
        depth = num_layers if query_layers <= 0 or fresh else min(query_layers, num_layers)
        return RecomputePlan(len(prompt), ctx_rows, cand_rows, forced_rows, query_rows, tuple(layers),
                             tuple(counts), load_from, query_pass, depth if query_pass else 0,
                             full=load_from >= num_layers, fresh_rows=torch.arange(fresh))

    if ratio <= 0 or n_cand == 0:
        return make((), (), 0)  # reuse: only the query rows
    n_ctx = ctx_rows.numel()
    if not uses_check_layers(policy):
        final = schedule_counts(ratio, (1.0,), n_ctx)[0]
        if final >= n_cand:
            return make((), (n_cand,), num_layers)
        if query_pool <= 1.0:
            return make((0,), (final,), 0, True)
        # a pool of query_pool x the budget from the query pass, refined at the check layers
        layers = [c for c in check_layers if 0 < c < num_layers]
        pool = min(n_cand, schedule_counts(ratio * query_pool, (1.0,), n_ctx)[0])
        later = schedule_counts(ratio, schedule[: len(layers)], n_ctx)
        if later:
            later[-1] = final
        counts = [pool] + [min(c, pool) for c in later]
        return make((0, *layers), counts if layers else [final], 0, True)
    layers = [c for c in check_layers if c < num_layers]
    counts = schedule_counts(ratio, schedule[: len(layers)], n_ctx)
    if layers and len(layers) < len(check_layers):
        counts[-1] = schedule_counts(ratio, (1.0,), n_ctx)[0]
    counts = [min(c, n_cand) for c in counts]
    # cached K/V is needed from the first check layer that drops a candidate on;
    # everything kept everywhere (e.g. ratio 1) is a full prefill: no loads
    partial = [c for c, kept in zip(layers, counts, strict=True) if kept < n_cand]
    if not layers or not partial:
        return make((), (n_cand,), num_layers)
    return make(layers, counts, partial[0])


# fewer recomputed rows than this at a layer: no K/V shift there (too few to take a mean over)
MIN_SHIFT_ROWS = 16


def _at_positions(offset: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One un-rotated vector per KV head, offset (Hkv, 1, D), rotated to each of T positions
    given by their cos, sin (T, D): (Hkv, T, D)."""
    return apply_rope(offset.expand(-1, cos.shape[0], -1).contiguous(), cos, sin)


def shift_applies(setting: str, policy: str) -> bool:
    """Whether config `stale_shift` (auto | on | off) shifts the stale K/V under selection `policy`.

    auto leaves out `deviation`: it recomputes the rows whose K/V deviate most, so their mean
    offset overstates the stale rows' (measured worse on MuSiQue dev; docs/EVAL.md)."""
    return setting == "on" or (setting == "auto" and policy != "deviation")


class StaleKeys:
    """The candidate rows whose cached K/V the recompute leaves stale, and their correction.

    At each layer, before the layer's fresh K/V are written, the recomputed candidate rows
    show in this very request how their loaded K/V differ from what a full prefill gives:
    - with `shift` (config `stale_shift`), the mean of fresh minus loaded over those rows,
      per KV head (keys un-rotated first, so the offset is position-free), is added to the
      stale rows' K/V in the cache (keys rotated back to each row's position);
    - with `enabled` (config `stale_bias`), how much more the query rows attend to the
      recomputed rows' loaded keys (shifted, with `shift`) than to their fresh ones
      (selector.stale_key_bias, per KV head) is set, negated, on the stale rows' keys
      (`KVCache.set_bias`): every later attention over the cache adds it.
    Both apply to the recompute and then to each decoded token. No recomputed row (reuse) or
    no stale row (ratio 1): nothing is changed.
    """

    def __init__(self, cand_rows: torch.Tensor, n: int, device: torch.device, enabled: bool, shift: bool = False):
        self.is_cand = torch.zeros(n, dtype=torch.bool)
        self.is_cand[cand_rows] = True
        self.device, self.enabled, self.shift = device, enabled, shift
        self.rows = _EMPTY  # (S,) stale rows, host
        self.rows_dev = _EMPTY.to(device)
        self._rotation: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin (S, D) of the stale rows
        self._means: list[torch.Tensor | None] = []  # per layer: the mean bias over heads (None: none set)

    def update(self, active: torch.Tensor) -> None:
        """The stale rows are the candidates not in `active` (sorted host positions)."""
        stale = self.is_cand.clone()
        stale[active] = False
        self.rows = stale.nonzero().flatten()
        self.rows_dev = self.rows.to(self.device)
        self._rotation = None

    def correct(self, runner: Runner, cache: KVCache, layer: int, query_q: torch.Tensor, fresh_k: torch.Tensor,
                fresh_v: torch.Tensor, recomputed: torch.Tensor) -> None:
        """query_q (H, Q, D) the query rows' fresh queries; fresh_k, fresh_v (Hkv, S, D) the fresh
        K/V of the recomputed candidate rows `recomputed` (S,) (device positions) at `layer`."""
        if not (self.enabled or self.shift) or self.rows.numel() == 0 or recomputed.numel() == 0:
            self._means.append(None)
            return
        loaded = cache.k[layer][:, recomputed]  # (Hkv, S, D) as placed by the loader: read before the write
        if self.shift and recomputed.numel() >= MIN_SHIFT_ROWS:
            loaded = self._shift(runner, cache, layer, fresh_k, fresh_v, loaded, recomputed)
        if not self.enabled:
            self._means.append(None)
            return
        bias = stale_key_bias(query_q, fresh_k, loaded, runner.scaling)  # (Hkv,)
        cache.set_bias(layer, self.rows_dev, -bias)
        self._means.append(bias.mean())  # kept on the device: no sync per layer

    def _shift(self, runner: Runner, cache: KVCache, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
               loaded_k: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
        """Add the recomputed rows' mean K/V offset to the stale rows of `layer`; returns the
        recomputed rows' loaded keys with the same offset (Hkv, S, D), for the bias."""
        cos, sin = runner.rotation(recomputed)  # (S, D) float32: R(p) of each recomputed row
        # R(p) k_fresh - R(p) k_loaded, turned back by R(-p): cos(-x) = cos x, sin(-x) = -sin x
        dk = apply_rope(fresh_k.float() - loaded_k.float(), cos, -sin).mean(dim=1, keepdim=True)  # (Hkv, 1, D)
        dv = (fresh_v.float() - cache.v[layer][:, recomputed].float()).mean(dim=1, keepdim=True)  # (Hkv, 1, D)
        if self._rotation is None:
            self._rotation = runner.rotation(self.rows)
        st_cos, st_sin = self._rotation  # (T, D) of the T stale rows
        keys, values, st = cache.k[layer], cache.v[layer], self.rows_dev
        keys[:, st] += _at_positions(dk, st_cos, st_sin).to(keys.dtype)
        values[:, st] += dv.to(values.dtype)
        return loaded_k + _at_positions(dk, cos, sin).to(loaded_k.dtype)

    def skip(self) -> None:
        """A layer with nothing to correct."""
        self._means.append(None)

    def per_layer(self) -> tuple[float, ...]:
        """The mean over heads of the offset taken off the stale keys at each layer so far."""
        return tuple(0.0 if m is None else float(m) for m in self._means)


@torch.inference_mode()
def run_layers(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan, loader: LayerLoader,
               *, policy: str, deviation_kind: str, value_weighted: bool = False, stale_bias: bool = False,
               stale_shift: bool = False) -> tuple[torch.Tensor, SelectionReport]:
    """Run every layer over `cache` (filled by `loader`) computing only the planned rows.

    `stale_shift`, `stale_bias`: correct the K/V and the scores of the keys left stale
    (`StaleKeys`). Returns the last row's logits (vocab,) and what was selected.
    """
    stale = StaleKeys(plan.cand_rows, plan.n, runner.device, stale_bias and not plan.full,
                      shift=stale_shift and not plan.full)
    if plan.query_pass:
        return _run_query_driven(runner, cache, token_ids, plan, loader, value_weighted, deviation_kind, stale)
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
    for layer in range(runner.num_layers):
        loader.wait(layer)
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
                                  runner.scaling)
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
                             bias=cache.layer_bias(layer, n))
        h = runner.finish(layer, h, attn)
        if changed:
            rows = active.to(dev)
            cos, sin = cos_all[rows], sin_all[rows]
    if plan.full:
        recomputed = int(plan.ctx_rows.numel())
    report = SelectionReport(plan.check_layers, tuple(int(c.numel()) for c in selected), recomputed,
                             selection_s, tuple(selected), key_bias=stale.per_layer())
    return runner.logits(h[-1:])[0], report


def query_pass(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan, loader: LayerLoader,
               value_weighted: bool = False) -> torch.Tensor:
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
    for layer in range(plan.query_layers):
        loader.wait(layer)
        q, k, v = runner.qkv(layer, h, cos, sin)  # (H, F+Q, D), (Hkv, F+Q, D) x2
        cache.write(layer, rows_dev, k, v, n)
        keys, values = cache.k[layer][:, :n], cache.v[layer][:, :n]
        probs = query_probs(q[:, nf:], keys, runner.scaling, q_start)  # (Hkv, g*Q, N)
        fused.add(layer, probs, values)
        if layer < plan.query_layers - 1:
            heads, tq, d = q[:, nf:].shape
            out = (probs.to(values.dtype) @ values).reshape(heads, tq, d)  # (H, Q, D)
            out = out.transpose(0, 1).reshape(tq, -1)  # (Q, H*D)
            if nf:
                out = torch.cat([runner.attend(q[:, :nf], fresh, keys[:, :nf], values[:, :nf]), out])
            h = runner.finish(layer, h, out)
    return fused.scores()


def _run_query_driven(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan,
                      loader: LayerLoader, value_weighted: bool, deviation_kind: str, stale: StaleKeys
                      ) -> tuple[torch.Tensor, SelectionReport]:
    t0 = time.perf_counter()
    scores = query_pass(runner, cache, token_ids, plan, loader, value_weighted).cpu()  # (q_start,)
    cand = plan.cand_rows
    forced = torch.zeros(plan.n, dtype=torch.bool)
    forced[plan.forced_rows] = True
    chosen = select_top(scores[cand], cand, plan.counts[0], forced[cand])
    selected = [chosen]
    selection_s = time.perf_counter() - t0
    n, dev = plan.n, runner.device
    # the fresh rows were computed in the query pass, at every layer
    active = torch.cat([chosen, plan.query_rows])  # (T,) sorted: context rows precede the query
    rows = active.to(dev)
    cos, sin = runner.rope(active)  # (T, D), kept for the rows that stay active
    h = runner.embed(token_ids[active])  # (T, hidden)
    last = runner.num_layers - 1
    nq = plan.query_rows.numel()
    stale.update(active)
    for layer in range(runner.num_layers):
        if layer >= plan.query_layers:  # layers the query pass did not wait for
            loader.wait(layer)
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
        bias = cache.layer_bias(layer, n)
        if layer == last:  # only the last row's output is needed
            h = runner.finish(layer, h[-1:], runner.attend(q[:, -1:], active[-1:], keys, values, bias=bias))
        else:  # host positions: no sync; the plan is reused while `active` stays the same tensor
            h = runner.finish(layer, h, runner.attend(q, active, keys, values, bias=bias))
        if narrowed:  # the pool was narrowed: the dropped rows are stale from the next layer on
            stale.update(active)
    report = SelectionReport(plan.check_layers, tuple(int(c.numel()) for c in selected), int(chosen.numel()),
                             selection_s, tuple(selected), query_pass=True, key_bias=stale.per_layer())
    return runner.logits(h[-1:])[0], report
