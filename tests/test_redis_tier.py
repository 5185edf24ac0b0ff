"""Redis and Redis Cluster tiers against real servers: round trips, batching, faults."""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from contextlib import suppress
from urllib.parse import urlsplit

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from eval.bench.load import ChunkShape, random_entry
from storage.cluster import RedisClusterTier
from storage.config import RedisClusterTierConfig, RedisTierConfig
from storage.entry import Expected
from storage.redis_tier import RedisTier, redact
from storage.serialization import MAX_HEADER_BYTES, encode_header
from storage.stack import LookupBudget, TieredStore
from storage.tier import StoreUnavailable

pytestmark = pytest.mark.redis
SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16)


def assert_same(a, b) -> None:
    assert a[0].dtype == b[0].dtype and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def redis_tier(url: str, **kw) -> RedisTier:
    return RedisTier(RedisTierConfig(url=url, backoff_initial_s=0.2, backoff_max_s=1.0, socket_timeout_s=1.0, **kw))


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_redis_round_trip_every_dtype(redis_url, kv_dtype):
    tier = redis_tier(redis_url)
    _, entry = random_entry(dataclasses.replace(SMALL, kv_dtype=kv_dtype), seed=4)
    assert tier.get_header("k") is None and tier.get_layer("k", 0) is None
    tier.put("k", entry)
    assert tier.contains("k") and list(tier.keys()) == ["k"]
    got = tier.get("k")
    assert got is not None and got.header == entry.header
    for a, b in zip(got.layers, entry.layers, strict=True):
        assert_same(a, b)
    assert_same(tier.get_layer("k", 2), entry.layers[2])  # header fetched in the same round trip
    batch = tier.get_layers("k", [2, 0], entry.header)
    assert_same(batch[0], entry.layers[2]) and assert_same(batch[1], entry.layers[0]) is None
    stats = tier.stats()
    assert stats["down"] is False and stats["entries"] == 1 and stats["bytes_used"] > entry.nbytes
    tier.delete("k")
    assert tier.get_header("k") is None
    assert redis.Redis.from_url(redis_url).dbsize() == 0  # header and every layer key removed
    tier.close()


def test_redis_ttl_prefix_isolation_and_clear(redis_url):
    a = redis_tier(redis_url, key_prefix="a:", ttl_s=30)
    b = redis_tier(redis_url, key_prefix="b:")
    _, entry = random_entry(SMALL)
    a.put("k", entry)
    b.put("k", entry)
    client = redis.Redis.from_url(redis_url)
    assert 0 < client.pttl("a:{k}:h") <= 30_000 and 0 < client.pttl("a:{k}:l2") <= 30_000
    assert client.pttl("b:{k}:h") == -1
    a.clear()
    assert a.get_header("k") is None and b.get("k") is not None


def test_foreign_key_names_under_the_prefix_are_not_entries(redis_url):
    """Names no put of ours wrote (not UTF-8, characters no key has) are skipped by keys()
    and stats(), not an error that breaks `kvblend store ls / stats`."""
    tier = redis_tier(redis_url)
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    client = redis.Redis.from_url(redis_url)
    client.set(b"kvblend:{\xff}:h", b"junk")
    client.set(b"kvblend:{a b}:h", b"junk")
    client.set(b"kvblend:{}:h", b"junk")
    assert list(tier.keys()) == ["k"]
    assert tier.stats()["entries"] == 1
    tier.clear()
    tier.close()


