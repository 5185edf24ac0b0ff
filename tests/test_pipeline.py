"""The KV path from the tiers into a request's cache: cpu-tier views and the pinned pool,
reads straight into caller buffers, the staged (batched) placement against the host one,
copy counts, the staging ring, and random:tiny through every mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import blend.kv.loader as pipeline
from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.kv.loader import LayerLoader, Placement, StagingRing
from blend.kv.prefix import EntryMaker
from blend.model.loading import load_model
from blend.model.runner import Runner
from eval.bench.load import ChunkShape, random_entry
from storage.codec import decode_into
from storage.config import CpuTierConfig, DiskTierConfig
from storage.disk import DiskTier
from storage.entry import Expected
from storage.memory import CpuTier, PinnedPool
from storage.stack import TieredStore
from tests.models import smollm2_tokenizer, tiny_model

SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16, kv_dtype="float32")
DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. " * 3,
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels. " * 2,
    "The Carrow Point light uses a rotating lens that flashes white every twelve seconds.",
]
QUESTION = "Who built the lighthouse at Carrow Point?"


# ------------------------------------------------------------------ cpu tier
def test_cpu_tier_reads_are_views_of_the_stored_memory():
    _, entry = random_entry(SMALL, seed=1)
    plain = CpuTier(CpuTierConfig(budget=1 << 24), pinned=False)
    plain.put("k", entry)
    k, v = plain.get_layer("k", 1)
    assert k.data_ptr() == entry.layers[1][0].data_ptr() and v.data_ptr() == entry.layers[1][1].data_ptr()
    pooled = CpuTier(CpuTierConfig(budget=1 << 24), pinned=True)  # ordinary memory here, same layout
    pooled.put("k", entry)
    k, v = pooled.get_layer("k", 1)
    assert k.data_ptr() != entry.layers[1][0].data_ptr()  # copied once into the pool at put
    assert torch.equal(k, entry.layers[1][0]) and torch.equal(v, entry.layers[1][1])
    again = pooled.get_layer("k", 1)
    assert again[0].data_ptr() == k.data_ptr()  # a view, not a copy
    assert v.data_ptr() == k.data_ptr() + k.nbytes  # one layer = K then V, contiguous
    first = pooled.get_layer("k", 0)[0]
    assert k.data_ptr() == first.data_ptr() + entry.header.layer_nbytes  # layers back to back in one block
    out = torch.empty(entry.header.layer_nbytes, dtype=torch.uint8)
    assert pooled.read_layer_into("k", 2, entry.header, out)
    assert torch.equal(out.view(torch.float32).view(2, *entry.header.shape)[0], entry.layers[2][0])
    assert pooled.stats()["pinned_used"] >= entry.nbytes


def test_pinned_pool_reuses_memory_only_after_every_view_is_gone():
    pool = PinnedPool(1 << 20, slab_bytes=1 << 20, pin=False)
    a = pool.allocate(300_000)
    b = pool.allocate(300_000)
    assert a is not None and b is not None and pool.used == 2 * 300_032
    assert pool.allocate(600_000) is None  # the budget is one slab
    view = a[10:20]
    del a
    assert pool.used == 2 * 300_032  # a view keeps the block
    del view
    assert pool.used == 300_032
    del b
    big = pool.allocate(900_000)  # freed neighbours coalesce
    assert big is not None and pool.capacity == 1 << 20


def test_cpu_tier_pool_evicts_to_place_an_entry():
    _, e0 = random_entry(SMALL, seed=0)
    size = e0.nbytes
    tier = CpuTier(CpuTierConfig(budget=3 * size), pinned=True)
    for i in range(5):
        tier.put(f"k{i}", random_entry(SMALL, seed=i)[1])
    assert list(tier.keys()) == ["k2", "k3", "k4"]
    held = tier.get_layer("k2", 0)  # a reader holding a view of k2 while k2 is evicted
    tier.get_header("k3"), tier.get_header("k4")
    tier.put("k5", random_entry(SMALL, seed=5)[1])
    assert not tier.contains("k2") and torch.equal(held[0], random_entry(SMALL, seed=2)[1].layers[0][0])


# ------------------------------------------------------------ reads into buffers
def test_disk_read_layer_into_verifies(tmp_path):
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), budget=1 << 26))
    _, entry = random_entry(SMALL, seed=4)
    tier.put("k", entry)
    out = torch.empty(entry.header.layer_nbytes, dtype=torch.uint8)
    assert tier.read_layer_into("k", 1, entry.header, out)
    k, v = out.view(torch.float32).view(2, *entry.header.shape).unbind(0)
    assert torch.equal(k, entry.layers[1][0]) and torch.equal(v, entry.layers[1][1])
    assert not tier.read_layer_into("missing", 1, entry.header, out)
    path = tmp_path / "d" / "k.kv"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # damage the last layer
    path.write_bytes(bytes(data))
    fresh = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), budget=1 << 26))
    assert not fresh.read_layer_into("k", 2, entry.header, out) and fresh.stats()["corrupt"] == 1
    with pytest.raises(ValueError, match="uint8"):
        tier.read_layer_into("k", 0, entry.header, torch.empty(3))


def test_redis_read_layer_into(redis_url):
    from storage.config import RedisTierConfig
    from storage.redis_tier import RedisTier

    tier = RedisTier(RedisTierConfig(url=redis_url, key_prefix="t:"))
    _, entry = random_entry(SMALL, seed=5)
    tier.put("k", entry)
    out = torch.empty(entry.header.layer_nbytes, dtype=torch.uint8)
    assert tier.read_layer_into("k", 2, None, out)
    assert torch.equal(out.view(torch.float32).view(2, *entry.header.shape)[1], entry.layers[2][1])
    assert not tier.read_layer_into("nope", 0, entry.header, out)
    tier.clear()
    tier.close()


def test_store_read_layer_into_falls_back_and_promotes(tmp_path):
    _, entry = random_entry(SMALL, seed=6)
    tiers = [CpuTier(CpuTierConfig(budget=1 << 24)), DiskTier(DiskTierConfig(path=str(tmp_path / "d"), budget=1 << 26))]
    with TieredStore(tiers, kv_dtype="float32") as store:
        tiers[1].put("k", entry)
        located = store.lookup("k", Expected.matching(entry.header))
        assert located is not None and located.tier_name == "disk"
        out = torch.empty(entry.header.layer_nbytes, dtype=torch.uint8)
        for i in range(SMALL.layers):
            assert store.read_layer_into(located, i, out)
            out.zero_()  # the caller reuses its buffer: the promotion kept its own copy
        store.flush()
        got = tiers[0].get("k")
        assert got is not None and all(torch.equal(a[0], b[0]) for a, b in zip(got.layers, entry.layers, strict=True))


# ------------------------------------------------------------- placement
def _placements(runner: Runner, store: TieredStore, maker: EntryMaker, tokens: int, seed: int = 0
                ) -> tuple[list[Placement], list[list[int]]]:
    """Three segments at prompt positions 0.. from a pooled cpu tier, a disk tier and memory."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 1000, (tokens,), generator=g).tolist() for _ in range(3)]
    entries = [maker.compute(x) for x in ids]
    out = []
    for i, entry in enumerate(entries):
        start = i * tokens
        if i == 2:
            out.append(Placement(start, tokens, 0, None, entry))
            continue
        key = f"seg{i}-{seed}-{tokens}"
        store.tiers[i].put(key, entry)
        located = store.lookup(key, Expected.matching(entry.header))
        assert located is not None and located.tier_index == i
        out.append(Placement(start, tokens, 0, located, None))
    return out, ids


