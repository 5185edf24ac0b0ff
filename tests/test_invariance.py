"""A row's numbers never depend on its step (issues 46 and 49): whatever else shares a
`Runner.forward` step (decode rows, chunks of other prefills, a blend's layer range), an item's
outputs and the K/V it writes are the same bits, in bfloat16 as in float32, on llama and Gemma 3
shapes; and through the engine, greedy requests run together answer as each runs alone."""

from __future__ import annotations

import threading

import pytest
import torch

from blend.engine.engine import BlendEngine
from blend.model.cache import KVCache
from blend.model.projections import MODULES, PACKED, projection_layout
from blend.model.runner import Rows, Runner
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_scheduler import DOCS, QUESTIONS, make_engine


def _runner(arch: str, dtype: str) -> Runner:
    lm = tiny_model(arch, vocab_size=512)
    lm.model.to(getattr(torch, dtype))
    return Runner(lm)


def _filled(runner: Runner, seed: int, n: int, capacity: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = runner.new_cache(capacity)
    runner.prefill(torch.randint(0, 512, (n,), generator=g), cache, logit_rows=())
    return cache


def _item(runner: Runner, kind: str, seed: int) -> Rows:
    """A fresh item of `kind` (its own cache, made the same way for the same seed)."""
    g = torch.Generator().manual_seed(1000 + seed)
    if kind == "decode":
        cache = _filled(runner, seed, 20 + seed % 7, 64)
        return Rows(torch.randint(0, 512, (1,), generator=g), cache, cache.length)
    if kind == "chunk":  # the second chunk of a prefill (positions 24..37)
        cache = _filled(runner, seed, 24, 64)
        return Rows(torch.randint(0, 512, (14,), generator=g), cache, 24)
    if kind == "blend":  # a blend's layer range: scattered rows entering layer 1 as hidden states
        cache = _filled(runner, seed, 34, 64)
        positions = torch.tensor([2, 5, 9, 10, 11, 12, 30, 31, 32, 33])
        hidden = torch.randn((10, runner.lm.model.config.hidden_size), generator=g).to(runner.dtype)
        return Rows(None, cache, positions=positions, hidden=hidden, layers=(1, 3))
    raise ValueError(kind)


def _record(runner: Runner, item: Rows, out) -> list[torch.Tensor]:
    """What an item leaves: its output and its cache's K/V at every layer."""
    assert out.error is None
    got = [out.logits if out.logits is not None else out.hidden]
    end = int(item.positions[-1]) + 1 if item.positions is not None else item.start + len(item)
    for layer in range(runner.num_layers):  # the slots written so far (the rest was never set)
        got += [item.cache.k[layer][:, :end].clone(), item.cache.v[layer][:, :end].clone()]
    return got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("kind", ["decode", "chunk", "blend"])
def test_an_item_is_the_same_bits_beside_0_1_3_and_7_other_items(kind, arch, dtype):
    runner = _runner(arch, dtype)
    kinds = ["decode", "chunk", "blend", "decode", "decode", "chunk", "decode"]
    reference = None
    for others in (0, 1, 3, 7):
        subject = _item(runner, kind, 0)
        rest = [_item(runner, kinds[i], i + 1) for i in range(others)]
        at = others // 2
        items = [*rest[:at], subject, *rest[at:]]
        got = _record(runner, subject, runner.forward(items)[at])
        if reference is None:
            reference = got
            continue
        for a, b in zip(reference, got, strict=True):
            assert torch.equal(a, b), f"{kind} beside {others} other items differs"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_gives_the_same_bits_whole_in_chunks_or_beside_others(dtype):
    """A 300-token prefill at once, or as the scheduler runs it (`RowsCursor`: pieces cut at
    multiples of the chunk, one or two chunks' worth per step, or layer ranges of them when the
    budget is smaller than a piece, decode rows beside some steps): the runner cuts a whole
    prefill at the same positions itself, and a row's layers are the same operations however
    steps group them, so the K/V and the last logits are the same bits."""
    from blend.model.runner import RowsCursor

    runner = _runner("llama", dtype)
    runner.chunk_tokens = 64
    layers = runner.num_layers
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(3))
    whole = runner.new_cache(300)
    expected = runner.prefill(ids, whole)
    for budget, steps in ((64 * layers, 5), (128 * layers, 3), (50 * layers, 7), (64, 5 * layers)):
        pieces = runner.new_cache(300)
        cursor = RowsCursor(Rows(ids, pieces, 0), 64)
        step, ranges = 0, set()
        while not cursor.done:
            want = cursor.want(budget)
            ranges |= {it.span() for it in want}
            others = [_item(runner, "decode", 5)] if step % 2 else []
            cursor.take(runner.forward([*want, *others])[: len(want)])
            step += 1
        assert step == steps
        assert (ranges == {(0, layers)}) == (budget % (64 * layers) == 0)  # layer ranges only where a piece is over
        assert torch.equal(cursor.value(), expected)
        for layer in range(layers):
            assert torch.equal(whole.k[layer][:, :300], pieces.k[layer][:, :300])
            assert torch.equal(whole.v[layer][:, :300], pieces.v[layer][:, :300])


