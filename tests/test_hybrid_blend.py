"""Blend on a hybrid model (tiny Gemma 3: sliding layers of 16 tokens around a global one):
ratio 1 equals full, ratio 0 equals reuse, reused KV at sliding layers is the document's own
KV re-rotated with each layer's RoPE, prefix mode is exact, every selection runs."""

from __future__ import annotations

import pytest
import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.recompute.selector import SELECTIONS, query_attention, query_probs
from eval.metrics import kl_divergence
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_engine import DOCS, QUESTION


def make_engine(chunk_tokens=16, **engine_overrides) -> BlendEngine:
    lm = tiny_model("gemma3_text", tokenizer=smollm2_tokenizer())
    assert lm.dims.window == 16
    engine_overrides.setdefault("split", "off")
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                        chunk_tokens=chunk_tokens, **engine_overrides)
    return BlendEngine(cfg, model=lm)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("selection", SELECTIONS)
def test_ratio_one_equals_full_and_zero_equals_reuse(selection):
    with make_engine(selection=selection) as engine:
        engine.ingest(DOCS)
        prompt = engine.build_prompt(QUESTION, DOCS)
        assert len(prompt) > 4 * 16  # the prompt crosses the window several times
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=6)
        one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=6)
        reuse = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=6)
        zero = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.0, max_new_tokens=6)
        half = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.5, max_new_tokens=6)
    assert maxdiff(full.first_token_logprobs, one.first_token_logprobs) < 1e-4
    assert one.token_ids == full.token_ids
    assert maxdiff(reuse.first_token_logprobs, zero.first_token_logprobs) == 0.0 and reuse.token_ids == zero.token_ids
    assert maxdiff(reuse.first_token_logprobs, full.first_token_logprobs) > 1e-3
    assert torch.isfinite(half.first_token_logprobs).all()
    assert kl_divergence(full.first_token_logprobs, half.first_token_logprobs) < kl_divergence(
        full.first_token_logprobs, reuse.first_token_logprobs)


def test_reused_kv_at_every_layer_type_equals_the_document_computed_at_its_offset():
    with make_engine(chunk_context="none") as engine:
        engine.ingest(DOCS)
        docs = [DOCS[2], DOCS[0], DOCS[1]]
        prompt = engine.build_prompt(QUESTION, docs)
        pre = engine.prefill(prompt, mode="reuse")
        assert pre.stats.documents.misses == 0
        runner = engine.runner
        for seg in prompt.documents:  # the document alone, its first token at seg.start
            ids = torch.tensor(seg.token_ids)
            cache = runner.new_cache(seg.end)
            with torch.inference_mode():
                h = runner.embed(ids)
                positions = torch.arange(seg.start, seg.end)
                for layer in range(runner.num_layers):
                    q, k, v = runner.heads_qkv(layer, h, positions)
                    cache.k[layer][:, seg.start:seg.end], cache.v[layer][:, seg.start:seg.end] = k, v
                    # positions relative to the document: its own window, as when it was ingested
                    local = torch.arange(seg.end - seg.start)
                    attn = runner.attend(q, local, k, v, window=runner.windows[layer])
                    h = runner.finish(layer, h, attn)
            for layer in range(runner.num_layers):
                assert maxdiff(pre.cache.k[layer][:, seg.start:seg.end], cache.k[layer][:, seg.start:seg.end]) < 1e-4
                assert maxdiff(pre.cache.v[layer][:, seg.start:seg.end], cache.v[layer][:, seg.start:seg.end]) < 1e-4


def test_prefix_mode_is_exact_on_a_hybrid_model():
    with make_engine() as engine:
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=4)
        engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=4)
        second = engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=4)
    assert second.stats.loaded_tokens > 0
    assert maxdiff(full.first_token_logprobs, second.first_token_logprobs) < 1e-4
    assert second.token_ids == full.token_ids


def test_query_scores_see_only_each_rows_window():
    torch.manual_seed(0)
    hkv, g, q_rows, n, d, w = 2, 2, 3, 40, 8, 10
    q, k = torch.randn(hkv * g, q_rows, d), torch.randn(hkv, n, d)
    probs = query_probs(q, k, 0.3, n - q_rows, window=w)  # (Hkv, g*Q, N)
    rows = torch.arange(n - q_rows, n).repeat(g)
    keys = torch.arange(n)
    outside = (keys[None, :] <= rows[:, None] - w) | (keys[None, :] > rows[:, None])
    assert float(probs[:, outside].abs().max()) == 0.0
    assert torch.allclose(probs.sum(-1), torch.ones(hkv, g * q_rows))
    assert float(query_attention(q, k, 0.3, window=w)[: n - q_rows - w + 1].max()) == 0.0
    assert float(query_attention(q, k, 0.3)[:5].min()) > 0.0
