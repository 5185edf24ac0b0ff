"""Which rows each layer computes for one blend request (`plan_recompute` -> `RecomputePlan`),
fixed before any compute: the candidates (context rows whose cached KV is not exact at its
prompt position), the rows always recomputed, the budget per selection and the first layer
that reads loaded KV."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from blend.config import CheckLayerSelection, QuerySelection, Selection
from blend.kv.loader import Placement, PlannedLoad
from blend.prompt.builder import Prompt
from blend.recompute.selector import schedule_counts

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

    def pass_rows(self) -> tuple[int, ...]:
        """Rows each layer of the query pass computes (the fresh and query rows; empty without one)."""
        if not self.query_pass:
            return ()
        return (self.fresh_rows.numel() + self.query_rows.numel(),) * self.query_layers

    def layer_rows(self, num_layers: int) -> tuple[int, ...]:
        """Rows whose q/k/v each layer of the layer loop computes (blend.recompute.layers runs
        exactly these; the split's cost model prices plans by them)."""
        fresh, query = self.fresh_rows.numel(), self.query_rows.numel()
        if self.full:
            return (self.n,) * num_layers
        if self.query_pass:  # the pool (then its narrowed sets) and the query, from layer 0
            rows, current = [], self.counts[0]
            for layer in range(num_layers):
                rows.append(current + query)
                if layer in self.check_layers[1:]:
                    current = self.counts[self.check_layers.index(layer)]
            return tuple(rows)
        if not self.check_layers:  # reuse: the computed prefix and the query
            return (fresh + query,) * num_layers
        exact = self.ctx_rows.numel() - self.cand_rows.numel()  # loaded, never candidates
        rows, current = [], self.n  # every row up to the first check layer
        for layer in range(num_layers):
            rows.append(current)
            if layer in self.check_layers:  # the kept candidates; exact rows until their loads start
                kept = min(self.counts[self.check_layers.index(layer)], self.cand_rows.numel())
                current = fresh + query + kept + (exact if layer < self.load_from else 0)
        return tuple(rows)

    @property
    def first_active(self) -> torch.Tensor:
        """Rows computed at layer 0: all of them when a check layer comes or nothing is
        loaded, else the fresh rows and the query (policy `query`: the query pass's rows)."""
        if self.check_layers and not self.query_pass or self.full:
            return torch.arange(self.n)
        return torch.cat([self.fresh_rows, self.query_rows])


def _rows(segments: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in segments]) if segments else _EMPTY


@dataclass(frozen=True)
class _Rows:
    """The rows every plan of one prompt starts from: which are cached, which are candidates
    (cached, not exact at their position), which are always recomputed, which are the query."""

    n: int  # prompt length
    ctx_rows: torch.Tensor  # (C,)
    cand_rows: torch.Tensor  # (N,)
    forced_rows: torch.Tensor  # (F,)
    query_rows: torch.Tensor  # (Q,)
    fresh: int  # the split's computed prefix: positions [0, fresh)

    def plan(self, layers: Sequence[int], counts: Sequence[int], load_from: int, num_layers: int,
             query_layers: int | None = None) -> RecomputePlan:
        """The plan selecting `counts` rows at `layers`, reading loaded K/V from `load_from` on;
        `query_layers`: the depth of a query pass before layer 0 (None: no query pass)."""
        return RecomputePlan(self.n, self.ctx_rows, self.cand_rows, self.forced_rows, self.query_rows, tuple(layers),
                             tuple(counts), load_from, query_layers is not None, query_layers or 0,
                             full=load_from >= num_layers, fresh_rows=torch.arange(self.fresh))


def _candidates(prompt: Prompt, placements: Sequence[Placement | PlannedLoad], sink_tokens: int, fresh: int) -> _Rows:
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
    return _Rows(len(prompt), ctx_rows, cand_rows, cand_rows[forced[cand_rows]],
                 torch.arange(prompt.query.start, len(prompt)), fresh)


