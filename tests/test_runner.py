"""Layerwise runner parity with transformers' own forward, exact masks, decoding."""

from __future__ import annotations

import pytest
import torch

from blend.decode.sampling import SamplingParams
from blend.model.attention import ATTN_GROUP_MIN, PAD_TO_CAUSAL
from blend.model.cache import KVCache
from blend.model.runner import Rows, Runner
from tests.models import smollm2, tiny_model


def _hf_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(ids[None]).logits[0].float()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_full_prefill_matches_transformers(arch):
    lm = tiny_model(arch, vocab_size=512, attention_bias=(arch == "qwen2"))
    runner = Runner(lm)
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(lm, ids)
    cache = runner.new_cache(40)
    all_rows = runner.prefill(ids, cache, logit_rows=range(37))
    diff = (all_rows - ref).abs()
    assert diff.max() < 1e-4, f"max {diff.max():.2e} mean {diff.mean():.2e}"
    last = runner.prefill(ids, runner.new_cache(37))
    assert (last[0] - ref[-1]).abs().max() < 1e-4


def test_qwen2_has_qkv_bias_and_parity():
    lm = tiny_model("qwen2", vocab_size=512)
    assert lm.model.model.layers[0].self_attn.q_proj.bias is not None
    ids = torch.arange(20) * 7 % 512
    ref = _hf_logits(lm, ids)[-1]
    out = Runner(lm).prefill(ids, Runner(lm).new_cache(20))[0]
    assert (out - ref).abs().max() < 1e-4


def test_scattered_queries_match_full_causal_rows():
    lm = tiny_model("llama", vocab_size=512)
    runner = Runner(lm)
    n = 50
    ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(n)
    h = runner.embed(ids)
    subset = torch.tensor([0, 3, 4, 17, 31, 32, 49])
    with torch.inference_mode():
        q, k, v = runner.heads_qkv(0, h, positions)
        full = runner.attend(q, positions, k, v)  # (T, H*D), is_causal path
        part = runner.attend(q[:, subset], positions[subset], k, v)  # explicit mask path
        # reference with an explicit materialised mask for the full causal range
        mask = torch.ones(n, n, dtype=torch.bool).tril()
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[None], k[None], v[None], attn_mask=mask, scale=runner.scaling, enable_gqa=True)[0]
    ref = ref.transpose(0, 1).reshape(n, -1)
    assert (full - ref).abs().max() < 1e-5
    assert (part - full[subset]).abs().max() < 1e-5
    # finishing the layer for the subset only equals the same rows of the full layer
    with torch.inference_mode():
        assert (runner.finish(0, h[subset], part) - runner.finish(0, h, full)[subset]).abs().max() < 1e-5


def test_dense_query_sets_use_the_causal_block_exactly():
    lm = tiny_model("llama", vocab_size=512)
    runner = Runner(lm)
    n = 64
    h = runner.embed(torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(8)))
    positions = torch.arange(n)
    with torch.inference_mode():
        q, k, v = runner.heads_qkv(0, h, positions)
        full = runner.attend(q, positions, k, v)
        for subset in (torch.arange(10, 64), torch.arange(1, 64, 1), torch.tensor([0] + list(range(3, 64)))):
            assert subset.numel() >= PAD_TO_CAUSAL * n  # takes the padded causal path
            out = runner.attend(q[:, subset], positions[subset], k, v)
            assert (out - full[subset]).abs().max() < 1e-5


def test_grouped_masked_attention_is_exact():
    lm = tiny_model("llama", vocab_size=512)
    runner = Runner(lm)
    n = 400
    h = runner.embed(torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(9)))
    positions = torch.arange(n)
    with torch.inference_mode():
        q, k, v = runner.heads_qkv(0, h, positions)
        full = runner.attend(q, positions, k, v)
        for subset in (torch.randperm(n, generator=torch.Generator().manual_seed(1))[:150].sort().values,
                       torch.arange(0, n, 3), torch.arange(300, 400)):
            assert subset.numel() >= 2 * ATTN_GROUP_MIN and subset.numel() < PAD_TO_CAUSAL * n
            out = runner.attend(q[:, subset], positions[subset], k, v)
            assert (out - full[subset]).abs().max() < 1e-5


