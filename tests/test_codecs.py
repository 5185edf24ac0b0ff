"""KV codecs (storage.codec): round-trip error bounds, sizes, headers, checksums, tags, budgets,
mixed codecs in one tier, the loader's decoding (host and staged paths), and the engine's
mode equivalences with encoded tiers."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.kv import loader as loader_module
from blend.kv.loader import LayerLoader, Placement
from blend.model.runner import Runner
from eval.bench.load import ChunkShape, random_entry, rope_frequencies
from eval.metrics import kl_divergence
from storage import codec as codecs
from storage.codec import CODECS, KEYS_PRE_ROPE, KEYS_ROTATED, decode_into, encode_layer, rotate
from storage.config import CpuTierConfig, DiskTierConfig, StoreConfig
from storage.disk import DiskTier, file_layout
from storage.entry import Expected, KVEntry, decode_layer, layer_checksum
from storage.keys import document_block_key
from storage.memory import CpuTier
from storage.serialization import decode_header, encode_header
from storage.signature import seal, verify
from storage.stack import TieredStore
from tests.models import smollm2_tokenizer, tiny_model

SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=16, tokens=40)
SECRET = "0123456789abcdef-secret"


def keyed(seed: int = 0, shape: ChunkShape = SMALL):
    token_ids, entry = random_entry(shape, seed=seed)
    return document_block_key("bench", token_ids, shape.kv_dtype, start=0), token_ids, entry


def expect(token_ids, shape: ChunkShape = SMALL) -> Expected:
    return Expected.of(token_ids, fingerprint="bench", num_layers=shape.layers, kv_heads=shape.kv_heads,
                       head_dim=shape.head_dim, kv_dtype=shape.kv_dtype, pos_start=0)


def group_bound(x: torch.Tensor, bits: int, group: int, dim: int, zero: bool) -> torch.Tensor:
    """Per element, the largest error a group quantizer may make: half a step (plus float16 rounding of
    the scale and minimum), the step being the group's range (or |max|) over its levels."""
    h, t, d = x.shape
    if dim == 1:  # keys: groups of `group` tokens per channel
        pad = -(-t // group) * group
        xp = torch.cat((x, x[:, -1:].expand(h, pad - t, d)), 1).view(h, -1, group, d)
        lo, hi = xp.amin(2, keepdim=True), xp.amax(2, keepdim=True)
        span = (hi - lo) if zero else torch.maximum(hi.abs(), lo.abs()) * 2
        step = span / ((1 << bits) - 1 if zero else (1 << bits) - 2)
        bound = step.expand_as(xp).reshape(h, pad, d)[:, :t]
    else:  # values: groups of `group` channels per token
        xg = x.view(h, t, d // group, group)
        lo, hi = xg.amin(3, keepdim=True), xg.amax(3, keepdim=True)
        span = (hi - lo) if zero else torch.maximum(hi.abs(), lo.abs()) * 2
        step = span / ((1 << bits) - 1 if zero else (1 << bits) - 2)
        bound = step.expand_as(xg).reshape(h, t, d)
    return bound * 0.5 * (1 + 2e-3) + x.abs() * 1e-3 + 1e-6  # + the float16 rounding of scale and minimum


# ------------------------------------------------------------------------- round trip
@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(2, 40, 16), (3, 128, 64), (1, 7, 8), (2, 130, 128), (1, 3, 6), (3, 5, 7)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_round_trip_error_within_half_a_step_of_each_group(name, shape, dtype):
    codec = CODECS[name]
    gen = torch.Generator().manual_seed(sum(shape))
    h, t, d = shape
    k = (torch.randn(shape, generator=gen) * 3 + torch.randn(1, 1, d, generator=gen) * 4).to(dtype)  # channel offsets
    k[:, :, 1] *= 20  # an outlier channel
    v = torch.randn(shape, generator=gen).to(dtype)
    inv = rope_frequencies(d)
    if not codec.supports(d):  # int4 packs two codes a byte: an odd head_dim is refused (RoPE models have none)
        with pytest.raises(ValueError, match="cannot encode head_dim 7"):
            encode_layer(codec, k, v, pos_start=11, inv_freq=inv)
        return
    kpart, vpart = encode_layer(codec, k, v, pos_start=11, inv_freq=inv)
    assert kpart.dtype == torch.uint8 and vpart.dtype == torch.uint8 and kpart.dim() == vpart.dim() == 1
    kn, vn = codec.part_nbytes(h, t, d, "float16")
    assert (kpart.numel(), vpart.numel()) == (kn, vn)
    k_out, v_out = torch.empty(shape), torch.empty(shape)
    decode_into(codec, kpart, vpart, k_out, v_out)
    # keys are quantized where the codec quantizes them: before RoPE for int4
    ref_k = k.float()
    if codec.keys == KEYS_PRE_ROPE:
        ref_k = rotate(ref_k, -torch.arange(11, 11 + t), inv)
    kb = group_bound(ref_k, codec.bits, codec.key_group, 1, codec.key_zero)
    vb = group_bound(v.float(), codec.bits, codec.value_group_for(d), 2, codec.value_zero)
    assert ((k_out - ref_k).abs() <= kb).all() and ((v_out - v.float()).abs() <= vb).all()
    # decoded in float16 (a GPU's staging buffer): the same within float16 arithmetic
    k16, v16 = torch.empty(shape, dtype=torch.float16), torch.empty(shape, dtype=torch.float16)
    decode_into(codec, kpart, vpart, k16, v16)
    for half, full in ((k16, k_out), (v16, v_out)):
        assert ((half.float() - full).abs() <= 2e-3 * (full.abs() + full.abs().amax())).all()
    if codec.keys == KEYS_PRE_ROPE:  # turned back to their positions, the keys are close to what was stored
        k_out = torch.empty(shape)
        decode_into(codec, kpart, vpart, k_out, torch.empty(shape))
        back = rotate(k_out, torch.arange(11, 11 + t), inv)
        assert ((back - k.float()).abs() <= math.sqrt(2) * kb.amax() + 1e-3).all()


def test_decoding_into_a_strided_cache_slice_equals_decoding_into_a_tensor():
    codec = CODECS["int4"]
    k, v = torch.randn(2, 70, 16), torch.randn(2, 70, 16)
    kpart, vpart = encode_layer(codec, k, v, inv_freq=rope_frequencies(16))
    ref_k, ref_v = torch.empty(2, 70, 16), torch.empty(2, 70, 16)
    decode_into(codec, kpart, vpart, ref_k, ref_v)
    cache = torch.zeros(2, 2, 100, 16)  # K and V of a cache, the segment at 20..89
    decode_into(codec, kpart, vpart, cache[0][:, 20:90], cache[1][:, 20:90])
    assert torch.equal(cache[0][:, 20:90], ref_k) and torch.equal(cache[1][:, 20:90], ref_v)
    assert not cache[:, :, :20].any() and not cache[:, :, 90:].any()


def test_constant_and_zero_groups_decode_exactly():
    for name in ("int8", "int4"):
        k = torch.full((2, 64, 16), 3.5, dtype=torch.float16)
        v = torch.zeros(2, 64, 16, dtype=torch.float16)
        codec = dataclasses.replace(CODECS[name], keys=KEYS_ROTATED)
        kpart, vpart = encode_layer(codec, k, v)
        k_out, v_out = torch.empty(2, 64, 16), torch.empty(2, 64, 16)
        decode_into(codec, kpart, vpart, k_out, v_out)
        assert torch.equal(k_out, k.float()) and torch.equal(v_out, v.float())


def test_sizes_meet_the_compression_targets():
    for heads, dim in ((3, 64), (8, 128)):  # SmolLM2-135M, a Llama-3-8B shape
        raw = CODECS["none"].layer_nbytes(heads, 512, dim, "float16")
        assert raw == 2 * heads * 512 * dim * 2
        assert raw / CODECS["int8"].layer_nbytes(heads, 512, dim, "float16") >= 1.9
        assert raw / CODECS["int4"].layer_nbytes(heads, 512, dim, "float16") >= 3.5
    # a short last block of a document costs a little more per token, never fewer bytes than its codes
    assert CODECS["int4"].layer_nbytes(3, 37, 64, "float16") > 2 * 3 * 37 * 64 // 2


# ----------------------------------------------------------------- entries and headers
def test_an_encoded_entry_round_trips_through_its_header_and_layer_bytes():
    key, tokens, entry = keyed()
    for name in ("int8", "int4"):
        coded = entry.encode(CODECS[name])
        assert coded.header.codec == CODECS[name] and coded.nbytes < entry.nbytes
        assert coded.encode(CODECS["int8"]) is coded  # never encoded twice
        assert decode_header(encode_header(coded.header)) == coded.header
        assert expect(tokens).mismatch(coded.header) is None
        plain = coded.decoded()
        shift = torch.arange(SMALL.tokens) + coded.header.pos_start - coded.header.keys_rotated_at
        for (k, v), (k2, v2) in zip(entry.layers, plain.layers, strict=True):
            k2 = rotate(k2.float(), shift, rope_frequencies(SMALL.head_dim)) if name == "int4" else k2.float()
            assert (k.float() - k2).abs().max() < (0.2 if name == "int4" else 0.02) * k.float().abs().max() + 0.1
            assert (v.float() - v2.float()).abs().max() < (0.2 if name == "int4" else 0.02) * v.float().abs().max()
    assert entry.encode(CODECS["none"]) is entry
    assert "codec" not in json.loads(encode_header(entry.header)[16:])  # a none header is what it always was


def test_an_entry_without_rope_frequencies_keeps_its_keys_rotated_in_int4():
    _, tokens, entry = keyed()
    bare = KVEntry(entry.header, entry.layers)  # e.g. built by hand: no model known
    coded = bare.encode(CODECS["int4"])
    assert coded.header.codec.keys == KEYS_ROTATED and coded.header.keys_rotated_at == coded.header.pos_start
    assert expect(tokens).mismatch(coded.header) is None
    k, _ = decode_layer(coded.header, *coded.layers[0], torch.float32)
    assert (k - entry.layers[0][0].float()).abs().max() < 0.25 * entry.layers[0][0].float().abs().max()


@pytest.mark.parametrize("edit", [
    dict(name="int9"), dict(bits=5), dict(key_group=32), dict(value_group=16), dict(key_zero=False),
    dict(scale="bfloat16"),
])
def test_a_header_with_an_unknown_or_edited_codec_is_a_counted_miss(tmp_path, edit):
    key, tokens, entry = keyed()
    cfg = StoreConfig(tiers=(DiskTierConfig(path=str(tmp_path / "disk"), codec="int8"),))
    with TieredStore.from_config(cfg) as store:
        store.put(key, entry, sync=True)
        _edit_header(store.tiers[0], key, lambda h: dataclasses.replace(h, codec=dataclasses.replace(h.codec, **edit)))
        assert store.lookup(key, expect(tokens)) is None  # never a crash, never decoded by the wrong rule
        stats = store.stats()["disk"]
        assert stats["mismatches"] + stats["corrupt"] == 1 and stats["lookup_misses"] == 1


def test_a_header_whose_keys_claim_another_rotation_fails_its_layer_checksums(tmp_path):
    """Both "rotated" and "pre-rope" are valid int4 records: the checksum binding catches the edit."""
    key, tokens, entry = keyed()
    cfg = StoreConfig(tiers=(DiskTierConfig(path=str(tmp_path / "disk"), codec="int4"),))
    with TieredStore.from_config(cfg) as store:
        store.put(key, entry, sync=True)
        _edit_header(store.tiers[0], key, lambda h: dataclasses.replace(h, codec=dataclasses.replace(
            h.codec, keys=KEYS_ROTATED)))
        located = store.lookup(key, expect(tokens))
        assert located is not None and located.header.codec.keys == KEYS_ROTATED
        assert store.get_layer(located, 0) is None  # the layer does not verify under the edited codec
        assert store.stats()["disk"]["corrupt"] == 1


def _with_layer_values(entry: KVEntry, change) -> KVEntry:
    """`entry` with `change(k, v)` applied to copies of every stored layer (K and V, or the encoded
    K part and V part), its checksums recomputed: a self-consistent entry, as an unsigned writer makes."""
    layers = []
    for k, v in entry.layers:
        k, v = k.clone(), v.clone()
        change(k, v)
        layers.append((k, v))
    sums = tuple(layer_checksum(entry.header.codec, k, v, entry.header.checksum) for k, v in layers)
    return KVEntry(dataclasses.replace(entry.header, layer_checksums=sums), layers)


def _scales(part: torch.Tensor, header) -> torch.Tensor:
    """The float16 scales (and minimums) of an encoded part, as a view to write into."""
    h, t, d = header.shape
    return part[codecs.codes_nbytes(h * t * d, header.codec.bits):].view(torch.float16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_finite_accepts_every_encoded_or_raw_layer_of_real_values(dtype):
    shape = dataclasses.replace(SMALL, kv_dtype=dtype)
    _, _, entry = keyed(shape=shape)
    for name in ("none", "int8", "int4"):
        coded = entry.encode(CODECS[name]) if name != "none" else entry
        for k, v in coded.layers:
            assert codecs.finite(coded.header.codec, k, v, coded.header.shape, dtype)


@pytest.mark.parametrize("name", ["none", "int8", "int4"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 60000.0])
def test_a_layer_that_decodes_to_non_finite_values_is_corrupt_behind_a_valid_checksum(tmp_path, name, bad):
    """NaN or an infinity in K or V (none) or in a scale or minimum (int8, int4; or a scale so large
    that a code decodes past float16's range): the tier reads it as a corrupt entry (deleted,
    counted, a miss), as it would a checksum failure."""
    key, tokens, entry = keyed()  # float16
    coded = entry.encode(CODECS[name]) if name != "none" else entry
    h = coded.header

    def plant(k: torch.Tensor, v: torch.Tensor) -> None:
        if name == "none":
            v.view(-1)[5] = bad
        else:
            _scales(k, h)[-1] = bad  # the last minimum of the keys
            _scales(v, h)[0] = bad  # the first scale of the values
    if name == "none" and bad == 60000.0:
        pytest.skip("60000 is a finite float16 value")
    forged = _with_layer_values(coded, plant)
    assert not codecs.finite(h.codec, *forged.layers[1], h.shape, "float16")
    assert codecs.finite(h.codec, *coded.layers[1], h.shape, "float16")
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), codec=name))
    try:
        tier.put(key, forged)
        assert tier.get_header(key) == forged.header  # the header is valid
        assert tier.get_layer(key, 1, forged.header) is None
        assert tier.stats()["corrupt"] == 1 and not tier.contains(key)
    finally:
        tier.close()


