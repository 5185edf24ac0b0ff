"""The one step executor (issue 40): a step's rows of several sequences run through the layers
together (`Runner.forward`: linear layers over every row, attention per sequence), a plan's
rows run in chunks with every running sequence's decode row alongside, and a blend pass
pauses between layers for decode steps. None of it changes a number: a request whose prefill
was cut into chunks beside seven decoding sequences gives what it gives alone."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from blend.decode.result import GenerationResult
from blend.engine.engine import BlendEngine
from blend.engine.sequence import Handle
from blend.model.runner import Rows, Runner
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_scheduler import DOCS, QUESTIONS, make_engine


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", tokenizer=smollm2_tokenizer())


# ---------------------------------------------------------------- the runner
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_forward_runs_a_chunked_prefill_beside_decode_rows_as_each_alone(arch):
    """A 90-token prompt prefilled in chunks of 13 rows, each step also carrying 7 other
    sequences' decode rows (one at a ring's wrap on Gemma 3's 16-token sliding layers): the
    chunked prompt's cache and last logits, and every decode row's logits, within 1e-4 of
    the same work done alone (`prefill` whole, `decode_step` per sequence)."""
    runner = Runner(tiny_model(arch, vocab_size=512))
    torch.manual_seed(0)
    prompt = torch.randint(0, 512, (90,))
    others = [torch.randint(0, 512, (n,)) for n in (3, 16, 17, 40, 64, 100, 131)]
    caches, refs = [], []
    for ids in others:
        for group in (caches, refs):
            cache = runner.new_cache(len(ids) + 20)
            runner.prefill(ids, cache)
            group.append(cache)
    alone = runner.new_cache(90)
    expected = runner.prefill(prompt, alone)[0]
    chunked = runner.new_cache(90)
    rows = Rows(prompt, chunked, 0)
    tokens = [int(ids[-1]) for ids in others]
    for a in range(0, 90, 13):
        chunk = rows.chunk(a, min(90, a + 13))
        out = runner.forward([chunk, *[Rows(torch.tensor([t]), c, c.length) for t, c in zip(tokens, caches, strict=True)]])
        single = runner.decode_step(tokens, refs)  # (7, vocab): the same decode rows alone
        assert (torch.stack([o.logits[0] for o in out[1:]]) - single).abs().max().item() < 1e-4
        tokens = [int(x.argmax()) for x in single]
    assert out[0].logits.shape == (1, expected.shape[0])
    assert (out[0].logits[0] - expected).abs().max().item() < 1e-4
    assert chunked.length == alone.length == 90
    for layer in range(runner.num_layers):
        got_k, got_v = chunked.window(layer, 0, 90) if not chunked.is_ring(layer) else chunked.window(layer, 74, 90)
        ref_k, ref_v = alone.window(layer, 0, 90) if not alone.is_ring(layer) else alone.window(layer, 74, 90)
        assert (got_k - ref_k).abs().max().item() < 1e-4 and (got_v - ref_v).abs().max().item() < 1e-4
    assert [c.length for c in caches] == [c.length for c in refs]


def test_rows_chunks_keep_the_wanted_logits_and_refuse_rows_outside():
    runner = Runner(tiny_model("llama", vocab_size=512))
    ids = torch.arange(20)
    whole = runner.new_cache(20)
    expected = runner.prefill(ids, whole, logit_rows=(3, 11, 19))
    rows = Rows(ids, runner.new_cache(20), 0, (3, 11, 19))
    got = [runner.forward([rows.chunk(a, a + 5)])[0].logits for a in range(0, 20, 5)]
    assert [g.shape[0] for g in got] == [1, 0, 1, 1]  # rows 3, 11 and 19 fall in chunks 0, 2 and 3
    assert (torch.cat(got) - expected).abs().max().item() < 1e-4
    assert runner.forward([Rows(ids[:4], runner.new_cache(4), 0, ())])[0].logits.shape == (0, expected.shape[1])
    refused = runner.forward([Rows(ids[:4], runner.new_cache(4), 0, (4,)), Rows(ids[:0], runner.new_cache(4), 0),
                              Rows(ids[:4], runner.new_cache(4), 0)])  # refused items fail alone
    assert "outside" in str(refused[0].error) and "empty prompt" in str(refused[1].error)
    assert refused[2].error is None and refused[2].logits.shape == (1, expected.shape[1])
    with pytest.raises(ValueError, match="outside"):
        runner.prefill(ids[:4], runner.new_cache(4), logit_rows=(4,))


# ------------------------------------------------------------- the scheduler
def _busy(engine: BlendEngine, n: int = 7) -> list[Handle]:
    """`n` long generations, returned once every one of them is decoding."""
    handles = [engine.submit(engine.request(QUESTIONS[i], DOCS[: 1 + i % 3], mode="reuse", max_new_tokens=400))
               for i in range(n)]
    deadline = time.monotonic() + 60
    while engine.scheduler.running < n:
        assert time.monotonic() < deadline, "the busy sequences never all ran"
        time.sleep(0.002)
    return handles


def _assert_same(a: GenerationResult, b: GenerationResult) -> None:
    assert a.token_ids == b.token_ids and a.text == b.text
    assert (a.token_logprobs - b.token_logprobs).abs().max().item() <= 1e-4  # every step's logits
    assert (a.token_logprobs[0] - b.token_logprobs[0]).abs().max().item() <= 1e-5  # the first token's


@pytest.mark.parametrize("mode", ["full", "prefix", "reuse", "blend"])
def test_a_prefill_cut_into_chunks_beside_seven_decoding_sequences_gives_what_it_gives_alone(lm, mode):
    """Greedy float32, chunks of 4 rows: the request's tokens and every step's log-probs as
    when it runs alone (with no chunking). Full and prefix ran their rows in chunks with the
    seven decode rows alongside; reuse and blend ran layer ranges of all their rows, the seven
    decode rows in the same steps."""
    spec = {"mode": mode, "recompute_ratio": 0.3, "max_new_tokens": 12, "logprobs": True}
    question, docs = "Who designed the tidal mill in Ostend?", DOCS
    with make_engine(lm, prefill_chunk_tokens=10**6) as engine:
        engine.ingest(DOCS)
        if mode == "prefix":  # its blocks stored first, as they are for the busy run below
            engine.generate(question, docs, **spec)
        expected = engine.generate(question, docs, **spec)
    with make_engine(lm, prefill_chunk_tokens=4) as engine:
        engine.ingest(DOCS)
        if mode == "prefix":
            engine.generate(question, docs, **spec)
        busy = _busy(engine)
        m = engine.scheduler.metrics
        rode, advances = m.decode_rows_in_prefill_steps, m.prefill_steps
        got = engine.generate(question, docs, **spec)
        rode, advances = m.decode_rows_in_prefill_steps - rode, m.prefill_steps - advances
        alongside = engine.scheduler.running
        for handle in busy:
            handle.cancel()
    assert alongside == 7  # they were still decoding
    _assert_same(expected, got)
    assert 0 < m.decode_only_s < m.decode_s  # the decode-only steps' time, without the rows' share of mixed steps
    if mode == "full":
        assert rode >= 7 * 10  # the prompt's ~100 rows in chunks of 4, 7 decode rows in each
    elif mode == "prefix":
        assert rode >= 7 * 2  # the rows after the loaded blocks, in chunks of 4
    else:  # a layer range per step (4 x layers row-layers), 7 decode rows in each
        assert rode >= 7 * 2 and advances >= 1


def test_a_chat_turn_cut_into_chunks_gives_what_it_gives_alone(lm, tmp_path):
    """A chat turn's exact prefill (the first: computed; the second: the device copy and the
    new rows) in chunks beside seven decoding sequences, against the same turns alone."""
    with make_engine(lm, tmp_path / "a", prefill_chunk_tokens=10**6) as engine:
        engine.ingest(DOCS)
        first = engine.chat("s", "Tell me about the mill. " * 6, max_new_tokens=10)
        second = engine.chat("s", "And the lighthouse? " * 6, max_new_tokens=10)
    with make_engine(lm, tmp_path / "b", prefill_chunk_tokens=4) as engine:
        engine.ingest(DOCS)
        busy = _busy(engine)
        rode = engine.scheduler.metrics.decode_rows_in_prefill_steps
        first_b = engine.chat("s", "Tell me about the mill. " * 6, max_new_tokens=10)
        second_b = engine.chat("s", "And the lighthouse? " * 6, max_new_tokens=10)
        rode = engine.scheduler.metrics.decode_rows_in_prefill_steps - rode
        for handle in busy:
            handle.cancel()
    assert rode >= 7 * 10
    for a, b in ((first, first_b), (second, second_b)):  # (a chat turn has no log-probs to compare)
        assert a.token_ids == b.token_ids and a.text == b.text and a.stats.mode == b.stats.mode


def test_a_plan_whose_rows_are_refused_fails_alone_and_the_decode_rows_go_on(lm):
    """Rows the executor refuses (a prompt past the model's positions, reached only in the
    executor here) end that request with the error; the sequences decoding beside it lose
    no token and end as they would have."""
    from blend.engine.sequence import Finished, Task
    from blend.model.plan import PlanCursor

    with make_engine(lm, prefill_chunk_tokens=4) as engine:
        engine.ingest(DOCS)
        expected = engine.generate(QUESTIONS[0], DOCS[:1], mode="reuse", max_new_tokens=30, logprobs=True)
        other = engine.submit(engine.request(QUESTIONS[0], DOCS[:1], mode="reuse", max_new_tokens=30), logprobs=True)
        while engine.scheduler.running < 1:
            time.sleep(0.002)
        runner = engine.runner

        class BadRows(PlanCursor):  # wants rows past the model's positions
            def _next(self, output, error):
                if error is not None:
                    raise error
                return Rows(torch.zeros(runner.max_positions + 1, dtype=torch.long), runner.new_cache(8), 0)

        plans = engine.scheduler.plans
        make = plans.plan
        plans.plan = lambda item: BadRows() if item.work == "bad rows" else make(item)
        handle = Handle()
        engine.scheduler.submit(Task("bad", "bad rows", handle))
        events = list(handle.events())
        got = other.result()
    assert isinstance(events[-1], Finished) and "positions" in str(events[-1].error)
    _assert_same(expected, got)


def test_schedule_decides_from_plain_data(lm):
    """`schedule()` is policy only (its state set by hand here, the thread never started): the
    head of the queue admitted, a plan with no work pending advanced first; with sequences
    decoding, a budget of `prefill_chunk_tokens` x layers row-layers and every decode row; with
    nothing decoding, the same budget (the oldest plan first) unless a plan is alone (no bound); a full cache that cannot grow within `max_active_kv` preempts the
    newest sequence. It changes nothing itself: the same answer twice, no cache grown, nobody
    parked, nothing started."""
    from blend.engine.scheduler import Step, _Slot
    from blend.model.plan import Once
    from blend.model.runner import RowsCursor

    with make_engine(lm, prefill_chunk_tokens=5) as engine:
        sched, runner = engine.scheduler, engine.runner
        layers = runner.num_layers
        assert sched.schedule() == Step(budget=5 * layers)  # idle
        slot = _Slot(None, Once(lambda: None))
        slot.cursor = RowsCursor(Rows(torch.arange(12), runner.new_cache(12), 0), 5)
        sched._prefilling = [slot]
        assert sched.schedule() == Step(plans=(slot,), budget=None)  # a plan alone: nothing to share the step with
        sched._waiting.append(engine._sequence(engine.request(QUESTIONS[1], DOCS[:1], mode="full", max_new_tokens=4),
                                               Handle()))
        assert sched.schedule().budget == 5 * layers  # others wait (this one admitted too): bounded
        sched._waiting.clear()
        seqs = [engine._sequence(engine.request(QUESTIONS[0], DOCS[:1], mode="full", max_new_tokens=40), Handle())
                for _ in range(2)]
        for seq in seqs:
            seq.cache = runner.new_cache(8)
            seq.cache.length = 4
        sched._running = list(seqs)
        assert sched.schedule() == sched.schedule() == Step(plans=(slot,), budget=5 * layers, decode=tuple(seqs))
        assert slot.cursor.want(5 * layers)[0].start == 0 and len(slot.cursor.want(5 * layers)) == 1  # 5 rows
        slot.cursor = None  # its work was taken: the plan advances first
        assert sched.schedule().advance == (slot,)
        waiting = engine._sequence(engine.request(QUESTIONS[1], DOCS[:1], mode="full", max_new_tokens=4), Handle())
        sched._waiting.append(waiting)
        assert sched.schedule().admit == ()  # while sequences decode, one plan's planning per step: the advance
        slot.cursor = RowsCursor(Rows(torch.arange(12), runner.new_cache(12), 0), 5)
        assert sched.schedule().admit == (waiting,) and sched.waiting == 1  # admitted by `_run_step`, not here
        sched._waiting.clear()
        for seq in seqs:
            seq.cache.length = 8  # full
        sched.config = dataclasses.replace(sched.config, max_active_kv=sched.active_kv_bytes() + 1)
        step = sched.schedule()
        assert step.preempt == (seqs[1],) and step.decode == (seqs[0],) and step.grow[0][0] is seqs[0]
        assert [s.cache.capacity for s in seqs] == [8, 8] and sched.metrics.preemptions == 0
        for seq in seqs:
            seq.cache.length = 4
        sched.config = dataclasses.replace(sched.config, max_active_kv=1 << 30, background_share=0.1)

        class Pending:  # background work waits
            def background_pending(self) -> bool:
                return True

        sched._background = Pending()
        sched._busy_s, sched.metrics.background_s = 10.0, 0.5
        assert sched.schedule().background  # busy, under its share (0.5 s of 10 s)
        sched.metrics.background_s = 1.5
        assert not sched.schedule().background  # busy, over its share: only the requests' work
        running, sched._running, sched._prefilling = sched._running, [], []
        assert sched.schedule() == Step(budget=5 * layers, background=True)  # idle: all of it
        sched._running = running
        sched._background = None
        sched._running, sched._prefilling = [], []


def test_step_pace_prices_decode_steps_and_each_kind_of_work():
    """`StepPace`: a step of b decode rows alone is the median of its last steps (an outlier moves
    nothing); a mixed step's time less its decode rows' is the plans' work, shared between kinds by
    their work at the rates known; the time of plans' work beside b rows makes the step `stretch`
    times the slowest decode step seen often enough, never less than `stretch` - 1 times b rows' own."""
    from blend.engine.scheduler import StepPace

    pace = StepPace()
    assert pace.seconds(1, 3.0) is None and pace.row_layers("A", 1.0) == float("inf")  # nothing measured
    for _ in range(3):
        pace.observe(1, {}, 0.020)
        pace.observe(4, {}, 0.040)
    pace.observe(4, {}, 2.0)  # a one-time pause: the median stays
    assert (pace.decode_time(1), pace.decode_time(4), pace.decode_time(3), pace.decode_time(8)) == (0.02, 0.04, 0.04,
                                                                                                  0.04)
    assert pace.seconds(1, 3.0) is None  # no work priced yet
    pace.observe(1, {"A": 100.0}, 0.120)  # 0.1 s of A's work: 1 ms a row-layer
    assert pace.rate_of("A") == pytest.approx(1e-3)
    pace.observe(4, {"A": 50.0, "B": 50.0}, 0.190)  # 0.15 s shared: B unknown, priced as A (the slowest known)
    assert pace.rate_of("B") == pytest.approx(1.5e-3) and pace.rate_of("C") == pytest.approx(1.5e-3)  # unknown: slowest
    pace.observe(7, {}, 9.0)  # a batch seen once does not set the slowest decode step
    assert pace.seconds(1, 3.0) == pytest.approx(3.0 * 0.04 - 0.02)  # a lone row leaves the plans more room
    assert pace.seconds(4, 3.0) == pytest.approx(2.0 * 0.04)
    assert pace.row_layers("A", 0.05) == pytest.approx(0.05 / pace.rate_of("A"))


