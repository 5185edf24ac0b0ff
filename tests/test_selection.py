"""Token selection for every policy and layout: the ratio end points, the budget, nesting,
forced sink rows, and query-driven selection finding planted tokens."""

from __future__ import annotations

import math

import pytest
import torch

from blend.engine.engine import BlendEngine
from blend.recompute.selector import SELECTIONS, QueryAttention, query_probs, select_top
from tests.test_engine import DOCS, QUESTION, make_engine, maxdiff

LAYOUTS = [("none", 0), ("system", 0), ("none", 3), ("system", 3)]


def _candidates(engine: BlendEngine, prompt) -> set[int]:
    """Context rows whose cached KV is not exact at their prompt position."""
    exact = {prompt.prefix}
    if engine.config.engine.blend.chunk_context == "system":
        exact.add(prompt.documents[0])
    return {p for s in prompt.segments if s.kind != "query" and s not in exact for p in range(s.start, s.end)}


@pytest.mark.parametrize("selection", SELECTIONS)
@pytest.mark.parametrize(("layout", "sink"), LAYOUTS)
def test_every_policy_and_layout_ratio_end_points_and_budget(selection, layout, sink):
    with make_engine(chunk_tokens=16, chunk_context=layout, sink_tokens=sink, selection=selection) as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=2)
        reuse = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=2)
        one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=2)
        zero = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.0, max_new_tokens=2)
        prompt = engine.build_prompt(QUESTION, DOCS)
        candidates = _candidates(engine, prompt)
        for ratio in (0.05, 0.2):
            pre = engine.prefill(prompt, mode="blend", ratio=ratio)
            n_ctx = pre.stats.context_tokens
            assert math.ceil(ratio * n_ctx) < len(candidates)
            rows = pre.stats.selection.selected_rows[-1]
            assert rows.numel() == pre.stats.recomputed_tokens == math.ceil(ratio * n_ctx)
            assert torch.equal(rows, rows.unique(sorted=True))  # sorted, no repeats
            assert set(rows.tolist()) <= candidates  # never an exact row
            if sink:
                sinks = {d.start + i for d in prompt.documents if d.start in candidates for i in range(sink)}
                assert sinks <= set(rows.tolist())  # the sink rows count inside the budget
    assert maxdiff(full.first_token_logprobs, one.first_token_logprobs) < 1e-4
    assert one.token_ids == full.token_ids and one.stats.recomputed_tokens == one.stats.context_tokens
    assert maxdiff(reuse.first_token_logprobs, zero.first_token_logprobs) == 0.0
    assert zero.token_ids == reuse.token_ids and zero.stats.recomputed_tokens == 0


@pytest.mark.parametrize("selection", SELECTIONS)
def test_gradual_filtering_nests_for_every_policy(selection):
    """Check-layer policies shrink at layers 1, 2, 3; `query` keeps a pool of 2.5x the
    budget from its query pass (layer 0) and narrows it at the same check layers."""
    pool = {"query_pool": 2.5} if selection == "query" else {}  # a knob of `query` only
    with make_engine(check_layers=[1, 2, 3], filter_schedule=[2.0, 1.5, 1.0], selection=selection,
                     sink_tokens=2, chunk_context="none", **pool) as engine:
        engine.ingest(DOCS)
        result = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.2, max_new_tokens=2)
    n_ctx = result.stats.context_tokens
    counts = list(result.stats.selection.selected_per_layer)
    expected = [math.ceil(0.4 * n_ctx), math.ceil(0.3 * n_ctx), math.ceil(0.2 * n_ctx)]
    if selection == "query":
        assert result.stats.selection.check_layers == (0, 1, 2, 3)
        expected = [math.ceil(0.5 * n_ctx), *expected]
    assert counts == expected and result.stats.recomputed_tokens == expected[-1]
    sets = [set(s.tolist()) for s in result.stats.selection.selected_rows]
    assert all(a > b for a, b in zip(sets, sets[1:], strict=False))
    assert all(torch.equal(s, s.unique(sorted=True)) for s in result.stats.selection.selected_rows)


def test_select_top_takes_forced_rows_first():
    rows = torch.arange(10, 20)
    scores = torch.arange(10.0)  # the last rows score highest
    forced = torch.zeros(10, dtype=torch.bool)
    forced[[0, 1, 2]] = True
    assert select_top(scores, rows, 5, forced).tolist() == [10, 11, 12, 18, 19]
    assert select_top(scores, rows, 2, forced).tolist() == [10, 11]  # more forced rows than budget: the first
    assert select_top(scores, rows, 3).tolist() == [17, 18, 19]


