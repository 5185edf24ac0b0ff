"""Local-disk tier: one file per entry, LRU eviction under a byte budget.

File layout (`<key>.kv`):
    header bytes (see serialization) | layer offsets (u64 LE x num_layers) | zero pad to 4 KiB
    | layer 0 (K bytes, V bytes) | layer 1 | ...
`get_layer` reads only that layer with one `os.preadv` into a fresh buffer.

Writes go to a temp file in the same directory and are published with `os.replace`, so
readers (this process or another one sharing the directory) see either no file or a
complete one. A file deleted or evicted while another process reads it is a miss (ENOENT).
Failed writes (disk full, permission denied) are logged, counted in `errors`, leave no
file behind and do not raise unless the tier is `required`.

LRU recency is the file mtime (refreshed on every header hit), so the index rebuilt from
the directory on start keeps the order across restarts. Each process keeps its own index
and rescans the directory before evicting, so the budget holds approximately when
several processes share one directory.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from storage.config import DiskTierConfig, tier_display_name
from storage.entry import CorruptEntry, EntryHeader, KVEntry
from storage.serialization import decode_header, encode_header, header_size, layer_from_bytes, verify_layer
from storage.tier import Layer, StoreUnavailable, TierStats, over_budget, read_entry, report_corrupt

log = logging.getLogger("kvblend.storage")

SUFFIX = ".kv"
TMP_PREFIX = ".tmp."
ALIGN = 4096
_STALE_TMP_S = 3600.0
_RESCAN_MIN_INTERVAL_S = 2.0
_WARN_INTERVAL_S = 30.0
_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}$")


@dataclass
class _FileInfo:
    size: int
    offsets: tuple[int, ...] | None = None  # layer offsets, once a header was read


class _Handle:
    __slots__ = ("fd", "refs", "retired")

    def __init__(self, fd: int) -> None:
        self.fd, self.refs, self.retired = fd, 1, False


class _Handles:
    """LRU of open read-only descriptors, one per entry file, reference counted.

    Keeping the descriptor between the layer reads of one entry keeps the kernel's
    readahead state, which roughly doubles cold read throughput compared with one open
    per layer. A descriptor is closed only when no reader holds it.
    """

    def __init__(self, capacity: int = 32) -> None:
        self.capacity = capacity
        self._open: OrderedDict[str, _Handle] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, key: str, path: Path, fresh: bool) -> tuple[_Handle, bool]:
        """A held descriptor for `path` and whether it was just opened; `fresh` forces a reopen.

        Raises OSError (FileNotFoundError: the entry is gone). Pair with `release`.
        """
        if not fresh:
            with self._lock:
                handle = self._open.get(key)
                if handle is not None:
                    self._open.move_to_end(key)
                    handle.refs += 1
                    return handle, False
        handle = _Handle(os.open(path, os.O_RDONLY))
        with self._lock:
            handle.refs += 1  # one reference for the cache, one for the caller
            old = self._open.pop(key, None)
            self._open[key] = handle
            if old is not None:
                self._retire(old)
            while len(self._open) > self.capacity:
                self._retire(self._open.popitem(last=False)[1])
        return handle, True

    def release(self, handle: _Handle) -> None:
        with self._lock:
            handle.refs -= 1
            if handle.refs == 0:
                os.close(handle.fd)

    def _retire(self, handle: _Handle) -> None:
        """Drop the cache's reference (lock held)."""
        if not handle.retired:
            handle.retired = True
            handle.refs -= 1
            if handle.refs == 0:
                os.close(handle.fd)

    def drop(self, key: str) -> None:
        with self._lock:
            handle = self._open.pop(key, None)
            if handle is not None:
                self._retire(handle)

    def drop_all(self) -> None:
        with self._lock:
            while self._open:
                self._retire(self._open.popitem()[1])


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def file_layout(header: EntryHeader) -> tuple[bytes, tuple[int, ...]]:
    """The bytes preceding the layer data (header, offset table, padding) and the layer offsets."""
    head = encode_header(header)
    data_offset = _align(len(head) + 8 * header.num_layers)
    offsets = tuple(data_offset + i * header.layer_nbytes for i in range(header.num_layers))
    table = struct.pack(f"<{header.num_layers}Q", *offsets)
    return head + table + bytes(data_offset - len(head) - len(table)), offsets