def test_while_sequences_decode_a_step_holds_plans_work_for_its_time(lm):
    """`schedule()` gives the step `seconds` of plans' work beside decode rows (`StepPace`) and
    none without decode rows or with `step_stretch: None`; `_run_step` asks each plan for at most
    the row-layers of its kind that fit the time left (and `prefill_chunk_tokens` x layers)."""
    from blend.engine.scheduler import _Slot
    from blend.model.plan import Once

    class Asked:  # a cursor that records the budgets it is asked for and wants nothing
        phase = "recompute"

        def __init__(self):
            self.budgets = []
            self.done = False

        def want(self, budget=None, *, ready_only=False):
            self.budgets.append(budget)
            return []

        def take(self, outs):
            raise AssertionError("nothing was wanted")

    with make_engine(lm, prefill_chunk_tokens=64) as engine:  # its thread sleeps: the state is set by hand
        sched, layers = engine.scheduler, engine.runner.num_layers
        sched.config = dataclasses.replace(sched.config, step_stretch=3.0)
        seqs = [engine._sequence(engine.request(QUESTIONS[0], DOCS[:1], mode="full", max_new_tokens=4), Handle())
                for _ in range(2)]
        for seq in seqs:
            seq.cache = engine.runner.new_cache(8)
            seq.cache.length = 4
        cursor = Asked()
        slot = _Slot(None, Once(lambda: None))
        slot.cursor = cursor
        sched._prefilling, sched._running = [slot], []
        sched.pace.observe(2, {}, 0.030)
        sched.pace.observe(0, {"Asked:recompute": 1000.0}, 0.5)  # 0.5 ms a row-layer
        assert sched.schedule().seconds is None  # nothing decodes: the row-layer budget only
        sched._running = list(seqs)
        step = sched.schedule()
        assert step.seconds == pytest.approx(2 * 0.030) and step.budget == 64 * layers
        sched._running = []  # (the rows themselves are not the point: the step keeps its seconds)
        sched._run_step(dataclasses.replace(step, decode=()))
        assert cursor.budgets[-1] == pytest.approx(min(64 * layers, 0.060 / 0.5e-3))
        sched._running = list(seqs)
        sched.config = dataclasses.replace(sched.config, step_stretch=None)
        assert sched.schedule().seconds is None
        sched._running, sched._prefilling = [], []


