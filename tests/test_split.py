"""The load-or-compute split: a tier slowed on purpose makes the engine compute a prefix
while the rest loads; results equal the unsplit path's; the plan never predicts more
than a full prefill; the cost model's fit."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.planning.planner import LayerCost, LoadCosts, PrefillCosts
from blend.planning.split import MIN_GAIN, Splitter, simulate
from blend.stats import LookupTally
from storage.config import CpuTierConfig
from storage.entry import EntryHeader, KVEntry
from storage.memory import CpuTier
from storage.stack import TieredStore
from tests.models import smollm2_tokenizer, tiny_model

DOCS = [f"Passage {i}: the harbour of Vell Corran shipped {i * 7} tons of slate to Ostend in the year "
        f"{1800 + i}, and the lighthouse keeper wrote it down in a blue ledger. " * 2 for i in range(6)]
QUESTION = "How many tons did the harbour ship?"


class SlowTier:
    """A tier whose reads take nbytes / bytes_per_s longer (a test wrapper: a slow disk)."""

    def __init__(self, inner: Any, bytes_per_s: float = float("inf")):
        self.inner, self.bytes_per_s = inner, bytes_per_s
        self.name, self.config = inner.name, inner.config

    def _delay(self, nbytes: int) -> None:
        if self.bytes_per_s != float("inf"):
            time.sleep(nbytes / self.bytes_per_s)

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None):
        got = self.inner.get_layer(key, layer, header)
        if got is not None:
            self._delay(got[0].nbytes * 2)
        return got

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None):
        return [self.get_layer(key, i, header) for i in layers]

    def read_layer_into(self, key: str, layer: int, header: EntryHeader | None, out: torch.Tensor) -> bool:
        ok = self.inner.read_layer_into(key, layer, header, out)
        if ok:
            self._delay(out.numel())
        return ok

    def __getattr__(self, name: str) -> Any:  # contains, get_header, put, delete, keys, clear, close, stats
        return getattr(self.inner, name)


def make_engine(slow: SlowTier, split: str, selection: str = "query", **knobs: Any) -> BlendEngine:
    lm = _model()
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                        chunk_tokens=48, split=split, selection=selection, **knobs)
    return BlendEngine(cfg, model=lm, store=TieredStore([slow], kv_dtype="float32"))


_MODEL: list[Any] = []


def _model():
    if not _MODEL:
        _MODEL.append(tiny_model("llama", tokenizer=smollm2_tokenizer(), hidden_size=128, intermediate_size=256))
    return _MODEL[0]


def store_exact_entries(engine: BlendEngine) -> None:
    """Store every cached block's KV as computed in its place in the prompt, keys rotated to
    the position the block's entry records (loading it then equals computing it, to
    rounding), so that any split and any selection give the full prefill's answer."""
    prompt = engine.build_prompt(QUESTION, DOCS)
    ids = prompt.token_ids
    docs, runner = engine.document_kv, engine.runner
    maker = docs.maker
    for seg in prompt.segments:
        if seg.kind == "query":
            continue
        blocks = docs.blocks(list(seg.token_ids), docs.context(seg, prompt))
        exact = maker.compute_blocks(seg.token_ids, ids[: seg.start], [(b.start, b.end) for b in blocks])
        for block, entry in zip(blocks, exact, strict=True):
            shift = block.pos_start - (seg.start + block.start)
            layers = [(runner.rerotate(k, shift), v) for k, v in entry.layers]
            stored = KVEntry.from_tensors(layers, fingerprint=maker.fingerprint,
                                          token_ids=seg.token_ids[block.start:block.end],
                                          pos_start=block.pos_start, kv_dtype=maker.kv_dtype)
            engine.store.put(block.key, stored, sync=True)


@pytest.fixture
def one_thread():
    """One compute thread: on a busy 2-core machine spinning thread pools make timings erratic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def proportional_compute(engine: BlendEngine, full_s: float, n: int) -> None:
    """Pin the engine's compute estimate to the measured full prefill, proportional to rows (a
    tiny model's per-layer overhead is noise on a busy machine; the plan is then deterministic)."""
    per_row = full_s / (engine.runner.num_layers * n)
    engine.splitter.prefill.layer_cost = lambda: LayerCost([(1.0, per_row)])


