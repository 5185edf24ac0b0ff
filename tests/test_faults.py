"""Fault injection through the engine: whatever a tier holds, a request answers exactly as a
clean recompute does, within a time bound, without touching anything outside the cache.

Each case ingests the documents into a one-tier store (disk, redis or redis-cluster),
damages or forges what the tier holds, then runs one request that meets the fault and
one after it. A case survives when both requests finish within TIMEOUT_S, both answers
(first-token log-probabilities and tokens) equal the answer of a clean recompute, the
second request recomputes nothing in its loader (a broken entry was repaired, not
recomputed forever), no file outside the cache directory changed, and (disk) every
file the tier opened lies inside its directory without following a link. Where the
fault can be healed by rewriting the entry, the second request must also find every
segment cached: the fault cost one recompute, not one per request.

Groups:
  header  each header field set to a wrong value, checksums recomputed (disk, redis, cluster)
  size    junk values, short and missing layers, wrong Redis types (disk, redis, cluster)
  path    symlinks, FIFOs, sockets, directories and hard links at entry and temp paths (disk)
  forged  entries written by someone without the store's secret (disk, redis)
Each sweep prints `faults tried N survived M`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from redis.cluster import RedisCluster

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from storage import checksum as _checksum
from storage.codec import codes_nbytes
from storage.disk import DiskTier
from storage.dtypes import dtype_name
from storage.entry import FORMAT_VERSION, EntryHeader, KVEntry, tensor_bytes
from storage.entry import layer_checksum as entry_layer_checksum
from storage.serialization import MAGIC, encode_header, header_size
from tests.models import smollm2_tokenizer, tiny_model

DOCS = [
    "The lighthouse at Carrow Point was built in 1871 by the engineer Maud Tillery.",
    "Tillery later moved to Ostend, where she designed a tidal mill with four wheels.",
]
QUESTION = "Who built the lighthouse at Carrow Point?"
CHUNK_TOKENS = 16
TIMEOUT_S = 30.0
SECRET = "correct horse battery staple"
JUNK_BYTES = 4 << 20
HEADER_FIELDS = {f.name for f in dataclasses.fields(EntryHeader)}
HUGE_INT = "<an integer of 5000 digits>"  # raw_header writes it as such: over json's 4300-digit limit


# ----------------------------------------------------------------------------- engine
@functools.cache
def _model():
    return tiny_model(tokenizer=smollm2_tokenizer())


def make_engine(tiers: list[dict], *, secret: str | None = None, namespace: str = "",
                miss_policy: str = "auto") -> BlendEngine:
    store: dict[str, Any] = {"kv_dtype": "float32", "tiers": tiers, "namespace": namespace}
    if secret is not None:
        store["secret"] = secret
    # split off: every fault request must read the planted entries (a split that computes the
    # prompt instead would survive a fault without meeting it)
    cfg = EngineConfig().with_overrides(store=store, chunk_tokens=CHUNK_TOKENS, split="off", miss_policy=miss_policy)
    return BlendEngine(cfg, model=_model())


def ask(engine: BlendEngine):
    return engine.generate(QUESTION, DOCS, mode="blend", recompute_ratio=0.25, max_new_tokens=3)


@functools.cache
def reference() -> tuple[torch.Tensor, tuple[int, ...]]:
    """The answer of a clean recompute: a cold request on an empty cpu-only store."""
    with make_engine([{"kind": "cpu", "budget": "64MiB"}]) as engine:
        result = ask(engine)
    return result.first_token_logprobs, tuple(result.token_ids)


def bounded(fn: Callable[[], Any], timeout: float = TIMEOUT_S, unblock: Callable[[], None] | None = None):
    """(value, None) or (None, problem) for fn() run in a thread: 'hang' past `timeout`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - every failure is a finding
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        if unblock is not None:
            unblock()
        thread.join(5)
        return None, f"hang (> {timeout:.0f} s)"
    if "error" in box:
        err = box["error"]
        return None, f"crash: {type(err).__name__}: {str(err)[:200]}"
    return box.get("value"), None


# ------------------------------------------------------------------------- the audit
class OpenAudit:
    """Records every os.open of a path under `root` that reaches outside it.

    A path opened with O_NOFOLLOW must have its parent inside `root`; one opened
    without it must resolve (following links) inside `root`.
    """

    def __init__(self, root: Path) -> None:
        self.lexical = os.path.abspath(root)
        self.real = os.path.realpath(root)
        self.violations: list[str] = []
        self._orig = os.open

    def _inside(self, path: str) -> bool:
        return path == self.real or path.startswith(self.real + os.sep)

    def _open(self, path, flags, mode=0o777, *, dir_fd=None):
        if isinstance(path, str | os.PathLike):
            # a name relative to a directory descriptor: that directory, as the kernel knows it
            base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
            p = os.path.normpath(os.path.join(base, os.fspath(path)))
            if p.startswith(self.lexical + os.sep) or p.startswith(self.real + os.sep):
                target = os.path.realpath(os.path.dirname(p)) if flags & os.O_NOFOLLOW else os.path.realpath(p)
                if not self._inside(target):
                    self.violations.append(f"opened {p} -> {target}")
        return self._orig(path, flags, mode, dir_fd=dir_fd)

    def __enter__(self) -> OpenAudit:
        os.open = self._open
        return self

    def __exit__(self, *exc: object) -> None:
        os.open = self._orig


