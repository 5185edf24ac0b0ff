"""The scheduler: batched decode gives each sequence what it gets alone, admission and the
prefill-between-decodes rule, cancellation and stop strings per sequence, seeds, preemption
by parking KV in the tiers under a small `max_active_kv`, and the thread-safe API
(`generate` from many threads, `generate_many`, `AsyncBlendEngine`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from blend.config import EngineConfig
from blend.decode.result import GenerationResult, TextDelta
from blend.engine.async_engine import AsyncBlendEngine
from blend.engine.engine import BlendEngine
from blend.engine.scheduler import Scheduler
from blend.engine.sequence import Cancelled, Handle
from blend.model.plan import Done, PlanCursor
from tests.models import smollm2_tokenizer, tiny_model

DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. " * 3,
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels. " * 2,
    "The Carrow Point light flashes white every twelve seconds and can be seen for twenty miles.",
    "Ostend's mill ground grain until 1932, when a storm broke two of its wheels.",
]
QUESTIONS = ["Who built the lighthouse?", "Where did Tillery move?", "How often does the light flash?",
             "What did Tillery design?", "When was the lighthouse built?", "How many wheels?",
             "Who is Maud Tillery?", "What colour is the light?"]
MODES = ["full", "reuse", "blend", "prefix", "blend", "full", "reuse"]


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", tokenizer=smollm2_tokenizer())


def make_engine(lm, tmp_path=None, **overrides) -> BlendEngine:
    tiers = [{"kind": "cpu", "budget": "64MiB"}]
    overrides.setdefault("split", "off")  # a tiny model may compute faster than it loads (see test_split.py)
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": tiers}, chunk_tokens=16,
                                        max_new_tokens=8, **overrides)
    if tmp_path is not None:
        cfg = cfg.with_overrides(sessions_dir=str(tmp_path / "sessions"))
    return BlendEngine(cfg, model=lm)


def requests(n: int = 7, max_new_tokens: int = 24) -> list[dict]:
    """Requests of different lengths and modes (1-4 documents each)."""
    return [{"query": QUESTIONS[i], "documents": DOCS[: 1 + i % len(DOCS)], "mode": MODES[i % len(MODES)],
             "recompute_ratio": 0.3, "max_new_tokens": max_new_tokens - i, "logprobs": True} for i in range(n)]


def alone(engine: BlendEngine, spec: dict) -> GenerationResult:
    args = {k: v for k, v in spec.items() if k not in ("query", "documents")}
    return engine.generate(spec["query"], spec["documents"], **args)


def assert_same(a: GenerationResult, b: GenerationResult, tol: float = 1e-4) -> None:
    assert a.token_ids == b.token_ids and a.text == b.text and a.finish_reason == b.finish_reason
    assert a.token_logprobs.shape == b.token_logprobs.shape
    assert (a.token_logprobs - b.token_logprobs).abs().max().item() <= tol  # every step's logits


# ------------------------------------------------------------- batched decode
def test_batched_decode_equals_each_sequence_alone(lm, tmp_path):
    """7 requests of four modes and different lengths plus a chat turn decode in one batch:
    every step's log-probs within 1e-4 of the request run alone, the same tokens and text."""
    specs = requests()
    with make_engine(lm, tmp_path / "a") as ref:
        ref.ingest(DOCS)
        expected = [alone(ref, s) for s in specs]
        turn = ref.chat("s", "Tell me about the mill.", documents=DOCS[:2], max_new_tokens=20)
    with make_engine(lm, tmp_path / "b") as engine:
        engine.ingest(DOCS)
        chat = engine.submit_chat("s", "Tell me about the mill.", documents=DOCS[:2], max_new_tokens=20)
        got = engine.generate_many(specs)
        turn_b = chat.result()
        sizes = engine.scheduler.metrics.batch_sizes
    assert max(sizes) >= 6  # they did decode together
    assert max(r.stats.batch_size_mean for r in got) > 2
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)
        assert a.stats.mode == b.stats.mode
    assert turn.token_ids == turn_b.token_ids and turn.text == turn_b.text


