"""Store hardening against real servers and processes: tenants isolated by namespace on a
shared Redis or directory, headers never published without their layers, temp files of
killed writers reclaimed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import yaml

from blend.cli import main as cli_main
from eval.bench.load import ChunkShape, random_entry
from storage.config import DiskTierConfig, RedisTierConfig, StoreConfig
from storage.disk import DiskTier, file_layout
from storage.keys import document_block_key
from storage.redis_tier import RedisTier
from storage.stack import TieredStore
from tests.conftest import RedisServer, _free_port

SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16)
ROOT = Path(__file__).resolve().parents[1]


def tenant(tmp_path: Path, namespace: str, tier: dict, count: int, seed: int = 0) -> tuple[Path, list[str]]:
    """Write a config for `namespace` over `tier` and store `count` entries through it."""
    config = tmp_path / f"{namespace}.yaml"
    config.write_text(yaml.safe_dump({"store": {"namespace": namespace, "tiers": [tier]}}))
    keys = []
    with TieredStore.from_config(StoreConfig.from_mapping({"namespace": namespace, "tiers": [tier]})) as store:
        for i in range(count):
            token_ids, entry = random_entry(SMALL, seed=seed + i)
            key = document_block_key("bench", token_ids, "float16", namespace=namespace, start=0)
            store.put(key, entry, sync=True)
            keys.append(key)
    return config, keys


@pytest.mark.parametrize("kind", ["redis", "disk"])
def test_two_namespaces_ls_stats_clear_never_touch_each_other(kind, tmp_path, capsys, request):
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        tier: dict = {"kind": "redis", "url": url}
    else:
        tier = {"kind": "disk", "path": str(tmp_path / "shared")}
    alpha, alpha_keys = tenant(tmp_path, "alpha", tier, 3)
    beta, beta_keys = tenant(tmp_path, "beta", tier, 4, seed=10)

    def stored(keys: list[str], namespace: str) -> int:
        with TieredStore.from_config(StoreConfig.from_mapping({"namespace": namespace, "tiers": [tier]})) as store:
            return sum(store.contains(k) is not None for k in keys)

    assert cli_main(["store", "ls", "--config", str(alpha)]) == 0
    out = capsys.readouterr().out
    assert all(k in out for k in alpha_keys) and "beta" not in out
    assert cli_main(["store", "stats", "--config", str(beta), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats[kind]["entries"] == 4
    assert cli_main(["store", "clear", "--config", str(alpha), "--yes"]) == 0
    capsys.readouterr()
    assert stored(alpha_keys, "alpha") == 0 and stored(beta_keys, "beta") == 4
    if kind == "redis":
        names = [n.decode() for n in redis.Redis.from_url(tier["url"]).keys("*")]
        assert names and all("beta" in n for n in names)  # every key of beta, and only those, is left


def test_a_tenants_budget_never_evicts_another_tenants_entries(tmp_path):
    _, entry = random_entry(SMALL)
    head, offsets = file_layout(entry.header)
    size = offsets[-1] + entry.header.layer_nbytes
    shared = str(tmp_path / "shared")
    _, beta_keys = tenant(tmp_path, "beta", {"kind": "disk", "path": shared}, 2, seed=10)
    tenant(tmp_path, "alpha", {"kind": "disk", "path": shared, "budget": 2 * size}, 5)  # evicts its own only
    with TieredStore.from_config(StoreConfig.from_mapping(
            {"namespace": "beta", "tiers": [{"kind": "disk", "path": shared}]})) as store:
        assert all(store.contains(k) for k in beta_keys)
        assert store.stats()["disk"]["entries"] == 2


@pytest.fixture
def tight_redis(tmp_path):
    """A redis-server with noeviction and about 1 MiB of room for data."""
    server = RedisServer(tmp_path / "tight", _free_port(), "--maxmemory-policy", "noeviction")
    server.start()
    client = redis.Redis(port=server.port)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + (1 << 20))
    yield server
    client.close()
    server.stop()


def test_redis_header_never_published_without_its_layers(tight_redis):
    tier = RedisTier(RedisTierConfig(url=tight_redis.url, socket_timeout_s=5.0))
    shape = ChunkShape(layers=8, kv_heads=2, head_dim=64, tokens=512)  # 256 KiB layers, 2 MiB in all
    client = redis.Redis(port=tight_redis.port)
    for seed in range(4):
        _, entry = random_entry(shape, seed=seed)
        key = f"k{seed}"
        tier.put(key, entry)  # out of memory part way: must not raise
        if client.exists(tier._hkey(key)):
            assert all(client.exists(tier._lkey(key, i)) for i in range(shape.layers)), key
        assert tier.get(key) is None or tier.get(key).header == entry.header
    assert tier.stats()["errors"] >= 1
    tier.close()


_KILLED_WRITER = """
import os, sys, time
import storage.disk as disk
from eval.bench.load import ChunkShape, random_entry
from storage.config import DiskTierConfig

def stall(fd, parts):
    os.write(fd, bytes(parts[0]))
    os.write(fd, os.urandom(1 << 20))
    print("writing", flush=True)
    time.sleep(600)

disk._write_all = stall
tier = disk.DiskTier(DiskTierConfig(path=sys.argv[1]))
_, entry = random_entry(ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16))
tier.put("k", entry)
"""


def test_temp_files_of_a_killed_writer_are_counted_then_reclaimed(tmp_path):
    directory = tmp_path / "cache"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(directory)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "writing"
        temps = [p for p in directory.iterdir() if p.name.startswith(".tmp.")]
        assert len(temps) == 1 and temps[0].stat().st_size > 1 << 20
        live = DiskTier(DiskTierConfig(path=str(directory)))  # the writer still runs: its file stays
        assert temps[0].exists()
        assert live.stats()["bytes_used"] >= 1 << 20  # counted in the budget meanwhile
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=10)
    DiskTier(DiskTierConfig(path=str(directory)))  # a start after the kill reclaims it
    assert not temps[0].exists()
    live._clean_temp_files()  # and so does the periodic cleaning of a running tier
    assert live.stats()["bytes_used"] == 0


def test_entries_partly_evicted_by_redis_are_counted_deleted_misses(tmp_path):
    server = RedisServer(tmp_path / "evicting", _free_port(), "--maxmemory-policy", "allkeys-random")
    server.start()
    client = redis.Redis(port=server.port)
    try:
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + (2 << 20))
        tier = RedisTier(RedisTierConfig(url=server.url, socket_timeout_s=5.0))
        shape = ChunkShape(layers=8, kv_heads=2, head_dim=64, tokens=64)  # 32 KiB layers
        entries = {f"k{i}": random_entry(shape, seed=i)[1] for i in range(30)}  # 7.5 MiB into 2 MiB
        for key, entry in entries.items():
            tier.put(key, entry)
        partial = whole = 0
        for key, entry in entries.items():
            header = tier.get_header(key)
            if header is None:
                continue
            layers = tier.get_layers(key, range(shape.layers), header)
            if all(layer is not None for layer in layers):
                whole += 1
                assert all(a[0].equal(b[0]) for a, b in zip(layers, entry.layers, strict=True))
            else:
                partial += 1
                assert all(layer is None for layer in layers) and not client.exists(tier._hkey(key))
        assert partial >= 1 and tier.stats()["partial"] == partial
        tier.close()
    finally:
        client.close()
        server.stop()
