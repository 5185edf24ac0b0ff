"""kvblend's KV handed to transformers (blend.engine.handoff): the cache's layout, the model's
own `generate` continuing from it, blend's stale-key bias carried or left out, refusals."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.engine.handoff import KVBlendCache
from blend.prompt.builder import SUMMARIZATION
from eval.metrics import kl_divergence
from tests.models import gemma3, smollm2
from tests.test_engine import DOCS, QUESTION, make_engine

MODES = ("full", "prefix", "reuse", "blend")


def continue_greedy(model, prepared, n: int) -> list[int]:
    """transformers' greedy continuation of a prepared prompt (its `generate`, as a user calls it)."""
    with warnings.catch_warnings():  # transformers 5.24 prefers `cache=`; `past_key_values=` still works
        warnings.simplefilter("ignore", FutureWarning)
        out = model.generate(prepared.input_ids, past_key_values=prepared.past_key_values, max_new_tokens=n,
                             do_sample=False)
    return out[0, prepared.input_ids.shape[1]:].tolist()


def first_token(model, prepared) -> torch.Tensor:
    """(vocab,) log-probs of transformers' last prompt position over the handed-over KV."""
    with torch.no_grad():
        out = model(prepared.input_ids[:, -1:], cache=prepared.past_key_values)
    return torch.log_softmax(out.logits[0, -1].float(), -1)


def own_first(prepared) -> torch.Tensor:
    return torch.log_softmax(prepared.logits.float(), -1)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_prepare_lays_out_every_mode(arch):
    with make_engine(arch) as engine:
        engine.ingest(DOCS)
        model = engine.transformers_model()
        windows = engine.runner.windows
        for mode in MODES:
            prepared = engine.prepare(QUESTION, DOCS, mode=mode, recompute_ratio=0.3)
            t = prepared.input_ids.shape[1]
            assert prepared.input_ids.shape == (1, len(engine.build_prompt(QUESTION, DOCS)))
            cache = prepared.past_key_values
            assert isinstance(cache, DynamicCache) and cache.get_seq_length() == t - 1
            for layer, window in zip(cache.layers, windows, strict=True):
                if window is None:
                    assert type(layer) is DynamicLayer and layer.keys.shape[-2] == t - 1
                else:  # transformers' sliding layer: the last window - 1 keys, every position counted
                    assert type(layer) is DynamicSlidingWindowLayer and layer.sliding_window == window
                    assert layer.keys.shape[-2] == min(t - 1, window - 1) and layer.cumulative_length == t - 1
            assert prepared.bias_carried == (mode == "blend") == isinstance(cache, KVBlendCache)
            # transformers computes the last position over kvblend's KV: kvblend's own first token
            assert kl_divergence(own_first(prepared), first_token(model, prepared)) < 1e-6, mode
        if arch == "gemma3_text":
            assert any(w is not None for w in windows) and len(engine.build_prompt(QUESTION, DOCS)) > max(
                w for w in windows if w is not None)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_full_handoff_continues_as_generate(arch):
    with make_engine(arch) as engine:
        model = engine.transformers_model()
        ref = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=32)
        got = continue_greedy(model, engine.prepare(QUESTION, DOCS, mode="full"), 32)
    assert len(ref.token_ids) == 32 and got == list(ref.token_ids)


def test_blend_handoff_with_and_without_the_bias():
    """The bias carried: the first token is blend's own (KL ~0) and greedy decoding follows
    kvblend's blend decode (which adds the bias at every step); without it the keys weigh
    as loaded, a measurable difference."""
    with make_engine() as engine:
        engine.ingest(DOCS)
        model = engine.transformers_model()
        carried = engine.prepare(QUESTION, DOCS, mode="blend", recompute_ratio=0.1)
        bare = engine.prepare(QUESTION, DOCS, mode="blend", recompute_ratio=0.1, carry_bias=False)
        assert carried.bias_carried and not bare.bias_carried and type(bare.past_key_values) is DynamicCache
        assert torch.equal(carried.logits, bare.logits)  # the same blend: only the hand-off differs
        got, got_bare = first_token(model, carried), first_token(model, bare)  # (each use extends its cache)
        with_bias, without = kl_divergence(own_first(carried), got), kl_divergence(own_first(bare), got_bare)
        assert with_bias < 1e-9 and without > 10 * with_bias and float((got - got_bare).abs().max()) > 1e-5
        carried = engine.prepare(QUESTION, DOCS, mode="blend", recompute_ratio=0.3)
        ref = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=16)
        assert continue_greedy(model, carried, len(ref.token_ids)) == list(ref.token_ids)


def test_prepare_refuses_what_generate_refuses():
    with make_engine() as engine:
        long_doc = "word " * 5000  # more tokens than the tiny model's 2048 positions
        with pytest.raises(ValueError) as by_generate:
            engine.generate(QUESTION, [long_doc], mode="full", max_new_tokens=1)
        with pytest.raises(ValueError) as by_prepare:
            engine.prepare(QUESTION, [long_doc], mode="full")
        assert str(by_prepare.value) == str(by_generate.value) and "positions" in str(by_prepare.value)
        with pytest.raises(ValueError, match="unknown mode"):
            engine.prepare(QUESTION, DOCS, mode="nope")
        with pytest.raises(TypeError, match="carry_bias"):
            engine.prepare(QUESTION, DOCS, carry_bias=1)


@pytest.mark.slow
@pytest.mark.parametrize("loader", [smollm2, gemma3], ids=["smollm2", "gemma3"])
def test_shipped_models_hand_off(loader):
    """Float32, the shipped models: transformers' 32 greedy tokens from kvblend's full-prefill KV
    are `generate(mode="full")`'s; from blend's KV (bias carried) its first token is blend's."""
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "256MiB"}]},
                                        split="off")
    with BlendEngine(cfg, model=loader()) as engine:
        model = engine.transformers_model()
        # a summary: 32 tokens of text before any end of sequence (a short answer would stop early)
        ref = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=32, template=SUMMARIZATION)
        got = continue_greedy(model, engine.prepare(QUESTION, DOCS, mode="full", template=SUMMARIZATION), 32)
        assert len(ref.token_ids) == 32 and got == list(ref.token_ids)
        engine.ingest(DOCS)
        for ratio in (0.05, 0.15):
            prepared = engine.prepare(QUESTION, DOCS, mode="blend", recompute_ratio=ratio)
            assert prepared.bias_carried
            assert kl_divergence(own_first(prepared), first_token(model, prepared)) <= 1e-4