def _loaded_cache(runner, store, placements, n, staged):
    cache = runner.new_cache(n)
    cache.k = [t.zero_() for t in cache.k]
    cache.v = [t.zero_() for t in cache.v]
    with LayerLoader(store, runner, cache, placements, range(1, runner.num_layers), depth=2, staged=staged) as ld:
        for layer in range(runner.num_layers):
            ld.wait(layer)
    return cache, ld.report()


@pytest.fixture
def tiny_setup(tmp_path):
    lm = tiny_model("llama")
    runner = Runner(lm)
    maker = EntryMaker(runner, lm.fingerprint, "float32")
    tiers = [CpuTier(CpuTierConfig(budget=1 << 26), pinned=True),
             DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), budget=1 << 28))]
    with TieredStore(tiers, kv_dtype="float32", promote=False) as store:
        yield runner, store, maker


def test_staged_placement_equals_host_placement_bit_for_bit(tiny_setup):
    runner, store, maker = tiny_setup
    placements, _ = _placements(runner, store, maker, 16)
    placements[1] = dataclasses.replace(placements[1], start=16)  # stored at 0, placed at 16: re-rotated
    placements[2] = dataclasses.replace(placements[2], pos_start=5)  # computed at 5.., placed at 32..
    n = 48
    host, host_report = _loaded_cache(runner, store, placements, n, staged=False)
    staged, staged_report = _loaded_cache(runner, store, placements, n, staged=True)
    for layer in range(1, runner.num_layers):
        assert torch.equal(host.k[layer][:, :n], staged.k[layer][:, :n])
        assert torch.equal(host.v[layer][:, :n], staged.v[layer][:, :n])
    assert host.k[1][:, :n].abs().sum() > 0
    # the reference: a stored key re-rotated by hand
    stored_k = store.get_layer(placements[1].located, 2)[0]
    assert torch.allclose(staged.k[2][:, 16:32], runner.rerotate(stored_k, 16), atol=1e-6)
    assert staged_report.bytes_by_tier == host_report.bytes_by_tier
    assert set(staged_report.bytes_by_tier) == {"cpu", "disk"}