@pytest.mark.parametrize(("ratio", "selection"), [(0.0, "query"), (0.3, "hybrid"), (0.3, "query")])
def test_slow_tier_takes_the_split_and_answers_like_the_unsplit_path(ratio, selection, one_thread):
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    with make_engine(slow, "adaptive", selection) as engine, make_engine(slow, "off", selection) as unsplit_engine:
        store_exact_entries(engine)
        for _ in range(2):  # warm-up
            full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=4)
        proportional_compute(engine, full.ttft_s, full.stats.context_tokens + full.stats.query_tokens)
        # bytes measured through the other engine: the split engine's load estimate then holds
        # only the slow reads below (its running average would otherwise halve them)
        nbytes = unsplit_engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=1).stats.bytes_loaded
        slow.bytes_per_s = nbytes / (2 * full.ttft_s)  # loading everything: ~2x a full prefill
        unsplit = unsplit_engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=ratio, max_new_tokens=4)
        assert not unsplit.stats.split.taken and unsplit.stats.split.reason.startswith("off")
        engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=ratio, max_new_tokens=1)  # measures the slow reads
        split = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=ratio, max_new_tokens=4)
    report = split.stats.split
    if ratio > 0 and selection == "query":
        # a query pass and the recompute after it do not overlap: a load-bound query-driven
        # blend computes everything (a full prefill) rather than a prefix
        assert report.taken and report.computed_tokens == split.stats.context_tokens, report
        assert split.stats.loaded_tokens == 0 and report.loaded_tokens == 0
    else:
        # a prefix (on a quiet machine); on an oversubscribed one the placement estimate can
        # grow until computing everything is the cheapest plan, which is then taken
        assert report.taken and 0 < report.computed_tokens <= split.stats.context_tokens, report
        assert report.loaded_tokens == split.stats.loaded_tokens
        assert report.computed_tokens + report.loaded_tokens == split.stats.context_tokens
    assert split.stats.recomputed_tokens >= report.computed_tokens
    # the plan: loading everything predicted slower than a full prefill, the split within 10% of one
    assert report.predicted_unsplit_s > report.predicted_full_s
    assert report.predicted_s <= 1.1 * report.predicted_full_s
    assert split.stats.to_dict()["split"]["taken"] is True
    # same answer as the unsplit path (and as full prefill: the stored entries are exact)
    assert split.token_ids == unsplit.token_ids == full.token_ids
    assert (split.first_token_logprobs - unsplit.first_token_logprobs).abs().max() < 1e-4
    assert (split.first_token_logprobs - full.first_token_logprobs).abs().max() < 1e-4


def test_prefix_mode_computes_the_first_blocks_while_the_rest_loads(one_thread):
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    with make_engine(slow, "adaptive") as engine, make_engine(slow, "off") as unsplit_engine:
        for _ in range(2):
            full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=4)
        proportional_compute(engine, full.ttft_s, full.stats.context_tokens + full.stats.query_tokens)
        first = engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=1)  # stores the prefix blocks
        engine.store.flush()
        nbytes = unsplit_engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=1).stats.bytes_loaded
        slow.bytes_per_s = nbytes / (2 * full.ttft_s)  # loading the blocks: ~2x a full prefill
        unsplit = unsplit_engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=4)
        engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=1)  # measures the slow reads
        split = engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=4)
    assert first.stats.stored_blocks > 0 and unsplit.stats.loaded_tokens > 0
    report = split.stats.split
    assert report.taken and report.computed_tokens > 0 and report.computed_tokens % 48 == 0, report
    assert 0 < split.stats.loaded_tokens == unsplit.stats.loaded_tokens - report.computed_tokens
    assert report.predicted_s <= 1.1 * report.predicted_full_s < report.predicted_unsplit_s
    # prefix blocks are exact: computing them or loading them gives the same answer
    assert split.token_ids == unsplit.token_ids == full.token_ids
    assert (split.first_token_logprobs - unsplit.first_token_logprobs).abs().max() < 1e-4