def _edit_header(tier: DiskTier, key: str, change) -> None:
    """Rewrite the header of `key`'s entry file with `change(header)` (layers left as they are)."""
    path = tier._file(key)
    data = path.read_bytes()
    header = decode_header(data)
    head, offsets = file_layout(change(header))
    old_head, old_offsets = file_layout(header)
    assert offsets == old_offsets  # same data offset: only the header bytes change
    path.write_bytes(head + data[len(old_head):])


def test_the_signed_tag_covers_the_codec():
    key, _, entry = keyed()
    sealed = seal(entry.encode(CODECS["int8"]), key, SECRET)
    assert verify(sealed.header, key, SECRET)
    assert not verify(dataclasses.replace(sealed.header, codec=CODECS["int4"]), key, SECRET)
    assert not verify(dataclasses.replace(sealed.header, codec=dataclasses.replace(CODECS["int8"], key_group=64)),
                      key, SECRET)


def test_a_signed_store_writes_each_tier_in_its_codec_sealed(tmp_path):
    key, tokens, entry = keyed()
    cfg = StoreConfig(secret=SECRET, tiers=(CpuTierConfig(budget=1 << 20),
                                             DiskTierConfig(path=str(tmp_path / "disk"), codec="int4")))
    with TieredStore.from_config(cfg) as store:
        store.put(key, entry, sync=True)
        top, bottom = store.tiers[0].get_header(key), store.tiers[1].get_header(key)
        assert top.codec.name == "none" and bottom.codec.name == "int4"
        assert verify(top, key, SECRET) and verify(bottom, key, SECRET)
        store.tiers[0].clear()
        located = store.lookup(key, expect(tokens))  # from disk, promoted as it is (int4)
        assert located.tier_name == "disk" and store.get(located) is not None
        store.flush()
        assert store.tiers[0].get_header(key) == bottom


