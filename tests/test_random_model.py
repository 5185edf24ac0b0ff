"""random:<shape> models: built in place on the device, deterministic per seed, finite,
runnable by the layerwise runner; the big shapes checked on the meta device only."""

from __future__ import annotations

import pytest
import torch

from blend.model.loading import RANDOM_SHAPES, load_model, load_random_model, random_config
from blend.model.runner import Runner


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_random_tiny_is_deterministic_per_seed_and_finite():
    lm = load_model("random:tiny", device="cpu")
    assert lm.random_weights and lm.source == "random:tiny" and lm.dtype == torch.float32
    d = lm.dims
    assert (d.arch, d.num_layers, d.hidden_size, d.num_heads, d.kv_heads, d.head_dim) == ("llama", 4, 128, 4, 2, 32)
    assert lm.model.lm_head.weight is lm.model.model.embed_tokens.weight  # tied again after to_empty
    assert lm.tokenizer is not None and len(lm.tokenizer) <= d.vocab_size
    again = load_random_model("tiny", device="cpu", seed=0)
    assert _same_weights(lm.model, again.model) and again.fingerprint == lm.fingerprint
    other = load_random_model("tiny", device="cpu", seed=1)
    assert not _same_weights(lm.model, other.model) and other.fingerprint != lm.fingerprint
    half = load_model("random:tiny", device="cpu", dtype="bfloat16")
    assert half.dtype == torch.bfloat16 and half.fingerprint != lm.fingerprint
    assert half.model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = lm.tokenizer("Random weights, real tokenizer.", return_tensors="pt").input_ids
    with torch.inference_mode():
        for model in (lm.model, half.model):
            logits = model(ids).logits
            assert torch.isfinite(logits).all() and logits.float().std() > 0


def test_random_tiny_runs_through_the_runner():
    lm = load_model("random:tiny", device="cpu")
    runner = Runner(lm)
    ids = lm.tokenizer("The runner prefills and decodes a random model.", return_tensors="pt").input_ids[0]
    with torch.inference_mode():
        ref = lm.model(ids[None]).logits[0].float()
    cache = runner.new_cache(len(ids))
    out = runner.prefill(ids, cache, logit_rows=range(len(ids)))
    assert (out - ref).abs().max() < 1e-4
    cache = runner.new_cache(len(ids))
    ours = runner.decode(runner.prefill(ids, cache)[0], cache, 8)
    with torch.inference_mode():
        gen = lm.model.generate(ids[None], max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                pad_token_id=lm.tokenizer.pad_token_id)[0, len(ids):].tolist()
    assert ours == gen and cache.length == len(ids) + 7


def test_unknown_shape_and_unavailable_device_name_the_fix():
    valid = ", ".join(sorted(RANDOM_SHAPES))
    with pytest.raises(ValueError, match=f"unknown random model shape 'llama-9t'.*one of: {valid}"):
        load_model("random:llama-9t", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' is not available.*use device='cpu'"):
            load_model("random:tiny", device="cuda")


def test_big_shapes_on_the_meta_device():
    lm = load_model("random:llama-3-8b", device="meta")
    assert lm.random_weights and lm.device.type == "meta"
    assert all(p.device.type == "meta" for p in lm.model.parameters())  # nothing allocated
    d = lm.dims
    assert (d.num_layers, d.hidden_size, d.num_heads, d.kv_heads, d.head_dim, d.vocab_size) == (
        32, 4096, 32, 8, 128, 128256)
    assert lm.config.intermediate_size == 14336 and lm.config.rope_parameters["rope_theta"] == 500000.0
    assert not lm.config.tie_word_embeddings
    assert sum(p.numel() for p in lm.model.parameters()) == 8_030_261_248  # Meta-Llama-3-8B
    assert d.kv_bytes_per_token(2) == 128 * 1024  # 128 KiB of bf16 K/V per token

    qwen = load_model("random:qwen2.5-7b", device="meta", dtype="bfloat16")
    d = qwen.dims
    assert (d.arch, d.num_layers, d.hidden_size, d.num_heads, d.kv_heads, d.head_dim, d.vocab_size) == (
        "qwen2", 28, 3584, 28, 4, 128, 152064)
    assert qwen.config.intermediate_size == 18944 and qwen.config.rope_parameters["rope_theta"] == 1e6
    assert qwen.model.model.layers[0].self_attn.k_proj.bias is not None
    assert sum(p.numel() for p in qwen.model.parameters()) == 7_615_616_512  # Qwen2.5-7B
    assert qwen.fingerprint != lm.fingerprint

    small = random_config("llama-3.2-1b")
    assert (small.num_hidden_layers, small.hidden_size, small.num_attention_heads, small.num_key_value_heads,
            small.head_dim, small.intermediate_size, small.vocab_size) == (16, 2048, 32, 8, 64, 8192, 128256)
    assert small.tie_word_embeddings and small.rope_parameters["rope_type"] == "llama3"
    assert small.rope_parameters["factor"] == 32.0