def test_a_pass_of_several_documents_in_layer_ranges_gives_the_same_bits():
    """A pass of three documents (items of their own caches, as a missed documents' pass asks):
    with a budget of a few layers' rows the pieces run as a wavefront of layer ranges, a later
    piece of a document never past an earlier one; the K/V and logits equal the pass run whole."""
    from blend.model.runner import RowsCursor

    runner = _runner("llama", "bfloat16")
    runner.chunk_tokens = 32
    layers = runner.num_layers
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 512, (n,), generator=gen) for n in (70, 33, 90)]
    whole = [runner.new_cache(len(d)) for d in docs]
    expected = [runner.prefill(d, c) for d, c in zip(docs, whole, strict=True)]
    caches = [runner.new_cache(len(d)) for d in docs]
    cursor = RowsCursor([Rows(d, c, 0) for d, c in zip(docs, caches, strict=True)], 32)
    steps = 0
    while not cursor.done:
        want = cursor.want(40)  # ~1 layer of a 32-row piece
        ends = {}
        for it in want:  # a later piece of the same cache ends no later than an earlier one
            first, end = it.span()
            assert end <= ends.get(id(it.cache), layers)
            ends[id(it.cache)] = end
        cursor.take(runner.forward(want))
        steps += 1
    assert steps > 3 * layers
    for got, exp in zip(cursor.value(), expected, strict=True):
        assert torch.equal(got, exp)
    for a, b, d in zip(whole, caches, docs, strict=True):
        for layer in range(layers):
            assert torch.equal(a.k[layer][:, :len(d)], b.k[layer][:, :len(d)])
            assert torch.equal(a.v[layer][:, :len(d)], b.v[layer][:, :len(d)])


@pytest.fixture(scope="module")
def bf16_lm():
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    lm.model.to(torch.bfloat16)
    return lm


def _spec(i: int) -> dict:
    modes = ["full", "blend", "reuse", "prefix", "blend", "full", "blend", "reuse"]
    return {"query": QUESTIONS[i], "documents": DOCS[: 1 + i % len(DOCS)], "mode": modes[i],
            "recompute_ratio": 0.3, "max_new_tokens": 10, "logprobs": True}


def _generate(engine: BlendEngine, spec: dict):
    args = {k: v for k, v in spec.items() if k not in ("query", "documents")}
    return engine.generate(spec["query"], spec["documents"], **args)


