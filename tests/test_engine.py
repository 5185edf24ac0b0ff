"""CacheBlend engine: mode equivalences, re-positioning, selection, edge cases, bad input."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from eval.metrics import kl_divergence
from tests.models import smollm2_tokenizer, tiny_model

DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. " * 3,
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels. " * 2,
    "The Carrow Point light uses a rotating lens that flashes white every twelve seconds.",
]
QUESTION = "Who built the lighthouse at Carrow Point?"


def make_engine(arch="llama", tmp_path=None, chunk_tokens=24, kv_dtype="float32", codec="none",
                **engine_overrides) -> BlendEngine:
    """A tiny engine with a cpu tier and, given tmp_path, a disk tier in `codec` (none: lossless,
    so results are comparable bit for bit across engines)."""
    lm = tiny_model(arch, tokenizer=smollm2_tokenizer(), attention_bias=(arch == "qwen2"))
    tiers = [{"kind": "cpu", "budget": "64MiB"}]
    if tmp_path is not None:
        tiers.append({"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB", "codec": codec})
    # a tiny model's layers cost about the same for 30 rows as for 3000, so the load-or-compute
    # split (tested in test_split.py) would rightly compute many blends whole: off here, where
    # the tests look at what blend itself does
    engine_overrides.setdefault("split", "off")
    cfg = EngineConfig().with_overrides(store={"kv_dtype": kv_dtype, "tiers": tiers}, chunk_tokens=chunk_tokens,
                                        **engine_overrides)
    return BlendEngine(cfg, model=lm)


def maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ratio_one_equals_full(arch):
    with make_engine(arch) as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=8)
        blend = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=8)
    assert maxdiff(full.first_token_logprobs, blend.first_token_logprobs) < 1e-4
    assert blend.token_ids == full.token_ids and blend.text == full.text
    assert blend.stats.recomputed_tokens == blend.stats.context_tokens


def test_ratio_zero_equals_reuse_and_blend_differs_from_both():
    with make_engine() as engine:
        engine.ingest(DOCS)
        reuse = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=4)
        zero = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.0, max_new_tokens=4)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=4)
        half = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.5, max_new_tokens=4)
    assert maxdiff(reuse.first_token_logprobs, zero.first_token_logprobs) == 0.0
    assert reuse.token_ids == zero.token_ids
    assert reuse.stats.recomputed_tokens == 0 and reuse.stats.documents.misses == 0
    assert maxdiff(reuse.first_token_logprobs, full.first_token_logprobs) > 1e-3  # context matters in this model
    kl_reuse = kl_divergence(full.first_token_logprobs, reuse.first_token_logprobs)
    kl_half = kl_divergence(full.first_token_logprobs, half.first_token_logprobs)
    assert kl_half < kl_reuse


def direct_kv(engine: BlendEngine, context_ids, token_ids, offset: int):
    """K/V of `token_ids` from one plain causal prefill of context + tokens placed so that the
    tokens start at position `offset` (the reference a stored document must equal)."""
    runner = engine.runner
    ids = torch.tensor(list(context_ids) + list(token_ids))
    n, c = ids.numel(), len(context_ids)
    positions = torch.arange(offset - c, offset - c + n)
    h = runner.embed(ids)
    out = []
    with torch.inference_mode():
        for layer in range(runner.num_layers):
            q, k, v = runner.heads_qkv(layer, h, positions)
            attn = torch.nn.functional.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, scale=runner.scaling, enable_gqa=True)[0]
            h = runner.finish(layer, h, attn.transpose(0, 1).reshape(n, -1))
            out.append((k[:, c:], v[:, c:]))
    return out


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_reordered_documents_equal_direct_computation_at_offsets(order):
    docs = [DOCS[i] for i in order]
    with make_engine(chunk_tokens=16, chunk_context="none") as engine:  # standalone: any order, any offset
        engine.ingest(DOCS)
        prompt = engine.build_prompt(QUESTION, docs)
        pre = engine.prefill(prompt, mode="reuse")
        assert pre.stats.documents.misses == 0
        for seg in prompt.documents:
            direct = direct_kv(engine, (), seg.token_ids, seg.start)
            for layer, (k, v) in enumerate(direct):
                assert maxdiff(pre.cache.k[layer][:, seg.start:seg.end], k) < 1e-4
                assert maxdiff(pre.cache.v[layer][:, seg.start:seg.end], v) < 1e-4


def test_repeated_document_empty_list_and_block_boundary():
    with make_engine(chunk_tokens=10) as engine:
        repeated = [DOCS[1], DOCS[1]]
        prompt = engine.build_prompt(QUESTION, repeated)
        assert len(prompt.documents) == 2  # a document is one segment ...
        blocks = engine.document_kv.blocks(prompt.documents[0].token_ids, [])
        assert len(blocks) >= 2 and blocks[-1].end - blocks[-1].start < 10  # ... stored as blocks, a short tail
        full = engine.generate(QUESTION, repeated, mode="full", max_new_tokens=3)
        blend = engine.generate(QUESTION, repeated, mode="blend", recompute_ratio=1.0, max_new_tokens=3)
        assert maxdiff(full.first_token_logprobs, blend.first_token_logprobs) < 1e-4
        assert blend.stats.documents.misses > 0  # computed during the request
        again = engine.generate(QUESTION, repeated, mode="blend", recompute_ratio=0.3, max_new_tokens=3)
        assert again.stats.documents.misses == 0
        for mode in ("full", "reuse", "prefix", "blend"):
            alone = engine.generate(QUESTION, [], mode=mode, max_new_tokens=3)
            assert alone.token_ids and alone.stats.query_tokens > 0


def test_prefix_mode_is_exact_and_stores_blocks():
    with make_engine(chunk_tokens=16) as engine:
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=4)
        first = engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=4)
        second = engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=4)
    assert maxdiff(full.first_token_logprobs, first.first_token_logprobs) < 1e-4
    assert maxdiff(full.first_token_logprobs, second.first_token_logprobs) < 1e-4
    assert second.stats.loaded_tokens > first.stats.loaded_tokens
    assert second.token_ids == full.token_ids


def test_bad_input(caplog):
    with make_engine() as engine:
        with pytest.raises(ValueError, match=r"within \[0, 1\]"):
            engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.5)
        with pytest.raises(ValueError, match="full, reuse, prefix, blend"):
            engine.generate(QUESTION, DOCS, mode="fast")
        with pytest.raises(ValueError, match="maximum of 2048 positions; use fewer or shorter documents"):
            engine.generate(QUESTION, ["word " * 2100], mode="full")
        with pytest.raises(ValueError, match="positions; shorten the conversation .*messages\\)$"):
            engine.generate([{"role": "user", "content": "word " * 2100}], mode="full")
        with pytest.raises(ValueError, match=r"ask for at most \d+ new tokens \(max_new_tokens\)"):
            engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=2048)
        # text that cannot fit is refused by its length, before tokenizing (megabytes take seconds)
        too_long = "w" * (2048 * engine.prompts.max_token_chars + 1)
        engine.prompts.tokenizer, tokenizer = None, engine.prompts.tokenizer  # any tokenizing would fail
        try:
            with pytest.raises(ValueError, match=r"characters\) cannot fit the model's 2048 positions"):
                engine.generate(QUESTION, [too_long], mode="full")
            with pytest.raises(ValueError, match="cannot fit"):
                engine.chat("long", too_long)
        finally:
            engine.prompts.tokenizer = tokenizer
        # under that bound, megabytes of words are refused after tokenizing a window of them
        words = "word " * (2048 * engine.prompts.max_token_chars // 6)
        seen: list[int] = []

        def counting(text, **kwargs):
            seen.append(len(text))
            return tokenizer(text, **kwargs)

        engine.prompts.tokenizer = counting
        try:
            with pytest.raises(ValueError, match=r"its first 16384 characters of one text alone are more tokens"):
                engine.generate(QUESTION, [words], mode="full")
        finally:
            engine.prompts.tokenizer = tokenizer
        assert seen and max(seen) <= 2048 * 8 < len(words)
        with caplog.at_level(logging.WARNING):
            result = engine.generate(QUESTION, ["", DOCS[0], "   "], mode="blend", max_new_tokens=2)
        assert "skipped 2 empty document" in caplog.text
        assert result.token_ids
        assert any("skipped 2 empty document" in w for w in result.warnings)  # the caller sees it too


def test_ingest_says_whether_a_tier_holds_each_document(tmp_path):
    # an empty document has nothing to cache: neither cached nor stored
    with make_engine() as engine:
        empty, doc = engine.ingest(["  ", DOCS[0]])
        assert (empty.keys, empty.cached, empty.stored) == ((), False, False)
        assert doc.keys and doc.stored is True and not doc.cached
        assert engine.ingest([DOCS[0]])[0].cached and engine.ingest([DOCS[0]], sync=False)[0].stored is None
    # the only tier cannot create its directory (required: false, so only warnings): not stored
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [
        {"kind": "disk", "path": str(blocker / "cache"), "budget": "64MiB"}]}, chunk_tokens=24, split="off")
    with BlendEngine(cfg, model=tiny_model("llama", tokenizer=smollm2_tokenizer())) as engine:
        (lost,) = engine.ingest([DOCS[1]])
        assert lost.keys and lost.stored is False and not lost.cached


def test_other_models_chunks_are_never_loaded(tmp_path):
    with make_engine(tmp_path=tmp_path) as a:
        keys_a = [k for doc in a.ingest(DOCS) for k in doc.keys]
    lm_b = tiny_model("llama", tokenizer=smollm2_tokenizer(), seed=1)
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [
        {"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB"}]}, chunk_tokens=24)
    with BlendEngine(cfg, model=lm_b) as b:
        result = b.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=2)
        assert result.stats.documents.hits == 0 and result.stats.documents.misses > 0
        keys_b = [k for doc in b.ingest(DOCS) for k in doc.keys]
        assert keys_a and keys_b and not set(keys_a) & set(keys_b)  # the key includes the model fingerprint


def test_corrupt_entry_is_recomputed(tmp_path):
    # the documents computed on their own (as the engine below recomputes them), not harvested
    with make_engine(tmp_path=tmp_path, miss_policy="standalone") as engine:
        reference = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=3)
    files = sorted((tmp_path / "disk").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    victims = [p for p in files if p.is_file() and p.stat().st_size > 4096]
    assert victims
    for path in victims:  # flip a byte in the middle of every stored entry (past the header)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [
        {"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB", "codec": "none"}]}, chunk_tokens=24,
        split="off")  # a tiny model computes faster than it loads: the split would compute it whole
    with BlendEngine(cfg, model=lm) as engine:
        again = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=3)
        assert again.stats.documents.misses > 0  # dropped at the failed load, computed on their own
        corrupt = engine.store.stats()
    assert maxdiff(reference.first_token_logprobs, again.first_token_logprobs) < 1e-5
    assert again.token_ids == reference.token_ids
    assert sum(s.get("corrupt", 0) for s in corrupt.values()) > 0


@pytest.mark.slow
def test_smollm2_blend_beats_reuse_on_sample_prompts():
    from eval.samples import sample_documents, sample_questions
    from tests.models import smollm2

    docs = dict(sample_documents())
    cfg = EngineConfig().with_overrides(store={"tiers": [{"kind": "cpu", "budget": "1GiB"}]})
    cases = [q for q in sample_questions() if len(q["docs"]) >= 2][:1] + sample_questions()[:1]
    with BlendEngine(cfg, model=smollm2()) as engine:
        for case in cases:
            names = list(dict.fromkeys(case["docs"] + sorted(docs)))[:3]  # the cited docs plus distractors
            texts = [docs[n][:1600] for n in names]  # ~450 tokens each keeps the test quick
            engine.ingest(texts)
            full = engine.generate(case["question"], texts, mode="full", max_new_tokens=1)
            reuse = engine.generate(case["question"], texts, mode="reuse", max_new_tokens=1)
            blend = engine.generate(case["question"], texts, mode="blend", recompute_ratio=0.15, max_new_tokens=1)
            kl_reuse = kl_divergence(full.first_token_logprobs, reuse.first_token_logprobs)
            kl_blend = kl_divergence(full.first_token_logprobs, blend.first_token_logprobs)
            assert kl_blend < kl_reuse, (case["question"], kl_blend, kl_reuse)


@pytest.mark.parametrize("selection", ["attention", "deviation"])
def test_alternative_selections(selection):
    from blend.recompute.selector import query_attention

    with make_engine(selection=selection) as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=3)
        one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=3)
        some = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.2, max_new_tokens=3)
    assert maxdiff(full.first_token_logprobs, one.first_token_logprobs) < 1e-4
    assert some.stats.recomputed_tokens == -(-some.stats.context_tokens * 2 // 10)
    # the attention score is a distribution over keys
    q, k = torch.randn(4, 3, 8), torch.randn(2, 10, 8)
    scores = query_attention(q, k, 8 ** -0.5)
    assert scores.shape == (10,) and abs(float(scores.sum()) - 1.0) < 1e-5


def test_chunks_computed_after_the_system_part():
    with make_engine(chunk_context="system") as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=3)
        one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=3)
        reuse = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=3)
        prefix = engine.generate(QUESTION, DOCS, mode="prefix", max_new_tokens=3)
        prompt = engine.build_prompt(QUESTION, DOCS)
        # the first chunk's cached KV is exact at its prompt position (computed after the
        # system part); reuse differs from full only through the later chunks
        exact = engine.prefill(prompt, mode="full")
        reused = engine.prefill(prompt, mode="reuse")
    assert maxdiff(full.first_token_logprobs, one.first_token_logprobs) < 1e-4
    assert reuse.stats.documents.misses == 0
    first, second = prompt.segments[1], prompt.segments[2]
    assert prefix.stats.loaded_tokens == first.end  # the prefix and the first chunk
    assert maxdiff(full.first_token_logprobs, prefix.first_token_logprobs) < 1e-4
    assert maxdiff(exact.cache.k[2][:, first.start:first.end], reused.cache.k[2][:, first.start:first.end]) < 1e-4
    assert maxdiff(exact.cache.k[2][:, second.start:second.end], reused.cache.k[2][:, second.start:second.end]) > 1e-3


def test_chunks_shared_through_redis_and_redis_cluster(redis_url, redis_cluster_urls):
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    tiers = {"redis": {"kind": "redis", "url": redis_url, "key_prefix": "engine-test:"},
             "redis-cluster": {"kind": "redis-cluster", "urls": list(redis_cluster_urls), "key_prefix": "engine-test:"}}
    for kind, tier in tiers.items():
        cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [tier]}, chunk_tokens=24)
        with BlendEngine(cfg, model=lm) as writer:  # one serving process ingests ...
            writer.ingest(DOCS)
            full = writer.generate(QUESTION, DOCS, mode="full", max_new_tokens=2)
        with BlendEngine(cfg, model=lm) as reader:  # ... another one reuses the shared chunks
            blend = reader.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=2)
            reuse = reader.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=2)
        assert reuse.stats.documents.misses == 0 and reuse.stats.documents.hits > 0
        assert reuse.stats.hits_by_tier == {kind: reuse.stats.cached_segments.hits}
        assert reuse.stats.load.bytes_by_tier[kind] > 0
        assert maxdiff(full.first_token_logprobs, blend.first_token_logprobs) < 1e-4


def test_prefetch_depth_does_not_change_results(tmp_path):
    results = []
    for depth in (1, 32):
        with make_engine(tmp_path=tmp_path / str(depth), prefetch_depth=depth) as engine:
            engine.ingest(DOCS)
            results.append(engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=3))
    assert maxdiff(results[0].first_token_logprobs, results[1].first_token_logprobs) == 0.0
    assert results[0].stats.load_s > 0 and results[0].stats.load.bytes_by_tier


@pytest.mark.redis
def test_delete_document_with_a_tier_down_says_so_and_can_be_retried(redis_server, redis_url):
    import redis as redis_py

    from storage.tier import StoreUnavailable

    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    tiers = [{"kind": "cpu", "budget": "64MiB"},
             {"kind": "redis", "url": redis_url, "key_prefix": "delete-test:", "socket_timeout_s": 1.0,
              "backoff_initial_s": 0.1, "backoff_max_s": 0.2}]
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": tiers}, chunk_tokens=24)
    with BlendEngine(cfg, model=lm) as engine:
        keys = engine.ingest([{"id": "d", "text": DOCS[0]}])[0].keys
        redis_server.stop()
        try:
            with pytest.raises(StoreUnavailable, match="tier redis could not be reached.*retry the delete"):
                engine.delete_document("d")
            assert not any(engine.store.tiers[0].contains(k) for k in keys)  # the reachable tier dropped them
        finally:
            redis_server.start()  # a fresh server: empty, like a restarted one without persistence
        client = redis_py.Redis.from_url(redis_url)
        client.set(f"delete-test:{{{keys[0]}}}:h", b"stale")  # as if the outage had kept the entry
        time.sleep(0.3)  # past the tier's backoff
        assert engine.delete_document("d") == keys  # the id stayed known: the retry reaches every tier
        assert client.exists(f"delete-test:{{{keys[0]}}}:h") == 0
        with pytest.raises(KeyError):
            engine.delete_document("d")