@pytest.mark.parametrize("split", ["off", "auto"])
def test_a_blend_runs_the_recompute_plan_its_split_was_priced_by(lm, monkeypatch, split):
    """Planned once: the split returns the plan it chose (`Split.plan`), and the layer loop runs
    that very object; nothing plans the rows again."""
    import blend.engine.prefill as prefill
    from blend.planning.split import Splitter

    splits, ran = [], []
    plan_of, cursor_of = Splitter.plan, prefill.BlendPass
    monkeypatch.setattr(Splitter, "plan", lambda self, *a, **k: splits.append(plan_of(self, *a, **k)) or splits[-1])
    monkeypatch.setattr(prefill, "BlendPass", lambda runner, cache, ids, plan, *a, **k: ran.append(plan) or
                        cursor_of(runner, cache, ids, plan, *a, **k))
    with make_engine(lm, split=split) as engine:
        engine.ingest(DOCS)
        engine.generate(QUESTIONS[0], DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=2)
    assert len(splits) == len(ran) == 1 and ran[0] is splits[0].plan
    assert not hasattr(prefill, "plan_recompute")


def test_every_mode_is_a_plan_of_data_and_a_stall_runs_the_full_plan(lm, monkeypatch):
    """full, prefix and blend/reuse are planned into data (`FullPlan`, `PrefixPlan`, `BlendPlan`:
    what is loaded, what each layer recomputes, what is harvested) before any row is computed,
    and `Prefiller.run` executes them; a load that stalls runs the plan's `FullPlan` of the same
    tokens instead, whose answer is the full prefill's."""
    from blend.engine.prefill import BlendPlan, FullPlan, Prefiller, PrefixPlan
    from blend.kv.loader import LoadStalled
    from blend.model.plan import Once
    from blend.recompute.plan import RecomputePlan

    ran = []
    run = Prefiller.run
    monkeypatch.setattr(Prefiller, "run", lambda self, plan: ran.append(plan) or run(self, plan))
    question = QUESTIONS[1]
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        full = engine.generate(question, DOCS[:2], mode="full", max_new_tokens=3, logprobs=True)
        engine.generate(question, DOCS[:2], mode="prefix", max_new_tokens=3)
        engine.generate(question, DOCS[:2], mode="blend", recompute_ratio=0.3, max_new_tokens=3)
        assert [type(p) for p in ran] == [FullPlan, PrefixPlan, BlendPlan]
        blend = ran[-1]
        assert isinstance(blend.split.plan, RecomputePlan) and blend.split.loaded and blend.harvest == ()
        assert {p.start for p in blend.split.loaded} >= {s.start for s in blend.prompt.segments
                                                          if s.kind == "document"}
        ran.clear()
        run_blend = Prefiller._run_blend

        def stalled(self, plan):
            return Once(lambda: (_ for _ in ()).throw(LoadStalled("a tier too slow (test)", ("cpu",))))

        monkeypatch.setattr(Prefiller, "_run_blend", stalled)
        got = engine.generate(question, DOCS[:2], mode="blend", recompute_ratio=0.3, max_new_tokens=3, logprobs=True)
        monkeypatch.setattr(Prefiller, "_run_blend", run_blend)
    assert [type(p) for p in ran] == [BlendPlan, FullPlan] and got.stats.stalled_tiers == ("cpu",)
    assert got.token_ids == full.token_ids
    assert (got.token_logprobs - full.token_logprobs).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mode", ["prefix", "blend"])
