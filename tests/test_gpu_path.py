"""The GPU path: the parts that run on CPU too (folded GQA attention, cached attention
plans) and the CUDA-only checks (pinned pool, staging reuse after events, the staged
loader, ratio 1 == full, greedy tokens), skipped with the reason where CUDA is absent."""

from __future__ import annotations

import pytest
import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.model.attention import ATTN_GROUP_MIN
from blend.model.loading import load_model
from blend.model.runner import Runner
from eval.bench.load import ChunkShape, random_entry
from storage.config import CpuTierConfig
from storage.memory import CpuTier
from tests.models import tiny_model

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. " * 3,
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels. " * 2,
    "The Carrow Point light uses a rotating lens that flashes white every twelve seconds.",
]
QUESTION = "Who built the lighthouse at Carrow Point?"


def test_folded_gqa_groups_equal_the_unfolded_attention():
    runner = Runner(tiny_model("llama"))  # 4 heads over 2 KV heads
    n = 200
    g = torch.Generator().manual_seed(0)
    q = torch.randn(runner.num_heads, n, runner.head_dim, generator=g)
    k = torch.randn(runner.kv_heads, n, runner.head_dim, generator=g)
    v = torch.randn(runner.kv_heads, n, runner.head_dim, generator=g)
    subset = torch.sort(torch.randperm(n, generator=g)[: 3 * ATTN_GROUP_MIN]).values
    plain = runner.plan_attention(subset, n, fold=1)
    folded = runner.plan_attention(subset, n, fold=2)
    assert plain.kind == folded.kind == "groups" and folded.fold == 2
    with torch.inference_mode():
        a = runner.attend(q[:, subset], subset, k, v, plain)
        b = runner.attend(q[:, subset], subset, k, v, folded)
        ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                               scale=runner.scaling, enable_gqa=True)[0]
    assert (a - b).abs().max() < 1e-5
    assert (b - ref[:, subset].transpose(0, 1).reshape(subset.numel(), -1)).abs().max() < 1e-5


def test_attention_plan_is_reused_for_the_same_rows():
    runner = Runner(tiny_model("llama"))
    runner.native_blend = False  # torch's plans (a CPU's native kernel needs none)
    q = torch.randn(runner.num_heads, 70, runner.head_dim)
    k = torch.randn(runner.kv_heads, 300, runner.head_dim)
    rows = torch.arange(0, 280, 4)  # (70,) scattered: masked groups
    with torch.inference_mode():
        runner.attend(q, rows, k, k)
        first = runner._plan[1]
        runner.attend(q, rows, k, k)
        assert runner._plan[1] is first  # same tensor, same key count: the masks are not rebuilt
        runner.attend(q, rows.clone(), k, k)
        assert runner._plan[1] is not first


# ------------------------------------------------------------------- CUDA
@needs_cuda
def test_cuda_cpu_tier_keeps_entries_in_the_pinned_pool():
    shape = ChunkShape(layers=4, kv_heads=2, head_dim=64, tokens=128, kv_dtype="bfloat16")
    tier = CpuTier(CpuTierConfig(budget=64 << 20))
    assert tier.pool is not None and tier.pool.pin
    _, entry = random_entry(shape, seed=0)
    tier.put("k", entry)
    k, v = tier.get_layer("k", 1)
    assert k.is_pinned() and v.is_pinned() and v.data_ptr() == k.data_ptr() + k.nbytes
    assert tier.get_layer("k", 1)[0].data_ptr() == k.data_ptr()  # views, not copies
    assert torch.equal(k, entry.layers[1][0])
    assert tier.stats()["pinned_bytes"] >= entry.nbytes


@needs_cuda
def test_cuda_staging_slot_is_reused_only_after_its_copy_event():
    from blend.kv.loader import StagingRing, copy_stream

    device = torch.device("cuda")
    ring = StagingRing(1, pinned=True)
    slot = ring.acquire(64 << 20)
    assert slot.buf.is_pinned()
    dst = torch.empty(slot.buf.numel(), dtype=torch.uint8, device=device)
    stream = copy_stream(device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # keep the stream busy so the copy is still pending
        dst.copy_(slot.buf, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    ring.release(slot, event)
    again = ring.acquire(16)
    assert again is slot and event.query() and ring.waits == 1


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_staged_loader_matches_full_prefill_at_ratio_one_and_greedy_tokens(tmp_path, dtype):
    lm = load_model("random:tiny", device="cuda", dtype=dtype)
    cfg = EngineConfig(model="random:tiny", device="cuda", dtype=dtype).with_overrides(
        store={"kv_dtype": "bfloat16" if dtype == "bfloat16" else "float32",
               "tiers": [{"kind": "cpu", "budget": "256MiB"},
                         {"kind": "disk", "path": str(tmp_path / "d"), "budget": "1GiB"}]},
        chunk_tokens=24)
    with BlendEngine(cfg, model=lm) as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=16)
        one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=16)
        assert one.token_ids == full.token_ids
        assert (one.first_token_logprobs - full.first_token_logprobs).abs().max() < (1e-4 if dtype == "float32" else 2e-2)
        reuse = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=4)
        assert reuse.stats.load.copies > 0 and reuse.stats.bytes_loaded > 0
        blend = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.15, max_new_tokens=4)
        assert torch.isfinite(blend.first_token_logprobs).all()
        segments = sum(1 for s in engine.build_prompt(QUESTION, DOCS).segments if s.kind != "query")
        assert blend.stats.load.copies <= blend.stats.load.layers_loaded * segments  # at most one copy per segment