def _at_once(engine: BlendEngine, specs: list[dict]) -> list:
    """Every request on a thread of its own, released together; their results (None: none came)."""
    results: list = [None] * len(specs)
    barrier = threading.Barrier(len(specs))

    def run(i: int) -> None:
        barrier.wait()
        results[i] = _generate(engine, specs[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def test_eight_concurrent_greedy_requests_answer_as_each_alone_in_bfloat16(bf16_lm):
    """Eight requests of four modes at once (bfloat16, a budget of 64 rows: prefills, blends and
    decode rows share steps) against the same requests one by one: the same tokens, and every
    step's log-probs bitwise equal."""
    specs = [_spec(i) for i in range(8)]
    with make_engine(bf16_lm, prefill_chunk_tokens=64) as engine:
        engine.ingest(DOCS)
        for spec in specs:
            if spec["mode"] == "prefix":  # its blocks stored before either run
                _generate(engine, spec)
        alone = [_generate(engine, spec) for spec in specs]
        results = _at_once(engine, specs)
        shared = engine.scheduler.metrics.shared_steps
    for a, b in zip(alone, results, strict=True):
        assert b is not None and a.token_ids == b.token_ids
        assert torch.equal(a.token_logprobs, b.token_logprobs)
    assert shared > 0  # two plans' work shared steps


def test_four_threads_of_mixed_modes_beside_a_cpu_bound_process_answer_as_sequentially(bf16_lm):
    """Four threads at once on one engine (full, reuse, blend, prefix; bfloat16), three rounds, a
    CPU-bound child process beside them (threads preempted at any point): every first-token
    log-prob bitwise equal to the same request run alone, the same tokens. Asserted, not timed."""
    import subprocess
    import sys

    modes = ["full", "reuse", "blend", "prefix"]
    specs = [{"query": QUESTIONS[i], "documents": DOCS[: 2 + i % 2], "mode": m, "recompute_ratio": 0.3,
              "max_new_tokens": 6} for i, m in enumerate(modes)]
    with make_engine(bf16_lm, prefill_chunk_tokens=8) as engine:
        engine.ingest(DOCS)
        for spec in specs:
            if spec["mode"] == "prefix":
                _generate(engine, spec)
        alone = [_generate(engine, spec) for spec in specs]
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            for _ in range(3):
                for a, b in zip(alone, _at_once(engine, specs), strict=True):
                    assert b is not None and a.token_ids == b.token_ids
                    assert torch.equal(a.first_token_logprobs, b.first_token_logprobs)
        finally:
            hog.kill()
            hog.wait()


def test_products_of_one_to_three_rows_equal_the_same_rows_inside_a_64_row_product():
    """`rows4`: a float32 row-wise product's rows the same bits alone (1-3 rows) as inside 64 rows, at
    SmolLM2's widths (MKL: the rows past the last multiple of 4 took other kernels on an AMD EPYC;
    every count on a Xeon without MKL's strict mode, `blend.model.mkl`). bfloat16 products: below."""
    from blend.model.runner import rows4

    g = torch.Generator().manual_seed(1)
    for out_f, in_f in ((576, 1536), (960, 576), (3072, 576)):
        w = torch.randn((out_f, in_f), generator=g) * 0.05
        x = torch.randn((64, in_f), generator=g)
        full = torch.nn.functional.linear(x, w)
        for n in (1, 2, 3):
            for r in range(0, 64 - n, 3):
                assert torch.equal(rows4(lambda t, w=w: torch.nn.functional.linear(t, w), x[r:r + n]), full[r:r + n])


# The dense bfloat16 layouts a CPU runs: oneDNN's prepacked products where its bfloat16 kernels
# exist (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), the modules' F.linear everywhere (the layout
# `projection_layout` gives a CPU without them, an AVX2-only one).
DENSE_LAYOUTS = [pytest.param(PACKED, marks=pytest.mark.skipif(
                     projection_layout(torch.device("cpu"), torch.bfloat16) != PACKED,
                     reason="oneDNN's bfloat16 products need avx512bw + avx512vl + avx512dq or avx_ne_convert")),
                 MODULES]


@pytest.mark.parametrize("dense", DENSE_LAYOUTS)
def test_an_item_s_bfloat16_rows_equal_themselves_alone_whatever_shares_the_product(dense):
    """`projections.Linear` with `cuts` (the step's items' row counts): in bfloat16 each item gets a
    product of its own, so an item's rows are the same bits alone as beside other items, decode rows
    first (`lead`) or not: at few rows (oneDNN's AMX kernels on a Xeon vary with the row count at
    SmolLM2's down projection) and where the step's rows pass PACKED_MAX_ROWS while the item's
    alone do not (200 beside 100: another kernel; 15 of their 300 rows of the 576 -> 960 product
    differed there on a Xeon, with one product for all)."""
    from blend.model.projections import Linear

    g = torch.Generator().manual_seed(3)
    for out_f, in_f in ((576, 1536), (960, 576), (3072, 576)):
        lin = Linear([(torch.randn((out_f, in_f), generator=g) * 0.05).to(torch.bfloat16)], [None], dense=dense)
        items = [torch.randn((n, in_f), generator=g).to(torch.bfloat16) for n in (7, 150, 2, 13, 200, 100)]
        alone = [lin(x) for x in items]
        together = lin(torch.cat(items), cuts=tuple(len(x) for x in items))
        assert torch.equal(together, torch.cat(alone)), (out_f, in_f)
        qkv = lin.split(torch.cat(items), cuts=tuple(len(x) for x in items))[0]
        assert torch.equal(qkv, torch.cat(alone)), (out_f, in_f)
        decode = torch.randn((3, in_f), generator=g).to(torch.bfloat16)  # decode rows first: one product of their own
        led = lin(torch.cat([decode, *items]), lead=3, cuts=tuple(len(x) for x in items))
        assert torch.equal(led, torch.cat([lin(decode), *alone])), (out_f, in_f)


@pytest.mark.parametrize("dense", DENSE_LAYOUTS)
def test_a_projection_of_one_bfloat16_row_equals_the_row_among_others(dense):
    """`projections.Linear` pads a single bfloat16 row itself where one row takes another kernel
    (checked once per shape, `one_row_differs`), so at SmolLM2's and Gemma 3's widths a row's bits
    are the same alone as inside a larger product (the runner no longer pads every product)."""
    from blend.model.projections import Linear

    g = torch.Generator().manual_seed(2)
    for out_f, in_f in ((576, 1536), (640, 2048), (960, 576), (3072, 576)):
        lin = Linear([(torch.randn((out_f, in_f), generator=g) * 0.05).to(torch.bfloat16)], [None], dense=dense)
        x = torch.randn((48, in_f), generator=g).to(torch.bfloat16)
        full = lin(x)
        for r in range(48):
            assert torch.equal(lin(x[r:r + 1]), full[r:r + 1]), (out_f, in_f, r)
