"""Redis tier: one key for the header and one per layer, pipelined writes and batched reads.

Key scheme, with `P` the configured key_prefix:
    P{<key>}:h     header bytes            P{<key>}:l<i>  layer i (K bytes then V bytes)
The braces are a Redis Cluster hash tag: all keys of one entry live in one slot, so the
same scheme works for the cluster tier and an entry can be written in one pipeline.
The header is written last and deleted first, so a reader that sees a header finds the
layers (unless the server evicted them under maxmemory: that read is a miss).

Faults: a connection error or timeout marks the tier `down`. While down, operations
return misses at once (puts are dropped) without touching the network; after an
exponential backoff (backoff_initial_s doubling to backoff_max_s) the next operation
probes the server again. Each up/down transition is logged once. With `required: true`
an unreachable server raises StoreUnavailable naming the URL instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from storage.config import RedisTierConfig, tier_display_name
from storage.entry import CorruptEntry, EntryHeader, KVEntry
from storage.serialization import decode_header, encode_header, layer_from_bytes, layer_to_bytes, verify_layer
from storage.tier import Layer, StoreUnavailable, TierStats, read_entry, report_corrupt

log = logging.getLogger("kvblend.storage")

R = TypeVar("R")

# Errors that mean "the server is not usable right now" (as opposed to a bad command).
DOWN_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    RedisClusterException,
    OSError,
)
SOCKET_READ_SIZE = 1 << 20  # large values: fewer recv() calls per layer
_STATS_CACHE_S = 10.0


def redact(url: str) -> str:
    """The URL with any password replaced by ***, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