def test_fast_tier_keeps_loading_everything(one_thread):
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    with make_engine(slow, "auto") as engine:
        engine.ingest(DOCS)
        engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=1)
        engine.generate(QUESTION, DOCS, mode="blend", max_new_tokens=1)
        result = engine.generate(QUESTION, DOCS, mode="blend", max_new_tokens=1)
    report = result.stats.split
    assert not report.taken and report.computed_tokens == 0 and report.reason
    assert result.stats.loaded_tokens == result.stats.context_tokens


def test_cost_model_fit_and_plan_arithmetic():
    prefill = PrefillCosts()
    assert prefill.layer_cost() is None
    for rows in (100, 400, 1000):  # 1 ms per layer + 10 us per row
        prefill.observe([rows] * 4, 4 * (1e-3 + 1e-5 * rows))
    cost = prefill.layer_cost()
    for rows in (100, 400, 700, 1000):  # through the points, linear between them
        assert cost(rows) == pytest.approx(1e-3 + 1e-5 * rows, rel=1e-6)
    # below the smallest: proportional to rows (optimistic until a small request is seen, so
    # that a process that only ran full prefills still loads rather than computes)
    assert cost(10) == pytest.approx(cost(100) / 10)
    assert cost(2000) == pytest.approx(2 * cost(1000))  # above the largest: proportional to rows
    prefill.observe([400] * 4, 4 * 9e-3)  # a slow run (cold start, busy moment) moves it only half way up
    assert prefill.layer_cost()(400) == pytest.approx((5e-3 + 9e-3) / 2)
    prefill.observe([410] * 4, 4 * 3e-3 * 410 / 400)  # a faster run of about that size is believed at once
    assert prefill.layer_cost()(400) == pytest.approx(3e-3)
    loads = LoadCosts("cpu")
    loads.observe({"disk": 4 << 20}, {"disk": 0.004}, 0.001)
    assert loads.read_seconds("disk", "disk", 1 << 20) == pytest.approx(0.001)
    loads.observe({"disk": 4 << 20}, {"disk": 0.4}, 0.001)  # the tier turned slow: believed at once
    assert loads.read_seconds("disk", "disk", 1 << 20) > 0.04
    assert loads.read_seconds("redis", "redis", 10**9) == pytest.approx(1.0)  # the prior
    # compute 1 s per layer, load 2 s per layer from layer 0: compute waits for every load
    total, compute, load = simulate([1, 1, 1], 2.0, 0, (0.0, 1.0))
    assert (total, compute, load) == (7.0, 3.0, 6.0)
    assert simulate([1, 1, 1], 2.0, 3, (0.0, 1.0)) == (3.0, 3.0, 0.0)


@pytest.mark.parametrize("selection", ["query", "hybrid", "deviation"])
@pytest.mark.parametrize("ratio", [0.0, 0.3, 1.0])
def test_the_plan_the_split_prices_is_the_plan_that_runs(selection, ratio):
    """One plan, worked out once: the rows per layer `RecomputePlan.layer_rows` predicts (what
    the split prices) are the rows the layer loop computed, and the stats carry them."""
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    pool = {"query_pool": 2.0, "check_layers": [1, 2], "filter_schedule": [1.5, 1.0]} if selection == "query" else {}
    with make_engine(slow, "off", selection, **pool) as engine:
        store_exact_entries(engine)
        prompt = engine.build_prompt(QUESTION, DOCS)
        from blend.recompute.plan import plan_recompute

        tally = LookupTally([t.name for t in engine.store.tiers])
        placements = engine.document_kv.resolve(prompt, [s for s in prompt.segments if s.kind != "query"], tally)
        sel, layers = engine.config.engine.blend.selection, engine.runner.num_layers
        plan = plan_recompute(prompt, ratio, sel, layers, placements=placements)
        ran = engine.prefill(prompt, mode="blend", ratio=ratio).stats.selection
        assert ran.layer_rows == plan.layer_rows(layers) and ran.pass_rows == plan.pass_rows()
        assert len(ran.layer_rows) == layers and (ran.pass_rows != ()) == (selection == "query" and 0 < ratio < 1)