def test_a_stall_in_the_executor_reaches_the_plan_closes_its_loader_and_runs_the_full_plan(lm, monkeypatch, mode):
    """Prefix mode's rows and a blend's passes wait for their loads inside the executor's step
    (decode rows beside them); a load that stalls there (layer 1, or mid-blend at layer 2) is thrown
    into the plan where it paused: its loader is closed on the way out, and the full plan of the same
    tokens answers as full prefill."""
    from blend.kv.loader import LayerLoader, LoadStalled

    question, docs, stall_at = (QUESTIONS[2], DOCS[:2], 1) if mode == "prefix" else (QUESTIONS[4], DOCS[:3], 2)
    args = {"recompute_ratio": 0.3} if mode == "blend" else {}
    with make_engine(lm, prefill_chunk_tokens=4) as engine:
        engine.ingest(DOCS)
        full = engine.generate(question, docs, mode="full", max_new_tokens=3, logprobs=True)
        if mode == "prefix":
            engine.generate(question, docs, mode="prefix", max_new_tokens=3)  # its blocks stored
        loaders: list[LayerLoader] = []
        init, wait = LayerLoader.__init__, LayerLoader.wait

        def tracked(self, *args, **kwargs):
            init(self, *args, **kwargs)
            loaders.append(self)

        def stalls(self, layer):
            if self.placements and layer == stall_at:
                raise LoadStalled(f"layer {stall_at} did not arrive (test)", ("cpu",))
            wait(self, layer)

        monkeypatch.setattr(LayerLoader, "__init__", tracked)
        monkeypatch.setattr(LayerLoader, "wait", stalls)
        busy = _busy(engine, 2)  # the rows run in the scheduler's steps, beside decode rows
        got = engine.generate(question, docs, mode=mode, max_new_tokens=3, logprobs=True, **args)
        for handle in busy:
            handle.cancel()
    assert got.stats.stalled_tiers == ("cpu",) and got.stats.mode == "full"
    assert got.token_ids == full.token_ids
    assert (got.token_logprobs - full.token_logprobs).abs().max().item() <= 1e-4
    assert loaders and all(loader._stop for loader in loaders if loader.placements)