# ------------------------------------------------------------------- tiers and budgets
@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_budgets_count_compressed_bytes(tmp_path, kind):
    entries = [keyed(seed=i, shape=ChunkShape(layers=3, kv_heads=2, head_dim=64, tokens=256)) for i in range(12)]
    raw = entries[0][2].nbytes
    held = {}
    for name in ("none", "int4"):
        budget = int(3.5 * raw) + (3 * 4096 if kind == "disk" else 0)  # three float16 entries (and file headers)
        tier = (CpuTierConfig(budget=budget, codec=name) if kind == "cpu" else
                DiskTierConfig(path=str(tmp_path / name), budget=budget, codec=name))
        with TieredStore.from_config(StoreConfig(tiers=(tier,))) as store:
            for key, _, entry in entries:
                store.put(key, entry, sync=True)
            stats = store.stats()[kind]
            held[name] = stats["entries"]
            assert stats["bytes_used"] <= budget
            coded = entries[0][2].encode(CODECS[name])
            assert stats["bytes_written"] >= 12 * coded.nbytes and stats["evictions"] == 12 - held[name]
    assert held["none"] == 3
    assert held["int4"] >= 3.3 * held["none"]


def test_one_tier_holds_entries_of_different_codecs(tmp_path):
    entries = [keyed(seed=i) for i in range(3)]
    path = str(tmp_path / "disk")
    for (key, _, entry), name in zip(entries, ("none", "int8", "int4"), strict=True):
        with TieredStore.from_config(StoreConfig(tiers=(DiskTierConfig(path=path, codec=name),))) as store:
            store.put(key, entry, sync=True)
    with TieredStore.from_config(StoreConfig(tiers=(DiskTierConfig(path=path, codec="int8"),))) as store:
        for (key, tokens, entry), name in zip(entries, ("none", "int8", "int4"), strict=True):
            located = store.lookup(key, expect(tokens))
            assert located is not None and located.header.codec.name == name
            kpart, vpart = store.get_layer(located, 2)
            k, v = decode_layer(located.header, kpart, vpart, torch.float32)
            if located.header.codec.keys == KEYS_PRE_ROPE:
                k = rotate(k, torch.arange(SMALL.tokens), rope_frequencies(SMALL.head_dim))
            want_k, want_v = entry.layers[2]
            tolerance = {"none": 0.0, "int8": 0.05, "int4": 0.6}[name]
            assert (k - want_k.float()).abs().max() <= tolerance and (v - want_v.float()).abs().max() <= tolerance
        assert store.stats()["disk"]["mismatches"] == 0