def snapshot(directory: Path) -> dict[str, str]:
    """Name -> digest (or kind) of everything under `directory`, links not followed."""
    out: dict[str, str] = {}
    for p in sorted(directory.rglob("*")):
        if p.is_symlink() or not p.is_file():
            out[str(p)] = "link" if p.is_symlink() else "dir"
        else:
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def unblock_fifos(directory: Path) -> None:
    """Open every FIFO under `directory` for writing once, releasing a reader blocked on it."""
    for p in directory.rglob("*"):
        try:
            if p.is_fifo():
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


# ----------------------------------------------------------------------- forging kit
def layer_checksum(k: torch.Tensor, v: torch.Tensor, algorithm: str) -> int:
    return _checksum.checksum((tensor_bytes(k.contiguous()), tensor_bytes(v.contiguous())), algorithm)


def forge(entry: KVEntry, layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None, **changes: Any) -> KVEntry:
    """`entry` with other layers and/or header fields: every size field and checksum is
    recomputed from the layers (so the forgery is self-consistent), then `changes` win.
    Any authentication tag is dropped."""
    layers = [(k.contiguous(), v.contiguous()) for k, v in (layers if layers is not None else entry.layers)]
    k0 = layers[0][0]
    algorithm = changes.get("checksum", entry.header.checksum)
    if algorithm not in _checksum.ALGORITHMS:
        algorithm = entry.header.checksum
    fields = dict(
        kv_dtype=dtype_name(k0.dtype), num_layers=len(layers), kv_heads=k0.shape[0], num_tokens=k0.shape[1],
        head_dim=k0.shape[2], layer_nbytes=2 * k0.numel() * k0.element_size(),
        layer_checksums=tuple(layer_checksum(k, v, algorithm) for k, v in layers),
    )
    if "tag" in HEADER_FIELDS:
        fields["tag"] = ""
    fields.update(changes)
    return KVEntry(header=dataclasses.replace(entry.header, **fields), layers=layers)


def poisoned(entry: KVEntry) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Layers of the same shape and dtype with other values (an answer-changing forgery)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(k.shape, generator=g).to(k.dtype), torch.randn(v.shape, generator=g).to(v.dtype))
            for k, v in entry.layers]


def raw_header(header: EntryHeader, mutate: Callable[[dict], Any] = lambda body: None,
               version: int = FORMAT_VERSION) -> bytes:
    """Encoded header bytes after `mutate(body)` edits its JSON body (no validation)."""
    body = json.loads(encode_header(header)[16:])
    mutate(body)
    data = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    data = data.replace(b'"%s"' % HUGE_INT.encode(), b"9" * 5000)  # Python's json refuses to parse it
    return MAGIC + struct.pack("<II", version, len(data)) + data


class Ctx:
    """What a fault sees: the engine, its single tier, raw access to that tier's bytes."""

    def __init__(self, engine: BlendEngine, outside: Path | None, client: Any = None) -> None:
        self.engine, self.outside, self.client = engine, outside, client
        self.tier = engine.store.tiers[0]
        self.keys = sorted(self.tier.keys())
        assert self.keys, "ingest stored nothing"
        self.entries = {key: self.tier.get(key) for key in self.keys}
        assert all(e is not None for e in self.entries.values())

    @property
    def kind(self) -> str:
        return self.tier.config.kind

    def put(self, key: str, entry: KVEntry) -> None:
        self.tier.put(key, entry)

    def path(self, key: str) -> Path:
        return Path(self.tier._file(key))

    def set_raw_header(self, key: str, data: bytes) -> None:
        if self.kind == "disk":
            path = self.path(key)
            old = path.read_bytes()
            path.write_bytes(data + old[header_size(old):])
        else:
            self.client.set(self.tier._hkey(key), data)

    def set_raw_layer(self, key: str, layer: int, data: bytes | None) -> None:
        """Replace (None: delete) one layer's bytes; disk: cut the file at that layer's end."""
        assert self.kind != "disk"
        name = self.tier._lkey(key, layer)
        if data is None:
            self.client.delete(name)
        else:
            self.client.set(name, data)

    def get_raw_layer(self, key: str, layer: int) -> bytes:
        return self.client.get(self.tier._lkey(key, layer))


