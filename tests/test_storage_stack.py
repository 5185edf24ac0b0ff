"""TieredStore: lookup verification, promotion, background writes, fallbacks, faults, CLI."""

from __future__ import annotations

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
from storage.entry import entry_nbytes
from storage.keys import chunk_key, tokens_digest
from storage.stack import TieredStore
from storage.tier import StoreUnavailable

SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16)


def keyed(seed: int = 0, fingerprint: str = "bench"):
    token_ids, entry = random_entry(SMALL, seed=seed, fingerprint=fingerprint)
    return chunk_key(fingerprint, token_ids, "float16"), token_ids, entry


def cpu_disk(tmp_path: Path, **kw) -> TieredStore:
    cfg = StoreConfig(tiers=(CpuTierConfig(budget=1 << 20), DiskTierConfig(path=str(tmp_path / "disk"))), **kw)
    return TieredStore.from_config(cfg)


def test_put_lookup_and_read_layers(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path) as store:
        assert store.lookup(key, tokens_digest=tokens_digest(tokens), fingerprint="bench") is None
        store.put(key, entry)  # background
        store.flush()
        assert store.contains(key) == "cpu" and list(store.keys()) == [key]
        located = store.lookup(key, tokens_digest=tokens_digest(tokens), fingerprint="bench")
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


def test_mismatched_tokens_or_fingerprint_is_a_miss(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path) as store:
        store.put(key, entry, sync=True)
        assert store.lookup(key, tokens_digest=tokens_digest(tokens[::-1]), fingerprint="bench") is None
        assert store.lookup(key, tokens_digest=tokens_digest(tokens), fingerprint="other-model") is None
        stats = store.stats()
        assert stats["cpu"]["mismatches"] == 2 and stats["disk"]["mismatches"] == 2


def test_hit_in_disk_is_promoted_to_cpu(tmp_path):
    key, tokens, entry = keyed()
    key2, tokens2, entry2 = keyed(seed=1)
    with cpu_disk(tmp_path) as store:
        cpu, disk = store.tiers
        disk.put(key, entry)
        disk.put(key2, entry2)
        located = store.lookup(key, tokens_digest=tokens_digest(tokens), fingerprint="bench")
        assert located.tier_name == "disk"
        for i in range(SMALL.layers):
            store.get_layer(located, i)  # reads are read-only: the promotion keeps them
        store.flush()
        assert cpu.contains(key) and store.stats()["cpu"]["promotions"] == 1
        got = cpu.get(key)
        assert all(torch.equal(a[0], b[0]) for a, b in zip(got.layers, entry.layers, strict=True))
        # partly read: flush() completes the promotion by reading the rest in the background
        located2 = store.lookup(key2, tokens_digest=tokens_digest(tokens2), fingerprint="bench")
        store.get_layer(located2, 0)
        store.flush()
        assert cpu.get(key2) is not None and store.stats()["cpu"]["promotions"] == 2
        assert store.lookup(key2, tokens_digest=tokens_digest(tokens2), fingerprint="bench").tier_name == "cpu"


def test_no_promotion_when_disabled(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path, promote=False) as store:
        store.tiers[1].put(key, entry)
        located = store.lookup(key, tokens_digest=tokens_digest(tokens), fingerprint="bench")
        store.get(located)
        store.flush()
        assert not store.tiers[0].contains(key)


def test_entry_vanishing_from_upper_tier_falls_back(tmp_path):
    key, tokens, entry = keyed()
    with cpu_disk(tmp_path) as store:
        store.put(key, entry, sync=True)
        located = store.lookup(key, tokens_digest=tokens_digest(tokens), fingerprint="bench")
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
                hits = [store.lookup(k, tokens_digest=tokens_digest(t), fingerprint="bench") for k, t, _ in entries]
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
        located = store.lookup(key, tokens_digest=tokens_digest(tokens), fingerprint="bench")
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
    assert cli_main(["store", "clear", "--config", str(config)]) == 0
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