def test_redis_corrupt_layer_is_deleted_and_counted(redis_url, caplog):
    tier = redis_tier(redis_url)
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    client = redis.Redis.from_url(redis_url)
    data = bytearray(client.get("kvblend:{k}:l1"))
    data[3] ^= 0xFF
    client.set("kvblend:{k}:l1", bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvblend.storage"):
        assert tier.get_layer("k", 1, entry.header) is None
    assert "corrupt" in caplog.text and tier.stats()["corrupt"] == 1
    assert client.dbsize() == 0
    tier.put("k", entry)
    client.set("kvblend:{k}:h", b"garbage")  # wrong magic
    assert tier.get_header("k") is None and client.dbsize() == 0


def test_redis_down_then_back_with_backoff(redis_server, redis_url, caplog):
    tier = redis_tier(redis_url)
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    redis_server.stop()
    try:
        with caplog.at_level(logging.WARNING, logger="kvblend.storage"):
            assert tier.get_header("k") is None
            assert tier.down and tier.stats()["down"] is True
            t0 = time.perf_counter()
            for _ in range(100):  # inside the backoff window: no network, instant misses
                assert tier.get_layer("k", 0, entry.header) is None
                tier.put("k", entry)
            assert time.perf_counter() - t0 < 0.5
        assert caplog.text.count("is down") == 1  # logged once per state change
    finally:
        redis_server.start()
    deadline = time.monotonic() + 5
    while tier.get_header("k") is None and time.monotonic() < deadline:
        tier.put("k", entry)  # the restarted server is empty; puts resume once the backoff expires
        time.sleep(0.05)
    assert not tier.down and tier.get("k") is not None
    assert tier.stats()["errors"] >= 1


def test_redis_required_raises_naming_the_url(redis_server, redis_url):
    dead = "redis://user:secret@127.0.0.1:1/0"
    with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:1.*required: false") as info:
        redis_tier(dead, required=True)
    assert "secret" not in str(info.value)
    tier = redis_tier(redis_url, required=True)
    redis_server.stop()
    try:
        with pytest.raises(StoreUnavailable, match=str(redis_server.port)):
            tier.get_header("k")
    finally:
        redis_server.start()


def test_redact_hides_passwords():
    assert redact("redis://u:pw@h:7/1") == "redis://u:***@h:7/1"
    assert redact("rediss://h:7") == "rediss://h:7"


def test_cluster_round_trip_and_single_slot(redis_cluster_urls):
    tier = RedisClusterTier(RedisClusterTierConfig(urls=tuple(redis_cluster_urls), key_prefix="t1:"))
    entries = {f"key{i}": random_entry(SMALL, seed=i)[1] for i in range(6)}
    for key, entry in entries.items():
        tier.put(key, entry)
    assert sorted(tier.keys()) == sorted(entries)
    for key, entry in entries.items():
        header = tier.get_header(key)
        assert header == entry.header
        assert_same(tier.get_layer(key, 1, header), entry.layers[1])
        got = tier.get(key)
        assert got is not None and all(torch.equal(a[0], b[0]) for a, b in zip(got.layers, entry.layers, strict=True))
    client = RedisCluster.from_url(redis_cluster_urls[0])
    slots = {client.keyslot(f"t1:{{key0}}:{s}") for s in ("h", "l0", "l1", "l2")}
    assert len(slots) == 1
    nodes = {client.get_node_from_key(f"t1:{{{k}}}:h").name for k in entries}
    assert len(nodes) > 1  # entries spread over the cluster
    assert tier.stats()["entries"] == 6 and tier.stats()["down"] is False
    tier.delete("key0")
    assert tier.get_header("key0") is None
    tier.clear()
    assert list(tier.keys()) == []
    tier.close()


def test_cluster_unreachable_is_down_or_required_error():
    cfg = RedisClusterTierConfig(urls=("redis://127.0.0.1:1",), connect_timeout_s=0.2, backoff_initial_s=0.2)
    tier = RedisClusterTier(cfg)
    assert tier.down and tier.get_header("k") is None
    with pytest.raises(StoreUnavailable, match="redis-cluster tier at redis://127.0.0.1:1"):
        RedisClusterTier(dataclasses.replace(cfg, required=True))


def test_redis_delete_reads_nothing_and_removes_every_layer(redis_url):
    tier = redis_tier(redis_url)
    _, entry = random_entry(dataclasses.replace(SMALL, layers=130), seed=1)  # more layers than one delete batch
    tier.put("k", entry)
    client = redis.Redis.from_url(redis_url)
    client.set("kvblend:{k}:h", b"junk" * (1 << 20))  # 4 MiB under the header: deleting must not fetch it
    sent = int(client.info("stats")["total_net_output_bytes"])
    tier.delete("k")
    assert int(client.info("stats")["total_net_output_bytes"]) - sent < 64 << 10
    assert client.dbsize() == 0


def test_redis_reads_are_bounded_before_values_travel(redis_url):
    tier = redis_tier(redis_url)
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    client = redis.Redis.from_url(redis_url)
    client.set("kvblend:{k}:l1", client.get("kvblend:{k}:l1") + b"\0" * (4 << 20))  # a layer 4 MiB too long
    sent = int(client.info("stats")["total_net_output_bytes"])
    assert tier.get_layers("k", [0, 1], entry.header) == [None, None]
    assert int(client.info("stats")["total_net_output_bytes"]) - sent < 64 << 10
    assert tier.stats()["corrupt"] == 1 and client.dbsize() == 0
    tier.put("k", entry)
    client.set("kvblend:{k}:h", encode_header(entry.header) + b"\0" * (4 << 20))
    sent = int(client.info("stats")["total_net_output_bytes"])
    assert tier.get_header("k") is None  # longer than any header may be
    assert int(client.info("stats")["total_net_output_bytes"]) - sent < 2 * MAX_HEADER_BYTES + (16 << 10)


@pytest.mark.parametrize("error", [redis.exceptions.ClusterDownError("The cluster is down"),
                                   redis.exceptions.TryAgainError("Multiple keys request during rehashing"),
                                   redis.exceptions.ReadOnlyError("You can't write against a read only replica.")])
@pytest.mark.parametrize("read", ["header", "layers"])
def test_server_state_replies_mark_the_tier_down_never_the_entry_corrupt(redis_url, error, read):
    """A cluster that is down (or resharding, or a read-only replica) answers with an error
    reply: the tier is down for its backoff, the entry is neither counted corrupt nor deleted."""
    tier = redis_tier(redis_url)
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    client = tier._client_or_connect()
    real_getrange, real_pipeline = client.getrange, client.pipeline

    def refuse(*_a, **_k):
        raise error

    class RefusingPipeline:  # a pipeline whose replies are all the error, as execute(raise_on_error=False) gives
        def __init__(self, n=0):
            self.n = n

        def getrange(self, *_a):
            self.n += 1

        def execute(self, raise_on_error=True):
            return [error] * self.n

    client.getrange = refuse
    client.pipeline = lambda **_k: RefusingPipeline()
    try:
        if read == "header":
            assert tier.get_header("k") is None
        else:
            assert tier.get_layers("k", [0, 1], entry.header) == [None, None]
        assert tier.down and tier.stats()["corrupt"] == 0
    finally:
        client.getrange, client.pipeline = real_getrange, real_pipeline
    assert redis.Redis.from_url(redis_url).exists("kvblend:{k}:h", "kvblend:{k}:l0", "kvblend:{k}:l1") == 3


class SlowProxy:
    """A TCP proxy on a free loopback port in front of a real Redis server that holds every
    chunk of the server's replies for `delay` seconds (0: passes them at once): a server
    that answers, but slowly."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname, parts.port)
        self.delay = 0.0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}/0"
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, slow: bool) -> None:
        with suppress(OSError):
            while data := src.recv(1 << 16):
                if slow and self.delay:
                    time.sleep(self.delay)
                dst.sendall(data)
        for sock in (src, dst):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.closed = True
        self.listener.close()


def test_a_slow_server_costs_a_request_its_lookup_budget_then_is_skipped(redis_url):
    """A server that answers every lookup, each under the socket timeout but slowly: one
    request's header reads stop costing once they add up to the budget (load_stall_s); the
    tier is suspended, later lookups miss at once, a late reply does not lift the suspension,
    and a server still slow after it is suspended twice as long."""
    proxy = SlowProxy(redis_url)
    config = RedisTierConfig(url=proxy.url, backoff_initial_s=1.0, backoff_max_s=30.0, socket_timeout_s=2.0)
    tier = RedisTier(config)
    store = TieredStore([tier], kv_dtype="float32")
    try:
        entries = [random_entry(SMALL, seed=i) for i in range(12)]
        for i, (_, entry) in enumerate(entries):
            store.put(f"k{i}", entry, sync=True)

        def expected(entry) -> Expected:
            h = entry.header
            return Expected(h.fingerprint, h.tokens_digest, h.num_tokens, h.num_layers, h.kv_heads, h.head_dim,
                            h.kv_dtype, h.pos_start)

        def lookups(budget: LookupBudget) -> tuple[int, float]:
            t0 = time.monotonic()
            hits = sum(store.lookup(f"k{i}", expected(e), budget) is not None for i, (_, e) in enumerate(entries))
            return hits, time.monotonic() - t0

        assert lookups(LookupBudget(0.6))[0] == 12  # fast: every entry found
        proxy.delay = 0.25
        hits, took = lookups(LookupBudget(0.6))  # unbounded, 12 x 0.25 s = 3 s
        assert 1 <= hits < 12 and took < 2.0 and tier.down  # unbounded: 3 s
        hits, took = lookups(LookupBudget(0.6))
        assert hits == 0 and took < 0.2  # suspended: no request waits on it
        late = threading.Thread(target=tier.get_header, args=("k0",))
        time.sleep(1.1)  # the suspension ends: the next read probes the server
        late.start()
        time.sleep(0.05)
        tier.suspend("slow again")  # while that read is still on its way
        late.join()
        assert tier.down  # the late reply did not lift it
        assert tier._retry_at - tier._down_at == pytest.approx(2.0)  # the second suspension: twice as long
    finally:
        store.close()
        proxy.close()


def test_a_large_ingest_over_a_healthy_but_distant_server_is_not_a_slow_server(redis_url):
    """Each document's lookups get their own budget: many documents whose lookups add up to
    more than load_stall_s (each quick) leave the tier up, and every document is stored."""
    from blend.config import EngineConfig
    from blend.engine.engine import BlendEngine
    from tests.models import smollm2_tokenizer, tiny_model

    proxy = SlowProxy(redis_url)
    try:
        store = {"kv_dtype": "float32", "tiers": [{"kind": "redis", "url": proxy.url, "key_prefix": "ingest:"}]}
        cfg = EngineConfig().with_overrides(store=store, chunk_tokens=16, load_stall_s=0.5, split="off")
        docs = [f"Passage {i} says that the number {i} is written in it." for i in range(30)]
        with BlendEngine(cfg, model=tiny_model(tokenizer=smollm2_tokenizer())) as engine:
            proxy.delay = 0.03  # 30+ lookups: about 1 s in all, 0.03-0.1 s per document
            assert not any(d.cached for d in engine.ingest(docs))
            engine.store.flush()
            assert not engine.store.tiers[0].down
            assert all(d.cached for d in engine.ingest(docs))
    finally:
        proxy.close()


def test_peek_header_reads_without_deleting_or_counting(redis_url):
    from storage.entry import CorruptEntry

    tier = redis_tier(redis_url)
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    before = tier.stats()
    assert tier.peek_header("k") == entry.header and tier.peek_header("absent") is None
    client = redis.Redis.from_url(redis_url)
    client.set("kvblend:{k}:h", b"garbage, not a header")
    with pytest.raises(CorruptEntry, match="magic"):
        tier.peek_header("k")
    assert client.exists("kvblend:{k}:h") and client.exists("kvblend:{k}:l0")  # shown, not deleted
    after = tier.stats()
    assert (after["hits"], after["misses"], after["corrupt"]) == (before["hits"], before["misses"], before["corrupt"])
    tier.clear()
    tier.close()