def test_store_stats_name_each_tiers_codec(tmp_path):
    cfg = StoreConfig(tiers=(CpuTierConfig(), DiskTierConfig(path=str(tmp_path / "d"), codec="int4")))
    with TieredStore.from_config(cfg) as store:
        stats = store.stats()
    assert stats["cpu"]["codec"] == "none" and stats["disk"]["codec"] == "int4"
    with pytest.raises(ValueError, match="must be one of 'none', 'int8' or 'int4'"):
        StoreConfig.from_mapping({"tiers": [{"kind": "cpu", "codec": "int2"}]})


def test_a_disk_tiers_default_codec_is_int8_and_a_cpu_tiers_none(tmp_path):
    assert CpuTierConfig().codec == "none" and DiskTierConfig(path=str(tmp_path)).codec == "int8"
    assert codecs.codec_named("int4") is CODECS["int4"]
    with pytest.raises(ValueError, match="none, int8, int4"):
        codecs.codec_named("zstd")


# ------------------------------------------------------------------------ the loader
@pytest.fixture
def tiny_runner():
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    return Runner(lm)


def _placements(runner, store, specs):
    """Placements of entries put into `store` (encoded by its tiers), at prompt starts."""
    out, n = [], 0
    for i, (length, pos_start) in enumerate(specs):
        ids = list(range(100 + 50 * i, 100 + 50 * i + length))
        cache = runner.new_cache(pos_start + length)
        runner.prefill(torch.tensor(list(range(7, 7 + pos_start)) + ids), cache, logit_rows=())
        layers = [(cache.k[j][:, pos_start:pos_start + length], cache.v[j][:, pos_start:pos_start + length])
                  for j in range(runner.num_layers)]
        entry = KVEntry.from_tensors(layers, fingerprint="f", token_ids=ids, pos_start=pos_start, kv_dtype="float16",
                                     rope=runner.inv_freqs[0])
        key = document_block_key("f", ids, "float16", start=0)
        store.put(key, entry, sync=True)
        exp = Expected.of(ids, fingerprint="f", num_layers=runner.num_layers, kv_heads=runner.kv_heads,
                          head_dim=runner.head_dim, kv_dtype="float16", pos_start=pos_start)
        located = store.lookup(key, exp)
        assert located is not None
        out.append((Placement(n + 3, length, pos_start, located, None), entry))
        n += length
    return out, n + 3