# --------------------------------------------------------------------------- faults
@dataclass(frozen=True)
class Fault:
    group: str
    name: str
    kinds: tuple[str, ...]
    apply: Callable[[Ctx], None]
    secret: bool = False
    max_bytes: int | None = None  # redis: most bytes a request may fetch from the server
    heals: bool = True  # the first request's rewrite makes the second one all hits


def every_entry(change: Callable[[KVEntry], KVEntry]) -> Callable[[Ctx], None]:
    def apply(ctx: Ctx) -> None:
        for key, entry in ctx.entries.items():
            ctx.put(key, change(entry))
    return apply


def every_raw_header(mutate: Callable[[dict], Any] = lambda body: None, version: int = FORMAT_VERSION,
                     cut: int | None = None) -> Callable[[Ctx], None]:
    def apply(ctx: Ctx) -> None:
        for key, entry in ctx.entries.items():
            data = raw_header(entry.header, mutate, version)
            ctx.set_raw_header(key, data[:cut] if cut is not None else data)
    return apply


def _set(field: str, value: Any) -> Callable[[dict], None]:
    return lambda body: body.__setitem__(field, value)


def _other_digest(entry: KVEntry) -> KVEntry:
    return forge(entry, tokens_digest=hashlib.sha256(b"other tokens").hexdigest())


def _wrong_checksum(entry: KVEntry) -> KVEntry:
    sums = list(forge(entry).header.layer_checksums)
    sums[-1] ^= 1
    return forge(entry, layer_checksums=tuple(sums))


ALL = ("disk", "redis", "redis-cluster")
REDIS = ("redis", "redis-cluster")
HEADER_FAULTS = [
    Fault("header", "fingerprint of another model", ALL, every_entry(lambda e: forge(e, fingerprint="0" * 16))),
    Fault("header", "tokens digest of other tokens", ALL, every_entry(_other_digest)),
    Fault("header", "num_tokens=1 (one token kept)", ALL,
          every_entry(lambda e: forge(e, [(k[:, :1], v[:, :1]) for k, v in e.layers]))),
    Fault("header", "num_tokens doubled", ALL,
          every_entry(lambda e: forge(e, [(torch.cat([k, k], 1), torch.cat([v, v], 1)) for k, v in e.layers]))),
    Fault("header", "num_layers - 1", ALL, every_entry(lambda e: forge(e, e.layers[:-1]))),
    Fault("header", "num_layers + 1", ALL, every_entry(lambda e: forge(e, e.layers + e.layers[-1:]))),
    Fault("header", "kv_heads 2->1, head_dim 16->32 (same bytes)", ALL,
          every_entry(lambda e: forge(e, [(k.reshape(1, k.shape[1], -1), v.reshape(1, v.shape[1], -1))
                                          for k, v in e.layers]))),
    Fault("header", "kv_heads 2->4, head_dim 16->8 (same bytes)", ALL,
          every_entry(lambda e: forge(e, [(k.reshape(4, k.shape[1], -1), v.reshape(4, v.shape[1], -1))
                                          for k, v in e.layers]))),
    Fault("header", "kv_dtype float32->float16, head_dim doubled (same bytes)", ALL,
          every_entry(lambda e: forge(e, [(k.view(torch.float16), v.view(torch.float16)) for k, v in e.layers]))),
    Fault("header", "pos_start + 3", ALL, every_entry(lambda e: forge(e, pos_start=e.header.pos_start + 3))),
    Fault("header", "pos_start 10**9", ALL, every_entry(lambda e: forge(e, pos_start=10**9))),
    Fault("header", "one layer checksum wrong", ALL, every_entry(_wrong_checksum)),
    Fault("header", "checksum algorithm unknown", ALL, every_entry(lambda e: forge(e, checksum="md5"))),
    Fault("header", "checksum algorithm crc32, checksums kept", ALL,
          every_entry(lambda e: forge(e, checksum="crc32", layer_checksums=e.header.layer_checksums))),
    Fault("header", "format_version 2", ALL, every_raw_header(_set("format_version", 2), version=2)),
    Fault("header", "layer_nbytes + 2", ALL, every_raw_header(lambda b: b.__setitem__("layer_nbytes", b["layer_nbytes"] + 2))),
    Fault("header", "num_tokens negative", ALL, every_raw_header(_set("num_tokens", -16))),
    Fault("header", "num_layers 0, no checksums", ALL,
          every_raw_header(lambda b: b.update(num_layers=0, layer_checksums=[]))),
    Fault("header", "pos_start an integer of 5000 digits", ALL, every_raw_header(_set("pos_start", HUGE_INT))),
    Fault("header", "kv_heads a string", ALL, every_raw_header(_set("kv_heads", "2"))),
    Fault("header", "kv_heads true", ALL, every_raw_header(_set("kv_heads", True))),
    Fault("header", "unknown extra field", ALL, every_raw_header(_set("owner", "mallory"))),
    Fault("header", "field missing", ALL, every_raw_header(lambda b: b.pop("pos_start"))),
    Fault("header", "JSON body is a list", ALL, every_raw_header(lambda b: (b.clear(), b.update({"x": [1]})))),
    Fault("header", "header cut in its JSON", ALL, every_raw_header(cut=40)),
    Fault("header", "header cut in its prelude", ALL, every_raw_header(cut=10)),
]