def test_decode_step_of_a_batch_equals_one_step_per_sequence(lm):
    """The runner's batched step against the prefill path's single-token step (the old decode),
    with a stale-key bias on some slots: logits within 1e-4, per sequence."""
    from blend.model.runner import Runner

    runner = Runner(lm)
    torch.manual_seed(0)
    caches, refs, tokens = [], [], []
    for n in (5, 37, 120, 300):
        ids = torch.randint(0, 1000, (n,))
        cache = runner.new_cache(n + 8)
        logits = runner.prefill(ids, cache)[0]
        bias = torch.randn(runner.kv_heads)
        cache.set_bias(1, torch.arange(0, n, 3), bias)
        ref = runner.new_cache(n + 8)
        runner.prefill(ids, ref)
        ref.set_bias(1, torch.arange(0, n, 3), bias)
        caches.append(cache)
        refs.append(ref)
        tokens.append(int(logits.argmax()))
    for _ in range(6):
        batched = runner.decode_step(tokens, caches)
        single = torch.stack([runner.prefill(torch.tensor([t]), c, start=c.length)[0] for t, c in zip(tokens, refs, strict=True)])
        assert (batched - single).abs().max().item() < 1e-4
        tokens = [int(x.argmax()) for x in batched]
    assert [c.length for c in caches] == [c.length for c in refs]


# ------------------------------------------------------------------- policy
def test_admission_respects_max_num_seqs_and_every_step_carries_every_decode_row(lm, monkeypatch):
    """Seven requests, three sequences at most: never more than three decode together; once a
    sequence decodes, every step (forward pass) carries its row, whatever plans' work rides in it."""
    steps: list[tuple[int, int]] = []  # (decode rows in the step, sequences running before it)
    forward = Scheduler._run_step

    def stepping(self, step):
        running = len(self._running)
        forward(self, step)
        steps.append((len(step.decode), running))

    monkeypatch.setattr(Scheduler, "_run_step", stepping)
    with make_engine(lm, max_num_seqs=3) as engine:
        engine.ingest(DOCS)
        steps.clear()
        results = engine.generate_many(requests(7, max_new_tokens=12))
        sizes = dict(engine.scheduler.metrics.batch_sizes)
    assert max(sizes) == 3  # never more than max_num_seqs decode together
    assert all(decoded == running for decoded, running in steps if running)  # no running sequence skipped
    assert all(r.stats.queued_s >= 0 for r in results) and max(r.stats.queued_s for r in results) > 0


def test_a_sequence_whose_prefill_ends_in_a_step_rides_in_that_step(lm, monkeypatch):
    """A prefill that ends in a step's advances (its first token out) gets its second token from
    that same step, which bounds the plans' work beside it: a first token is never followed by a
    step of others' prefill alone. The answers are those of each request alone."""
    joined: list[tuple[int, bool]] = []  # per sequence that joined in a step: its tokens after it, budget bounded
    run = Scheduler._run_step

    def stepping(self, step):
        before = list(self._running)
        prefilling = [s.item for s in self._prefilling if s.item is not None and s.item.cache is None]
        bounds = []
        self._with_joined = lambda step: bounds.append(Scheduler._with_joined(self, step)) or bounds[-1]
        run(self, step)
        del self._with_joined
        for seq in prefilling:
            tokens = len(seq.generation.tokens)
            if seq in before or not tokens or (tokens == 1 and seq.generation.done):
                continue  # still prefilling, or ended at its first token (it never joins)
            joined.append((tokens, bounds[-1].budget is not None))  # its prefill ended in this step's advances

    specs = requests(6, max_new_tokens=10)
    with make_engine(lm, max_num_seqs=4) as engine:
        engine.ingest(DOCS)
        each = [alone(engine, spec) for spec in specs]
        monkeypatch.setattr(Scheduler, "_run_step", stepping)
        together = engine.generate_many(specs)
    assert len(joined) == sum(len(r.token_ids) > 1 for r in each)  # every prefill ended in some step's advances
    assert all(tokens >= 2 for tokens, _ in joined)  # ... and its next token came from that same step
    assert all(bounded for _, bounded in joined)  # the plans' work beside a new stream was bounded
    for a, b in zip(each, together, strict=True):
        assert_same(a, b)