# ------------------------------------------------------- issue 46: blends in the one executor
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_a_step_holds_blends_a_chunk_and_decode_rows_and_each_answers_as_alone(arch):
    """Three sequences decode while four blends and a full prefill arrive at once: steps hold
    several blends' passes (a query pass beside another blend's layer range) and the decode rows,
    and the prefill's chunk beside the decode rows; every request's first-token log-probs within 1e-5 of it run alone
    (float32) and the same greedy tokens."""
    from blend.recompute import layers

    lm = tiny_model(arch, tokenizer=smollm2_tokenizer())
    specs = [{"mode": m, "recompute_ratio": 0.3, "max_new_tokens": 6, "logprobs": True}
             for m in ("blend", "blend", "full", "blend", "blend")]
    with make_engine(lm, prefill_chunk_tokens=256) as engine:  # a budget that holds several plans' work
        engine.ingest(DOCS)
        alone = [engine.generate(QUESTIONS[i], DOCS[i % 3:], **spec) for i, spec in enumerate(specs)]
        steps: list[tuple[int, int, int]] = []  # per step: blend items, other multi-row items, decode rows
        forward = engine.runner.forward

        def recording(items):
            blends = sum(isinstance(it.needs, (layers._QueryPassNeeds, layers._RecomputeNeeds,
                                               layers._CheckLayerNeeds)) for it in items)
            decodes = sum(it.decodes() for it in items)
            steps.append((blends, len(items) - blends - decodes, decodes))
            return forward(items)

        engine.runner.forward = recording
        busy = _busy(engine, 3)
        held, release = threading.Event(), threading.Event()
        holder = threading.Thread(target=engine.run_exclusive,  # the scheduler held while all five queue up
                                  args=(lambda: held.set() or release.wait(30),))
        holder.start()
        assert held.wait(30)
        handles = [engine.submit(engine.request(QUESTIONS[i], DOCS[i % 3:], **{k: v for k, v in spec.items()
                                                                             if k != "logprobs"}), logprobs=True)
                   for i, spec in enumerate(specs)]
        release.set()
        holder.join(30)
        got = [h.result() for h in handles]
        for handle in busy:
            handle.cancel()
    for a, b in zip(alone, got, strict=True):
        assert a.token_ids == b.token_ids
        assert (a.first_token_logprobs - b.first_token_logprobs).abs().max().item() <= 1e-5
    assert any(blends >= 2 and decodes >= 3 for blends, _, decodes in steps)  # two blends' passes in one step
    assert any(chunks >= 1 and decodes >= 3 for _, chunks, decodes in steps)  # the prefill's chunk beside them
    # (whether a chunk and a blend share one step depends on when the blend's loads arrive: a blend asks
    # only for loaded layers; tests/test_invariance.py runs such steps by hand, bitwise)


