"""A sliding layer's decode cache is a ring of window + slack slots: decoding across the window
boundary, multi-token continuations and the stale-key bias give what a linear cache gives,
with the sliding layers' memory bounded."""

from __future__ import annotations

import pytest
import torch

import blend.model.cache as cache_module
from tests.models import tiny_model
from tests.test_engine import DOCS, QUESTION
from tests.test_hybrid_blend import make_engine


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
        tokens = engine.runner.decode(pre.logits, pre.cache, 40)  # linear cache throughout
        # the scheduler compacts the prompt's cache into rings before its batched decode steps
        result = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=40)
    assert result.token_ids == tokens[:len(result.token_ids)] and len(result.token_ids) >= 10


def test_batched_decode_of_ring_and_linear_caches_equals_alone(small_slack):
    runner = _runner()
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(9))
    with torch.inference_mode():
        caches, refs = [], []
        for n in (20, 35, 50):  # each sequence at its own length; two compacted into rings
            cache = runner.new_cache(n + 30)
            runner.prefill(ids[:n], cache)
            ref = runner.new_cache(n + 30)
            runner.prefill(ids[:n], ref)
            caches.append(cache)
            refs.append(ref)
        caches[0].compact_()
        caches[2].compact_()
        for step in range(25):  # every ring wraps
            tokens = [int(ids[(step * 7 + b) % 60]) for b in range(3)]
            batched = runner.decode_step(tokens, caches)
            alone = torch.stack([runner.decode_step([t], [r])[0] for t, r in zip(tokens, refs, strict=True)])
            assert (batched - alone).abs().max() < 1e-4, f"step {step}"
    assert caches[0].k[0].shape[1] == small_slack and refs[0].k[0].shape[1] == 50


def test_parking_a_cache_with_rings_restores_the_same_cache(small_slack):
    with make_engine() as engine:
        engine.ingest(DOCS)
        prompt = engine.build_prompt(QUESTION, DOCS)
        pre = engine.prefill(prompt, mode="blend", ratio=0.3, capacity=len(prompt) + 60)
        cache, runner = pre.cache, engine.runner
        cache.compact_()
        ids, logits = list(prompt.token_ids), pre.logits
        for _ in range(25):  # the rings wrap: the parked window is a ring's positions
            token = int(torch.argmax(logits))
            logits = runner.step(token, cache)
            ids.append(token)
        parking = engine.scheduler.parking
        parked = parking.park(ids[: cache.length], cache)
        assert parked.split is not None and parked.window[2] - parked.window[1] == small_slack
        restored = parking.restore(parked, cache.length + 30)
        assert restored is not None and restored.rings == cache.rings and restored.length == cache.length
        for _ in range(20):
            token = int(torch.argmax(logits))
            logits = runner.step(token, cache)
            again = runner.step(token, restored)
            assert (logits - again).abs().max() < 1e-5
        parking.release(parked)
        engine.store.flush()
        assert not [k for k in engine.store.keys() if k.startswith("s")]  # parked entries deleted


def test_growth_bytes_count_the_linear_layers_only_once_rings_exist(small_slack):
    runner = _runner()
    cache = runner.new_cache(40)
    per_slot = 2 * runner.kv_heads * runner.head_dim * 4  # K and V, float32
    assert cache.growth_bytes(100) == 4 * 60 * per_slot  # every layer grows before compaction
    with torch.inference_mode():
        runner.prefill(torch.arange(30), cache, logit_rows=())
    cache.compact_()
    assert cache.growth_bytes(100) == 1 * 60 * per_slot  # the global layer only: the rings are full size
    cache.ensure_capacity(100)
    assert cache.allocated_bytes() == (100 + 3 * small_slack) * per_slot
