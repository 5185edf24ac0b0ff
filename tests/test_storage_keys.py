"""Keys, entries, serialization and store config: pure functions, no tiers."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest
import torch

from eval.bench.load import ChunkShape, random_entry
from storage.config import StoreConfig, load_yaml
from storage.entry import CorruptEntry, KVEntry, entry_nbytes
from storage.keys import LAYOUT_VERSION, document_block_key, prefix_block_key, tokens_digest
from storage.serialization import (
    MAGIC,
    MAX_HEADER_BYTES,
    PRELUDE_SIZE,
    decode_header,
    encode_header,
    header_size,
    layer_from_bytes,
    layer_to_bytes,
)
from storage.signature import seal, verify

SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16)


def test_document_key_ignores_what_precedes_but_not_content():
    doc = [5, 6, 7, 8]
    a = document_block_key("fp", doc, "float16", start=0)
    assert a == document_block_key("fp", list(doc), "float16", start=0)  # same document, any prompt it sits in
    assert a != document_block_key("fp", doc[:-1], "float16", start=0)
    assert a != document_block_key("fp2", doc, "float16", start=0)
    assert a != document_block_key("fp", doc, "bfloat16", start=0)
    assert a != document_block_key("fp", doc, "float16", context_digest=tokens_digest([1, 2]), start=0)
    assert a != document_block_key("fp", doc, "float16", namespace="tenant1", start=0)
    assert document_block_key("fp", doc, "float16", namespace="tenant1", start=0).startswith("tenant1-")
    assert document_block_key("fp", torch.tensor(doc), "float16", start=0) == a  # tensors hash like lists


def test_block_keys_name_where_the_block_starts():
    """Block [2, 4) of 2-token blocks and block [0, 4) of 4-token blocks end at the same token
    but hold different rows: engines with different block sizes over one store must not share
    (and, on the header's mismatch, delete) each other's entries."""
    doc = [5, 6, 7, 8]
    assert document_block_key("fp", doc, "float16", start=2) != document_block_key("fp", doc, "float16", start=0)
    assert prefix_block_key("fp", doc, "float16", start=2) != prefix_block_key("fp", doc, "float16", start=0)
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ValueError, match="block start"):
            document_block_key("fp", doc, "float16", start=bad)
        with pytest.raises(ValueError, match="block start"):
            prefix_block_key("fp", doc, "float16", start=bad)


def test_prefix_and_document_keys_never_collide():
    tokens = [1, 2, 3]
    assert document_block_key("fp", tokens, "float16", start=0) != prefix_block_key("fp", tokens, "float16", start=0)
    assert prefix_block_key("fp", [9, 1, 2, 3], "float16", start=1) != prefix_block_key("fp", tokens, "float16", start=0)


def test_keys_are_safe_short_ascii():
    key = document_block_key("fp", range(1000), "float16", namespace="ns.1", start=512)
    assert key.isascii() and len(key) < 64 and "/" not in key and " " not in key
    assert isinstance(LAYOUT_VERSION, int)
    with pytest.raises(ValueError, match="namespace"):
        document_block_key("fp", [1], "float16", namespace="bad/ns", start=0)


def test_tokens_digest_is_little_endian_32bit():
    import hashlib

    ids = [0, 1, 49151, 2**31 - 1]
    assert tokens_digest(ids) == hashlib.sha256(struct.pack("<4I", *ids)).hexdigest()
    with pytest.raises(ValueError, match="32 bits"):
        tokens_digest([2**40])


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_serialization_round_trip(kv_dtype):
    _, entry = random_entry(dataclasses.replace(SMALL, kv_dtype=kv_dtype))
    header = decode_header(encode_header(entry.header))
    assert header == entry.header
    for i, (k, v) in enumerate(entry.layers):
        k2, v2 = layer_from_bytes(layer_to_bytes(k, v), header, i)
        assert k2.dtype == getattr(torch, kv_dtype) and k2.shape == (2, 16, 8)
        assert torch.equal(k2, k) and torch.equal(v2, v)


def test_serialization_rejects_damage():
    _, entry = random_entry(SMALL)
    data = bytearray(layer_to_bytes(*entry.layers[0]))
    data[7] ^= 0x01
    with pytest.raises(CorruptEntry, match="checksum"):
        layer_from_bytes(data, entry.header, 0)
    with pytest.raises(CorruptEntry, match="bytes"):
        layer_from_bytes(data[:-2], entry.header, 0)
    head = bytearray(encode_header(entry.header))
    with pytest.raises(CorruptEntry, match="magic"):
        decode_header(b"X" + bytes(head[1:]))
    with pytest.raises(CorruptEntry):
        decode_header(bytes(head[:-5]))
    nested = b"[" * 5000  # deeper than the JSON parser recurses: still just a corrupt entry
    with pytest.raises(CorruptEntry, match="RecursionError"):
        decode_header(head[:PRELUDE_SIZE - 4] + len(nested).to_bytes(4, "little") + nested)


def _encoded(header, **changes) -> bytes:
    """Header bytes with JSON fields replaced by arbitrary values (no validation)."""
    body = json.loads(encode_header(header)[PRELUDE_SIZE:])
    body.update(changes)
    data = json.dumps(body).encode()
    return MAGIC + struct.pack("<II", header.format_version, len(data)) + data


@pytest.mark.parametrize("changes", [
    dict(kv_heads="2"), dict(kv_heads=True), dict(num_tokens=-1), dict(head_dim=2.0), dict(fingerprint=5),
    dict(tag=7), dict(layer_checksums=[1, "2", 3]), dict(layer_checksums=[1, 2, -3]), dict(layer_checksums="x"),
    dict(num_layers=0, layer_checksums=[]), dict(kv_dtype="int8"), dict(owner="mallory"),
])
def test_decode_header_rejects_wrong_types_and_values(changes):
    _, entry = random_entry(SMALL)
    with pytest.raises(CorruptEntry):
        decode_header(_encoded(entry.header, **changes))


def test_header_size_is_bounded_and_tag_optional():
    _, entry = random_entry(SMALL)
    assert b'"tag"' not in encode_header(entry.header)  # unsigned entries keep the format they always had
    tagged = dataclasses.replace(entry.header, tag="ab" * 32)
    assert decode_header(encode_header(tagged)) == tagged
    with pytest.raises(CorruptEntry, match="exceeds"):
        header_size(MAGIC + struct.pack("<II", 1, MAX_HEADER_BYTES))


def test_seal_binds_entry_key_and_secret():
    _, entry = random_entry(SMALL)
    sealed = seal(entry, "c1", "s3cret")
    assert sealed.header.checksum == "sha256" and len(sealed.header.tag) == 64
    assert sealed.layers is entry.layers  # no copy
    assert verify(sealed.header, "c1", "s3cret")
    assert seal(sealed, "c1", "s3cret") is sealed  # a promotion does not re-hash
    assert not verify(sealed.header, "c2", "s3cret")  # bound to the key (namespace, content address)
    assert not verify(sealed.header, "c1", "other")
    assert not verify(entry.header, "c1", "s3cret")  # unsigned
    for change in (dict(pos_start=1), dict(fingerprint="x"), dict(layer_checksums=(1, 2, 3)),
                   dict(checksum="xxh3_64")):
        assert not verify(dataclasses.replace(sealed.header, **change), "c1", "s3cret"), change
    for i, (k, v) in enumerate(sealed.layers):  # the sha256 checksums verify the layers
        layer_from_bytes(layer_to_bytes(k, v), sealed.header, i)


def test_from_tensors_copies_and_converts():
    k = torch.randn(2, 4, 8)
    entry = KVEntry.from_tensors([(k, k)], fingerprint="f", token_ids=[1, 2, 3, 4], pos_start=7, kv_dtype="bfloat16")
    k.zero_()
    assert entry.layers[0][0].dtype == torch.bfloat16 and entry.layers[0][0].abs().sum() > 0
    assert entry.header.pos_start == 7 and entry.header.tokens_digest == tokens_digest([1, 2, 3, 4])
    assert entry.nbytes == entry_nbytes(1, 2, 4, 8, "bfloat16")
    with pytest.raises(ValueError, match="batch dimension"):
        KVEntry.from_tensors([(k[None], k[None])], fingerprint="f", token_ids=[1, 2, 3, 4], pos_start=0,
                             kv_dtype="float16")


def test_store_config_from_yaml_and_errors(tmp_path):
    cfg = StoreConfig.from_mapping(load_yaml("configs/default.yaml")["store"])
    assert [t.kind for t in cfg.tiers] == ["cpu", "disk"] and cfg.tiers[0].budget == 2 * 1024**3
    with pytest.raises(ValueError, match="valid keys are: budget, codec, exact_codec, kind, name"):
        StoreConfig.from_mapping({"tiers": [{"kind": "cpu", "budgte": "1GiB"}]})
    with pytest.raises(ValueError, match="valid keys are: .*kv_dtype"):
        StoreConfig.from_mapping({"kvdtype": "float16"})
    with pytest.raises(ValueError, match="valid kinds are: cpu, disk, redis, redis-cluster"):
        StoreConfig.from_mapping({"tiers": [{"kind": "s3"}]})
    with pytest.raises(ValueError, match="kv_dtype"):
        StoreConfig.from_mapping({"kv_dtype": "int8"})
    with pytest.raises(ValueError, match="fsync"):
        StoreConfig.from_mapping({"tiers": [{"kind": "disk", "path": "x", "fsync": "sometimes"}]})
    with pytest.raises(ValueError, match="distinct `name:`"):
        StoreConfig.from_mapping({"tiers": [{"kind": "cpu"}, {"kind": "cpu"}]})
    for name in ("redis.yaml", "redis-cluster.yaml"):
        StoreConfig.from_mapping(load_yaml(f"configs/{name}")["store"])


def test_budget_smaller_than_one_entry_fails_at_config_time():
    cfg = StoreConfig.from_mapping({"tiers": [{"kind": "cpu", "budget": "1GiB"}, {"kind": "disk", "path": "d", "budget": "1MiB"}]})
    size = entry_nbytes(30, 3, 512, 64, "float16")
    with pytest.raises(ValueError, match=r"tiers\[1\] \(disk\): budget 1MiB is smaller than one chunk entry \(11.2"):
        cfg.validate_for(size)
    cfg.validate_for(512 * 1024)