def plan_recompute(prompt: Prompt, ratio: float, selection: Selection, num_layers: int, *,
                   placements: Sequence[Placement | PlannedLoad] = (), fresh: int = 0) -> RecomputePlan:
    """Plan blend at `ratio` (0: reuse) with `selection`, by its type: a `QuerySelection`
    (`_query_plan`) or a `CheckLayerSelection` (`_check_layer_plan`).

    `placements` tell which cached rows are exact (their keys were computed at their
    prompt position after the very tokens that precede them: pos_start == start); those
    are loaded but never candidates. Without placements every context row is a candidate.
    The first `selection.sink_tokens` of every document that is not exact are always
    recomputed, inside the budget. `fresh` (a block boundary) is the load-or-compute split's
    computed prefix: those rows are computed at every layer (in the query pass, for a
    query selection), never loaded nor candidates; the ratio applies to the rest.
    """
    if not isinstance(selection, QuerySelection | CheckLayerSelection):
        raise TypeError(f"plan_recompute: selection must be a QuerySelection or a CheckLayerSelection "
                        f"(blend.config), got {type(selection).__name__}")
    rows = _candidates(prompt, placements, selection.sink_tokens, fresh)
    if ratio <= 0 or rows.cand_rows.numel() == 0:
        return rows.plan((), (), 0, num_layers)  # reuse: only the query rows
    if isinstance(selection, QuerySelection):
        return _query_plan(rows, ratio, selection, num_layers)
    return _check_layer_plan(rows, ratio, selection, num_layers)


def _query_plan(rows: _Rows, ratio: float, selection: QuerySelection, num_layers: int) -> RecomputePlan:
    """A query pass over the loaded KV picks the rows recomputed from layer 0. `query_layers`:
    how many layers the pass runs (0 or more than the model: all; with a split's computed
    prefix, all: the pass computes those rows exactly); `query_pool` > 1: the pass keeps that
    many times the budget, narrowed to it at the check layers (`filter_schedule`) by query
    attention x KV deviation. Check layers at 0 or beyond the model are dropped."""
    n_ctx, n_cand = rows.ctx_rows.numel(), rows.cand_rows.numel()
    final = schedule_counts(ratio, (1.0,), n_ctx)[0]
    if final >= n_cand:
        return rows.plan((), (n_cand,), num_layers, num_layers)  # every candidate: a full prefill
    depth = num_layers if selection.query_layers <= 0 or rows.fresh else min(selection.query_layers, num_layers)
    if selection.query_pool <= 1.0:
        return rows.plan((0,), (final,), 0, num_layers, depth)
    # a pool of query_pool x the budget from the query pass, refined at the check layers
    layers = [c for c in selection.check_layers if 0 < c < num_layers]
    pool = min(n_cand, schedule_counts(ratio * selection.query_pool, (1.0,), n_ctx)[0])
    later = schedule_counts(ratio, selection.filter_schedule[: len(layers)], n_ctx)
    if later:
        later[-1] = final
    counts = [pool] + [min(c, pool) for c in later]
    return rows.plan((0, *layers), counts if layers else [final], 0, num_layers, depth)


def _check_layer_plan(rows: _Rows, ratio: float, selection: CheckLayerSelection, num_layers: int) -> RecomputePlan:
    """Every row computed up to the first check layer, where the candidates are ranked and the
    top ones kept (`filter_schedule`: a shrinking share at each later one). Check layers
    beyond the model are dropped; the last one kept then takes the final budget."""
    n_ctx, n_cand = rows.ctx_rows.numel(), rows.cand_rows.numel()
    layers = [c for c in selection.check_layers if c < num_layers]
    counts = schedule_counts(ratio, selection.filter_schedule[: len(layers)], n_ctx)
    if layers and len(layers) < len(selection.check_layers):
        counts[-1] = schedule_counts(ratio, (1.0,), n_ctx)[0]
    counts = [min(c, n_cand) for c in counts]
    # cached K/V is needed from the first check layer that drops a candidate on;
    # everything kept everywhere (e.g. ratio 1) is a full prefill: no loads
    partial = [c for c, kept in zip(layers, counts, strict=True) if kept < n_cand]
    if not layers or not partial:
        return rows.plan((), (n_cand,), num_layers, num_layers)
    return rows.plan(layers, counts, partial[0], num_layers)