def test_staged_placement_converts_and_rotates_in_float32(tmp_path):
    lm = tiny_model("llama")
    lm.model.to(torch.bfloat16)
    runner = Runner(lm)
    maker = EntryMaker(runner, lm.fingerprint, "float16")  # stored in another dtype than computed
    tiers = [CpuTier(CpuTierConfig(budget=1 << 26), pinned=True),
             DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), budget=1 << 28))]
    with TieredStore(tiers, kv_dtype="float16", promote=False) as store:
        placements, _ = _placements(runner, store, maker, 16)
        placements[1] = dataclasses.replace(placements[1], start=16)
        placements[2] = dataclasses.replace(placements[2], pos_start=3)
        host, _ = _loaded_cache(runner, store, placements, 48, staged=False)
        staged, _ = _loaded_cache(runner, store, placements, 48, staged=True)
    assert staged.k[1].dtype == torch.bfloat16
    for layer in range(1, runner.num_layers):
        ref = host.k[layer][:, :48].float()
        assert (staged.k[layer][:, :48].float() - ref).abs().max() <= 0.02 * ref.abs().max()
        assert torch.equal(staged.v[layer][:, :48], host.v[layer][:, :48])


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_host_placement_into_bfloat16_rotates_in_float32_and_rounds_once(tmp_path, codec):
    """Float16 entries (raw or decoded from a codec; int4 keys stored before RoPE) placed into
    a bfloat16 cache on a CPU: each key is the float32 rotation of what the tier holds, rounded
    once to bfloat16 (at most half a bfloat16 ulp away: 2^-8 of its size). Rotating in place in
    bfloat16 rounds three times, with bfloat16 cos / sin."""
    lm = tiny_model("llama")
    lm.model.to(torch.bfloat16)
    runner = Runner(lm)
    maker = EntryMaker(runner, lm.fingerprint, "float16")
    tiers = [CpuTier(CpuTierConfig(budget=1 << 26, codec=codec), pinned=True),
             DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), budget=1 << 28, codec=codec))]
    with TieredStore(tiers, kv_dtype="float16", promote=False) as store:
        placements, _ = _placements(runner, store, maker, 16)
        placements[1] = dataclasses.replace(placements[1], start=16)  # stored at 0, placed at 16
        host, _ = _loaded_cache(runner, store, placements, 48, staged=False)
        assert host.k[1].dtype == torch.bfloat16
        for layer in range(1, runner.num_layers):
            for p in placements[:2]:
                header = p.located.header
                kpart, vpart = store.get_layer(p.located, layer)
                if header.codec.raw:
                    k, v = kpart.float(), vpart.float()
                else:
                    k, v = torch.empty(header.shape), torch.empty(header.shape)
                    decode_into(header.codec, kpart, vpart, k, v)
                if header.keys_pre_rope:  # decoded at position 0: rotated to its positions
                    ref = runner.rerotate(k, torch.arange(p.start, p.start + p.length), layer)
                else:
                    ref = runner.rerotate(k, p.start - p.pos_start, layer)
                got = host.k[layer][:, p.start:p.start + p.length].float()
                assert ((got - ref).abs() <= ref.abs() * 2 ** -8 * 1.001 + 1e-6).all()
                assert torch.equal(host.v[layer][:, p.start:p.start + p.length], v.bfloat16())