@pytest.mark.parametrize("selection", ["query", "hybrid"])
def test_a_computed_prefix_inside_any_plan_equals_full_prefill(selection):
    """plan_recompute + run_layers with the split's computed prefix (fresh rows) ending inside
    a document, for the query pass and for check-layer policies: with exact stored entries
    the first-token logits equal a full prefill's (fp32)."""
    from blend.kv.loader import LayerLoader
    from blend.recompute.layers import run_layers
    from blend.recompute.plan import plan_recompute

    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    with make_engine(slow, "off", selection) as engine:
        store_exact_entries(engine)
        prompt = engine.build_prompt(QUESTION, DOCS)
        full = engine.prefill(prompt, mode="full").logits
        tally = LookupTally([t.name for t in engine.store.tiers])
        placements = engine.document_kv.resolve(prompt, [s for s in prompt.segments if s.kind != "query"], tally)
        boundaries = [p.start + p.length for p in placements if p.start > 0]
        fresh = boundaries[len(boundaries) // 2]  # a block boundary in the middle of the context
        assert not any(s.start == fresh for s in prompt.segments)  # inside a document
        cfg, runner = engine.config.engine.blend, engine.runner
        assert cfg.selection.policy == selection
        for ratio in (0.0, 0.3):
            plan = plan_recompute(prompt, ratio, cfg.selection, runner.num_layers, placements=placements, fresh=fresh)
            assert plan.fresh_rows.numel() == fresh and int(plan.ctx_rows.min()) == fresh
            cache = runner.new_cache(len(prompt))
            cache.length = plan.n
            loaded = [p for p in placements if p.start >= fresh]
            with LayerLoader(engine.store, runner, cache, loaded, range(plan.load_from, runner.num_layers),
                             cfg.prefetch_depth) as loader:
                logits, chosen = run_layers(runner, cache, torch.tensor(prompt.token_ids), plan, loader,
                                            policy=selection, deviation_kind=cfg.selection.deviation)
            assert (logits - full).abs().max() < 1e-3, (ratio, float((logits - full).abs().max()))
            if ratio > 0:
                assert chosen.recomputed_tokens > 0 and all(int(c.min()) >= fresh for c in chosen.selected_rows)


def test_after_full_prefills_only_a_fast_tier_blend_still_loads(one_thread):
    """A process whose cost model has seen only full prefills (demo, eval) must not take the
    query pass + recompute for more than a full prefill: it loads."""
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))  # not slowed
    with make_engine(slow, "adaptive", "query") as engine:
        store_exact_entries(engine)
        for _ in range(3):
            engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=1)
        blend = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.15, max_new_tokens=1)
        assert not blend.stats.split.taken, blend.stats.split
        assert blend.stats.selection.query_pass and blend.stats.loaded_tokens > 0


def test_a_blend_that_loaded_nothing_is_observed_as_a_full_prefill():
    """Ratio 1 runs as a full prefill through the blend path: its time must be attributed to
    every row, not to the query rows (that made small requests look as slow as a full one)."""
    from blend.planning.split import rows_per_layer
    from blend.stats import RequestStats, SelectionReport

    full_plan = RequestStats(mode="blend", recompute_ratio=1.0, context_tokens=90, query_tokens=10,
                             loaded_tokens=0, recomputed_tokens=90,
                             selection=SelectionReport(recomputed_tokens=90, layer_rows=(100,) * 4))
    assert rows_per_layer(full_plan, 4) == [100] * 4
    reuse = RequestStats(mode="reuse", recompute_ratio=0.0, context_tokens=90, query_tokens=10, loaded_tokens=90,
                         recomputed_tokens=0, selection=SelectionReport(layer_rows=(10,) * 4))
    assert rows_per_layer(reuse, 4) == [10] * 4
    query = RequestStats(mode="blend", recompute_ratio=0.2, context_tokens=90, query_tokens=10, loaded_tokens=90,
                         recomputed_tokens=18, selection=SelectionReport((0,), (18,), 18, query_pass=True,
                                                                          pass_rows=(10,) * 4, layer_rows=(28,) * 4))
    assert rows_per_layer(query, 4) == [28] * 4  # the query pass is observed apart (pass_rows)