def _load(runner, store, placements, n, staged):
    cache = runner.new_cache(n + 4)
    cache.k = [t.zero_() for t in cache.k]
    cache.v = [t.zero_() for t in cache.v]
    with LayerLoader(store, runner, cache, placements, range(runner.num_layers), depth=2, staged=staged) as ld:
        for layer in range(runner.num_layers):
            ld.wait(layer)
    return cache, ld.report()


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_the_loader_decodes_on_both_paths_alike_and_close_to_the_stored_kv(tmp_path, tiny_runner, codec):
    runner = tiny_runner
    tiers = [CpuTier(CpuTierConfig(budget=64 << 20, codec=codec), pinned=True),  # the staged path's direct copies
             DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), codec=codec))]
    with TieredStore(tiers, promote=False) as store:
        made, n = _placements(runner, store, [(20, 0), (33, 5), (17, 12)])
        store.tiers[0].delete(made[1][0].located.key)  # the second one from disk
        made[1] = (dataclasses.replace(made[1][0], located=store.lookup(made[1][0].located.key, Expected.matching(
            made[1][0].located.header))), made[1][1])
        placements = [p for p, _ in made]
        host, host_report = _load(runner, store, placements, n, staged=False)
        staged, staged_report = _load(runner, store, placements, n, staged=True)
    assert staged_report.bytes_by_tier == host_report.bytes_by_tier
    assert set(host_report.bytes_by_tier) == {"cpu", "disk"}
    assert sum(host_report.bytes_by_tier.values()) == sum(p.header.nbytes for p in placements)  # compressed bytes
    tolerance = 0.02 if codec == "int8" else 0.25
    for layer in range(runner.num_layers):  # staged: decoded into the storage dtype (float16) on the way
        assert torch.allclose(host.k[layer], staged.k[layer], rtol=2e-3, atol=2e-3)
        assert torch.allclose(host.v[layer], staged.v[layer], rtol=2e-3, atol=2e-3)
        for p, entry in made:  # the stored KV re-rotated to its prompt positions, within the codec's error
            want_k = runner.rerotate(entry.layers[layer][0].float(), p.start - p.pos_start)
            got_k = host.k[layer][:, p.start:p.start + p.length]
            assert (got_k - want_k).abs().max() <= tolerance * want_k.abs().max() + 1e-3
            want_v = entry.layers[layer][1].float()
            assert (host.v[layer][:, p.start:p.start + p.length] - want_v).abs().max() <= tolerance * want_v.abs().max()


