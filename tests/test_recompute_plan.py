"""`plan_recompute` takes the `Selection` config and dispatches on its type: for each kind of
selection (query pass, its pool narrowed at check layers, a check-layer policy, gradual
filtering, sink tokens, a split's computed prefix, reuse, a full plan) the plan equals a fixed
expected one, written down from the planner as it was before the dispatch (policy string +
loose knobs), so the refactor kept every row, count and layer."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from blend.config import CheckLayerSelection, QuerySelection
from blend.kv.loader import PlannedLoad
from blend.prompt.builder import Prompt, Segment
from blend.recompute.plan import plan_recompute

LAYERS = 4


def make_prompt() -> Prompt:
    """106 tokens: a system part (0..8), three documents (8..40, 40..72, 72..100), the query (100..106)."""
    bounds = [("prefix", 0, 8), ("document", 8, 40), ("document", 40, 72), ("document", 72, 100), ("query", 100, 106)]
    return Prompt(tuple(range(106)), tuple(Segment(kind, tuple(range(a, b)), a, i - 1 if kind == "document" else -1)
                                           for i, (kind, a, b) in enumerate(bounds)))


# the system part and the first document exact at their positions; the other two computed standalone
LOADS = (PlannedLoad(0, 8, 0, "cpu", 1), PlannedLoad(8, 32, 8, "cpu", 1), PlannedLoad(40, 32, 8, "cpu", 1),
         PlannedLoad(72, 28, 8, "cpu", 1))

CASES = {  # name: (selection, ratio, placements, fresh)
    "query": (QuerySelection(), 0.15, LOADS, 0),
    "query-2-layers": (QuerySelection(query_layers=2), 0.15, LOADS, 0),
    "query-pool": (QuerySelection(query_pool=2.0, check_layers=(1, 2), filter_schedule=(1.5, 1.0)), 0.15, LOADS, 0),
    "query-sinks-fresh": (QuerySelection(sink_tokens=2, query_layers=2), 0.3, LOADS, 40),
    "query-reuse": (QuerySelection(), 0.0, LOADS, 0),
    "query-full": (QuerySelection(), 1.0, LOADS, 0),
    "deviation": (CheckLayerSelection(policy="deviation"), 0.15, LOADS, 0),
    "hybrid-gradual-sinks": (CheckLayerSelection(policy="hybrid", check_layers=(1, 2, 3), filter_schedule=(2.0, 1.5, 1.0),
                                                 sink_tokens=3), 0.2, LOADS, 0),
    "attention-beyond-model": (CheckLayerSelection(policy="attention", check_layers=(1, 5), filter_schedule=(2.0, 1.0)),
                               0.2, LOADS, 0),
    "deviation-full": (CheckLayerSelection(policy="deviation"), 1.0, LOADS, 0),
    "deviation-no-placements-fresh": (CheckLayerSelection(policy="deviation"), 0.5, (), 8),
}


class Expected(NamedTuple):
    ctx: list  # (start, end) runs of the cached context rows
    cand: list  # ... of the candidates
    forced: list  # ... of the rows always recomputed
    check_layers: tuple
    counts: tuple
    load_from: int
    query_layers: int | None  # the query pass's depth (None: no query pass)
    full: bool
    layer_rows: tuple
    pass_rows: tuple


EXPECTED = {
    "query": Expected([(0, 100)], [(40, 100)], [], (0,), (15,), 0, 4, False, (21, 21, 21, 21), (6, 6, 6, 6)),
    "query-2-layers": Expected([(0, 100)], [(40, 100)], [], (0,), (15,), 0, 2, False, (21, 21, 21, 21), (6, 6)),
    "query-pool": Expected([(0, 100)], [(40, 100)], [], (0, 1, 2), (30, 23, 15), 0, 4, False, (36, 36, 29, 21), (6, 6, 6, 6)),
    "query-sinks-fresh": Expected([(40, 100)], [(40, 100)], [(40, 42), (72, 74)], (0,), (18,), 0, 4, False, (24, 24, 24, 24), (46, 46, 46, 46)),
    "query-reuse": Expected([(0, 100)], [(40, 100)], [], (), (), 0, None, False, (6, 6, 6, 6), ()),
    "query-full": Expected([(0, 100)], [(40, 100)], [], (), (60,), 4, None, True, (106, 106, 106, 106), ()),
    "deviation": Expected([(0, 100)], [(40, 100)], [], (1,), (15,), 1, None, False, (106, 106, 21, 21), ()),
    "hybrid-gradual-sinks": Expected([(0, 100)], [(40, 100)], [(40, 43), (72, 75)], (1, 2, 3), (40, 30, 20), 1, None, False, (106, 106, 46, 36), ()),
    "attention-beyond-model": Expected([(0, 100)], [(40, 100)], [], (1,), (20,), 1, None, False, (106, 106, 26, 26), ()),
    "deviation-full": Expected([(0, 100)], [(40, 100)], [], (), (60,), 4, None, True, (106, 106, 106, 106), ()),
    "deviation-no-placements-fresh": Expected([(8, 100)], [(8, 100)], [], (1,), (46,), 1, None, False, (106, 106, 60, 60), ()),
}


def runs(rows) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for v in rows.tolist():
        if out and out[-1][1] == v:
            out[-1][1] = v + 1
        else:
            out.append([v, v + 1])
    return [(a, b) for a, b in out]


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_of_each_selection_type_is_the_expected_one(name):
    selection, ratio, placements, fresh = CASES[name]
    plan = plan_recompute(make_prompt(), ratio, selection, LAYERS, placements=placements, fresh=fresh)
    got = Expected(runs(plan.ctx_rows), runs(plan.cand_rows), runs(plan.forced_rows), plan.check_layers, plan.counts,
                   plan.load_from, plan.query_layers if plan.query_pass else None, plan.full, plan.layer_rows(LAYERS),
                   plan.pass_rows())
    assert got == EXPECTED[name]
    assert plan.n == 106 and runs(plan.query_rows) == [(100, 106)] and plan.fresh_rows.tolist() == list(range(fresh))


def test_a_selection_of_another_type_is_refused():
    with pytest.raises(TypeError, match="selection must be a QuerySelection or a CheckLayerSelection .*got str"):
        plan_recompute(make_prompt(), 0.15, "deviation", LAYERS)  # type: ignore[arg-type]