def test_a_slow_small_sample_does_not_make_larger_requests_look_slower():
    # full prefills measured at 3,000 rows: 3 ms per layer; a cold call at 300 rows took 8 ms
    cost = LayerCost([(300.0, 8e-3), (3000.0, 3e-3), (100.0, 1e-3)])
    assert cost(3000) == pytest.approx(3e-3)  # the measured size keeps its measured time
    assert cost(300) == pytest.approx(3e-3)  # capped: more rows never cost less
    assert cost(100) == pytest.approx(1e-3)  # smaller points below the cap are kept
    assert cost(6000) == pytest.approx(6e-3)  # above the largest: proportional to rows
    assert all(a[1] <= b[1] for a, b in zip(cost.points, cost.points[1:], strict=False))


def test_loading_predicted_slower_than_full_prefill_computes_even_for_a_small_gain():
    """When loading everything is predicted slower than a full prefill, a plan that saves
    less than MIN_GAIN of it is still taken (never slower than no cache); when loading is
    predicted faster than a full prefill, the MIN_GAIN margin holds."""
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    with make_engine(slow, "off", "query") as engine:
        store_exact_entries(engine)
        prompt = engine.build_prompt(QUESTION, DOCS)
        tally = LookupTally([t.name for t in engine.store.tiers])
        placements = engine.document_kv.resolve(prompt, [s for s in prompt.segments if s.kind != "query"], tally)
        layers, cfg = engine.runner.num_layers, engine.config.engine
    n = len(prompt)
    nbytes = sum(p.header.layer_nbytes for p in placements) * layers
    # a launch-bound layer (a GPU's at these sizes): 1 ms for 30 rows as for all of them, so
    # computing a prefix while the rest loads saves little and computing everything is the
    # only plan that beats loading everything
    prefill = PrefillCosts()
    for rows in (30, n):
        prefill.observe([rows] * layers, layers * 1e-3)
    seen = {"inside the margin": 0, "below full": 0}
    for step in range(60):  # reads of everything from 0.3x to ~1.8x a full prefill
        loads = LoadCosts("cpu")
        read_s = (0.3 * 1.03 ** step) * layers * 1e-3
        loads.observe({"cpu": nbytes}, {"cpu": read_s}, 1e-6 * read_s)  # placement: negligible
        splitter = Splitter(prefill, loads, {"cpu": "cpu"}, mode="adaptive")
        report = splitter.plan(prompt, placements, 0.0, cfg.blend.selection, layers).report
        unsplit, full = report.predicted_unsplit_s, report.predicted_full_s
        if full < unsplit < full / (1 - MIN_GAIN):
            seen["inside the margin"] += 1
            assert report.taken and report.predicted_s < unsplit, report
        elif unsplit < full:
            seen["below full"] += 1
            if report.taken:
                assert report.predicted_s <= (1 - MIN_GAIN) * unsplit, report
        assert not report.taken or report.predicted_s <= min(unsplit, full) + 1e-12, report
    assert seen["inside the margin"] >= 1 and seen["below full"] >= 1, seen


def test_a_query_driven_blend_is_observed_as_its_two_phases():
    """The query pass (query rows in every layer, timed as the selection less the load waits)
    and the recompute (selection + query) are two samples of the compute model, not one
    average of both."""
    from blend.stats import LoadReport, RequestStats, SelectionReport

    stats = RequestStats(mode="blend", recompute_ratio=0.2, context_tokens=90, query_tokens=10, loaded_tokens=90,
                         recomputed_tokens=18, prefill_s=1.0,
                         load=LoadReport(exposed_load_s=0.1, bytes_by_tier={"cpu": 1 << 20}),
                         selection=SelectionReport((0,), (18,), 18, selection_s=0.4, query_pass=True,
                                                   pass_rows=(10,) * 4, layer_rows=(28,) * 4))
    prefill = PrefillCosts()
    Splitter(prefill, LoadCosts("cpu"), {"cpu": "cpu"}, mode="adaptive").observe(stats, 4)
    cost = prefill.layer_cost()
    assert cost(10) == pytest.approx((0.4 - 0.1) / 4)  # the query pass: 10 rows per layer
    assert cost(28) == pytest.approx((0.9 - 0.3) / 4)  # the recompute: 18 + 10 rows per layer


