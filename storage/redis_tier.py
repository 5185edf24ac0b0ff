"""Redis tier: one key for the header and one per layer, pipelined writes and batched reads.

Key scheme, with `P` the configured key_prefix followed by `<namespace>:` when the store
has a namespace:
    P{<key>}:h     header bytes            P{<key>}:l<i>  layer i (K bytes then V bytes)
The braces are a Redis Cluster hash tag: all keys of one entry live in one slot, so the
same scheme works for the cluster tier. Listing, stats and `clear` scan `P{*`, so tenants
with different namespaces (or prefixes) never see or delete each other's keys.

Publication: the old header is deleted and the layers written in one pipeline; only if
every layer was stored is the header written, in a second round trip, so a header is
never visible without its layers (under `noeviction` a full server rejects some layers:
then nothing is published and the written layers are removed). A header found later
without a layer (evicted under maxmemory) is a partial entry: counted, deleted, a miss.

Reads are bounded before any value travels: a header is read with GETRANGE up to
MAX_HEADER_BYTES, a layer up to the header's layer_nbytes (one byte more reveals a value
that is too long), so junk under a key costs at most that much.

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

import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from storage.config import RedisTierConfig, tier_display_name
from storage.entry import CorruptEntry, EntryHeader, KVEntry
from storage.keys import ENTRY_KEY_RE
from storage.serialization import (
    MAX_HEADER_BYTES,
    decode_header,
    encode_header,
    layer_from_bytes,
    layer_to_bytes,
    layer_views,
)
from storage.tier import Layer, StoreUnavailable, TierStats, read_entry, report_corrupt

log = logging.getLogger("kvblend.storage")

R = TypeVar("R")

# Server replies that describe the server's state, not the key's value: the cluster is
# down or resharding, the server is loading or a read-only replica. Never a corrupt entry.
STATE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ClusterDownError,  # also MasterDownError
    redis.exceptions.TryAgainError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.BusyLoadingError,
)
# Errors that mean "the server is not usable right now" (as opposed to a bad command).
DOWN_ERRORS: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.ClusterError,
    RedisClusterException,
    OSError,
    *STATE_ERRORS,
)
SOCKET_READ_SIZE = 1 << 20  # large values: fewer recv() calls per layer
_STATS_CACHE_S = 10.0
DELETE_BATCH = 128  # layer keys deleted per round trip (more than the layers of most models)


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

    def __init__(self, config: Any, *, namespace: str = "") -> None:
        self.config = config
        self.name = tier_display_name(config)
        self.namespace = namespace
        self._prefix = f"{config.key_prefix}{namespace}:" if namespace else config.key_prefix
        self._ttl = None if config.ttl_s is None else max(1, int(round(config.ttl_s * 1000)))  # ms
        self._stats = TierStats()
        self._state_lock = threading.Lock()
        self._client_lock = threading.Lock()
        self._client: Any = None
        self._down = False
        self._down_at = 0.0  # when it was last marked down: an operation begun before proves nothing
        self._retry_at = 0.0
        self._backoff = config.backoff_initial_s
        self._suspended_s = config.backoff_initial_s  # the last suspension's length (suspend: slow, not gone)
        self._suspended_until = -float("inf")
        self._stats_cache: tuple[float, int, int] | None = None
        self._run("connect", lambda c: c.ping(), None)  # reports the initial state; raises if required

    # -------------------------------------------------------------- connection
    @property
    def target(self) -> str:
        """Where this tier points, password redacted."""
        return redact(self.config.url)

    def _retry(self) -> Retry:
        # one immediate retry for a stale pooled connection; never after a timeout, which
        # would make a stalled server cost two socket timeouts per probe
        return Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))

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

    def _mark_down(self, what: str, err: BaseException, backoff_s: float | None = None) -> None:
        with self._state_lock:
            first = not self._down
            if backoff_s is not None:
                self._backoff = backoff_s
            elif first:
                self._backoff = self.config.backoff_initial_s
            else:
                self._backoff = min(self._backoff * 2, self.config.backoff_max_s)
            self._down = True
            self._down_at = time.monotonic()
            self._retry_at = self._down_at + self._backoff
            backoff = self._backoff
        self._stats.add(errors=1)
        if first and not self.config.required:  # a required tier raises instead: one message, not two
            log.warning(
                "%s tier at %s is down (%s failed: %s); serving misses, retrying in %.1fs with backoff",
                self.name, self.target, what, err, backoff,
            )
        if self.config.required:
            raise StoreUnavailable(
                f"{self.kind} tier at {self.target} is unreachable ({what}: {err}); start the server or fix "
                "the URL, or set required: false to continue on the other tiers"
            ) from err

    def suspend(self, reason: str) -> None:
        """Treat the server as down for a while: it answers, but too slowly to use. A server
        still slow when that ends (suspended again within backoff_max_s) is suspended twice
        as long, up to backoff_max_s: a reply that arrives is no sign it became fast."""
        cfg = self.config
        with self._state_lock:
            now = time.monotonic()
            again = now - self._suspended_until <= cfg.backoff_max_s
            self._suspended_s = min(self._suspended_s * 2, cfg.backoff_max_s) if again else cfg.backoff_initial_s
            self._suspended_until = now + self._suspended_s
            backoff = self._suspended_s
        self._mark_down("read", TimeoutError(reason), backoff)

    def _mark_up(self, started: float) -> None:
        """An operation begun at `started` (time.monotonic) succeeded: the server is up again,
        unless it was marked down after that operation began (a slow reply still arriving
        from before a suspension says nothing new)."""
        if not self._down:
            return
        with self._state_lock:
            if started < self._down_at:
                return
            was_down, self._down = self._down, False
            self._backoff = self.config.backoff_initial_s
        if was_down:
            log.warning("%s tier at %s is reachable again", self.name, self.target)

    def _run(self, what: str, fn: Callable[[Any], R], default: R) -> R:
        """Run `fn(client)` with fault handling: `default` when down or on a server error."""
        if not self._usable():
            return default
        started = time.monotonic()
        try:
            result = fn(self._client_or_connect())
        except DOWN_ERRORS as e:
            self._mark_down(what, e)
            return default
        except redis.RedisError as e:  # e.g. OOM under maxmemory: the server is up
            self._stats.add(errors=1)
            log.warning("%s tier at %s: %s failed: %s", self.name, self.target, what, e)
            return default
        self._mark_up(started)
        return result

    # -------------------------------------------------------------------- keys
    def _hkey(self, key: str) -> str:
        return f"{self._prefix}{{{key}}}:h"

    def _lkey(self, key: str, layer: int) -> str:
        return f"{self._prefix}{{{key}}}:l{layer}"

    def _key_of(self, redis_key: bytes | str) -> str | None:
        """The entry key inside a scanned header key name; None for a name no put of ours
        wrote (not UTF-8, or not a key's characters): someone else's key under the prefix."""
        try:
            text = redis_key.decode() if isinstance(redis_key, bytes) else redis_key
        except UnicodeDecodeError:
            return None
        key = text[len(self._prefix) + 1 : text.rfind("}")]
        return key if ENTRY_KEY_RE.match(key) else None

    # ------------------------------------------------------------------- reads
    def contains(self, key: str) -> bool:
        return bool(self._run("exists", lambda c: c.exists(self._hkey(key)), 0))

    def _header_bytes(self, c: Any, key: str) -> bytes | redis.ResponseError:
        """At most MAX_HEADER_BYTES + 1 bytes of the header value (b"" if absent), or the
        server's error (a key of another type)."""
        try:
            return c.getrange(self._hkey(key), 0, MAX_HEADER_BYTES)
        except STATE_ERRORS:
            raise  # the tier is down, the entry is not corrupt
        except redis.ResponseError as e:
            return e

    @staticmethod
    def _parse_header(data: bytes | redis.ResponseError | None) -> EntryHeader | None:
        """The header in `data`, None when absent; CorruptEntry when unreadable."""
        if data is None or data == b"":
            return None
        if isinstance(data, redis.ResponseError):
            raise CorruptEntry(f"header key unreadable: {data}")
        if len(data) > MAX_HEADER_BYTES:
            raise CorruptEntry(f"header value is larger than {MAX_HEADER_BYTES} bytes")
        return decode_header(data)

    def _decode_header(self, key: str, data: bytes | redis.ResponseError | None) -> EntryHeader | None:
        """The header in `data`, or None (absent, or corrupt: then deleted and counted)."""
        try:
            return self._parse_header(data)
        except CorruptEntry as e:
            report_corrupt(self, self._stats, key, e)
            return None

    def peek_header(self, key: str) -> EntryHeader | None:
        return self._parse_header(self._run("get header", lambda c: self._header_bytes(c, key), None))

    def get_header(self, key: str) -> EntryHeader | None:
        header = self._decode_header(key, self._run("get header", lambda c: self._header_bytes(c, key), None))
        if header is None:
            self._stats.add(misses=1)
        else:
            self._stats.add(hits=1)
        return header

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None) -> Layer | None:
        """One GET (two, pipelined, without `header`); verified tensors over the received bytes."""
        return self.get_layers(key, [layer], header)[0]

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None) -> list[Layer | None]:
        """Fetch several layers in one pipelined round trip (without `header`: the header
        first, in one more). A missing or corrupt layer makes the whole entry a miss: it is
        deleted (counted in `partial` or `corrupt`) and every requested layer is None."""
        t0 = time.perf_counter()
        layers = list(layers)
        if header is None:
            header = self._decode_header(key, self._run("get header", lambda c: self._header_bytes(c, key), None))
            if header is None:
                self._stats.add(layer_misses=len(layers))
                return [None] * len(layers)
        for i in layers:
            if not 0 <= i < header.num_layers:
                raise IndexError(f"layer {i} out of range: entry has {header.num_layers} layers")
        end = header.layer_nbytes  # inclusive: a value one byte longer than a layer shows as too long

        def fetch(c: Any) -> list[Any]:
            if len(layers) == 1:  # no pipeline machinery for one command
                try:
                    return [c.getrange(self._lkey(key, layers[0]), 0, end)]
                except STATE_ERRORS:
                    raise
                except redis.ResponseError as e:
                    return [e]
            pipe = c.pipeline(transaction=False)
            for i in layers:
                pipe.getrange(self._lkey(key, i), 0, end)
            replies = pipe.execute(raise_on_error=False)
            state = next((r for r in replies if isinstance(r, STATE_ERRORS)), None)
            if state is not None:
                raise state
            return replies

        replies = self._run("get layers", fetch, None)
        if replies is None:
            self._stats.add(layer_misses=len(layers))
            return [None] * len(layers)
        out: list[Layer | None] = []
        nbytes = 0
        for i, data in zip(layers, replies, strict=True):
            try:
                if isinstance(data, redis.ResponseError):
                    raise CorruptEntry(f"layer {i} unreadable: {data}")
                if data is None or data == b"":
                    self._stats.add(partial=1, layer_misses=len(layers))
                    log.warning("%s tier: entry %s lost layer %d (evicted?); deleted, it will be recomputed",
                                self.name, key, i)
                    self.delete(key)
                    return [None] * len(layers)
                out.append(layer_from_bytes(data, header, i, owned=True))
                nbytes += len(data)
            except CorruptEntry as e:
                self._stats.add(layer_misses=len(layers))
                report_corrupt(self, self._stats, key, e)
                return [None] * len(layers)
        hits = sum(x is not None for x in out)
        self._stats.add(
            layer_reads=hits, layer_misses=len(out) - hits, bytes_read=nbytes, read_seconds=time.perf_counter() - t0
        )
        return out

    def read_layer_into(self, key: str, layer: int, header: EntryHeader | None, out: Any) -> bool:
        """Layer `layer` read as `get_layers` does (bounded, verified, a partial entry is a
        miss) and copied once into `out`, a contiguous (layer_nbytes,) uint8 CPU tensor
        (e.g. a pinned staging buffer). False on a miss."""
        if header is None:
            header = self._decode_header(key, self._run("get header", lambda c: self._header_bytes(c, key), None))
            if header is None:
                self._stats.add(layer_misses=1)
                return False
        got = self.get_layers(key, [layer], header)[0]
        if got is None:
            return False
        dst_k, dst_v = layer_views(out, header)  # K then V (or an encoded entry's parts) of one reply
        dst_k.copy_(got[0])
        dst_v.copy_(got[1])
        return True

    def get(self, key: str) -> KVEntry | None:
        return read_entry(self, key)

    # ------------------------------------------------------------------ writes
    def put(self, key: str, entry: KVEntry) -> None:
        """Delete the old header and write all layers in one pipeline, then, only if every
        layer was stored, the header (with the configured TTL). On a refused layer (e.g.
        out of memory) the written layers are removed and nothing is published."""
        t0 = time.perf_counter()
        values = [layer_to_bytes(k, v) for k, v in entry.layers]
        head = encode_header(entry.header)
        names = [self._lkey(key, i) for i in range(len(values))]

        def write(c: Any) -> bool:
            pipe = c.pipeline(transaction=False)
            pipe.delete(self._hkey(key))
            for name, value in zip(names, values, strict=True):
                pipe.set(name, value, px=self._ttl)
            replies = pipe.execute(raise_on_error=False)
            refused = next((r for r in replies if isinstance(r, Exception)), None)
            if refused is None:
                try:
                    c.set(self._hkey(key), head, px=self._ttl)
                    return True
                except redis.ResponseError as e:
                    refused = e
            cleanup = c.pipeline(transaction=False)
            for name in names:
                cleanup.delete(name)
            cleanup.execute(raise_on_error=False)
            raise refused

        if self._run("put", write, False):
            self._stats.add(
                puts=1, bytes_written=entry.nbytes + len(head), write_seconds=time.perf_counter() - t0
            )
            self._stats_cache = None

    def delete(self, key: str) -> bool:
        """Delete the header, then layers l0, l1, ... in batches of DELETE_BATCH in the same
        pipeline (one round trip for up to DELETE_BATCH layers), continuing while a batch's
        last layer existed. Reads nothing, scans nothing: deleting a junk or forged entry
        costs the same as deleting a good one."""

        def remove(c: Any) -> None:
            start = 0
            while True:
                pipe = c.pipeline(transaction=False)
                if start == 0:
                    pipe.delete(self._hkey(key))
                for i in range(start, start + DELETE_BATCH):
                    pipe.delete(self._lkey(key, i))
                replies = pipe.execute(raise_on_error=False)
                if replies[-1] != 1:
                    return True
                start += DELETE_BATCH

        reached = bool(self._run("delete", remove, False))
        self._stats_cache = None
        return reached

    def keys(self) -> Iterator[str]:
        pattern = _glob_escape(self._prefix) + "{*}:h"
        names = self._run("scan", lambda c: list(c.scan_iter(match=pattern, count=1000)), [])
        return iter(sorted(key for key in map(self._key_of, names) if key is not None))

    def clear(self) -> bool:
        """Delete every key under this tier's key_prefix (other prefixes are untouched);
        False when the server is down (nothing deleted)."""
        pattern = _glob_escape(self._prefix) + "{*"

        def wipe(c: Any) -> bool:
            names = list(c.scan_iter(match=pattern, count=1000))
            for start in range(0, len(names), 500):
                pipe = c.pipeline(transaction=False)
                for name in names[start : start + 500]:
                    pipe.delete(name)
                pipe.execute()
            return True

        cleared = self._run("clear", wipe, False)
        self._stats_cache = None
        return cleared

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
                    pipe.getrange(self._hkey(key), 0, MAX_HEADER_BYTES - 1)
                for data in pipe.execute(raise_on_error=False):
                    if isinstance(data, bytes) and data:
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
