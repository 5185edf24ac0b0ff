"""`kvblend bench ttft`'s compute-bound references: rows and (query, key) pairs per layer of
each mode, `ideal_speedup` and `bound_speedup`, and one run on a tiny model."""

from __future__ import annotations

import argparse

import pytest
import torch

from blend.model import native
from eval.bench.ttft import (
    blend_rows_per_layer,
    blend_work,
    bound_speedup,
    causal_pairs,
    ideal_speedup,
    run_ttft,
)
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_engine import DOCS, QUESTION, make_engine


def test_bound_speedup_prices_attention_by_the_pairs_computed():
    n, layers = 100, 3
    layer_s, attention_s = [1.0, 1.0, 0.5], [0.4, 0.4, 0.0]
    everything = [(n, n * (n + 1) // 2)] * (layers - 1) + [(n, n)]
    assert bound_speedup(layer_s, attention_s, everything, n) == pytest.approx(1.0)
    # 10 rows at the end of the prompt: 10% of the rows but ~19% of the pairs
    late = torch.arange(90, 100)
    work = [(10, causal_pairs(late))] * (layers - 1) + [(10, n)]
    linear = sum(t - a for t, a in zip(layer_s, attention_s, strict=True)) * 0.1
    attention = 0.8 * causal_pairs(late) / (n * (n + 1) // 2)
    assert bound_speedup(layer_s, attention_s, work, n) == pytest.approx(sum(layer_s) / (linear + attention))
    assert bound_speedup(layer_s, attention_s, work, n) < ideal_speedup(layer_s, [10] * layers, n)
    # the same number of rows at the start of the prompt attend over far fewer keys
    early = [(10, causal_pairs(torch.arange(10)))] * (layers - 1) + [(10, n)]
    assert bound_speedup(layer_s, attention_s, early, n) > ideal_speedup(layer_s, [10] * layers, n)
    # with no time in attention the bound is the rows-only ideal
    assert bound_speedup(layer_s, [0.0] * layers, work, n) == pytest.approx(ideal_speedup(layer_s, [10] * layers, n))


@pytest.mark.parametrize("selection", ["query", "deviation"])
def test_blend_work_follows_what_each_mode_computed(selection):
    with make_engine(selection=selection) as engine:
        engine.ingest(DOCS)
        layers = engine.runner.num_layers
        n = len(engine.build_prompt(QUESTION, DOCS))
        runs = {r: engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=r, max_new_tokens=1).stats
                for r in (0.0, 0.3, 1.0)}
    q = runs[0.0].query_tokens
    query = torch.arange(n - q, n)
    # reuse: the query rows only (and, with the query policy, no query pass: nothing to select)
    assert blend_work(runs[0.0], layers, n) == [(q, causal_pairs(query))] * (layers - 1) + [(q, n)]
    assert blend_rows_per_layer(runs[0.0], layers, n) == [q] * layers
    # ratio 1: every row everywhere, nothing loaded: exactly a full prefill's work
    full = [(n, n * (n + 1) // 2)] * (layers - 1) + [(n, n)]
    assert blend_work(runs[1.0], layers, n) == full
    assert blend_rows_per_layer(runs[1.0], layers, n) == [n] * layers
    assert bound_speedup([1.0] * layers, [0.5] * layers, blend_work(runs[1.0], layers, n), n) == pytest.approx(1.0)
    # a selection: its kept rows and the query from its check layer on
    stats = runs[0.3]
    kept = torch.cat([stats.selection.selected_rows[-1], query])
    work = blend_work(stats, layers, n)
    if selection == "query":  # selected before layer 0, plus the query pass's rows at every layer
        assert work[0] == (kept.numel() + q, causal_pairs(kept) + causal_pairs(query))
        assert work[-1] == (kept.numel() + q, n + causal_pairs(query))
    else:  # every row before check layer 1
        assert work[0] == full[0]
        assert work[1] == (kept.numel(), causal_pairs(kept))


def test_bench_ttft_reports_both_bounds_on_a_tiny_model(tmp_path):
    lm = tiny_model(tokenizer=smollm2_tokenizer())
    # a tiny model's layers cost about the same for any row count, so the load-or-compute split
    # would often (by timing) compute the blends whole: off, so the ratios compute what they say
    config = tmp_path / "bench.yaml"
    config.write_text("engine:\n  blend:\n    split: \"off\"\n")
    args = argparse.Namespace(config=str(config), chunks=3, chunk_tokens=64, ratios="0,0.3,1", tiers="cpu", repeats=1,
                              redis_url=None, cluster_urls=None, model=None, dtype=None, device=None, kv_dtype=None)
    summary = run_ttft(args, lm=lm)
    rows = {r["ratio"]: r for r in summary["results"]}
    assert set(rows) == {0.0, 0.3, 1.0}
    assert summary["attention_layer_ms"] > 0
    assert summary["blend_attention"] == ("native" if native.blend_kernel() is not None else "torch")
    assert rows[1.0]["ideal_speedup"] == pytest.approx(1.0) and rows[1.0]["bound_speedup"] == pytest.approx(1.0)
    assert {r["split_taken"] for r in rows.values()} == {0}
    assert rows[0.0]["recomputed_tokens"] == 0 < rows[0.3]["recomputed_tokens"] < rows[1.0]["recomputed_tokens"]
    assert rows[0.0]["bound_speedup"] > rows[0.3]["bound_speedup"] > 1.0
    # one repeat per setting: no spread; the CPU probe ran at both ends
    assert summary["widest_spread"] == 0.0 and summary["probe_gflops_start"] > 0 and summary["probe_gflops_end"] > 0
    assert isinstance(summary["unsteady"], bool)