@pytest.mark.parametrize("mode", ["blend", "reuse", "prefix"])
def test_a_tier_too_slow_to_wait_for_is_given_up_and_the_request_computed_whole(mode):
    """A read that takes longer than load_stall_s: the request does not wait for it; it is
    computed like a full prefill and says which tier stalled."""
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    lm = _model()
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                        chunk_tokens=48, split="off", load_stall_s=0.2)
    with BlendEngine(cfg, model=lm, store=TieredStore([slow], kv_dtype="float32")) as engine:
        engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=1)  # stores this prompt's prefix blocks
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=3)
        slow.bytes_per_s = 1e5  # a layer of a block takes ~0.5-1 s
        got = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=3)
        assert got.stats.stalled_tiers == ("cpu",) and got.stats.to_dict()["stalled_tiers"] == ["cpu"]
        assert got.token_ids == full.token_ids
        assert torch.allclose(got.first_token_logprobs, full.first_token_logprobs, atol=1e-4)
        slow.bytes_per_s = float("inf")
        again = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=1)
        assert again.stats.stalled_tiers == () and again.stats.loaded_tokens > 0


def test_a_chat_turn_resumed_from_a_stalling_tier_is_computed(tmp_path):
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                        chunk_tokens=16, split="off", load_stall_s=0.2, sessions_dir=str(tmp_path))
    with BlendEngine(cfg, model=_model(), store=TieredStore([slow], kv_dtype="float32")) as engine:
        engine.chat("s", DOCS[0] + " What was shipped?", max_new_tokens=3)
        engine.chat("t", DOCS[0] + " What was shipped?", max_new_tokens=3)
        engine.offload("s")
        engine.offload("t")
        resumed = engine.chat("t", "And when?", max_new_tokens=3)
        assert resumed.stats.source == "store" and resumed.stats.stalled_tiers == ()
        slow.bytes_per_s = 2e4
        stalled = engine.chat("s", "And when?", max_new_tokens=3)
        assert stalled.stats.source == "computed" and stalled.stats.stalled_tiers == ("cpu",)
        assert stalled.token_ids == resumed.token_ids


def test_placement_rate_counts_the_computed_entries_it_placed(one_thread):
    """A blend whose documents missed places their computed KV beside the little it read; the
    placement rate must count those bytes (it once came out ~50x too low, and the split then
    computed every later request whole)."""
    loads = LoadCosts("cpu")
    loads.observe({"cpu": 1 << 20}, {"cpu": 1e-3}, place_s=0.1, other_bytes=50 << 20)
    assert loads.place_seconds(51 << 20) == pytest.approx(0.1)
    engine = make_engine(SlowTier(CpuTier(CpuTierConfig(budget=64 << 20))), split="adaptive",
                         miss_policy="standalone")
    try:
        cold = engine.generate(QUESTION, DOCS[:3], mode="blend", recompute_ratio=0.3, max_new_tokens=1).stats
        assert cold.documents.misses == 3 and cold.load.computed_bytes > 0
        engine.store.flush()
        warm = engine.generate(QUESTION, DOCS[:3], mode="blend", recompute_ratio=0.3, max_new_tokens=1).stats
        assert warm.documents.misses == 0 and warm.load.computed_bytes == 0 and sum(warm.load.bytes_by_tier.values())
    finally:
        engine.close()


@pytest.mark.parametrize("mode", ["blend", "prefix"])
def test_a_request_s_own_split_overrides_the_engine_s_for_that_request_only(mode, one_thread):
    """`split="off"` on one request (eval's way): no split, no calibration for it, the same answer
    as an engine configured off; the engine's own split is untouched and serves the next request."""
    slow = SlowTier(CpuTier(CpuTierConfig(budget=64 << 20)))
    with make_engine(slow, "auto") as engine, make_engine(slow, "off") as unsplit_engine:
        store_exact_entries(engine)
        engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=1, split="off")  # prefix mode: stores its blocks
        engine.store.flush()
        off = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4, split="off")
        assert engine.splitter.needs_calibration, "a request whose split is off calibrated the cost model"
        assert off.stats.split.reason == "off (the request's split)" and not off.stats.split.taken
        alike = unsplit_engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4)
        assert alike.stats.split.reason == "off (engine.blend.split)"
        assert off.token_ids == alike.token_ids
        assert (off.first_token_logprobs - alike.first_token_logprobs).abs().max() < 1e-5
        assert engine.splitter.mode == "auto"
        engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=1)  # the engine's own split: auto, calibrated
        assert not engine.splitter.needs_calibration