def test_a_blend_cursor_driven_by_hand_gives_what_the_scheduler_gives(lm, monkeypatch):
    """The `BlendPass` a blend request's plan yields, made again by hand over the same plan and
    the same stored entries and driven alone (`run_layers`), gives the scheduler's logits bit for
    bit."""
    import blend.engine.prefill as prefill
    from blend.kv.loader import LayerLoader
    from blend.recompute.layers import run_layers

    made = []
    cursor_of = prefill.BlendPass

    def recording(runner, cache, ids, plan, loader, **kwargs):
        made.append((cache.capacity, ids.clone(), plan, list(loader.placements), kwargs))
        return cursor_of(runner, cache, ids, plan, loader, **kwargs)

    monkeypatch.setattr(prefill, "BlendPass", recording)
    with make_engine(lm, prefill_chunk_tokens=8) as engine:
        engine.ingest(DOCS)
        engine.store.flush()
        busy = _busy(engine, 2)  # the blend runs in steps beside decode rows
        prompt = engine.build_prompt(QUESTIONS[3], DOCS)
        pre = engine.prefill(prompt, mode="blend", ratio=0.3)
        for handle in busy:
            handle.cancel()
        capacity, ids, plan, placements, kwargs = made[-1]
        runner = engine.runner
        cache = runner.new_cache(capacity)
        cache.length = plan.n
        with LayerLoader(engine.store, runner, cache, placements, range(plan.load_from, runner.num_layers), 2) as loader:
            logits, report = run_layers(runner, cache, ids, plan, loader, **kwargs)
    assert torch.equal(logits, pre.logits)
    assert report.recomputed_tokens == pre.stats.selection.recomputed_tokens