# ----- size faults
def _junk_header(ctx: Ctx) -> None:
    for key in ctx.keys:
        junk = MAGIC + struct.pack("<II", FORMAT_VERSION, JUNK_BYTES) + os.urandom(JUNK_BYTES)
        if ctx.kind == "disk":
            ctx.path(key).write_bytes(junk)
        else:
            ctx.client.set(ctx.tier._hkey(key), junk)


def _junk_layer(ctx: Ctx) -> None:
    for key, entry in ctx.entries.items():
        if ctx.kind == "disk":
            with ctx.path(key).open("ab") as fh:
                fh.write(os.urandom(JUNK_BYTES))
        else:
            ctx.set_raw_layer(key, entry.header.num_layers - 1, os.urandom(JUNK_BYTES))


def _short_layer(ctx: Ctx) -> None:
    for key, entry in ctx.entries.items():
        last = entry.header.num_layers - 1
        if ctx.kind == "disk":
            os.truncate(ctx.path(key), ctx.path(key).stat().st_size - 4)
        else:
            ctx.set_raw_layer(key, last, ctx.get_raw_layer(key, last)[:-4])


def _missing_layer(ctx: Ctx) -> None:
    for key, entry in ctx.entries.items():
        last = entry.header.num_layers - 1
        if ctx.kind == "disk":
            os.truncate(ctx.path(key), ctx.path(key).stat().st_size - entry.header.layer_nbytes)
        else:
            ctx.set_raw_layer(key, last, None)


def _wrong_type(which: str) -> Callable[[Ctx], None]:
    def apply(ctx: Ctx) -> None:
        for key, entry in ctx.entries.items():
            name = ctx.tier._hkey(key) if which == "header" else ctx.tier._lkey(key, entry.header.num_layers - 1)
            ctx.client.delete(name)
            ctx.client.rpush(name, b"not a string")
    return apply