def test_an_unreadable_encoded_layer_fails_the_load_on_both_paths_and_drops_the_entry(tmp_path, tiny_runner):
    """A corrupt layer of an encoded entry: no model work in the loader; the wait for that layer
    raises `LoadFailed` (a `LoadStalled`: the plan computes without the store) and the entry is
    deleted, a miss for the next request."""
    from blend.kv.loader import LoadFailed

    runner = tiny_runner
    cfg = StoreConfig(tiers=(DiskTierConfig(path=str(tmp_path / "disk"), codec="int4"),))
    for staged in (False, True):
        with TieredStore.from_config(cfg) as store:
            store.clear()
            made, n = _placements(runner, store, [(20, 0), (33, 5)])
            key = made[1][0].located.key
            path = store.tiers[0]._file(key)
            data = bytearray(path.read_bytes())
            data[-10] ^= 0xFF  # the last layer's V part
            path.write_bytes(bytes(data))
            placements = [p for p, _ in made]
            with pytest.raises(LoadFailed, match="unreadable") as err:
                _load(runner, store, placements, n, staged=staged)
            assert err.value.tiers == ("disk",)
            assert not path.exists() and key not in list(store.keys())


def test_an_entry_replaced_while_loading_fails_the_load_and_stays(tiny_runner):
    """A newer entry under a located key (a harvested document's standalone recompute, written
    behind a lookup): the load fails as for an unreadable layer, but the new entry is kept."""
    from blend.kv.loader import LoadFailed

    runner = tiny_runner
    with TieredStore([CpuTier(CpuTierConfig(budget=64 << 20, codec="int8"))], promote=False) as store:
        made, n = _placements(runner, store, [(20, 0), (33, 5)])
        key = made[1][0].located.key
        again, _ = _placements(runner, store, [(20, 0), (33, 9)])  # the same tokens from another position
        assert again[1][0].located.key == key and again[1][0].located.header != made[1][0].located.header
        with pytest.raises(LoadFailed, match="replaced") as err:
            _load(runner, store, [p for p, _ in made], n, staged=False)
        assert err.value.tiers == ("cpu",)
        assert store.tiers[0].get_header(key) == again[1][0].located.header