def _stages(plan) -> list[str]:
    """A plan's progress as data: each plan's type and stage, the outermost first, down its subs."""
    from blend.model.plan import PlanCursor, Timed

    chain = []
    while isinstance(plan, PlanCursor):
        chain.append(f"{type(plan).__name__}:{plan.stage}")
        plan = plan.plan if isinstance(plan, Timed) else plan.sub
    return chain


def _by_hand(engine: BlendEngine, plan) -> tuple:
    """`plan` driven want after want on the scheduler's thread, as the scheduler drives it: its
    value, and each want's kind with the plan's stages read before it ran."""
    from blend.model.plan import PAUSE, Done
    from blend.model.runner import RowsCursor

    runner, seen = engine.runner, []

    def drive():
        want = plan.take()
        while not isinstance(want, Done):
            seen.append((type(want).__name__, _stages(plan)))
            output = None
            if isinstance(want, (Rows, list)):
                cursor = RowsCursor(want, runner.chunk_tokens)
                while not cursor.done:
                    cursor.take(runner.forward(cursor.want()))
                output = cursor.value()
            elif want is not PAUSE:
                assert hasattr(want, "want") and hasattr(want, "take")  # a model-work Cursor
                while not want.done:
                    want.take(runner.forward(want.want()))
            want = plan.take(output)
        return want.value

    return engine.run_exclusive(drive), seen