def test_a_cancelled_sequence_leaves_the_batch_and_the_others_are_unchanged(lm):
    specs = requests(4, max_new_tokens=30)
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        expected = [alone(engine, s) for s in specs]
        stream = engine.generate_stream(QUESTIONS[7], DOCS, max_new_tokens=200)
        others = threading.Thread(target=lambda: got.extend(engine.generate_many(specs)))
        got: list[GenerationResult] = []
        first = next(stream)  # running now
        assert isinstance(first, TextDelta)
        others.start()
        deadline = time.monotonic() + 60
        while engine.scheduler.running < 2:  # the others joined the batch
            assert time.monotonic() < deadline
            time.sleep(0.005)
        stream.close()  # a client that goes away mid-batch
        others.join(120)
        assert engine.scheduler.metrics.cancelled == 1
        assert engine.scheduler.running == 0 and engine.scheduler.active_kv_bytes() == 0
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_stop_strings_and_seeds_are_per_sequence(lm):
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        free = engine.generate(QUESTIONS[0], DOCS[:2], max_new_tokens=16)
        assert len(free.text) > 8
        stop = free.text[5:8]
        sampled = dict(temperature=0.9, top_p=0.9, seed=7, max_new_tokens=16)
        alone_sample = engine.generate(QUESTIONS[1], DOCS[:2], **sampled)
        specs = [{"query": QUESTIONS[0], "documents": DOCS[:2], "max_new_tokens": 16, "stop": [stop]},
                 {"query": QUESTIONS[1], "documents": DOCS[:2], **sampled},
                 {"query": QUESTIONS[0], "documents": DOCS[:2], "max_new_tokens": 16}]
        stopped, batched_sample, unstopped = engine.generate_many(specs)
    assert stopped.finish_reason == "stop" and stop not in stopped.text and free.text.startswith(stopped.text)
    assert unstopped.text == free.text  # the stop string of its neighbour does not apply to it
    assert batched_sample.token_ids == alone_sample.token_ids  # a seed gives the same sample alone or batched


# --------------------------------------------------------------- preemption
def two_but_not_their_growth(lm, specs: list[dict]) -> int:
    """A KV budget that admits the first two sequences (prompt + DECODE_RESERVE each) and holds
    any one of them whole, but not the first two once they grow."""
    from blend.engine.scheduler import DECODE_RESERVE

    per_token = 2 * lm.dims.num_layers * lm.dims.kv_heads * lm.dims.head_dim * 4  # float32
    with make_engine(lm) as engine:
        n = [len(engine.build_prompt(s["query"], s["documents"])) for s in specs]
    admitted = n[0] + n[1] + 2 * DECODE_RESERVE
    whole = max(k + s["max_new_tokens"] for k, s in zip(n, specs, strict=True))
    assert whole <= admitted + 8 < n[0] + specs[0]["max_new_tokens"] + n[1] + DECODE_RESERVE
    return (admitted + 8) * per_token


@pytest.fixture
def small_reserve(monkeypatch):
    """Caches allocated with room for 64 new tokens (not DECODE_RESERVE's 256), so that 90-token
    answers grow their caches."""
    monkeypatch.setattr("blend.engine.scheduler.DECODE_RESERVE", 64)
    monkeypatch.setattr("blend.engine.layout.DECODE_RESERVE", 64)


def test_preemption_parks_kv_in_the_tiers_and_resumes_with_the_same_output(lm, small_reserve):
    """A budget that fits two sequences' prompts but not their growth: the newest is parked in
    the tiers and resumed, with the output of an unpreempted run; the running set never holds
    more than the budget, and nothing is left behind (KV freed, parked blocks deleted)."""
    specs = [dict(s, max_new_tokens=90, logprobs=True) for s in requests(4)]
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        expected = [alone(engine, s) for s in specs]
    budget = two_but_not_their_growth(lm, specs)
    with make_engine(lm, max_active_kv=budget) as engine:
        engine.ingest(DOCS)
        got = engine.generate_many(specs)
        m = engine.scheduler.metrics
        assert m.preemptions >= 1 and m.resumes == m.preemptions and m.resumes_recomputed == 0
        assert m.peak_active_kv <= budget
        assert engine.scheduler.active_kv_bytes() == 0 and engine.scheduler.running == 0
        assert engine.scheduler.waiting == 0
        engine.store.flush()
        parked = [k for k in engine.store.keys() if k.startswith("s")]  # storage.keys.parked_block_key
        assert parked == []  # the parked blocks were deleted after resuming
    assert sum(r.stats.preempted for r in got) == m.preemptions
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)