# ------------------------------------------------------------------------ the engine
QUESTION = "Who built the lighthouse at Carrow Point?"
DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery. " * 3,
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels. " * 2,
    "The Carrow Point light uses a rotating lens that flashes white every twelve seconds.",
]


def _engine(tmp_path, codec: str) -> BlendEngine:
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float16", "tiers": [
        {"kind": "cpu", "budget": "64MiB", "codec": codec},
        {"kind": "disk", "path": str(tmp_path / codec), "budget": "256MiB", "codec": codec}]},
        chunk_tokens=24, split="off")
    return BlendEngine(cfg, model=lm)


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_ratio_one_is_full_and_ratio_zero_is_reuse_with_any_codec(tmp_path, codec):
    with _engine(tmp_path, codec) as engine:
        engine.ingest(DOCS)
        full = engine.generate(QUESTION, DOCS, mode="full", max_new_tokens=4)
        one = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=1.0, max_new_tokens=4)
        reuse = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=4)
        zero = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.0, max_new_tokens=4)
        assert reuse.stats.documents.misses == 0 and reuse.stats.loaded_tokens > 0
    assert torch.equal(full.first_token_logprobs, one.first_token_logprobs) and one.token_ids == full.token_ids
    assert torch.equal(reuse.first_token_logprobs, zero.first_token_logprobs) and zero.token_ids == reuse.token_ids