def test_a_plan_cursor_driven_by_hand_gives_what_the_scheduler_gives(lm):
    """A blend request whose two last documents miss, its plan (a cursor: `Prefiller.plan`)
    driven by hand want after want on a second engine: its stages are data read between the
    wants (the misses' pass, then the blend's passes), and its logits, KV and stats
    equal the scheduler's run of the same request on the first engine, bit for bit."""
    from blend.engine.prefill import PromptWork

    got = []
    for by_hand in (False, True):
        with make_engine(lm, miss_policy="standalone") as engine:
            engine.ingest(DOCS[:2])
            engine.store.flush()
            prompt = engine.build_prompt(QUESTIONS[2], DOCS)
            if by_hand:
                got.append(_by_hand(engine, engine.prefiller.plan(PromptWork(prompt, None, "blend", 0.3, None,
                                                                              len(prompt)))))
            else:
                got.append((engine.prefill(prompt, mode="blend", ratio=0.3), None))
    (scheduled, _), (pre, seen) = got
    blend = [next(s for s in stages if s.startswith("BlendPrefill:")) for _, stages in seen]
    assert [kind for kind, _ in seen] == ["list", "BlendPass"]  # the misses' pass, then the blend
    assert blend == ["BlendPrefill:misses", "BlendPrefill:run"]
    assert "DocumentPasses:pass" in seen[0][1] and seen[-1][1][-1] == "BlendRun:passes"
    assert torch.equal(pre.logits, scheduled.logits)
    n = len(prompt)
    for layer in range(lm.config.num_hidden_layers):
        assert torch.equal(pre.cache.k[layer][:, :n], scheduled.cache.k[layer][:, :n])
    assert pre.stats.miss.computed == len(DOCS) - 2 and pre.stats.miss == scheduled.stats.miss.replace(
        compute_s=pre.stats.miss.compute_s)
    assert pre.stats.selection.recomputed_tokens == scheduled.stats.selection.recomputed_tokens