def test_prefill_continuation_equals_one_pass():
    lm = tiny_model("qwen2", vocab_size=512)
    runner = Runner(lm)
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(4))
    one = runner.prefill(ids, runner.new_cache(30))
    cache = runner.new_cache(8)
    runner.prefill(ids[:19], cache)
    two = runner.prefill(ids[19:], cache, start=19)  # grows the cache, masks by position
    assert cache.length == 30
    assert (one - two).abs().max() < 1e-4


def test_greedy_decode_matches_generate():
    lm = tiny_model("llama", vocab_size=512)
    runner = Runner(lm)
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(6))
    cache = runner.new_cache(12)
    ours = runner.decode(runner.prefill(ids, cache)[0], cache, 16)
    with torch.inference_mode():
        ref = lm.model.generate(ids[None], max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0)[0, 12:].tolist()
    assert ours == ref


def test_sampling_is_seeded_and_top_p_restricts():
    logits = torch.tensor([5.0, 4.9, -10.0, -10.0])
    picks = {__import__("blend.decode.sampling", fromlist=["sample"]).sample(logits, SamplingParams(1.0, 0.5)) for _ in range(50)}
    assert picks == {0}
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    from blend.decode.sampling import sample

    # extreme values the API accepts: a temperature near 0 is greedy, a top_p that underflows keeps the top token
    big = torch.tensor([30.0, 29.0, -3.0e4, 0.0], dtype=torch.bfloat16)
    assert sample(big, SamplingParams(1e-300, 1.0), torch.Generator().manual_seed(1)) == 0
    assert sample(big, SamplingParams(1.0, 1e-300), torch.Generator().manual_seed(1)) == 0
    assert sample(big, SamplingParams(1e300, 1.0), torch.Generator().manual_seed(1)) in range(4)


def test_bad_inputs():
    lm = tiny_model("llama", vocab_size=512, max_position_embeddings=64)
    runner = Runner(lm)
    with pytest.raises(ValueError, match="empty prompt"):
        runner.prefill(torch.tensor([], dtype=torch.long), runner.new_cache(1))
    with pytest.raises(ValueError, match="70 tokens.*64 positions"):
        runner.prefill(torch.zeros(70, dtype=torch.long), runner.new_cache(70))


@pytest.mark.slow
def test_smollm2_parity_and_generate():
    lm = smollm2()
    runner = Runner(lm)
    ids = lm.tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids[0]
    ref = _hf_logits(lm, ids)
    out = runner.prefill(ids, runner.new_cache(len(ids)), logit_rows=range(len(ids)))
    assert (out - ref).abs().max() < 1e-4
    cache = runner.new_cache(len(ids))
    ours = runner.decode(runner.prefill(ids, cache)[0], cache, 16)
    with torch.inference_mode():
        gen = lm.model.generate(ids[None], max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=lm.tokenizer.eos_token_id)[0, len(ids):].tolist()
    assert ours == gen


def test_prefill_without_logit_rows_writes_the_same_kv():
    lm = tiny_model("llama", vocab_size=512)
    runner = Runner(lm)
    ids = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(5))
    with_logits, kv_only = runner.new_cache(29), runner.new_cache(29)
    runner.prefill(ids, with_logits)
    out = runner.prefill(ids, kv_only, logit_rows=())
    assert out.shape == (0, 512) and kv_only.length == 29
    for layer in range(runner.num_layers):
        assert torch.equal(kv_only.k[layer], with_logits.k[layer])
        assert torch.equal(kv_only.v[layer], with_logits.v[layer])


def _after(runner: Runner, context: KVCache | None, start: int, capacity: int) -> KVCache:
    """A new cache holding `context`'s first `start` slots (a document is computed after them)."""
    cache = runner.new_cache(capacity)
    for layer in range(runner.num_layers if start else 0):
        cache.k[layer][:, :start], cache.v[layer][:, :start] = context.k[layer][:, :start], context.v[layer][:, :start]
    cache.length = start
    return cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("start", [0, 7])