def test_blend_over_encoded_tiers_stays_close_to_blend_over_float16(tmp_path):
    results = {}
    for codec in ("none", "int8", "int4"):
        with _engine(tmp_path, codec) as engine:
            engine.ingest(DOCS)
            results[codec] = engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.3, max_new_tokens=1)
    base = results["none"].first_token_logprobs
    assert kl_divergence(base, results["int8"].first_token_logprobs) < 1e-3
    assert kl_divergence(base, results["int4"].first_token_logprobs) < 5e-2
    assert loader_module.FORCE_STAGED is None


@pytest.mark.redis
@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_a_redis_tier_stores_and_serves_encoded_entries(redis_url, codec):
    from storage.config import RedisTierConfig

    key, tokens, entry = keyed()
    cfg = StoreConfig(tiers=(RedisTierConfig(url=redis_url, codec=codec, key_prefix="codecs:"),),
                      secret=SECRET)
    with TieredStore.from_config(cfg) as store:
        store.put(key, entry, sync=True)
        located = store.lookup(key, expect(tokens))
        assert located is not None and located.header.codec.name == codec and verify(located.header, key, SECRET)
        out = torch.empty(located.header.layer_nbytes, dtype=torch.uint8)
        assert store.read_layer_into(located, 1, out)  # the staged path's read: encoded bytes
        kpart, vpart = store.get_layer(located, 1)
        assert torch.equal(out, torch.cat((kpart, vpart)))
        stats = store.stats()["redis"]
        assert stats["codec"] == codec and 0 < stats["bytes_used"] < entry.nbytes
        store.clear()


def test_a_hybrid_models_keys_go_before_rope_with_each_layers_own_frequencies():
    """Gemma 3 rotates its sliding and global layers with different bases: int4 takes each layer's
    rotation off with that layer's frequencies, and the loader puts it back with the same (rotating
    with the wrong base scrambles the keys of the other layer type)."""
    lm = tiny_model("gemma3_text", tokenizer=smollm2_tokenizer())
    runner = Runner(lm)
    assert len({float(f[1]) for f in runner.inv_freqs}) == 2  # two RoPE bases
    stored = {}
    for codec in ("none", "int4"):
        cfg = EngineConfig().with_overrides(store={"kv_dtype": "float16", "tiers": [
            {"kind": "cpu", "budget": "64MiB", "codec": codec}]}, chunk_tokens=16, split="off")
        with BlendEngine(cfg, model=lm) as engine:
            engine.ingest(DOCS)
            tier = engine.store.tiers[0]
            stored[codec] = {key: tier.get(key) for key in tier.keys()}
            assert engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=1).stats.documents.hits == 3
    assert stored["none"].keys() == stored["int4"].keys()
    for key, plain in stored["none"].items():
        coded = stored["int4"][key]
        assert coded.header.keys_pre_rope and plain.header.pos_start == coded.header.pos_start
        positions = torch.arange(coded.header.pos_start, coded.header.pos_start + coded.header.num_tokens)
        for layer in range(runner.num_layers):  # decoded at position 0, turned as the loader turns them
            k, _ = decode_layer(coded.header, *coded.layers[layer], torch.float32)
            cos, sin = runner.rotation(positions, layer)
            half = k.shape[-1] // 2
            c, s_ = cos[:, :half], sin[:, :half]
            back = torch.cat((k[..., :half] * c - k[..., half:] * s_, k[..., half:] * c + k[..., :half] * s_), -1)
            want = plain.layers[layer][0].float()
            assert (back - want).abs().max() <= 0.25 * want.abs().max() + 0.05, (key, layer)
