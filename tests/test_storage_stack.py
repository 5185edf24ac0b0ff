"""TieredStore: lookup verification, promotion, background writes, fallbacks, faults, CLI."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path

import pytest
import torch
import yaml

from blend.cli import main as cli_main
from eval.bench.load import ChunkShape, random_entry
from storage.config import CpuTierConfig, DiskTierConfig, RedisTierConfig, StoreConfig
from storage.entry import Expected, entry_nbytes
from storage.keys import document_block_key
from storage.signature import verify
from storage.stack import TieredStore
from storage.tier import StoreUnavailable

SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16)


def keyed(seed: int = 0, fingerprint: str = "bench"):
    token_ids, entry = random_entry(SMALL, seed=seed, fingerprint=fingerprint)
    return document_block_key(fingerprint, token_ids, "float16", start=0), token_ids, entry


def expect(token_ids, fingerprint: str = "bench", **changes) -> Expected:
    fields = dict(fingerprint=fingerprint, num_layers=SMALL.layers, kv_heads=SMALL.kv_heads, head_dim=SMALL.head_dim,
                  kv_dtype=SMALL.kv_dtype, pos_start=0) | changes
    return Expected.of(token_ids, **fields)


def cpu_disk(tmp_path: Path, codec: str = "none", **kw) -> TieredStore:
    """A cpu + disk store; the disk tier in `codec` (none: both tiers hold the same entry)."""
    cfg = StoreConfig(tiers=(CpuTierConfig(budget=1 << 20), DiskTierConfig(path=str(tmp_path / "disk"), codec=codec)),
                      **kw)
    return TieredStore.from_config(cfg)


def test_put_lookup_and_read_layers(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path) as store:
        assert store.lookup(key, expect(tokens)) is None
        store.put(key, entry)  # background
        store.flush()
        assert store.contains(key) == "cpu" and list(store.keys()) == [key]
        located = store.lookup(key, expect(tokens))
        assert located is not None and located.tier_name == "cpu" and located.header == entry.header
        k, v = store.get_layer(located, 1)
        assert torch.equal(k, entry.layers[1][0]) and torch.equal(v, entry.layers[1][1])
        both = store.get_layers(located, [0, 2])
        assert torch.equal(both[1][1], entry.layers[2][1])
        assert store.get(located).header == entry.header
        assert all(t.contains(key) for t in store.tiers)  # written to every tier
        stats = store.stats()
        assert stats["cpu"]["lookup_hits"] == 1 and stats["cpu"]["lookup_misses"] == 1
        assert stats["disk"]["lookup_misses"] == 1 and stats["disk"]["bytes_written"] > 0


@pytest.mark.parametrize("change", [
    dict(fingerprint="other-model"), dict(token_ids="reversed"), dict(num_layers=4), dict(kv_heads=1, head_dim=16),
    dict(head_dim=16), dict(kv_dtype="bfloat16"), dict(kv_dtype="float32"), dict(pos_start=3),
])
def test_header_not_matching_the_expectation_is_a_counted_deleted_miss(tmp_path, change):
    key, tokens, entry = keyed()
    if change.pop("token_ids", None):
        tokens = tokens[::-1]
    with cpu_disk(tmp_path) as store:
        store.put(key, entry, sync=True)
        assert store.lookup(key, expect(tokens, **change)) is None
        stats = store.stats()
        assert stats["cpu"]["mismatches"] == 1 and stats["disk"]["mismatches"] == 1
        assert stats["cpu"]["lookup_misses"] == 1 and stats["disk"]["lookup_misses"] == 1
        assert store.contains(key) is None  # deleted from every tier that held it: the recompute rewrites it


def test_expected_mismatch_names_the_field():
    _, tokens, entry = keyed()
    assert expect(tokens).mismatch(entry.header) is None
    assert expect(tokens, kv_heads=1).mismatch(entry.header) == "kv_heads 2, expected 1"
    bad_algorithm = dataclasses.replace(entry.header, checksum="md5")
    assert "checksum algorithm 'md5'" in expect(tokens).mismatch(bad_algorithm)
    short = dataclasses.replace(entry.header, layer_checksums=entry.header.layer_checksums[:-1])
    assert "2 layer checksums" in expect(tokens).mismatch(short)


def test_store_with_a_secret_seals_writes_and_refuses_untagged_entries(tmp_path):
    key, tokens, entry = keyed()
    key2, tokens2, entry2 = keyed(seed=1)
    with cpu_disk(tmp_path, secret="s3cret-0123456789abcdef") as store:
        store.put(key, entry, sync=True)
        stored = store.tiers[1].get_header(key)
        assert stored.checksum == "sha256" and verify(stored, key, "s3cret-0123456789abcdef")
        assert store.lookup(key, expect(tokens)).header == stored
        store.tiers[1].put(key2, entry2)  # planted without the secret (or written by an engine with another one)
        assert store.lookup(key2, expect(tokens2)) is None
        # a miss, counted, and left in place: two engines with different secrets must not wipe each other
        assert store.stats()["disk"]["unauthenticated"] == 1 and store.tiers[1].contains(key2)
        assert store.lookup(key2, expect(tokens2)) is None and store.stats()["disk"]["unauthenticated"] == 2
        store.tiers[0].clear()  # a promotion from disk keeps the tag (and does not re-hash)
        located = store.lookup(key, expect(tokens))
        assert located.tier_name == "disk" and store.get(located) is not None
        store.flush()
        assert store.tiers[0].get_header(key) == stored
        sealed = store.tiers[1].get(key)
    with cpu_disk(tmp_path) as plain:
        assert plain.lookup(key, expect(tokens)) is None  # the signed store's entries live in its own namespace
        plain.tiers[1].put(key, sealed)
        assert plain.lookup(key, expect(tokens)) is not None  # without a secret, tags are not required
    with pytest.raises(ValueError, match="secret: must be at least 16 characters"):
        cpu_disk(tmp_path, secret="")


def test_repair_rewrites_a_broken_entry(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path) as store:
        store.tiers[1].put(key, entry)
        located = store.lookup(key, expect(tokens))
        path = store.tiers[1].path / f"{key}.kv"
        path.write_bytes(path.read_bytes()[:-10])  # cut inside the last layer
        assert store.get_layer(located, 2) is None and not path.exists()
        store.repair(located, entry)
        store.flush()
        assert store.stats()["disk"]["repairs"] == 1
        assert store.get(store.lookup(key, expect(tokens))) is not None and path.exists()


def test_hit_in_disk_is_promoted_to_cpu(tmp_path):
    key, tokens, entry = keyed()
    key2, tokens2, entry2 = keyed(seed=1)
    with cpu_disk(tmp_path) as store:
        cpu, disk = store.tiers
        disk.put(key, entry)
        disk.put(key2, entry2)
        located = store.lookup(key, expect(tokens))
        assert located.tier_name == "disk"
        for i in range(SMALL.layers):
            store.get_layer(located, i)  # reads are read-only: the promotion keeps them
        store.flush()
        assert cpu.contains(key) and store.stats()["cpu"]["promotions"] == 1
        got = cpu.get(key)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(got.layers, entry.layers, strict=True))
        # partly read: flush() completes the promotion by reading the rest in the background
        located2 = store.lookup(key2, expect(tokens2))
        store.get_layer(located2, 0)
        store.flush()
        assert cpu.get(key2) is not None and store.stats()["cpu"]["promotions"] == 2
        assert store.lookup(key2, expect(tokens2)).tier_name == "cpu"


def test_no_promotion_when_disabled(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path, promote=False) as store:
        store.tiers[1].put(key, entry)
        located = store.lookup(key, expect(tokens))
        store.get(located)
        store.flush()
        assert not store.tiers[0].contains(key)


def test_entry_vanishing_from_upper_tier_falls_back(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path) as store:
        store.put(key, entry, sync=True)
        located = store.lookup(key, expect(tokens))
        store.tiers[0].delete(key)  # evicted between lookup and read
        k, _ = store.get_layer(located, 2)
        assert torch.equal(k, entry.layers[2][0])
        store.delete(key)
        assert store.get_layer(located, 2) is None and store.contains(key) is None


def test_budget_smaller_than_entry_rejected_before_building(tmp_path):
    cfg = StoreConfig(tiers=(CpuTierConfig(budget=1000), DiskTierConfig(path=str(tmp_path / "never"))))
    with pytest.raises(ValueError, match=r"tiers\[0\] \(cpu\): budget .* smaller than one chunk entry"):
        TieredStore.from_config(cfg, min_entry_bytes=entry_nbytes(3, 2, 16, 8, "float16"))
    assert not (tmp_path / "never").exists()


@pytest.mark.redis
def test_stack_survives_redis_going_down(tmp_path, redis_server, redis_url, caplog):
    cfg = StoreConfig(tiers=(
        CpuTierConfig(budget=4 * 3072),
        RedisTierConfig(url=redis_url, backoff_initial_s=0.2, socket_timeout_s=1.0),
    ))
    entries = [keyed(seed=i) for i in range(6)]
    with TieredStore.from_config(cfg) as store:
        redis_server.stop()
        try:
            with caplog.at_level(logging.WARNING, logger="kvblend.storage"):
                for key, _, entry in entries:
                    store.put(key, entry)  # redis writes fail quietly; cpu keeps the last four
                store.flush()
                hits = [store.lookup(k, expect(t)) for k, t, _ in entries]
            assert [h is not None for h in hits] == [False, False, True, True, True, True]
            assert store.stats()["redis"]["down"] is True and "is down" in caplog.text
        finally:
            redis_server.start()
        deadline = time.monotonic() + 5
        key, tokens, entry = entries[0]
        while store.tiers[1].get_header(key) is None and time.monotonic() < deadline:
            store.put(key, entry, sync=True)
            time.sleep(0.05)
        assert store.stats()["redis"]["down"] is False
        store.tiers[0].clear()
        located = store.lookup(key, expect(tokens))
        assert located.tier_name == "redis" and store.get(located) is not None


@pytest.mark.redis
def test_required_redis_fails_clearly():
    cfg = StoreConfig(tiers=(CpuTierConfig(), RedisTierConfig(url="redis://127.0.0.1:1/0", required=True)))
    with pytest.raises(StoreUnavailable, match=r"redis tier at redis://127\.0\.0\.1:1/0 is unreachable"):
        TieredStore.from_config(cfg)


def test_cli_store_stats_ls_clear_and_bench(tmp_path, capsys):
    config = tmp_path / "kv.yaml"
    config.write_text(yaml.safe_dump({"store": {"tiers": [{"kind": "disk", "path": str(tmp_path / "d")}]}}))
    key, _, entry = keyed()
    store = TieredStore.from_config(StoreConfig.from_mapping(yaml.safe_load(config.read_text())["store"]))
    store.put(key, entry, sync=True)
    store.close()
    assert cli_main(["store", "ls", "--config", str(config)]) == 0
    assert key in capsys.readouterr().out
    assert cli_main(["store", "stats", "--config", str(config), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["disk"]["entries"] == 1
    assert cli_main(["store", "clear", "--config", str(config), "--yes"]) == 0
    assert list((tmp_path / "d").iterdir()) == []
    assert cli_main(["bench", "load", "--tier", "cpu,disk", "--size-mb", "0.05", "--layers", "2", "--rounds", "1",
                     "--config", str(config), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["tier"] for r in result["tiers"]] == ["cpu", "disk"]
    assert all(r["read_gbps"] > 0 and r["ratio"] > 0 for r in result["tiers"])


def test_background_failure_of_required_tier_surfaces_on_flush(tmp_path, monkeypatch):
    import errno
    import os

    key, _, entry = keyed()
    cfg = StoreConfig(tiers=(CpuTierConfig(budget=1 << 20), DiskTierConfig(path=str(tmp_path / "d"), required=True)))
    store = TieredStore.from_config(cfg)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "writev", full)
    store.put(key, entry)  # queued: does not raise here
    with pytest.raises(StoreUnavailable, match="No space left"):
        store.flush()
    assert store.tiers[0].contains(key)  # tiers before the failing one were written
    store.close()


def test_engines_with_different_secrets_do_not_see_or_delete_each_others_entries(tmp_path):
    """Each secret has its own namespace (a digest of it): another secret's store does not see the
    entry at all (a plain miss, nothing to reject, nothing overwritten); an entry that fails
    authentication in a store's own namespace is a miss, counted, and stays where it is."""
    key, tokens, entry = keyed()
    mine = StoreConfig(secret="first-secret-0123456789", tiers=(DiskTierConfig(path=str(tmp_path / "d")),))
    theirs = dataclasses.replace(mine, secret="other-secret-0123456789")
    assert mine.key_namespace != theirs.key_namespace and "secret" not in mine.key_namespace
    with TieredStore.from_config(mine) as a:
        a.put(key, entry, sync=True)
    with TieredStore.from_config(theirs) as b:
        assert b.lookup(key, expect(tokens)) is None and not b.tiers[0].contains(key)
        stats = b.stats()["disk"]
        assert stats["unauthenticated"] == 0 and stats["lookup_misses"] == 1
        b.put(key, entry, sync=True)  # its own copy, beside the other's
    with TieredStore.from_config(mine) as a:
        located = a.lookup(key, expect(tokens))  # still there for its owner, its own
        assert located is not None and verify(located.header, key, "first-secret-0123456789")
        key2, tokens2, entry2 = keyed(seed=1)
        a.tiers[0].put(key2, entry2)  # unsigned, in its namespace: planted
        assert a.lookup(key2, expect(tokens2)) is None
        assert a.stats()["disk"]["unauthenticated"] == 1 and a.tiers[0].contains(key2)