def test_query_probs_equal_an_explicit_causal_softmax_per_head():
    torch.manual_seed(1)
    heads, kv_heads, tq, n, d = 6, 2, 5, 40, 8
    q, k = torch.randn(heads, tq, d), torch.randn(kv_heads, n, d)
    probs = query_probs(q, k, d ** -0.5, q_start=n - tq)  # (Hkv, g*Q, N)
    g = heads // kv_heads
    for h in range(heads):
        scores = (q[h] @ k[h // g].T) * d ** -0.5  # (Q, N)
        visible = torch.arange(n)[None, :] <= (n - tq + torch.arange(tq))[:, None]
        expected = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        rows = probs[h // g, (h % g) * tq:(h % g + 1) * tq]  # head-major rows of its KV head
        assert torch.allclose(rows, expected, atol=1e-6)
    with pytest.raises(ValueError, match="last ones"):
        query_probs(q, k, d ** -0.5, q_start=n - tq - 1)


def test_query_attention_is_a_causal_distribution_fused_over_layers():
    torch.manual_seed(0)
    q, k = torch.randn(4, 3, 8), torch.randn(2, 10, 8)  # 3 query rows at positions 7, 8, 9
    probs = query_probs(q, k, 8 ** -0.5, q_start=7)
    assert probs.shape == (2, 6, 10)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 6))
    assert float(probs[:, 0, 8:].abs().max()) == 0.0  # the first query row does not see later rows
    fused = QueryAttention(7)
    fused.add(0, probs, torch.randn(2, 10, 8))  # layer 0 is not fused
    assert torch.allclose(fused.scores(), torch.full((7,), 1 / 7))
    for layer in (1, 2):
        fused.add(layer, probs, torch.randn(2, 10, 8))
    assert fused.scores().shape == (7,) and abs(float(fused.scores().sum()) - 1.0) < 1e-5


def test_query_selection_recomputes_from_layer_zero_without_full_early_layers():
    with make_engine(selection="query") as engine:
        engine.ingest(DOCS)
        result = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.2, max_new_tokens=2)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=2)
        reuse = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=2)
    assert result.stats.selection.check_layers == (0,)  # selected before layer 0
    from eval.metrics import kl_divergence

    kl_blend = kl_divergence(full.first_token_logprobs, result.first_token_logprobs)
    kl_reuse = kl_divergence(full.first_token_logprobs, reuse.first_token_logprobs)
    assert kl_blend < kl_reuse


@pytest.mark.slow
def test_query_selection_picks_planted_tokens():
    """One planted sentence among ~1.4k tokens of unrelated passages decides the answer
    (reuse answers about another passage): at a 5% budget, query-driven selection
    recomputes the planted tokens that the question names, and answers like full prefill."""
    from blend.config import EngineConfig
    from eval.samples import sample_documents
    from tests.models import smollm2

    texts = [t[:1400] for _, t in sample_documents()[:4]]
    planted = "Professor Ilsa Vantoor discovered the comet Brighthollow in 1931."
    texts[2] = texts[2][:700] + " " + planted + " " + texts[2][700:]
    question = "Which comet did Ilsa Vantoor discover?"
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "1GiB"}]},
                                        selection="query")
    with BlendEngine(cfg, model=smollm2()) as engine:
        engine.ingest(texts)
        prompt = engine.build_prompt(question, texts)
        full = engine.generate(question, texts, mode="full", max_new_tokens=6)
        reuse = engine.generate(question, texts, mode="reuse", max_new_tokens=6)
        blend = engine.generate(question, texts, mode="blend", recompute_ratio=0.05, max_new_tokens=6)
        tok = engine.lm.tokenizer
    named = tok(" Ilsa Vantoor discovered the comet", add_special_tokens=False).input_ids
    doc = prompt.documents[2]
    ids = list(doc.token_ids)
    at = next(i for i in range(len(ids)) if ids[i:i + len(named)] == named)
    planted_rows = {doc.start + at + j for j, t in enumerate(named) if tok.decode([t]).strip() != "the"}
    chosen = set(blend.stats.selection.selected_rows[-1].tolist())
    assert len(chosen) == math.ceil(0.05 * blend.stats.context_tokens)
    assert len(planted_rows & chosen) >= 0.75 * len(planted_rows), sorted(planted_rows - chosen)
    assert reuse.text != full.text and blend.text == full.text
