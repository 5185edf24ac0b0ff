"""Misses priced, not paid blindly: the plan a blend (or reuse) request runs when some of its
documents are not in the store.

A missing document's KV must be computed before it can be placed. Computing each one on its own
(after its context, as ingest does) and then blending costs the documents' own prefill *and* a
blend pass: with most documents missing, more than a full prefill. The plans:

  standalone  the missing documents computed on their own (one forward pass per group of
              documents after the same context), stored, then the blend pass over the whole
              prompt (what ingest would have stored: the entries every later request loads);
  harvest     one full prefill of the whole prompt: this request's answer is exact, and each
              missing document's KV is cut out of it (`EntryMaker.harvest`: keys turned back to
              the position the document's standalone entry has) and stored, at no extra compute;
  mixed       the prompt's first segments, up to a segment boundary, computed in every layer of
              the blend pass (the load-or-compute split's computed prefix: exact, since those rows
              see only each other), the missing documents among them harvested from it; the
              missing documents after it computed on their own.

`engine.blend.miss_policy` chooses: `auto` (default) prices each plan with the engine's cost model
(`Splitter.cost_model()`: under `engine.blend.split: auto` calibrated once and fixed, so the choice
is a function of the request's sizes and which documents missed) and runs the cheapest;
`standalone` or `harvest` force one. Without a cost model (`engine.blend.split: off`) `auto`
prices by rows computed (every layer's cost proportional to its rows).

A harvested entry holds the document's K/V as computed in that request's context (after the
documents before it there), not standalone; docs/EVAL.md measures what that does to later blends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from blend.config import Selection
from blend.kv.documents import DocumentCache, Resolution
from blend.kv.loader import PlannedLoad
from blend.kv.prefix import pack_groups
from blend.planning.planner import CostModel, LayerCost
from blend.planning.split import Splitter, simulate
from blend.prompt.builder import Prompt

MISS_POLICIES = ("auto", "standalone", "harvest")
STANDALONE, HARVEST, MIXED = "standalone", "harvest", "mixed"
# no cost model (engine.blend.split: off): every layer priced by its rows
ROWS_MODEL = CostModel(LayerCost([(1.0, 1.0)]), {}, float("inf"), False, "rows")


@dataclass(frozen=True)
class MissPlan:
    """What a request whose documents missed computes, and how.

    `fresh`: prompt positions [0, fresh) computed in every layer (harvest: the whole prompt, a
    full prefill; mixed: the blend pass's computed prefix; standalone: 0). `standalone` and
    `harvested`: indices into the resolution's segments (`Resolution.looked`) of the missing
    documents computed on their own and of those cut out of this request's computation.
    `predicted`: seconds per plan priced (the chosen one among them).
    """

    kind: str
    fresh: int
    standalone: tuple[int, ...]
    harvested: tuple[int, ...]
    reason: str
    predicted: dict[str, float] = field(default_factory=dict)


def plan_misses(policy: str, model: CostModel | None, prompt: Prompt, resolution: Resolution,
                documents: DocumentCache, ratio: float, selection: Selection, num_layers: int) -> MissPlan:
    """The plan of a request whose `resolution` has misses (see the module docstring)."""
    if policy not in MISS_POLICIES:
        raise ValueError(f"engine.blend.miss_policy must be one of {', '.join(MISS_POLICIES)}, got {policy!r}")
    looked = resolution.looked
    missed = tuple(i for i, lk in enumerate(looked) if lk.missed)
    if policy == STANDALONE:
        return MissPlan(STANDALONE, 0, missed, (), "engine.blend.miss_policy: standalone")
    n = len(prompt)
    if policy == HARVEST:
        return MissPlan(HARVEST, n, (), missed, "engine.blend.miss_policy: harvest")
    priced = model or ROWS_MODEL
    layer = priced.layer

    def own_passes(indices: Sequence[int]) -> float:
        """The missing documents at `indices` computed on their own: grouped by context, packed."""
        by_context: dict[tuple[int, ...], list[int]] = {}
        for i in indices:
            by_context.setdefault(tuple(looked[i].rebuild.context), []).append(len(looked[i].rebuild.ids))
        total = 0.0
        for context_ids, lengths in by_context.items():
            context = len(context_ids)
            for group in pack_groups(lengths, context):
                rows = sum(lengths[j] for j in group)
                pairs = sum(lengths[j] * (context + (lengths[j] + 1) / 2) for j in group)  # context and itself
                total += num_layers * layer.with_pairs(rows, pairs)
        return total

    def loads(fresh: int) -> list[PlannedLoad]:
        """Every block placed after `fresh`: a hit as read from its tier, a miss as computed."""
        out = []
        for lk in looked:
            for b, loc in zip(lk.rebuild.block_list, lk.found, strict=True):
                start = lk.segment.start + b.start
                if start < fresh:
                    continue
                nbytes = (loc.header.layer_nbytes if loc is not None
                          else documents.entry_layer_nbytes(b.end - b.start))
                out.append(PlannedLoad(start, b.end - b.start, b.pos_start,
                                       loc.tier_name if loc is not None else "computed", nbytes))
        return out

    def blend(fresh: int) -> float:
        return Splitter.price(priced, prompt, loads(fresh), ratio, selection, num_layers, fresh)[0]

    predicted = {STANDALONE: own_passes(missed) + blend(0),
                 HARVEST: simulate([n] * num_layers, 0.0, num_layers, layer, pairs=[n * (n + 1) / 2] * num_layers)[0]}
    best_mixed: tuple[float, int] | None = None
    for k, lk in enumerate(looked[:-1]):  # a computed prefix up to the end of segment k (not all of them)
        inside = [i for i in missed if i <= k]
        if len(inside) < 2:  # one missing document there: computing it alone costs the same
            continue
        cost = own_passes([i for i in missed if i > k]) + blend(lk.segment.end)
        if best_mixed is None or cost < best_mixed[0]:
            best_mixed = (cost, k)
    if best_mixed is not None:
        predicted[MIXED] = best_mixed[0]
    kind = min(predicted, key=lambda name: (predicted[name], name != STANDALONE))
    how = "rows computed" if model is None else f"the {model.source} cost model"
    reason = (f"{len(missed)} of {len(looked)} segments missed; by {how}: "
              + ", ".join(f"{name} {seconds:.4g}" for name, seconds in sorted(predicted.items(), key=lambda x: x[1])))
    if kind == HARVEST:
        return MissPlan(HARVEST, n, (), missed, reason, predicted)
    if kind == MIXED:
        assert best_mixed is not None
        k = best_mixed[1]
        return MissPlan(MIXED, looked[k].segment.end, tuple(i for i in missed if i > k),
                        tuple(i for i in missed if i <= k), reason, predicted)
    return MissPlan(STANDALONE, 0, missed, (), reason, predicted)
