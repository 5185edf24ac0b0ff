"""A sliding layer's decode cache is a ring of window + slack slots: decoding across the window
boundary, multi-token continuations and the stale-key bias give what a linear cache gives,
with the sliding layers' memory bounded."""

from __future__ import annotations

import copy

import pytest
import torch

import blend.model.cache as cache_module
from blend.decode.sampling import SamplingParams
from tests.models import tiny_model
from tests.test_hybrid_blend import make_engine
from tests.test_engine import DOCS, QUESTION


@pytest.fixture
def small_slack(monkeypatch):
    monkeypatch.setattr(cache_module, "RING_SLACK", 3)  # rings of 16 + 3 slots: they wrap within a short test
    return 19


def _runner():
    from blend.model.runner import Runner

    return Runner(tiny_model("gemma3_text", vocab_size=256))


def test_ring_decode_equals_the_linear_cache_and_stays_bounded(small_slack):
    runner = _runner()
    ids = torch.randint(0, 256, (130,), generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        linear = runner.new_cache(130)
        ring = runner.new_cache(130)
        first_linear = runner.prefill(ids[:30], linear)
        first_ring = runner.prefill(ids[:30], ring)
        assert torch.equal(first_linear, first_ring)
        ring.compact_()
        assert [t.shape[1] for t in ring.k] == [small_slack, small_slack, 130, small_slack]
        for pos in range(30, 130):  # 100 steps: each ring wraps five times
            a = runner.step(int(ids[pos]), linear)
            b = runner.step(int(ids[pos]), ring)
            assert (a - b).abs().max() < 1e-5, f"position {pos}"
        ring.ensure_capacity(500)
        assert [t.shape[1] for t in ring.k] == [small_slack, small_slack, 500, small_slack]  # the rings stay put
        assert ring.nbytes() < linear.nbytes()


@pytest.mark.parametrize("chunk", [1, 5, 40])
def test_multi_token_continuations_into_a_wrapped_ring(small_slack, chunk):
    runner = _runner()
    ids = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        ref = runner.prefill(ids, runner.new_cache(150), logit_rows=range(150))
        ring = runner.new_cache(150, ring=True)
        assert ring.k[0].shape[1] == small_slack
        runner.prefill(ids[:50], ring, logit_rows=())
        got = []
        for start in range(50, 150, chunk):
            part = ids[start:start + chunk]
            got.append(runner.prefill(part, ring, start=start, logit_rows=range(part.numel())))
    assert (torch.cat(got) - ref[50:]).abs().max() < 1e-4
    with pytest.raises(ValueError, match="no longer holds position"):
        ring.window(0, 10, 20)


def test_blend_decoding_through_rings_keeps_the_stale_bias(small_slack):
    with make_engine() as engine:
        engine.ingest(DOCS)
        prompt = engine.build_prompt(QUESTION, DOCS)
        pre = engine.prefill(prompt, mode="blend", ratio=0.3, capacity=len(prompt) + 40)
        assert pre.cache.bias is not None  # the stale-key correction is on
        reference = copy.deepcopy(pre.cache)
        tokens = engine.runner.decode(pre.logits, reference, 40)  # linear cache throughout
        result = engine.decoder.finish(pre, 0.0, 0.0, 40, SamplingParams(0.0, 1.0))
        assert pre.cache.is_ring(0) and pre.cache.k[0].shape[1] == small_slack
    assert result.token_ids == tokens[:len(result.token_ids)] and len(result.token_ids) >= 10