def test_a_preempted_sequence_whose_parked_kv_is_gone_is_recomputed(lm, monkeypatch, small_reserve):
    specs = [dict(s, max_new_tokens=90) for s in requests(3)]
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        expected = [alone(engine, s) for s in specs]
    with make_engine(lm, max_active_kv=two_but_not_their_growth(lm, specs)) as engine:
        engine.ingest(DOCS)
        parking = engine.scheduler.parking
        park = parking.park

        def park_then_lose(ids, cache):  # the tiers evict the parked blocks at once
            parked = park(ids, cache)
            engine.store.flush()
            for key, _start, _end in parked.blocks:
                engine.store.delete(key)
            return parked

        monkeypatch.setattr(parking, "park", park_then_lose)
        got = engine.generate_many(specs)
        m = engine.scheduler.metrics
        assert m.preemptions >= 1 and m.resumes_recomputed == m.resumes
    for a, b in zip(expected, got, strict=True):
        # recomputed by prefill (not decode steps): the same tokens, logits rounded differently
        assert a.token_ids == b.token_ids


# --------------------------------------------------------------- concurrency
def test_generate_from_many_threads_equals_the_same_calls_in_sequence(lm):
    specs = requests(8, max_new_tokens=16)
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        for s in specs:  # warm: every document's blocks stored
            alone(engine, s)
        expected = [alone(engine, s) for s in specs]
        got: list[GenerationResult | None] = [None] * len(specs)

        def call(i: int) -> None:
            got[i] = alone(engine, specs[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(specs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for a, b in zip(expected, got, strict=True):
        assert b is not None
        assert_same(a, b)
        assert a.first_token_logprobs.sub(b.first_token_logprobs).abs().max().item() <= 1e-4


def test_async_engine_gathers_and_streams(lm):
    specs = requests(4, max_new_tokens=12)
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        expected = [alone(engine, s) for s in specs]

        async def main() -> tuple[list[GenerationResult], list]:
            facade = AsyncBlendEngine(engine)
            got = await asyncio.gather(*(facade.generate(s["query"], s["documents"],
                                                         **{k: v for k, v in s.items()
                                                            if k not in ("query", "documents")}) for s in specs))
            streamed = [item async for item in facade.generate_stream(QUESTIONS[0], DOCS[:2], max_new_tokens=6)]
            with pytest.raises(ValueError, match="recompute"):
                await facade.generate(QUESTIONS[0], DOCS, recompute_ratio=2.0)
            return got, streamed

        got, streamed = asyncio.run(main())
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)
    assert isinstance(streamed[-1], GenerationResult)
    assert "".join(d.text for d in streamed[:-1]) == streamed[-1].text


def test_generate_many_checks_every_request_first_and_closed_engines_refuse(lm):
    with make_engine(lm) as engine:
        with pytest.raises(ValueError, match=r"requests\[1\]: .*recompute"):
            engine.generate_many([{"query": "a"}, {"query": "b", "recompute_ratio": 3}])
        with pytest.raises(ValueError, match="unknown request key"):
            engine.generate_many([{"query": "a", "colour": "red"}])
        with pytest.raises(TypeError, match="list of request"):
            engine.generate_many({"query": "a"})
        assert engine.scheduler.metrics.finished == 0  # nothing was queued
    with pytest.raises(ValueError, match="closed"):
        engine.generate("a")


def test_a_deadline_cancels_a_queued_or_running_request(lm):
    with make_engine(lm) as engine:
        req = engine.request(QUESTIONS[0], DOCS, max_new_tokens=200)
        handle = engine.submit(req, deadline=time.monotonic() + 0.05)
        with pytest.raises(Cancelled):
            handle.result()
        assert engine.scheduler.running == 0


def test_run_exclusive_runs_on_the_schedulers_thread_and_returns_or_raises(lm):
    engine = make_engine(lm)
    try:
        caller = threading.current_thread()
        seen = engine.run_exclusive(lambda: (threading.current_thread(), torch.is_inference_mode_enabled()))
        assert seen[0] is not caller and seen[0].name == engine.scheduler._name and seen[1]
        engine.generate("q", ["some words here"], mode="full", max_new_tokens=2)  # the engine still serves

        def broken() -> None:
            raise ValueError("from the model thread")

        with pytest.raises(ValueError, match="from the model thread"):
            engine.run_exclusive(broken)
    finally:
        engine.close()
    with pytest.raises(ValueError, match="closed"):
        engine.run_exclusive(lambda: None)


# ------------------------------------------------------------- failure isolation
def _poisoned(engine: BlendEngine, spec: dict, where: str):
    """`spec` as a scheduled sequence whose prefill hands over NaN: its last logits (sampling its
    first token fails) or its cache's K (its first decode step's logits are NaN, sampling fails)."""
    args = {k: v for k, v in spec.items() if k not in ("query", "documents", "logprobs")}
    seq = engine._sequence(engine.request(spec["query"], spec["documents"], **args), Handle())
    plans = engine.scheduler.plans
    make = plans.plan

    class Poisoned(PlanCursor):  # the plan, then its value poisoned
        def _next(self, output, error):
            if error is not None:
                raise error
            if self.stage == "start":
                self.stage = "plan"
                return self.run(make(seq))
            (output.logits if where == "logits" else output.cache.k[0]).fill_(float("nan"))
            return Done(output)

    def plan_of(item):
        return make(item) if item is not seq else Poisoned()

    plans.plan = plan_of
    return seq


@pytest.mark.parametrize("where", ["logits", "cache"])
def test_a_failing_sequence_fails_alone_and_its_caller_is_told(lm, where):
    """A sampled sequence whose logits turn NaN (after its prefill, or at a decode step while others
    decode with it) ends with the error at its caller, in time; the requests beside it finish with
    the output they get alone, and the engine goes on serving."""
    specs = requests(3, max_new_tokens=16)
    bad_spec = {"query": QUESTIONS[3], "documents": DOCS[:2], "mode": "reuse", "max_new_tokens": 16,
                "temperature": 0.8, "seed": 1}
    with make_engine(lm) as engine:
        engine.ingest(DOCS)
        expected = [alone(engine, s) for s in specs]
        got: list = []
        others = threading.Thread(target=lambda: got.extend(engine.generate_many(specs)), daemon=True)
        others.start()
        deadline = time.monotonic() + 60
        while engine.scheduler.running < 1:  # the others are decoding
            assert time.monotonic() < deadline
            time.sleep(0.002)
        bad = _poisoned(engine, bad_spec, where)
        engine.scheduler.submit(bad)
        failed: list[BaseException] = []
        waiter = threading.Thread(target=lambda: failed.append(_raised(bad.handle.result)), daemon=True)
        waiter.start()
        waiter.join(60)
        assert not waiter.is_alive(), "the failing request's caller waits forever"
        assert isinstance(failed[0], RuntimeError) and "probability" in str(failed[0])
        others.join(120)
        assert not others.is_alive()
        assert engine.scheduler.metrics.failed == 1
        assert engine.scheduler.running == 0 and engine.scheduler.active_kv_bytes() == 0
        after = alone(engine, specs[0])  # still serving
    for a, b in zip(expected, got, strict=True):
        assert_same(a, b)
    assert_same(expected[0], after)


def _raised(fn) -> BaseException | None:
    try:
        fn()
    except BaseException as err:  # noqa: BLE001 - the test inspects it
        return err
    return None


def test_cancelling_an_async_generate_while_it_is_submitted_cancels_the_request(lm):
    """The task is cancelled while its request is laid out and queued off the event loop (the loop
    lives on, as a server's does, so its sink still takes events): the request is cancelled all the same (it leaves at the scheduler's next step), it does not
    decode unobserved to its end."""
    with make_engine(lm) as engine:
        engine.ingest(DOCS)

        async def main() -> None:
            facade = AsyncBlendEngine(engine)
            task = asyncio.create_task(facade.generate(QUESTIONS[0], DOCS, max_new_tokens=200))
            await asyncio.sleep(0)  # the task runs up to its submission (in the loop's executor)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            deadline = time.monotonic() + 60  # the loop lives on (a server's would): its sink still works
            metrics = engine.scheduler.metrics
            while engine.scheduler.depth() or metrics.finished + metrics.cancelled + metrics.failed < 2:
                assert time.monotonic() < deadline, "the cancelled request still runs"
                await asyncio.sleep(0.005)

        asyncio.run(main())
        metrics = engine.scheduler.metrics
        assert metrics.cancelled == 1 and metrics.finished == 1  # the ingest; the request did not finish
        assert metrics.generated_tokens <= 2  # it left at the next step
