"""The load-or-compute split: never slower than full prefill.

Loading cached KV only pays when it arrives faster than the model could compute it.
From a slow tier (a cold disk, a remote Redis) loading every cached segment can take
longer than a full prefill. Then a prefix of the prompt is computed with plain prefill
(exact, nothing loaded) while the KV of the rest loads; the split point is chosen so
that both finish together. Blend's selective recompute then applies to the loaded part
only.

The decision prices each candidate with a `CostModel` (blend.planning.planner): seconds per
layer as a function of the rows it computes, and per tier the time its reads and the
placement take. For every segment boundary s the prefill is simulated layer by layer
(compute of layer l starts when layer l-1 is done and layer l's KV is placed) and the s with
the smallest predicted time wins; a split is taken only when it is predicted to save at
least `MIN_GAIN` of the unsplit time, or at all when loading everything is predicted slower
than a full prefill. The candidates include computing everything (a full prefill), so the
predicted time never exceeds a full prefill's.

A split changes the numbers (a computed prefix is exact, a loaded one is not), so which cost
model decides is a choice between reproducibility and adaptation (`engine.blend.split`):

  auto      (default) deterministic: the cost model is fixed for the engine's life. The
            model's compute is calibrated once (`PrefillCosts.calibrated`: timed prefills of
            fixed sizes, on the scheduler's thread, before the first request that consults
            the split, or in `BlendEngine.warmup`), each tier's reads and the placement are
            priced at the priors of their kind (`PRIOR_READ_GBPS`, `PRIOR_PLACE_GBPS`). A
            decision is then a function of the request's sizes only: the same request gets
            the same split, and the same answer, however busy the machine is later.
  adaptive  the live estimates, fed by every request (`observe`): a tier that turns slow is
            seen within a request or two; a busy CPU makes compute look slower: the same
            request may be split in one run and loaded in another.
  off       every cached segment is loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from blend.config import QuerySelection, Selection
from blend.kv.loader import Placement, PlannedLoad
from blend.model.runner import Runner
from blend.modes import SPLIT_MODES
from blend.planning.planner import CostModel, LayerCost, LoadCosts, PrefillCosts
from blend.prompt.builder import Prompt
from blend.recompute.plan import RecomputePlan, plan_recompute
from blend.stats import RequestStats, SplitReport

MIN_GAIN = 0.10  # a split must be predicted to save this share of the unsplit time (unless
# loading everything is predicted slower than a full prefill: then any saving is taken)


def _off(mode: str | None) -> str:
    """The reason of an unsplit prefill whose split is off."""
    return "off (engine.blend.split)" if mode is None else "off (the request's split)"


def worth_it(best: float, unsplit: float, full: float) -> bool:
    """Whether a plan predicted at `best` seconds replaces loading everything (`unsplit`):
    when it saves MIN_GAIN of it, or at all when loading everything is predicted to lose
    against a full prefill (`full`) — a cached mode must never be slower than no cache."""
    return best <= (1 - MIN_GAIN) * unsplit or (unsplit > full and best < unsplit)


@dataclass(frozen=True)
class Split:
    """What a request computes and what it loads."""

    computed_tokens: int  # prompt positions [0, computed_tokens) are computed, not loaded
    loaded: tuple[Placement, ...]  # the placements still loaded
    report: SplitReport
    plan: RecomputePlan | None = None  # the recompute plan this split was priced by, the one that runs (blends)


def simulate(rows: Sequence[int], load_per_layer: float, load_from: int,
             cost: Callable[[float], float] | LayerCost | tuple[float, float], place_in_compute: float = 0.0,
             start: float = 0.0, pairs: Sequence[float] | None = None) -> tuple[float, float, float]:
    """Predicted (prefill seconds, compute seconds, load seconds) of a layer loop.

    Layer l computes `rows[l]` rows in cost(rows) seconds (a (c0, c1) pair: c0 + c1 x rows), after layer l-1 and after its
    KV is loaded (layers >= load_from each take `load_per_layer`, back to back from time
    0); the loop itself starts at `start` (after other compute). `place_in_compute` is
    per-layer placement work that runs on the compute threads (CPU) rather than beside them.
    `pairs` (with a LayerCost): the (query, key) pairs layer l's rows attend over
    (`LayerCost.with_pairs`: rows over a long context cost more than a prefill of as many rows).
    """
    if isinstance(cost, tuple):
        c0, c1 = cost

        def cost(r: float, c0: float = c0, c1: float = c1) -> float:
            return c0 + c1 * r

    done, loaded, compute = start, 0.0, 0.0
    for layer, r in enumerate(rows):
        t = cost.with_pairs(r, pairs[layer]) if pairs is not None and isinstance(cost, LayerCost) else cost(r)
        if layer >= load_from:
            loaded += load_per_layer
            t += place_in_compute
            done = max(done, loaded)
        done += t
        compute += t
    return done, compute, loaded if load_from < len(rows) else 0.0


class Splitter:
    """Chooses the split of each request (see the module docstring for `mode`)."""

    def __init__(self, prefill: PrefillCosts, loads: LoadCosts, tier_kinds: dict[str, str], *, mode: str = "auto",
                 runner: Runner | None = None):
        if mode not in SPLIT_MODES:
            raise ValueError(f"engine.blend.split must be one of {', '.join(SPLIT_MODES)}, got {mode!r}")
        if mode == "auto" and runner is None and not prefill.is_calibrated:
            raise ValueError("engine.blend.split auto calibrates the model's compute: pass the runner")
        self.prefill, self.loads, self.tier_kinds, self.mode = prefill, loads, dict(tier_kinds), mode
        self.runner = runner
        self._calibrated: CostModel | None = None

    @property
    def needs_calibration(self) -> bool:
        """Whether the next `cost_model()` call measures the model first (mode auto, once)."""
        return self.calibrates(None)

    def calibrates(self, mode: str | None) -> bool:
        """Whether `cost_model(mode)` would measure the model first (mode auto, once per engine)."""
        return self._mode(mode) == "auto" and self._calibrated is None

    def _mode(self, mode: str | None) -> str:
        """A request's own split mode (`GenerationRequest.split`), else the engine's."""
        return self.mode if mode is None else mode

    def cost_model(self, mode: str | None = None) -> CostModel | None:
        """The cost model this engine's decisions are made with, for the split and for any other
        planner that weighs computing against loading (e.g. whether computing a request's
        missing documents beats a full prefill):

        - auto: the calibrated model, fixed for the engine's life (the same object on every
          call; the first call measures the model's compute on the calling thread, which must
          be the thread that owns the model: the scheduler's; `needs_calibration` says whether
          this call would);
        - adaptive: a snapshot of the live estimates (None before the first observed request);
        - off: None.

        `mode`: a request's own split mode (None: the engine's).
        """
        mode = self._mode(mode)
        if mode == "off":
            return None
        if mode == "auto":
            if self._calibrated is None:
                assert self.runner is not None or self.prefill.is_calibrated
                layer = self.prefill.calibrated(self.runner)  # type: ignore[arg-type]
                reads, place = self.loads.rates(self.tier_kinds, live=False)
                self._calibrated = CostModel(layer, reads, place, self.loads.pipelined, "calibrated")
            return self._calibrated
        layer = self.prefill.layer_cost()
        if layer is None:
            return None
        reads, place = self.loads.rates(self.tier_kinds, live=True)
        return CostModel(layer, reads, place, self.loads.pipelined, "live")

    @staticmethod
    def _load_per_layer(model: CostModel, placements: Sequence[Placement | PlannedLoad]) -> tuple[float, float]:
        """(seconds per layer of the pipelined load, seconds per layer of placement on the compute threads)."""
        reads: dict[str, int] = {}
        for p in placements:
            reads[p.source] = reads.get(p.source, 0) + p.layer_nbytes
        return model.load_per_layer(reads)

    def plan(self, prompt: Prompt, placements: Sequence[Placement], ratio: float, selection: Selection,
             num_layers: int, fresh: int | None = None, mode: str | None = None) -> Split:
        """The split of a blend (ratio 0: reuse) of `prompt` whose cached segments are `placements`.

        Every candidate is priced by the rows the recompute plan of that split computes per
        layer (`plan_recompute`, the plan that then runs: `RecomputePlan.layer_rows`). A query
        pass (selection `query`) computes the fresh and query rows while its layers load, and
        only then are the selected rows recomputed from layer 0, so the two phases add up
        instead of overlapping. `mode`: the request's own split mode (None: the engine's).
        """
        ordered = sorted(placements, key=lambda p: p.start)

        def recompute(computed: int) -> RecomputePlan:
            return plan_recompute(prompt, ratio, selection, num_layers,
                                  placements=[p for p in ordered if p.start >= computed], fresh=computed)

        def unsplit(reason: str, plan: RecomputePlan | None = None, **predicted: float | None) -> Split:
            loaded = sum(p.length for p in ordered)
            return Split(0, tuple(ordered), SplitReport(False, reason, 0, loaded, **predicted), plan or recompute(0))

        if fresh:  # decided by the miss plan (blend.planning.misses): its missing documents harvested from it
            loaded = tuple(p for p in ordered if p.start >= fresh)
            return Split(fresh, loaded, SplitReport(True, f"the miss plan computes the first {fresh} tokens", fresh,
                                                    sum(p.length for p in loaded)), recompute(fresh))
        if self._mode(mode) == "off":
            return unsplit(_off(mode))
        if not ordered:
            return unsplit("nothing to load")
        model = self.cost_model(mode)
        if model is None:
            return unsplit("no compute estimate yet (the first requests measure it)")
        cost = model.layer
        n = len(prompt)
        # candidates: compute nothing, or every prefix of whole segments (the last one: everything)
        candidates = [0] + [p.start + p.length for p in ordered if p.start + p.length <= prompt.query.start]
        if isinstance(selection, QuerySelection) and ratio > 0 and len(candidates) > 2:
            # a query pass runs the computed prefix beside the loads, then recomputes the selection
            # of the rest: the phases do not overlap, so only loading everything or computing
            # everything (a full prefill) is offered
            candidates = [candidates[0], candidates[-1]]
        priced = [self.price_plan(model, prompt, ordered, ratio, selection, num_layers, s) for s in candidates]
        results = [(*prices, s) for (prices, _), s in zip(priced, candidates, strict=True)]
        plans = dict(zip(candidates, (plan for _, plan in priced), strict=True))
        full = simulate([n] * num_layers, 0.0, num_layers, cost, pairs=[n * (n + 1) / 2] * num_layers)[0]
        base = results[0]
        best = min(results, key=lambda r: (r[0], r[3]))
        predicted = dict(predicted_unsplit_s=base[0], predicted_full_s=full)
        if best[3] == 0 or not worth_it(best[0], base[0], full):
            why = (f"loads hidden: predicted load {base[2]:.4f} s, compute {base[1]:.4f} s" if base[2] <= base[1]
                   else f"load-bound but no split saves {MIN_GAIN:.0%}: predicted {base[0]:.4f} s")
            return unsplit(why, plans[0], predicted_s=base[0], predicted_load_s=base[2], predicted_compute_s=base[1],
                           **predicted)
        total, compute, load, s = best
        loaded = tuple(p for p in ordered if p.start >= s)
        tokens = sum(p.length for p in loaded)
        reason = (f"load-bound: loading everything predicted {base[0]:.4f} s (load {base[2]:.4f} s), full prefill "
                  f"{full:.4f} s; computing the first {s} tokens while the rest loads: {total:.4f} s")
        report = SplitReport(True, reason, s, tokens, predicted_s=total, predicted_load_s=load,
                             predicted_compute_s=compute, **predicted)
        return Split(s, loaded, report, plans[s])

    @staticmethod
    def price(model: CostModel, prompt: Prompt, loads: Sequence[Placement | PlannedLoad], ratio: float,
              selection: Selection, num_layers: int, fresh: int = 0) -> tuple[float, float, float]:
        """`price_plan`'s prices."""
        return Splitter.price_plan(model, prompt, loads, ratio, selection, num_layers, fresh)[0]

    @staticmethod
    def price_plan(model: CostModel, prompt: Prompt, loads: Sequence[Placement | PlannedLoad], ratio: float,
                   selection: Selection, num_layers: int, fresh: int = 0
                   ) -> tuple[tuple[float, float, float], RecomputePlan]:
        """Predicted (prefill, compute, load) seconds of a blend (ratio 0: reuse) of `prompt` that
        computes positions [0, fresh) in every layer and places the `loads` after them, priced by
        the rows its own recompute plan computes per layer (`RecomputePlan.layer_rows`). A query
        pass (selection `query`) computes the fresh and query rows while its layers load, and only
        then are the selected rows recomputed from layer 0: the two phases add up."""
        loaded = [p for p in loads if p.start >= fresh]  # the first `fresh` tokens are computed
        per_layer, in_compute = Splitter._load_per_layer(model, loaded) if loaded else (0.0, 0.0)
        plan = plan_recompute(prompt, ratio, selection, num_layers, placements=loaded, fresh=fresh)
        rows = plan.layer_rows(num_layers)
        n = len(prompt)
        # the (query, key) pairs of each layer: the query rows and the split's prefix by position,
        # the selected rows at the candidates' mean position (which of them is not known yet)
        query_pairs = float((plan.query_rows + 1).sum())
        fresh = plan.fresh_rows.numel()
        fresh_pairs = fresh * (fresh + 1) / 2
        mean_cand = float(plan.cand_rows.float().mean()) + 1 if plan.cand_rows.numel() else 0.0
        nq = plan.query_rows.numel()
        if plan.full:
            pairs = [n * (n + 1) / 2] * len(rows)
        else:
            pairs = [query_pairs + max(0, r - nq) * mean_cand for r in rows]
        if plan.query_pass:
            passed = plan.pass_rows()
            total, compute, load = simulate(passed, per_layer, 0, model.layer, in_compute,
                                            pairs=[fresh_pairs + query_pairs] * len(passed))
            rest = simulate(rows, per_layer, len(passed), model.layer, in_compute, start=total, pairs=pairs)
            return (rest[0], compute + rest[1], load + rest[2]), plan
        return simulate(rows, per_layer, plan.load_from, model.layer, in_compute, pairs=pairs), plan

    def plan_prefix(self, n: int, chain: Sequence[Placement], num_layers: int, mode: str | None = None) -> Split:
        """The split of a prefix-mode prefill of n tokens whose exact cached prefix is `chain`:
        the first blocks may be computed (a plain prefill, before the tail) instead of loaded;
        computing the whole chain means one full prefill. `mode` as in `plan`."""
        ordered = sorted(chain, key=lambda p: p.start)
        end = max((p.start + p.length for p in ordered), default=0)

        def unsplit(reason: str, **predicted: float | None) -> Split:
            return Split(0, tuple(ordered), SplitReport(False, reason, 0, end, **predicted))

        if self._mode(mode) == "off":
            return unsplit(_off(mode))
        if not ordered:
            return unsplit("nothing to load")
        model = self.cost_model(mode)
        if model is None:
            return unsplit("no compute estimate yet (the first requests measure it)")
        cost = model.layer
        full = simulate([n] * num_layers, 0.0, num_layers, cost)[0]
        results: list[tuple[float, float, float, int]] = [(full, full, 0.0, end)]  # everything in one prefill
        for s in [0] + [p.start + p.length for p in ordered if p.start + p.length < end]:
            loaded = [p for p in ordered if p.start >= s]
            first = simulate([s] * num_layers, 0.0, num_layers, cost)[0] if s else 0.0
            per_layer, in_compute = self._load_per_layer(model, loaded) if loaded else (0.0, 0.0)
            tail = [n - end] * num_layers
            total, compute, load = simulate(tail, per_layer, 0 if loaded else num_layers, cost, in_compute, first)
            results.append((total, compute + first, load, s))
        base, best = results[1], min(results, key=lambda r: (r[0], r[3]))
        predicted = dict(predicted_unsplit_s=base[0], predicted_full_s=full)
        if best[3] == 0 or not worth_it(best[0], base[0], full):
            return unsplit("loads hidden or no split saves enough", predicted_s=base[0], predicted_load_s=base[2],
                           predicted_compute_s=base[1], **predicted)
        total, compute, load, s = best
        loaded = tuple(p for p in ordered if p.start >= s)
        reason = (f"load-bound: loading the prefix predicted {base[0]:.4f} s (load {base[2]:.4f} s), full prefill "
                  f"{full:.4f} s; computing its first {s} tokens while the rest loads: {total:.4f} s")
        return Split(s, loaded, SplitReport(True, reason, s, end - s, predicted_s=total, predicted_load_s=load,
                                            predicted_compute_s=compute, **predicted))

    # ---------------------------------------------------------- observations
    def observe(self, stats: RequestStats, num_layers: int) -> None:
        """Feed one finished request (its prefill timed to the logits) into the live estimates
        (in every mode; only `adaptive` decides with them, `auto`'s calibrated model never changes).

        Requests that computed chunk misses are skipped for compute (their prefill time
        includes that work), and so are requests that read from a tier other than CPU
        memory: disk and Redis reads run beside the compute and slow it (threads, the GIL),
        which is the load's cost, not the model's. A query-driven blend is two samples: its
        query pass (the query and fresh rows in every layer; timed as the selection, less
        the load waits) and its recompute (the selection and the query), not one average
        of the two (launch-bound small layers would be priced like large ones). Every
        request with loads updates the load estimates."""
        rows = rows_per_layer(stats, num_layers)
        misses = stats.documents.misses + stats.system.misses + stats.prefix_blocks.misses
        load = stats.load
        slow_reads = any(self.tier_kinds.get(name, name) not in ("cpu", "computed") for name in load.bytes_by_tier)
        if rows is not None and not (stats.mode in ("blend", "reuse") and misses) and not slow_reads:
            passed = stats.selection.pass_rows
            if passed:
                first = min(stats.compute_s, max(0.0, stats.selection.selection_s - stats.exposed_load_s))
                self.prefill.observe(passed, first)
                self.prefill.observe(rows, stats.compute_s - first)
            else:
                self.prefill.observe(rows, stats.compute_s)
        if load.bytes_by_tier:
            self.loads.observe(dict(load.bytes_by_tier), dict(load.read_s_by_tier), load.place_s,
                               other_bytes=load.computed_bytes)


def rows_per_layer(stats: RequestStats, num_layers: int) -> list[int] | None:
    """Rows each layer computed in a finished request (blend and reuse: what its layer loop
    recorded, the query pass apart in `stats.selection.pass_rows`; None when unknown)."""
    n = stats.context_tokens + stats.query_tokens
    if stats.mode == "full":
        return [n] * num_layers
    if stats.mode == "prefix":
        computed = n - stats.loaded_tokens
        return [computed] * num_layers if computed > 0 else None
    if stats.mode in ("blend", "reuse") and stats.selection.layer_rows:
        return list(stats.selection.layer_rows)
    return None