@pytest.mark.parametrize("kinds, secret, warned", [
    (("redis",), None, True), (("redis",), "a-secret-0123456789ab", False), (("cpu", "disk"), None, False),
])
def test_a_shared_tier_without_a_secret_warns_once_at_start(tmp_path, caplog, kinds, secret, warned):
    tiers = {"cpu": CpuTierConfig(), "disk": DiskTierConfig(path=str(tmp_path / "d")),
             "redis": RedisTierConfig(url="redis://127.0.0.1:1/0", connect_timeout_s=0.2, socket_timeout_s=0.2)}
    with caplog.at_level(logging.WARNING, logger="kvblend.storage"):
        with TieredStore.from_config(StoreConfig(secret=secret, tiers=tuple(tiers[k] for k in kinds))):
            pass
    risk = [r.getMessage() for r in caplog.records if "without store.secret" in r.getMessage()]
    assert len(risk) == (1 if warned else 0)
    if warned:
        assert "plant entries" in risk[0] and "KVBLEND_STORE_SECRET" in risk[0]


@pytest.mark.parametrize("busy_s", [0.3, 1.5])
def test_a_lookup_of_a_queued_write_is_served_from_the_queue(tmp_path, monkeypatch, busy_s):
    """A document looked up while its put waits in the write-behind queue is a hit, not a second
    computation and a second write, however long the writer takes (a loaded machine: it once
    waited 1 s, then missed, and the request's numbers depended on the load), and it is not
    waited for (a hung write held every request, issue 49): the hit is served from the queued
    put, sealed as the top tier will hold it."""
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path) as store:
        cpu = store.tiers[0]
        slow_put = cpu.put

        def put(*args, **kwargs):
            time.sleep(busy_s)  # a busy writer: nothing is in any tier for a while
            return slow_put(*args, **kwargs)

        monkeypatch.setattr(cpu, "put", put)
        store.put(key, entry)  # queued; the writer takes busy_s for it
        t0 = time.monotonic()
        located = store.lookup(key, expect(tokens))
        assert time.monotonic() - t0 < busy_s / 2  # not waited for
        assert located is not None and located.tier_name == "cpu" and located.held is not None
        layers = store.get_layers(located, range(located.header.num_layers))
        stats = store.stats()
        assert stats["cpu"]["lookup_hits"] == 1 and stats["cpu"]["lookup_misses"] == 0 and store.queued_hits == 1
        store.flush()
        assert store.stats()["disk"]["puts"] == 1 and not store._queued
        written = store.lookup(key, expect(tokens))
        assert written is not None and written.held is None and written.header == located.header
        for (k1, v1), (k2, v2) in zip(layers, store.get_layers(written, range(written.header.num_layers)),
                                      strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)