def test_layers_larger_than_a_staging_slot_are_staged_in_several_fills(tiny_setup, monkeypatch):
    runner, store, maker = tiny_setup
    placements, _ = _placements(runner, store, maker, 16)
    monkeypatch.setattr(pipeline, "STAGING_SLOT_MAX", 1)  # one segment per fill
    host, _ = _loaded_cache(runner, store, placements, 48, staged=False)
    staged, report = _loaded_cache(runner, store, placements, 48, staged=True)
    for layer in range(1, runner.num_layers):
        assert torch.equal(host.k[layer], staged.k[layer]) and torch.equal(host.v[layer], staged.v[layer])
    assert report.copies == 3 * report.layers_loaded


def test_scattered_positions_are_placed_too(tiny_setup):
    runner, store, maker = tiny_setup
    placements, _ = _placements(runner, store, maker, 8)
    placements = [dataclasses.replace(p, start=s) for p, s in zip(placements, (0, 12, 30), strict=True)]  # gaps
    host, _ = _loaded_cache(runner, store, placements, 40, staged=False)
    staged, _ = _loaded_cache(runner, store, placements, 40, staged=True)
    for layer in range(1, runner.num_layers):
        assert torch.equal(host.k[layer], staged.k[layer]) and torch.equal(host.v[layer], staged.v[layer])


@pytest.mark.parametrize("staged", [False, True])
def test_copies_per_layer_are_bounded_by_segments_not_bytes(tiny_setup, staged):
    runner, store, maker = tiny_setup
    counts = []
    for tokens in (8, 64):
        placements, _ = _placements(runner, store, maker, tokens, seed=tokens)
        _, report = _loaded_cache(runner, store, placements, 3 * tokens, staged=staged)
        assert report.layers_loaded == runner.num_layers - 1
        counts.append(report.copies / report.layers_loaded)
    assert counts[0] == counts[1]
    assert counts[0] <= (3 if staged else 2 * 3)


def test_stored_entries_stay_bit_identical_after_a_blend(tmp_path, monkeypatch):
    for staged in (False, True):
        monkeypatch.setattr(pipeline, "FORCE_STAGED", staged)
        lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
        cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                            chunk_tokens=24)
        with BlendEngine(cfg, model=lm) as engine:
            engine.ingest(DOCS)
            cpu = engine.store.tiers[0]
            before = {key: [(k.clone(), v.clone()) for k, v in cpu.get(key).layers] for key in cpu.keys()}
            engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=2)
            engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=2)
            for key, layers in before.items():
                for (k0, v0), (k1, v1) in zip(layers, cpu.get(key).layers, strict=True):
                    assert torch.equal(k0, k1) and torch.equal(v0, v1)


class _Event:
    """A stand-in for a CUDA event: not complete until synchronize() is called."""

    def __init__(self):
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_staging_ring_reuses_a_slot_only_after_its_copy_event():
    ring = StagingRing(2, pinned=False)
    a = ring.acquire(1000)
    b = ring.acquire(5000)
    assert a is not b and a.buf.numel() >= 1000 and b.buf.numel() >= 5000
    ea, eb = _Event(), _Event()
    ring.release(a, ea)
    ring.release(b, eb)
    again = ring.acquire(10)
    assert again is a and ea.done and ring.waits == 1  # waited for the event before handing it out
    eb.done = True
    other = ring.acquire(3 << 20)  # grows the slot
    assert other is b and ring.waits == 1 and b.buf.numel() >= 3 << 20


# ----------------------------------------------------------- random:tiny
def test_random_tiny_runs_through_every_mode(tmp_path):
    lm = load_model("random:tiny", device="cpu")
    cfg = EngineConfig(model="random:tiny").with_overrides(
        store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"},
                                                {"kind": "disk", "path": str(tmp_path / "d"), "budget": "256MiB"}]},
        chunk_tokens=24, sessions_dir=str(tmp_path / "sessions"))
    with BlendEngine(cfg, model=lm) as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=4)
        one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=4)
        assert one.token_ids == full.token_ids
        assert (one.first_token_logprobs - full.first_token_logprobs).abs().max() < 1e-4
        for mode in ("reuse", "prefix", "blend"):
            result = engine.generate(QUESTION, DOCS, mode=mode, max_new_tokens=4)
            assert len(result.token_ids) >= 1 and torch.isfinite(result.first_token_logprobs).all()
            assert result.stats.mode == mode
        first = engine.chat("s", "Hello there, who are you?", max_new_tokens=3)
        second = engine.chat("s", "And what do you do?", max_new_tokens=3)
        assert first.token_ids and second.token_ids
        assert lm.random_weights