SIZE_FAULTS = [
    Fault("size", f"{JUNK_BYTES >> 20} MiB of junk under the header", ALL, _junk_header, max_bytes=JUNK_BYTES // 4),
    Fault("size", f"{JUNK_BYTES >> 20} MiB of junk under a layer", ALL, _junk_layer, max_bytes=JUNK_BYTES // 4),
    Fault("size", "short layer (4 bytes missing)", ALL, _short_layer),
    Fault("size", "missing layer", ALL, _missing_layer),
    Fault("size", "header key holds a list", REDIS, _wrong_type("header")),
    Fault("size", "layer key holds a list", REDIS, _wrong_type("layer")),
]


# ----- path faults (disk)
def _outside_file(ctx: Ctx, name: str, data: bytes) -> Path:
    path = ctx.outside / name
    path.write_bytes(data)
    return path


def _replace_with(make: Callable[[Ctx, str, Path], None]) -> Callable[[Ctx], None]:
    def apply(ctx: Ctx) -> None:
        for key in ctx.keys:
            path = ctx.path(key)
            path.unlink()
            make(ctx, key, path)
    return apply


def _link_to_outside_text(ctx: Ctx, key: str, path: Path) -> None:
    path.symlink_to(_outside_file(ctx, "passwd", b"root:x:0:0:root:/root:/bin/bash\n"))


def _outside_entry(ctx: Ctx, key: str, entry: KVEntry) -> Path:
    tier = DiskTier(dataclasses.replace(ctx.tier.config, path=str(ctx.outside / "entries")))
    tier.put(key, entry)
    tier.close()
    return Path(tier._file(key))


def _link_to_outside_poison(ctx: Ctx, key: str, path: Path) -> None:
    entry = ctx.entries[key]
    path.symlink_to(_outside_entry(ctx, key, forge(entry, poisoned(entry))))


def _link_to_outside_genuine(ctx: Ctx, key: str, path: Path) -> None:
    path.symlink_to(_outside_entry(ctx, key, ctx.entries[key]))


def _hardlink_to_outside(ctx: Ctx, key: str, path: Path) -> None:
    os.link(_outside_file(ctx, f"hard-{key}", b"outside data " * 100), path)


def _dangling(ctx: Ctx, key: str, path: Path) -> None:
    path.symlink_to(ctx.outside / "does-not-exist")


def _fifo(ctx: Ctx, key: str, path: Path) -> None:
    os.mkfifo(path)


def _directory(ctx: Ctx, key: str, path: Path) -> None:
    path.mkdir()
    (path / "inner").write_bytes(b"x")


def _link_to_outside_dir(ctx: Ctx, key: str, path: Path) -> None:
    target = ctx.outside / "adir"
    target.mkdir(exist_ok=True)
    path.symlink_to(target)


def _socket(ctx: Ctx, key: str, path: Path) -> None:
    short = Path(tempfile.mkdtemp(prefix="kvb", dir=path.parent.parent))  # AF_UNIX paths are short
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(short / "s"))
    os.rename(short / "s", path)
    short.rmdir()
    ctx.engine._test_sockets = getattr(ctx.engine, "_test_sockets", []) + [s]


def _plant_at_temp_names(make: Callable[[Path, Path], None], names: Callable[[Ctx, str], list[str]]
                         ) -> Callable[[Ctx], None]:
    """Delete the entries (so the next request rewrites them) and plant `make` at their temp names."""
    def apply(ctx: Ctx) -> None:
        target = _outside_file(ctx, "victim", b"must stay unchanged\n")
        for key in ctx.keys:
            ctx.tier.delete(key)
            for name in names(ctx, key):
                make(ctx.path(key).parent / name, target)
    return apply


def _legacy_temp_names(ctx: Ctx, key: str) -> list[str]:
    """Where a writer without random temp names would write: .tmp.<key>.<pid>.<thread id>."""
    idents = [t.ident for t in threading.enumerate() if t.ident is not None]
    return [f".tmp.{key}.{os.getpid()}.{ident}" for ident in idents]


FIXED_TEMP_TOKEN = "feedfacecafebeef"


def _chosen_temp_names(ctx: Ctx, key: str) -> list[str]:
    """The temp name the writer will try first (its random token is fixed by this case)."""
    import storage.disk as disk

    disk._random_token = lambda: FIXED_TEMP_TOKEN  # restored by the sweep after the case
    return [disk.temp_name(key, FIXED_TEMP_TOKEN)]


def _symlink_to(path: Path, target: Path) -> None:
    path.symlink_to(target)


def _fifo_at(path: Path, target: Path) -> None:
    os.mkfifo(path)


def _dir_at(path: Path, target: Path) -> None:
    path.mkdir()


PATH_FAULTS = [
    Fault("path", "entry is a symlink to an outside text file", ("disk",), _replace_with(_link_to_outside_text)),
    Fault("path", "entry is a symlink to a poisoned entry outside", ("disk",), _replace_with(_link_to_outside_poison)),
    Fault("path", "entry is a symlink to a genuine entry outside", ("disk",), _replace_with(_link_to_outside_genuine)),
    Fault("path", "entry is a hard link to an outside file", ("disk",), _replace_with(_hardlink_to_outside)),
    Fault("path", "entry is a dangling symlink", ("disk",), _replace_with(_dangling)),
    Fault("path", "entry is a FIFO", ("disk",), _replace_with(_fifo)),
    Fault("path", "entry is a directory", ("disk",), _replace_with(_directory), heals=False),
    Fault("path", "entry is a symlink to an outside directory", ("disk",), _replace_with(_link_to_outside_dir)),
    Fault("path", "entry is a unix socket", ("disk",), _replace_with(_socket)),
    Fault("path", "symlink at the writer's pid/thread temp name", ("disk",),
          _plant_at_temp_names(_symlink_to, _legacy_temp_names)),
    Fault("path", "symlink at the writer's chosen temp name", ("disk",),
          _plant_at_temp_names(_symlink_to, _chosen_temp_names), heals=False),  # every name it tries is taken
    Fault("path", "FIFO at the writer's chosen temp name", ("disk",),
          _plant_at_temp_names(_fifo_at, _chosen_temp_names), heals=False),
    Fault("path", "directory at the writer's chosen temp name", ("disk",),
          _plant_at_temp_names(_dir_at, _chosen_temp_names), heals=False),
]


# ----- forged entries (the reader has a secret; the forger does not)
def _copy_entry(ctx: Ctx, src_tier: Any, key: str, dst_key: str) -> None:
    if ctx.kind == "disk":
        ctx.path(dst_key).write_bytes(Path(src_tier._file(key)).read_bytes())
    else:
        for suffix_src, suffix_dst in [(src_tier._hkey(key), ctx.tier._hkey(dst_key))] + [
            (src_tier._lkey(key, i), ctx.tier._lkey(dst_key, i)) for i in range(ctx.entries[dst_key].header.num_layers)
        ]:
            ctx.client.set(suffix_dst, ctx.client.get(suffix_src))


def _replayed_from_other_namespace(ctx: Ctx) -> None:
    """Genuine entries signed with the same secret for another namespace, copied under our keys."""
    config = dataclasses.replace(ctx.engine.config.store, namespace="other")
    with BlendEngine(ctx.engine.config.with_overrides(store=config), model=_model()) as other:
        other.ingest(DOCS)
        for key in ctx.keys:
            other_key = f"{other.store.namespace}-{key.split('-')[-1]}"  # the same content, its namespace
            assert other.store.tiers[0].contains(other_key)
            ctx_entry = other.store.tiers[0].get(other_key)
            assert ctx_entry is not None
            _copy_entry(ctx, other.store.tiers[0], other_key, key)


def _signed_elsewhere(entry: KVEntry, key: str) -> KVEntry:
    from storage.signature import seal

    return seal(forge(entry, poisoned(entry)), key, "another secret")


def _downgraded(entry: KVEntry) -> KVEntry:
    """The genuine signed header with xxh3 checksums of poisoned layers, tag kept."""
    forged = forge(entry, poisoned(entry), checksum="xxh3_64")
    return KVEntry(dataclasses.replace(forged.header, tag=entry.header.tag), forged.layers)


def _genuine_header_poisoned_layers(entry: KVEntry) -> KVEntry:
    return KVEntry(entry.header, poisoned(entry))


def _with_random_tag(entry: KVEntry) -> KVEntry:
    forged = forge(entry, poisoned(entry))
    return KVEntry(dataclasses.replace(forged.header, tag=os.urandom(32).hex()), forged.layers)


def _per_key(change: Callable[[KVEntry, str], KVEntry]) -> Callable[[Ctx], None]:
    def apply(ctx: Ctx) -> None:
        for key, entry in ctx.entries.items():
            ctx.put(key, change(entry, key))
    return apply


SIGNED = ("disk", "redis")
FORGED_FAULTS = [
    Fault("forged", "poisoned entry without a tag", SIGNED, every_entry(lambda e: forge(e, poisoned(e))), secret=True),
    Fault("forged", "poisoned entry with a random tag", SIGNED, every_entry(_with_random_tag), secret=True),
    Fault("forged", "poisoned entry signed with another secret", SIGNED, _per_key(_signed_elsewhere), secret=True),
    Fault("forged", "signed header, poisoned layers", SIGNED, every_entry(_genuine_header_poisoned_layers),
          secret=True),
    Fault("forged", "signed header downgraded to xxh3 over poisoned layers", SIGNED, every_entry(_downgraded),
          secret=True),
    Fault("forged", "genuine entries of another namespace replayed", SIGNED, _replayed_from_other_namespace,
          secret=True),
]
ALL_FAULTS = HEADER_FAULTS + SIZE_FAULTS + PATH_FAULTS + FORGED_FAULTS


# ---------------------------------------------------------------------------- sweep
def tier_config(kind: str, tmp: Path, redis_url: str | None, cluster_urls: list[str] | None, n: int) -> dict:
    """One tier in codec none: a healthy hit then answers exactly as a clean recompute (the criterion),
    and the faults forge raw layers (codec headers are swept in tests/test_codecs.py)."""
    if kind == "disk":
        return {"kind": "disk", "path": str(tmp / "cache"), "budget": "256MiB", "codec": "none"}
    if kind == "redis":
        return {"kind": "redis", "url": redis_url, "key_prefix": f"sweep{n}:", "codec": "none"}
    return {"kind": "redis-cluster", "urls": cluster_urls, "key_prefix": f"sweep{n}:", "codec": "none"}


def net_output_bytes(kind: str, client: Any) -> int:
    if kind == "redis":
        return int(client.info("stats")["total_net_output_bytes"])
    return sum(int(s["total_net_output_bytes"]) for s in client.info("stats", target_nodes=RedisCluster.ALL_NODES).values())


def run_case(fault: Fault, kind: str, tmp: Path, n: int, redis_url: str | None = None,
             cluster_urls: list[str] | None = None) -> list[str]:
    """Problems found for one fault on one tier kind (empty: survived)."""
    import storage.disk as disk

    ref_logprobs, ref_tokens = reference()
    tmp.mkdir(parents=True)
    outside = tmp / "outside"
    outside.mkdir()
    client: Any = None
    if kind == "redis":
        client = redis.Redis.from_url(redis_url)
    elif kind == "redis-cluster":
        client = RedisCluster.from_url(cluster_urls[0])
    random_token = getattr(disk, "_random_token", None)
    problems: list[str] = []
    engine, err = bounded(lambda: make_engine([tier_config(kind, tmp, redis_url, cluster_urls, n)],
                                              secret=SECRET if fault.secret else None))
    if err:
        return [f"engine: {err}"]
    try:
        _, err = bounded(lambda: engine.ingest(DOCS))
        if err:
            return [f"ingest: {err}"]
        _, err = bounded(lambda: fault.apply(Ctx(engine, outside, client)))
        if err:
            return [f"applying the fault: {err}"]
        before = snapshot(outside)
        audit = OpenAudit(tmp / "cache")
        for attempt in (1, 2):
            sent = net_output_bytes(kind, client) if fault.max_bytes and client is not None else 0
            with audit:
                result, err = bounded(lambda: ask(engine), unblock=lambda: unblock_fifos(tmp))
                if err is None:
                    _, err = bounded(engine.store.flush, unblock=lambda: unblock_fifos(tmp))
            if err:
                problems.append(f"request {attempt}: {err}")
                break
            if fault.max_bytes and client is not None:
                fetched = net_output_bytes(kind, client) - sent
                if fetched > fault.max_bytes:
                    problems.append(f"request {attempt}: fetched {fetched} bytes from the server")
            if not (torch.equal(result.first_token_logprobs, ref_logprobs) and tuple(result.token_ids) == ref_tokens):
                diff = float((result.first_token_logprobs - ref_logprobs).abs().max())
                problems.append(f"request {attempt}: answer differs from a clean recompute (max |diff| {diff:.3g})")
            stats = result.stats
            missed = stats.documents.misses + stats.system.misses + bool(stats.stalled_tiers)
            if attempt == 2 and fault.heals and missed:
                problems.append(f"request 2 computed {missed} segments again (the entry was not rewritten)")
        problems += audit.violations[:3]
        if snapshot(outside) != before:
            problems.append("a file outside the cache directory changed")
    finally:
        if random_token is not None:
            disk._random_token = random_token
        unblock_fifos(tmp)
        bounded(engine.close, unblock=lambda: unblock_fifos(tmp))
        for s in getattr(engine, "_test_sockets", []):
            s.close()
        if client is not None and kind != "disk":
            for tier in engine.store.tiers:
                bounded(tier.clear)
            client.close()
    return problems


def sweep(faults: list[Fault], kinds: tuple[str, ...], tmp_path: Path, **urls: Any) -> None:
    tried, failed = 0, []
    for kind in kinds:
        for fault in faults:
            if kind not in fault.kinds:
                continue
            tried += 1
            problems = run_case(fault, kind, tmp_path / f"case{tried}", tried, **urls)
            if problems:
                failed.append(f"[{fault.group}] {kind}: {fault.name}: {'; '.join(problems)}")
    groups = sorted({f.group for f in faults})
    print(f"\nfault sweep {'/'.join(groups)} on {'/'.join(kinds)}: faults tried {tried} survived {tried - len(failed)}")
    for line in failed:
        print("  FAILED", line)
    assert not failed, f"{len(failed)} of {tried} faults not survived:\n" + "\n".join(failed)


def test_fault_sweep_disk(tmp_path):
    sweep(ALL_FAULTS, ("disk",), tmp_path)


@pytest.mark.redis
def test_fault_sweep_redis(tmp_path, redis_url):
    sweep(ALL_FAULTS, ("redis",), tmp_path, redis_url=redis_url)


@pytest.mark.redis
def test_fault_sweep_redis_cluster(tmp_path, redis_cluster_urls):
    sweep(ALL_FAULTS, ("redis-cluster",), tmp_path, cluster_urls=redis_cluster_urls)


# ------------------------------------------------------- values that are not finite
def _nan_scales(entry: KVEntry) -> KVEntry:
    """An int8 entry whose every scale and minimum is NaN, its checksums recomputed (what a writer
    without the store's secret can plant): the codes are intact, the decoded KV all NaN."""
    h = entry.header
    assert h.codec.name == "int8"
    at = codes_nbytes(h.kv_heads * h.num_tokens * h.head_dim, h.codec.bits)
    layers = []
    for kp, vp in entry.layers:
        kp, vp = kp.clone(), vp.clone()
        kp[at:].view(torch.float16).fill_(float("nan"))
        vp[at:].view(torch.float16).fill_(float("nan"))
        layers.append((kp, vp))
    sums = tuple(entry_layer_checksum(h.codec, k, v, h.checksum) for k, v in layers)
    return KVEntry(dataclasses.replace(h, layer_checksums=sums, tag=""), layers)


@contextlib.contextmanager
def _planted_nan(tmp_path):
    """An engine over an int8 disk tier whose every ingested entry decodes to NaN behind valid checksums."""
    with make_engine([{"kind": "disk", "path": str(tmp_path / "cache"), "budget": "256MiB",
                       "codec": "int8"}]) as engine:
        engine.ingest(DOCS)
        tier = engine.store.tiers[0]
        for key in tier.keys():
            tier.put(key, _nan_scales(tier.get(key)))
        yield engine


NAN_REQUESTS = {
    "greedy blend": dict(mode="blend", recompute_ratio=0.05, max_new_tokens=3),
    "greedy reuse": dict(mode="reuse", max_new_tokens=3),
    "sampled blend": dict(mode="blend", recompute_ratio=0.05, max_new_tokens=3, temperature=0.8, seed=1),
}


@pytest.mark.parametrize("name", list(NAN_REQUESTS))
def test_entries_that_decode_to_nan_are_a_miss_computed_instead(tmp_path, name):
    """int8 entries with NaN scales behind valid checksums (no secret): the load fails at them (no
    model work in the loader), the entries are dropped and the request planned again finds them
    missing and computes them on their own: it answers as a clean recompute does (finite log-probs
    within 1e-4, the same tokens), in time; the entries are rewritten."""
    args = NAN_REQUESTS[name]
    with make_engine([{"kind": "cpu", "budget": "64MiB"}], miss_policy="standalone") as clean:
        want = clean.generate(QUESTION, DOCS, **args)  # the documents computed on their own, then blended
    with _planted_nan(tmp_path) as engine:
        tier = engine.store.tiers[0]
        got, err = bounded(lambda: engine.generate(QUESTION, DOCS, **args))
        assert err is None, err
        assert torch.isfinite(got.first_token_logprobs).all() and got.text
        assert (got.first_token_logprobs - want.first_token_logprobs).abs().max() <= 1e-4
        assert got.token_ids == want.token_ids
        assert got.stats.documents.misses > 0 and tier.stats()["corrupt"] > 0  # met, dropped, computed
        engine.store.flush()
        again, err = bounded(lambda: engine.generate(QUESTION, DOCS, **args))  # the rewritten entries: hits
        assert err is None, err
        assert again.stats.documents.misses == 0 and not again.stats.stalled_tiers
        assert torch.isfinite(again.first_token_logprobs).all()


# ----------------------------------------------------------- one store, two secrets
def test_engines_with_different_secrets_on_one_store_each_hit_their_own_entries(tmp_path):
    """Two engines with different secrets (and one without) share one disk directory: each keeps
    its entries in its own namespace (a digest of its secret, never the secret), so after all
    of them wrote, each request of each engine hits its own entries: none is rejected as
    unauthenticated, recomputed and overwritten under the other's keys."""
    disk = {"kind": "disk", "path": str(tmp_path / "cache"), "budget": "256MiB", "codec": "none"}
    secrets = [SECRET, "another secret, as long as the first one", None]
    engines = [make_engine([disk], secret=s) for s in secrets]
    try:
        for engine in engines:
            engine.ingest(DOCS)
        for engine in engines:
            engine.store.flush()
        for _ in range(2):
            for engine in reversed(engines):
                result = engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=2)
                assert result.stats.documents.hits == len(DOCS) and result.stats.documents.misses == 0
                assert result.stats.system.misses == 0 and not result.stats.stalled_tiers
        namespaces = [engine.store.namespace for engine in engines]
        assert len(set(namespaces)) == 3 and namespaces[2] == ""
        assert not any(s in n for s in secrets[:2] for n in namespaces)  # a digest, not the secret
        for engine in engines:
            stats = engine.store.stats()["disk"]
            assert stats["unauthenticated"] == 0 and stats["mismatches"] == 0
        keys = [set(engine.store.tiers[0].keys()) for engine in engines]
        assert keys[0] and not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]
    finally:
        for engine in engines:
            engine.close()


def test_an_unreadable_entry_is_computed_on_the_schedulers_thread_not_the_loaders(tmp_path, monkeypatch):
    """The model runs on one thread: an entry whose stored layers decode to NaN fails the load (the
    loader computes nothing) and the request's plan computes the document, on the scheduler's
    thread."""
    from blend.model.runner import Runner

    threads: list[str] = []
    forward = Runner.forward

    def recording(self, items):
        threads.append(threading.current_thread().name)
        return forward(self, items)

    with _planted_nan(tmp_path) as engine:
        monkeypatch.setattr(Runner, "forward", recording)
        got, err = bounded(lambda: engine.generate(QUESTION, DOCS, mode="reuse", max_new_tokens=2))
        assert err is None, err
        assert got.stats.documents.misses > 0
    assert threads and set(threads) == {"kvblend-scheduler"}
