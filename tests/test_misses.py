"""Misses priced, not paid blindly (blend.planning.misses): a request whose documents all miss
takes the full-prefill plan and harvests them; the plans as priced; a mixed plan harvests from
its computed prefix; harvested entries round-trip every codec and are hit by later requests in
another order; concurrent requests missing one document compute it once; a write already
queued is not queued again."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
import torch

from blend.config import EngineConfig, QuerySelection
from blend.engine.engine import BlendEngine
from blend.planning import misses
from blend.planning.misses import HARVEST, MIXED, STANDALONE, MissPlan, plan_misses
from storage.config import CpuTierConfig
from storage.memory import CpuTier
from storage.stack import TieredStore
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_engine import DOCS, QUESTION

MORE = [
    "The harbour of Lenwick froze over in the winter of 1902, stranding eleven ships for a month. " * 2,
    "Lenwick's mayor at the time, Oskar Brandt, organised sledges to bring coal across the ice.",
]
_MODEL: list[Any] = []


def _model():
    if not _MODEL:
        _MODEL.append(tiny_model("llama", tokenizer=smollm2_tokenizer()))
    return _MODEL[0]


def make_engine(tiers: list[dict] | None = None, *, store: TieredStore | None = None, **knobs: Any) -> BlendEngine:
    tiers = tiers or [{"kind": "cpu", "budget": "64MiB"}]
    knobs.setdefault("split", "off")  # priced by rows: a tiny model's calibration would be noise
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": tiers}, chunk_tokens=24, **knobs)
    return BlendEngine(cfg, model=_model(), store=store)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ---------------------------------------------------------------- harvest
@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_a_request_whose_documents_all_miss_is_a_full_prefill_that_stores_them(tmp_path, codec):
    docs = DOCS + MORE
    tiers = [{"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB", "codec": codec}]
    with make_engine(tiers) as engine:
        cold = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=0.15, max_new_tokens=4)
        full = engine.generate(QUESTION, docs, mode="full", max_new_tokens=4)
        miss = cold.stats.miss
        assert miss.plan == HARVEST and miss.harvested == miss.missed == len(docs) + 1  # the system part too
        assert miss.predicted[HARVEST] < miss.predicted[STANDALONE]
        assert maxdiff(cold.first_token_logprobs, full.first_token_logprobs) < 1e-5  # exact: a full prefill
        assert cold.token_ids == full.token_ids and cold.stats.loaded_tokens == 0
        assert cold.stats.to_dict()["miss_plan"]["plan"] == HARVEST
        counts, deadline = engine.document_kv.background, time.monotonic() + 30
        while counts.done < counts.queued and time.monotonic() < deadline:  # idle: recomputed standalone
            time.sleep(0.02)
        engine.store.flush()
        shuffled = [docs[i] for i in (3, 0, 4, 2, 1)]
        warm = engine.generate(QUESTION, shuffled, mode="blend", recompute_ratio=0.15, max_new_tokens=4)
        assert warm.stats.documents.misses == 0 and warm.stats.documents.hits == len(docs)
        assert warm.stats.miss.plan is None and warm.stats.loaded_tokens > 0
        assert torch.isfinite(warm.first_token_logprobs).all()
        if codec == "none":  # the entries as stored come back bit for bit: the same blend twice
            again = engine.generate(QUESTION, shuffled, mode="blend", recompute_ratio=0.15, max_new_tokens=4)
            assert torch.equal(again.first_token_logprobs, warm.first_token_logprobs)


def test_a_harvested_entry_is_the_standalone_entry_when_its_context_is_the_same():
    """One document after the system part: the full prefill computes it exactly as its standalone
    entry does, so the harvested entry (keys turned back to the standalone position) equals the
    ingested one (float32)."""
    with make_engine(miss_policy="harvest") as harvesting, make_engine() as ingesting:
        prompt = harvesting.build_prompt(QUESTION, [DOCS[0]])
        harvesting.generate(QUESTION, [DOCS[0]], mode="blend", max_new_tokens=1)
        ingesting.ingest([DOCS[0]])
        harvesting.store.flush()
        for key in ingesting.document_kv.keys(prompt.documents[0], prompt):
            ours, theirs = harvesting.store.tiers[0].get(key), ingesting.store.tiers[0].get(key)
            assert ours is not None and theirs is not None and ours.header.pos_start == theirs.header.pos_start
            for (k1, v1), (k2, v2) in zip(ours.layers, theirs.layers, strict=True):
                assert maxdiff(k1, k2) < 1e-5 and maxdiff(v1, v2) < 1e-5


def test_one_missing_document_among_hits_is_computed_on_its_own_and_the_policy_is_obeyed():
    docs = DOCS + MORE
    with make_engine() as engine:
        engine.ingest(docs[:4])
        one = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=0.15, max_new_tokens=2)
        assert one.stats.miss.plan == STANDALONE and one.stats.miss.computed == 1 and one.stats.miss.compute_s > 0
    with make_engine(miss_policy="harvest") as engine:
        engine.ingest(docs[:4])
        forced = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=0.15, max_new_tokens=2)
        assert forced.stats.miss.plan == HARVEST and forced.stats.miss.harvested == 1
    with make_engine(miss_policy="standalone") as engine:
        forced = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=0.15, max_new_tokens=2)
        assert forced.stats.miss.plan == STANDALONE and forced.stats.miss.computed == len(docs) + 1


def test_a_mixed_plan_harvests_its_computed_prefix_and_computes_the_rest(monkeypatch):
    """The first two documents missing, the rest cached: computed in every layer as the blend's
    prefix and cut out of it; the last missing one on its own. Every entry is then a hit."""
    docs = DOCS + MORE
    with make_engine() as engine:
        engine.ingest([docs[2], docs[3]])
        prompt = engine.build_prompt(QUESTION, docs)
        real = misses.plan_misses

        def mixed(policy, model, prompt, resolution, documents, ratio, selection, num_layers) -> MissPlan:
            looked = resolution.looked
            missed = [i for i, lk in enumerate(looked) if lk.missed]
            assert [looked[i].segment.kind for i in missed] == ["document"] * 3  # the system part was ingested
            real(policy, model, prompt, resolution, documents, ratio, selection, num_layers)  # prices without error
            return MissPlan(MIXED, looked[2].segment.end, (missed[-1],), tuple(missed[:-1]), "forced by the test")

        monkeypatch.setattr("blend.engine.prefill.plan_misses", mixed)
        got = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=0.15, max_new_tokens=2)
        assert got.stats.miss.plan == MIXED and got.stats.miss.harvested == 2 and got.stats.miss.computed == 1
        assert got.stats.split.computed_tokens == prompt.documents[1].end
        monkeypatch.setattr("blend.engine.prefill.plan_misses", real)
        engine.store.flush()
        warm = engine.generate(QUESTION, docs, mode="blend", recompute_ratio=0.15, max_new_tokens=2)
        assert warm.stats.documents.misses == 0 and warm.stats.system.misses == 0


def test_plans_are_priced_by_the_cost_model():
    """By rows (no cost model): every document missing is dearer on its own than one full
    prefill; one missing among hits is cheaper; the result does not change between calls."""
    with make_engine() as engine:
        docs = DOCS + MORE
        prompt = engine.build_prompt(QUESTION, docs)
        cached = [i for i, s in enumerate(prompt.segments) if s.kind != "query"]
        sel = QuerySelection()
        cold = engine.document_kv.lookup(prompt, cached)
        plans = [plan_misses("auto", None, prompt, cold, engine.document_kv, 0.15, sel, engine.runner.num_layers)
                 for _ in range(2)]
        assert plans[0] == plans[1] and plans[0].kind == HARVEST and plans[0].fresh == len(prompt)
        engine.ingest(docs[:4])
        engine.store.flush()
        warm = engine.document_kv.lookup(prompt, cached)
        plan = plan_misses("auto", None, prompt, warm, engine.document_kv, 0.15, sel, engine.runner.num_layers)
        assert plan.kind == STANDALONE and len(plan.standalone) == 1 and plan.fresh == 0
        with pytest.raises(ValueError, match="miss_policy must be one of auto, standalone, harvest"):
            plan_misses("fast", None, prompt, warm, engine.document_kv, 0.15, sel, engine.runner.num_layers)


def test_the_config_checks_the_policy():
    with pytest.raises(ValueError, match="miss_policy"):
        EngineConfig().with_overrides(miss_policy="sometimes")


# ------------------------------------------------------------------ one computation
class SlowWrites:
    """A tier whose puts take `seconds` (a writer still busy when the next request looks up)."""

    def __init__(self, inner: Any, seconds: float):
        self.inner, self.seconds, self.puts = inner, seconds, 0
        self.name, self.config = inner.name, inner.config

    def put(self, key: str, entry: Any) -> None:
        self.puts += 1
        time.sleep(self.seconds)
        self.inner.put(key, entry)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_concurrent_requests_missing_one_document_compute_it_once():
    docs = DOCS + MORE[:1]
    alone = []
    for i in range(4):
        with make_engine() as engine:
            engine.ingest(DOCS)
            alone.append(engine.generate(f"{QUESTION} ({i})", docs, mode="blend", recompute_ratio=0.15,
                                         max_new_tokens=3))
    slow = SlowWrites(CpuTier(CpuTierConfig(budget=64 << 20)), 0.3)
    with make_engine(store=TieredStore([slow], kv_dtype="float32")) as engine:
        engine.ingest(DOCS)
        engine.store.flush()
        got = engine.generate_many([{"query": f"{QUESTION} ({i})", "documents": docs, "mode": "blend",
                                     "recompute_ratio": 0.15, "max_new_tokens": 3} for i in range(4)])
        engine.store.flush()
    assert sum(r.stats.miss.computed for r in got) == 1  # one computation ...
    assert sum(r.stats.miss.deduplicated for r in got) == 3  # ... the others waited for its write
    for ours, theirs in zip(got, alone, strict=True):
        assert maxdiff(ours.first_token_logprobs, theirs.first_token_logprobs) < 1e-5
        assert ours.token_ids == theirs.token_ids


class HeldWrites(SlowWrites):
    """A tier whose first put waits until `release` is set: the writer is busy while the test queues."""

    def __init__(self, inner: Any):
        super().__init__(inner, 0.0)
        self.release = threading.Event()

    def put(self, key: str, entry: Any) -> None:
        if self.puts == 0:
            assert self.release.wait(10)
        super().put(key, entry)


def test_a_write_already_queued_is_not_queued_again():
    held = HeldWrites(CpuTier(CpuTierConfig(budget=64 << 20)))
    store = TieredStore([held], kv_dtype="float32")
    try:
        from eval.bench.load import ChunkShape, random_entry

        _, entry = random_entry(ChunkShape(layers=2, kv_heads=2, head_dim=8, tokens=4, kv_dtype="float32"), seed=1)
        store.put("d-first", entry)  # the writer holds this one ...
        store.put("d-key", entry)
        store.put("d-key", entry)  # ... while this key is still queued: not queued again
        harvested = dataclasses.replace(entry, header=dataclasses.replace(entry.header, origin="harvested"))
        store.put("d-key", harvested)  # computed otherwise: queued (the later one wins)
        held.release.set()
        store.flush()
        assert store.puts_deduplicated == 1 and held.puts == 3
        assert held.get("d-key").header.origin == "harvested"
        assert store.stats()[held.name]["write_s"] > 0
    finally:
        store.close()


def test_rows_over_a_long_context_are_priced_by_their_attention_pairs():
    """LayerCost.with_pairs: a plain prefill's own pairs cost nothing more; every pair past them
    costs pair_s (past the largest point, rows over its length are what it included); the
    calibration measures pair_s."""
    from blend.model.runner import Runner
    from blend.planning.planner import LayerCost, measure_layer_cost

    cost = LayerCost([(100.0, 1.0), (400.0, 4.0)], pair_s=1e-3)
    assert cost.with_pairs(100, 100 * 101 / 2) == pytest.approx(1.0)
    assert cost.with_pairs(100, 100 * 101 / 2 + 500) == pytest.approx(1.5)
    assert cost.with_pairs(800, 800 * 401 / 2) == pytest.approx(8.0)  # the largest point's length: included
    assert cost.with_pairs(800, 800 * 801 / 2) == pytest.approx(8.0 + 1e-3 * 800 * 400 / 2)
    assert LayerCost([(100.0, 1.0)]).with_pairs(100, 1e9) == 1.0  # no pair price (live estimates)
    calibrated = measure_layer_cost(Runner(_model()))
    assert calibrated.pair_s > 0 and calibrated.points


# ------------------------------------------------------------ harvested entries
def test_harvested_entries_say_so_and_are_recomputed_on_their_own_when_idle():
    """A harvested entry's header says `origin: harvested`; once the scheduler has nothing else to
    do it recomputes the document alone and stores the standalone entry in its place (counted);
    with recompute_harvested false the harvested entries stay."""
    docs = DOCS + MORE[:1]
    with make_engine(miss_policy="harvest") as engine, make_engine() as ingesting:
        prompt = engine.build_prompt(QUESTION, docs)
        engine.generate(QUESTION, docs, mode="blend", max_new_tokens=1)
        deadline = time.monotonic() + 30
        counts = engine.document_kv.background
        steps = engine.scheduler.metrics
        while (counts.done < counts.queued or counts.queued == 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        engine.store.flush()
        assert counts.queued == counts.done == len(docs) + 1 and counts.dropped == 0
        assert steps.background_steps >= counts.done and steps.background_s > 0
        ingesting.ingest(docs)
        ingesting.store.flush()
        for seg in prompt.documents:
            for key in engine.document_kv.keys(seg, prompt):
                ours, theirs = engine.store.tiers[0].get(key), ingesting.store.tiers[0].get(key)
                assert ours.header.origin == "" and theirs.header.origin == ""
                for (k1, v1), (k2, v2) in zip(ours.layers, theirs.layers, strict=True):
                    assert maxdiff(k1, k2) < 1e-5 and maxdiff(v1, v2) < 1e-5
    with make_engine(miss_policy="harvest", recompute_harvested=False) as engine:
        engine.generate(QUESTION, docs, mode="blend", max_new_tokens=1)
        time.sleep(0.3)
        engine.store.flush()
        prompt = engine.build_prompt(QUESTION, docs)
        key = engine.document_kv.keys(prompt.documents[1], prompt)[0]
        assert engine.store.tiers[0].get(key).header.origin == "harvested"
        assert engine.scheduler.metrics.background_steps == 0 and engine.document_kv.background_pending()


def test_a_plan_waiting_for_the_background_plans_entries_lifts_it_out_of_its_share():
    """The background plan claims the blocks it recomputes; a plan that asks for one of them
    (`computing`, then it waits) marks it awaited, and the scheduler then runs it first in every
    step whatever its share is (no request waits at background priority). Its end clears both."""
    from blend.engine.scheduler import _Slot

    docs = DOCS + MORE[:1]
    with make_engine(miss_policy="harvest", recompute_harvested=True, background_share=0.0) as engine:
        cache, sched = engine.document_kv, engine.scheduler

        def check():
            prompt = engine.build_prompt(QUESTION, docs)
            cache._background.clear()  # only the one queued below
            seg = prompt.documents[0]
            ids, context = list(seg.token_ids), cache.context(seg, prompt)
            cache._queue_standalone(cache.lookup(prompt, [1]).looked[0].rebuild)
            plan = cache.background_plan()
            first = plan.take()  # its blocks claimed; its pass wanted
            keys = [b.key for b in cache.blocks(ids, context)]
            assert isinstance(first, list) and not cache.background_awaited()
            assert cache.computing(keys) and cache.background_awaited()
            sched._bg = _Slot(None, plan, background=True)
            sched._busy_s, sched.metrics.background_s = 10.0, 5.0  # far over its share (0)
            step = sched.schedule()
            assert step.background and step.awaited  # busy (this very task), over its share: it runs, first
            plan.close()
            assert not cache.computing(keys) and not cache.background_awaited()
            assert not sched.schedule().awaited
            sched._bg = None

        engine.generate(QUESTION, docs, mode="full", max_new_tokens=1)  # the scheduler's thread runs
        engine.run_exclusive(check)


def test_a_failure_of_the_loop_releases_the_plans_claims_and_the_next_request_is_served():
    """The scheduler's loop fails (an error out of the forward pass itself, as out of memory would)
    while a blend computes its missing documents (their blocks claimed): the request fails with
    the error, its plan is closed (its claims released), and the next request for the same
    documents is served instead of waiting for a claim nobody holds."""
    docs = DOCS + MORE[:1]
    with make_engine(miss_policy="standalone") as engine:
        engine.ingest(DOCS[:1])
        prompt = engine.build_prompt(QUESTION, docs)
        keys = [b.key for i in (2, 3) for b in engine.document_kv.segment_blocks(prompt)[i]]
        forward, claimed = engine.runner.forward, []

        def failing(items):
            if not claimed:  # the first pass: the missing documents' (their blocks claimed)
                claimed.append(engine.document_kv.computing(keys))
                raise RuntimeError("out of memory (test)")
            return forward(items)

        engine.runner.forward = failing
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.generate(QUESTION, docs, mode="blend", max_new_tokens=1)
        assert claimed == [True] and not engine.document_kv.computing(keys)
        got: list = []  # (a claim left behind would make it wait for ever: a thread, a bounded join)
        served = threading.Thread(target=lambda: got.append(engine.generate(QUESTION, docs, mode="blend",
                                                                            max_new_tokens=2)), daemon=True)
        served.start()
        served.join(60)
        assert got and got[0].token_ids and got[0].stats.miss.computed == len(docs) - 1


def test_the_origin_round_trips_and_an_unknown_one_is_corrupt():
    import dataclasses

    from eval.bench.load import ChunkShape, random_entry
    from storage.entry import CorruptEntry
    from storage.serialization import decode_header, encode_header

    _, entry = random_entry(ChunkShape(layers=2, kv_heads=2, head_dim=8, tokens=4, kv_dtype="float32"), seed=1)
    assert b"origin" not in encode_header(entry.header)  # a standalone header as it always was
    harvested = dataclasses.replace(entry.header, origin="harvested")
    assert decode_header(encode_header(harvested)).origin == "harvested"
    with pytest.raises(CorruptEntry, match="origin"):
        decode_header(encode_header(dataclasses.replace(entry.header, origin="forged")))


def test_a_failing_background_plan_fails_no_request():
    from blend.model.plan import Once

    class Broken:
        def __init__(self):
            self.calls = 0

        def background_pending(self) -> bool:
            return self.calls < 2

        def background_awaited(self) -> bool:
            return False

        def background_plan(self):
            self.calls += 1
            return self._plan()

        def _plan(self):
            return Once(lambda: (_ for _ in ()).throw(OSError("the store went away")))

        def drop_background(self) -> int:
            return 0

    with make_engine() as engine:
        broken = Broken()
        engine.scheduler._background = broken  # the engine's own is the DocumentCache
        engine.generate(QUESTION, DOCS, mode="blend", max_new_tokens=1)  # starts the scheduler's thread
        deadline = time.monotonic() + 10
        while broken.calls < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert broken.calls == 2
        got = engine.generate(QUESTION, DOCS, mode="blend", max_new_tokens=2)
        assert got.token_ids and engine.scheduler.metrics.failed == 0


def test_harvested_entries_are_recomputed_while_a_stream_of_two_clients_goes_on():
    """Two closed-loop clients keep sending blend requests (each the next as the last ends, so the
    machine is never idle between them); the harvested documents are recomputed standalone within
    the background share of the busy steps, counted, while the requests go on and answer."""
    import threading

    docs = DOCS + MORE[:1]
    with make_engine(miss_policy="harvest", prefill_chunk_tokens=16, background_share=0.3) as engine:
        engine.generate(QUESTION, docs, mode="blend", max_new_tokens=1)  # harvests every document
        counts, metrics = engine.document_kv.background, engine.scheduler.metrics
        queued, answers, stop = counts.queued, [], threading.Event()

        def client(offset: int) -> None:
            i = offset
            while not stop.is_set() and len(answers) < 60:
                answers.append(engine.generate(QUESTION, DOCS[i % 2:], mode="reuse", max_new_tokens=12))
                i += 1

        clients = [threading.Thread(target=client, args=(i,)) for i in range(2)]
        for t in clients:
            t.start()
        deadline = time.monotonic() + 60
        while counts.done < queued and time.monotonic() < deadline:
            time.sleep(0.02)
        busy_steps = metrics.background_busy_steps
        stop.set()
        for t in clients:
            t.join(60)
    assert queued == len(docs) + 1 and counts.done == queued  # every harvested document recomputed
    assert busy_steps > 0  # ... within the busy steps, beside the clients' requests
    assert answers and all(a.token_ids for a in answers)