class DiskTier:
    """Directory-backed tier; thread-safe, multi-process safe on one directory."""

    def __init__(self, config: DiskTierConfig) -> None:
        self.config = config
        self.name = tier_display_name(config)
        self.path = Path(config.path)
        self.budget = config.budget
        self._fsync = config.fsync == "always"
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._handles = _Handles()
        self._index: OrderedDict[str, _FileInfo] = OrderedDict()  # LRU order, oldest first
        self._bytes = 0
        self._last_rescan = 0.0
        self._last_warning = 0.0
        self._suppressed = 0
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self._failed("cannot create the cache directory", e)
        self._rescan(clean_tmp=True)

    # ----------------------------------------------------------------- helpers
    def _file(self, key: str) -> Path:
        if not _KEY_RE.match(key):
            raise ValueError(f"disk tier: key {key!r} is not a safe file name; use keys from storage.keys")
        return self.path / (key + SUFFIX)

    def _failed(self, what: str, err: OSError) -> None:
        """Count and (rate-limited) log an I/O failure; raise if the tier is required."""
        self._stats.add(errors=1)
        if self.config.required:
            raise StoreUnavailable(
                f"disk tier at {str(self.path)!r}: {what}: {err}; free space or fix the directory's "
                "permissions, or set required: false to run without this tier"
            ) from err
        now = time.monotonic()
        if now - self._last_warning >= _WARN_INTERVAL_S:
            extra = f" ({self._suppressed} similar failures not logged)" if self._suppressed else ""
            log.warning("%s tier at %s: %s: %s%s", self.name, self.path, what, err, extra)
            self._last_warning, self._suppressed = now, 0
        else:
            self._suppressed += 1

    def _rescan(self, clean_tmp: bool = False) -> None:
        """Rebuild the index from the directory, oldest mtime first. Removes stale temp files."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        try:
            with os.scandir(self.path) as it:
                for de in it:
                    try:
                        st = de.stat()
                    except FileNotFoundError:
                        continue
                    if de.name.endswith(SUFFIX) and not de.name.startswith(TMP_PREFIX):
                        found.append((st.st_mtime, de.name[: -len(SUFFIX)], st.st_size))
                    elif clean_tmp and de.name.startswith(TMP_PREFIX) and now - st.st_mtime > _STALE_TMP_S:
                        _unlink_quiet(de.path)
        except OSError:
            found = []
        found.sort()
        with self._lock:
            old = self._index
            self._index = OrderedDict(
                (key, _FileInfo(size, old[key].offsets if key in old else None)) for _, key, size in found
            )
            self._bytes = sum(info.size for info in self._index.values())
            self._last_rescan = time.monotonic()

    def _read_prelude(self, fd: int) -> tuple[EntryHeader, tuple[int, ...], int]:
        """Header, layer offsets and file size of an open entry file. Raises CorruptEntry."""
        size = os.fstat(fd).st_size
        first = os.pread(fd, ALIGN, 0)
        total = header_size(first)
        if total > len(first):
            first = os.pread(fd, total, 0)
        header = decode_header(first)
        table_len = 8 * header.num_layers
        table = first[total : total + table_len]
        if len(table) < table_len:
            table = os.pread(fd, table_len, total)
        if len(table) != table_len:
            raise CorruptEntry("file truncated inside the layer offset table")
        offsets = struct.unpack(f"<{header.num_layers}Q", table)
        if offsets != file_layout(header)[1]:
            raise CorruptEntry("layer offset table does not match the header")
        expected = offsets[-1] + header.layer_nbytes
        if size != expected:
            raise CorruptEntry(f"file is {size} bytes, expected {expected} (truncated or padded)")
        return header, offsets, size

    def _remember(self, key: str, size: int, offsets: tuple[int, ...], touch: bool) -> None:
        with self._lock:
            info = self._index.get(key)
            if info is None:
                self._index[key] = _FileInfo(size, offsets)
                self._bytes += size
            else:
                info.offsets = offsets
                if touch:
                    self._index.move_to_end(key)

    def _forget(self, key: str) -> None:
        self._handles.drop(key)
        with self._lock:
            info = self._index.pop(key, None)
            if info is not None:
                self._bytes -= info.size

    # ------------------------------------------------------------------- reads
    def contains(self, key: str) -> bool:
        return self._file(key).exists()

    def get_header(self, key: str) -> EntryHeader | None:
        """Read and verify the entry's header; refreshes the file's mtime (LRU recency).

        Opens the file afresh (so a replaced or deleted file is noticed) and keeps the
        descriptor for the layer reads that usually follow.
        """
        try:
            handle, _ = self._handles.acquire(key, self._file(key), fresh=True)
        except FileNotFoundError:
            self._forget(key)
            self._stats.add(misses=1)
            return None
        except OSError as e:
            self._failed(f"cannot open {key}{SUFFIX}", e)
            self._stats.add(misses=1)
            return None
        try:
            header, offsets, size = self._read_prelude(handle.fd)
            try:
                os.utime(handle.fd)  # recency survives restarts
            except OSError:
                pass
        except CorruptEntry as e:
            self._stats.add(misses=1)
            report_corrupt(self, self._stats, key, e)
            return None
        except OSError as e:
            self._failed(f"cannot read {key}{SUFFIX}", e)
            self._stats.add(misses=1)
            return None
        finally:
            self._handles.release(handle)
        self._remember(key, size, offsets, touch=True)
        self._stats.add(hits=1)
        return header

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None) -> Layer | None:
        """Read one layer with a single preadv; the tensors own a fresh buffer."""
        t0 = time.perf_counter()
        for fresh in (False, True):
            try:
                handle, opened = self._handles.acquire(key, self._file(key), fresh=fresh)
            except FileNotFoundError:
                self._forget(key)
                self._stats.add(layer_misses=1)
                return None
            except OSError as e:
                self._failed(f"cannot open {key}{SUFFIX}", e)
                self._stats.add(layer_misses=1)
                return None
            try:
                got = self._read_layer(key, handle.fd, layer, header)
            except CorruptEntry as e:
                if not opened:
                    continue  # a descriptor kept from before a replacement: retry on the current file
                self._stats.add(layer_misses=1)
                report_corrupt(self, self._stats, key, e)
                return None
            except OSError as e:
                self._failed(f"cannot read {key}{SUFFIX}", e)
                self._stats.add(layer_misses=1)
                return None
            finally:
                self._handles.release(handle)
            if got is None:
                self._stats.add(layer_misses=1)
                return None
            self._stats.add(layer_reads=1, bytes_read=got[0].nbytes * 2, read_seconds=time.perf_counter() - t0)
            return got
        raise AssertionError("unreachable")

    def _read_layer(self, key: str, fd: int, layer: int, header: EntryHeader | None) -> Layer | None:
        """Read and verify one layer from an open entry file (None if the entry changed)."""
        with self._lock:
            info = self._index.get(key)
            offsets = info.offsets if info is not None else None
        if header is None or offsets is None:
            file_header, offsets, size = self._read_prelude(fd)
            if header is not None and file_header != header:
                return None  # replaced by a different entry since `header` was read
            header = file_header
            self._remember(key, size, offsets, touch=False)
        if not 0 <= layer < header.num_layers:
            raise IndexError(f"layer {layer} out of range: entry has {header.num_layers} layers")
        n = header.layer_nbytes
        buf = torch.empty(n, dtype=torch.uint8)  # (layer_nbytes,) not zero-filled
        got = os.preadv(fd, [buf.numpy()], offsets[layer])
        if got != n:
            raise CorruptEntry(f"layer {layer}: read {got} of {n} bytes (file truncated)")
        return layer_from_bytes(buf, header, layer)

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None) -> list[Layer | None]:
        return [self.get_layer(key, i, header) for i in layers]

    def read_layer_into(self, key: str, layer: int, header: EntryHeader | None, out: torch.Tensor) -> bool:
        """Read layer `layer` (K bytes then V bytes) with one preadv straight into `out`, a
        contiguous (layer_nbytes,) uint8 CPU tensor (e.g. a pinned staging buffer), and verify it.

        False on a miss or a corrupt layer (counted like `get_layer`; `out` then holds garbage).
        """
        t0 = time.perf_counter()
        for fresh in (False, True):
            try:
                handle, opened = self._handles.acquire(key, self._file(key), fresh=fresh)
            except FileNotFoundError:
                self._forget(key)
                self._stats.add(layer_misses=1)
                return False
            except OSError as e:
                self._failed(f"cannot open {key}{SUFFIX}", e)
                self._stats.add(layer_misses=1)
                return False
            try:
                ok = self._read_layer_into(key, handle.fd, layer, header, out)
            except CorruptEntry as e:
                if not opened:
                    continue  # a descriptor kept from before a replacement: retry on the current file
                self._stats.add(layer_misses=1)
                report_corrupt(self, self._stats, key, e)
                return False
            except OSError as e:
                self._failed(f"cannot read {key}{SUFFIX}", e)
                self._stats.add(layer_misses=1)
                return False
            finally:
                self._handles.release(handle)
            if not ok:
                self._stats.add(layer_misses=1)
                return False
            self._stats.add(layer_reads=1, bytes_read=out.numel(), read_seconds=time.perf_counter() - t0)
            return True
        raise AssertionError("unreachable")

    def _read_layer_into(self, key: str, fd: int, layer: int, header: EntryHeader | None, out: torch.Tensor) -> bool:
        """preadv one layer of an open entry file into `out` and verify it (False if the entry changed)."""
        with self._lock:
            info = self._index.get(key)
            offsets = info.offsets if info is not None else None
        if header is None or offsets is None:
            file_header, offsets, size = self._read_prelude(fd)
            if header is not None and file_header != header:
                return False  # replaced by a different entry since `header` was read
            header = file_header
            self._remember(key, size, offsets, touch=False)
        if not 0 <= layer < header.num_layers:
            raise IndexError(f"layer {layer} out of range: entry has {header.num_layers} layers")
        n = header.layer_nbytes
        if out.dtype != torch.uint8 or out.numel() != n or not out.is_contiguous():
            raise ValueError(f"read_layer_into: out must be a contiguous ({n},) uint8 tensor, got "
                             f"{tuple(out.shape)} {out.dtype}")
        buf = out.numpy()
        got = os.preadv(fd, [buf], offsets[layer])
        if got != n:
            raise CorruptEntry(f"layer {layer}: read {got} of {n} bytes (file truncated)")
        verify_layer(buf, header, layer)
        return True

    def get(self, key: str) -> KVEntry | None:
        return read_entry(self, key)

    # ------------------------------------------------------------------ writes
    def _make_room(self, need: int) -> None:
        """Evict least recently used files until `need` more bytes fit the budget."""
        with self._lock:
            over = self._bytes + need > self.budget
        if over and time.monotonic() - self._last_rescan >= _RESCAN_MIN_INTERVAL_S:
            self._rescan()  # account for files other processes wrote or removed
        victims: list[str] = []
        with self._lock:
            while self._bytes + need > self.budget and self._index:
                key, info = self._index.popitem(last=False)
                self._bytes -= info.size
                victims.append(key)
        for key in victims:
            self._handles.drop(key)
            _unlink_quiet(self._file(key))
        if victims:
            self._stats.add(evictions=len(victims))

    def put(self, key: str, entry: KVEntry) -> None:
        """Write `entry` atomically (temp file + os.replace), evicting LRU files past the budget.

        Failures are logged and counted; nothing partial is ever visible. Raises
        StoreUnavailable only when the tier is `required`.
        """
        t0 = time.perf_counter()
        final = self._file(key)
        head, offsets = file_layout(entry.header)
        size = offsets[-1] + entry.header.layer_nbytes
        if over_budget(self, self._stats, key, size, self.budget):
            return
        self._forget(key)
        self._make_room(size)
        tmp = self.path / f"{TMP_PREFIX}{key}.{os.getpid()}.{threading.get_ident()}"
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            parts: list[memoryview] = [memoryview(head)]
            for k, v in entry.layers:
                parts.append(memoryview(k.view(torch.uint8).reshape(-1).numpy()))
                parts.append(memoryview(v.view(torch.uint8).reshape(-1).numpy()))
            _write_all(fd, parts)
            if self._fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(tmp, final)
            if self._fsync:
                _fsync_dir(self.path)
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            _unlink_quiet(tmp)
            self._failed(f"cannot write entry {key}", e)
            return
        self._remember(key, size, offsets, touch=True)
        self._stats.add(puts=1, bytes_written=size, write_seconds=time.perf_counter() - t0)

    def delete(self, key: str) -> None:
        self._forget(key)
        _unlink_quiet(self._file(key))

    def keys(self) -> Iterator[str]:
        try:
            names = os.listdir(self.path)
        except OSError:
            names = []
        return iter([n[: -len(SUFFIX)] for n in names if n.endswith(SUFFIX) and not n.startswith(TMP_PREFIX)])

    def clear(self) -> None:
        for key in list(self.keys()):
            self.delete(key)
        self._rescan()

    def close(self) -> None:
        """Close the kept descriptors."""
        self._handles.drop_all()

    def files(self) -> list[Path]:
        """Paths of the entry files now in the directory (used by benchmarks to drop page cache)."""
        return [self._file(k) for k in self.keys()]

    def stats(self) -> dict:
        with self._lock:
            entries, used = len(self._index), self._bytes
        return self._stats.snapshot(entries, used) | {"budget": self.budget, "path": str(self.path)}


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """writev until every byte of `parts` is written (handles short writes)."""
    while parts:
        n = os.writev(fd, parts[:512])
        if n == 0:
            raise OSError(errno.EIO, "write returned 0 bytes")
        while n and parts:
            if n >= parts[0].nbytes:
                n -= parts[0].nbytes
                parts = parts[1:]
            else:
                parts[0] = parts[0][n:]
                n = 0


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: str | os.PathLike) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e)