def test_documents_in_one_step_equal_one_prefill_each_bitwise(start, dtype):
    """Several documents after the same context as items of one `forward` step (each on its own
    cache, the context's K/V copied in; the linear layers over all their rows at once): every
    document's K/V bit for bit what it gets prefilled alone, so a stored entry never depends on
    what was ingested with it (issue 49, finding 5; a packed pass differed by up to 8.8e-3)."""
    from blend.model.loading import load_model

    runner = Runner(load_model("random:tiny", device="cpu", dtype=dtype))
    g = torch.Generator().manual_seed(0)
    context = torch.randint(0, 1000, (start,), generator=g)
    seqs = [torch.randint(0, 1000, (n,), generator=g) for n in (5, 13, 1, 9, 2)]
    kept = runner.new_cache(max(start, 1))
    if start:
        runner.prefill(context, kept, logit_rows=())
    together = [_after(runner, kept, start, start + len(seq)) for seq in seqs]
    out = runner.forward([Rows(seq, cache, start, ()) for seq, cache in zip(seqs, together, strict=True)])
    assert all(o.error is None and o.logits.shape[0] == 0 for o in out)
    for seq, cache in zip(seqs, together, strict=True):
        alone = _after(runner, kept, start, start + len(seq))
        runner.prefill(seq, alone, start=start, logit_rows=())
        assert cache.length == alone.length == start + len(seq)
        for layer in range(runner.num_layers):
            assert torch.equal(cache.k[layer][:, start:], alone.k[layer][:, start:])
            assert torch.equal(cache.v[layer][:, start:], alone.v[layer][:, start:])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prefill_s_pieces_through_sdpa_equal_the_blend_kernel(dtype):
    """`sdpa_tails` (on by itself where bfloat16 SDPA runs on AMX): a prefill cut into pieces sends
    each piece after the first, contiguous rows ending at the last key, through SDPA (`tail`), not
    the blend kernel: the same logits within the dtype's rounding, on any CPU (the switch forced)."""
    from blend.model.loading import load_model

    lm = load_model("random:tiny", device="cpu", dtype=dtype)
    ids = torch.randint(0, 1000, (45,), generator=torch.Generator().manual_seed(3))
    out = {}
    for tails in (False, True):
        runner = Runner(lm)
        runner.chunk_tokens, runner.sdpa_tails = 16, tails
        runner.strategies.clear()
        out[tails] = runner.prefill(ids, runner.new_cache(45), logit_rows=range(45)).float()
        assert runner.strategies["tail" if tails else "native"] == (2 * runner.num_layers if tails or
                                                                    runner.native_blend else 0)
    tol = 1e-4 if dtype == "float32" else 5e-2
    assert (out[True] - out[False]).abs().max() < tol * out[False].abs().max()


def test_float32_products_rows_do_not_depend_on_their_batch():
    """A float32 row's product (`rows4`, as the runner calls it) has the same bits alone, among a few
    rows or inside a prefill-sized product: MKL in strict CNR mode (`blend.model.mkl`, set when
    blend.model is imported; on a Xeon without it SmolLM2's down projection differed at every count
    up to 128 rows) and the padding of 1-11 rows to a multiple of 4 (an AMD EPYC's small-row path)."""
    import torch.nn.functional as F

    from blend.model.runner import rows4

    g = torch.Generator().manual_seed(0)
    for fan_in, fan_out in ((1536, 576), (128, 64), (576, 576)):
        w = torch.randn(fan_out, fan_in, generator=g)
        x = torch.randn(300, fan_in, generator=g)
        whole = F.linear(x, w)
        for t in (1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 64, 100, 128):
            assert torch.equal(rows4(lambda rows, w=w: F.linear(rows, w), x[:t]), whole[:t]), (fan_in, fan_out, t)