class RedisTier:
    """Tier on one Redis server (redis:// or rediss://, optional user:password@ and /db)."""

    kind = "redis"

    def __init__(self, config: Any) -> None:
        self.config = config
        self.name = tier_display_name(config)
        self._prefix = config.key_prefix
        self._ttl = None if config.ttl_s is None else max(1, int(round(config.ttl_s * 1000)))  # ms
        self._stats = TierStats()
        self._state_lock = threading.Lock()
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._down = False
        self._retry_at = 0.0
        self._backoff = config.backoff_initial_s
        self._stats_cache: tuple[float, int, int] | None = None
        self._run("connect", lambda c: c.ping(), None)  # reports the initial state; raises if required

    # -------------------------------------------------------------- connection
    @property
    def target(self) -> str:
        """Where this tier points, password redacted."""
        return redact(self.config.url)

    def _retry(self) -> Retry:
        return Retry(NoBackoff(), 1)  # one immediate retry for a stale pooled connection

    def _connect(self) -> Any:
        """Create the client (no network I/O for a single server)."""
        cfg: RedisTierConfig = self.config
        pool = redis.BlockingConnectionPool.from_url(
            cfg.url,
            max_connections=cfg.pool_size,
            timeout=cfg.socket_timeout_s,
            socket_timeout=cfg.socket_timeout_s,
            socket_connect_timeout=cfg.connect_timeout_s,
            socket_read_size=SOCKET_READ_SIZE,
            retry=self._retry(),
        )
        return redis.Redis(connection_pool=pool)

    def _client_or_connect(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = self._connect()
            return self._client

    @property
    def down(self) -> bool:
        return self._down

    def _usable(self) -> bool:
        """False while down and inside the backoff window (raises instead if required)."""
        with self._state_lock:
            if not self._down or time.monotonic() >= self._retry_at:
                return True
        if self.config.required:
            raise StoreUnavailable(
                f"{self.kind} tier at {self.target} is unreachable; start the server or fix the URL, "
                "or set required: false to continue on the other tiers"
            )
        return False

    def _mark_down(self, what: str, err: BaseException) -> None:
        with self._state_lock:
            first = not self._down
            if first:
                self._backoff = self.config.backoff_initial_s
            else:
                self._backoff = min(self._backoff * 2, self.config.backoff_max_s)
            self._down = True
            self._retry_at = time.monotonic() + self._backoff
            backoff = self._backoff
        self._stats.add(errors=1)
        if first:
            log.warning(
                "%s tier at %s is down (%s failed: %s); serving misses, retrying in %.1fs with backoff",
                self.name, self.target, what, err, backoff,
            )
        if self.config.required:
            raise StoreUnavailable(
                f"{self.kind} tier at {self.target} is unreachable ({what}: {err}); start the server or fix "
                "the URL, or set required: false to continue on the other tiers"
            ) from err

    def _mark_up(self) -> None:
        if not self._down:
            return
        with self._state_lock:
            was_down, self._down = self._down, False
            self._backoff = self.config.backoff_initial_s
        if was_down:
            log.warning("%s tier at %s is reachable again", self.name, self.target)

    def _run(self, what: str, fn: Callable[[Any], R], default: R) -> R:
        """Run `fn(client)` with fault handling: `default` when down or on a server error."""
        if not self._usable():
            return default
        try:
            result = fn(self._client_or_connect())
        except DOWN_ERRORS as e:
            self._mark_down(what, e)
            return default
        except redis.RedisError as e:  # e.g. OOM under maxmemory: the server is up
            self._stats.add(errors=1)
            log.warning("%s tier at %s: %s failed: %s", self.name, self.target, what, e)
            return default
        self._mark_up()
        return result

    # -------------------------------------------------------------------- keys
    def _hkey(self, key: str) -> str:
        return f"{self._prefix}{{{key}}}:h"

    def _lkey(self, key: str, layer: int) -> str:
        return f"{self._prefix}{{{key}}}:l{layer}"

    def _key_of(self, redis_key: bytes | str) -> str:
        text = redis_key.decode() if isinstance(redis_key, bytes) else redis_key
        return text[len(self._prefix) + 1 : text.rindex("}")]

    # ------------------------------------------------------------------- reads
    def contains(self, key: str) -> bool:
        return bool(self._run("exists", lambda c: c.exists(self._hkey(key)), 0))

    def _decode_header(self, key: str, data: bytes | None) -> EntryHeader | None:
        if data is None:
            return None
        try:
            return decode_header(data)
        except CorruptEntry as e:
            report_corrupt(self, self._stats, key, e)
            return None

    def get_header(self, key: str) -> EntryHeader | None:
        header = self._decode_header(key, self._run("get header", lambda c: c.get(self._hkey(key)), None))
        if header is None:
            self._stats.add(misses=1)
        else:
            self._stats.add(hits=1)
        return header

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None) -> Layer | None:
        """One GET (two, pipelined, without `header`); verified tensors over the received bytes."""
        return self.get_layers(key, [layer], header)[0]

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None) -> list[Layer | None]:
        """Fetch several layers in one pipelined round trip; a missing or corrupt layer is None."""
        t0 = time.perf_counter()
        layers = list(layers)

        def fetch(c: Any) -> list[Any]:
            if header is not None and len(layers) == 1:
                return [c.get(self._lkey(key, layers[0]))]  # no pipeline machinery for one GET
            pipe = c.pipeline(transaction=False)
            if header is None:
                pipe.get(self._hkey(key))
            for i in layers:
                pipe.get(self._lkey(key, i))
            return pipe.execute()

        replies = self._run("get layers", fetch, None)
        if replies is None:
            self._stats.add(layer_misses=len(layers))
            return [None] * len(layers)
        if header is None:
            header = self._decode_header(key, replies[0])
            replies = replies[1:]
            if header is None:
                self._stats.add(layer_misses=len(layers))
                return [None] * len(layers)
        out: list[Layer | None] = []
        nbytes = 0
        for i, data in zip(layers, replies, strict=True):
            if not 0 <= i < header.num_layers:
                raise IndexError(f"layer {i} out of range: entry has {header.num_layers} layers")
            if data is None:
                out.append(None)
                continue
            try:
                out.append(layer_from_bytes(data, header, i, owned=True))
                nbytes += len(data)
            except CorruptEntry as e:
                report_corrupt(self, self._stats, key, e)
                return [None] * len(layers)
        hits = sum(x is not None for x in out)
        self._stats.add(
            layer_reads=hits, layer_misses=len(out) - hits, bytes_read=nbytes, read_seconds=time.perf_counter() - t0
        )
        return out

    def read_layer_into(self, key: str, layer: int, header: EntryHeader | None, out: Any) -> bool:
        """GET layer `layer`, verify the reply and copy it once into `out`, a contiguous
        (layer_nbytes,) uint8 CPU tensor (e.g. a pinned staging buffer). False on a miss."""
        t0 = time.perf_counter()
        if header is None:
            header = self.get_header(key)
            if header is None:
                self._stats.add(layer_misses=1)
                return False
        if not 0 <= layer < header.num_layers:
            raise IndexError(f"layer {layer} out of range: entry has {header.num_layers} layers")
        data = self._run("get layer", lambda c: c.get(self._lkey(key, layer)), None)
        if data is None:
            self._stats.add(layer_misses=1)
            return False
        try:
            verify_layer(data, header, layer)
        except CorruptEntry as e:
            report_corrupt(self, self._stats, key, e)
            self._stats.add(layer_misses=1)
            return False
        out.numpy()[:] = np.frombuffer(data, dtype=np.uint8)
        self._stats.add(layer_reads=1, bytes_read=len(data), read_seconds=time.perf_counter() - t0)
        return True

    def get(self, key: str) -> KVEntry | None:
        return read_entry(self, key)

    # ------------------------------------------------------------------ writes
    def put(self, key: str, entry: KVEntry) -> None:
        """Write all layers then the header in one pipeline (with the configured TTL)."""
        t0 = time.perf_counter()
        values = [layer_to_bytes(k, v) for k, v in entry.layers]
        head = encode_header(entry.header)

        def write(c: Any) -> bool:
            pipe = c.pipeline(transaction=False)
            for i, value in enumerate(values):
                pipe.set(self._lkey(key, i), value, px=self._ttl)
            pipe.set(self._hkey(key), head, px=self._ttl)
            pipe.execute()
            return True

        if self._run("put", write, False):
            self._stats.add(
                puts=1, bytes_written=entry.nbytes + len(head), write_seconds=time.perf_counter() - t0
            )
            self._stats_cache = None

    def delete(self, key: str) -> None:
        """Delete header first, then the layers (found through the header, else by SCAN)."""

        def remove(c: Any) -> None:
            data = c.get(self._hkey(key))
            c.delete(self._hkey(key))
            try:
                n = decode_header(data).num_layers if data is not None else None
            except CorruptEntry:
                n = None
            if n is None:
                names = list(c.scan_iter(match=_glob_escape(f"{self._prefix}{{{key}}}:") + "*", count=1000))
            else:
                names = [self._lkey(key, i) for i in range(n)]
            pipe = c.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.execute()

        self._run("delete", remove, None)
        self._stats_cache = None

    def keys(self) -> Iterator[str]:
        pattern = _glob_escape(self._prefix) + "{*}:h"
        names = self._run("scan", lambda c: list(c.scan_iter(match=pattern, count=1000)), [])
        return iter(sorted(self._key_of(n) for n in names))

    def clear(self) -> None:
        """Delete every key under this tier's key_prefix (other prefixes are untouched)."""
        pattern = _glob_escape(self._prefix) + "{*"

        def wipe(c: Any) -> None:
            names = list(c.scan_iter(match=pattern, count=1000))
            for start in range(0, len(names), 500):
                pipe = c.pipeline(transaction=False)
                for name in names[start : start + 500]:
                    pipe.delete(name)
                pipe.execute()

        self._run("clear", wipe, None)
        self._stats_cache = None

    def close(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _usage(self) -> tuple[int, int]:
        """(entries, bytes) under this prefix, by SCAN + pipelined header GETs; cached 10 s."""
        cached = self._stats_cache
        if cached is not None and time.monotonic() - cached[0] < _STATS_CACHE_S:
            return cached[1], cached[2]
        if self._down and time.monotonic() < self._retry_at:
            return (cached[1], cached[2]) if cached is not None else (0, 0)
        keys = list(self.keys())

        def sizes(c: Any) -> int:
            total = 0
            for start in range(0, len(keys), 500):
                pipe = c.pipeline(transaction=False)
                for key in keys[start : start + 500]:
                    pipe.get(self._hkey(key))
                for data in pipe.execute():
                    if data is not None:
                        try:
                            total += decode_header(data).nbytes + len(data)
                        except CorruptEntry:
                            pass
            return total

        used = self._run("stats", sizes, 0)
        self._stats_cache = (time.monotonic(), len(keys), used)
        return len(keys), used

    def stats(self) -> dict:
        """Counters plus `down`; entries/bytes_used scan the keyspace (O(entries), cached 10 s)."""
        entries, used = self._usage()
        return self._stats.snapshot(entries, used) | {"down": self._down, "url": self.target}
