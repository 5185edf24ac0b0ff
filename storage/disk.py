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

The tier stays inside its directory: it holds the directory open and resolves every name
relative to that descriptor (openat, renameat, unlinkat), so a directory renamed or
replaced by a link while the tier runs is never followed (the configured path itself may
be a link; a namespace's subdirectory may not); entries are opened with O_NOFOLLOW | O_NONBLOCK and
used only if fstat says they are regular files (a symlink, FIFO, socket or directory at
an entry path is a corrupt entry: a miss, removed without following it); temp files get
an unpredictable name and are created with O_EXCL | O_NOFOLLOW; publishing renames over
the entry name (a rename never follows a link). A writer holds an flock on its temp file
until the file is published, so temp files of writers that died (kill -9) are recognised
by their free lock and removed at start and every few minutes; until then they count
against the budget. A namespace gets its own subdirectory: its entries, budget, listing
and clearing never touch another namespace's.

The tier owns only its own files: a `*.kv` file whose name is not an engine key
(`storage.keys.ENGINE_KEY_RE`) and which does not start with the entry magic is a file of
somebody else's that happens to sit in the directory; it is never indexed, listed, evicted
or cleared (counted in `stats()["foreign_files"]`).

LRU recency is the file mtime (refreshed on every header hit), so the index rebuilt from
the directory on start keeps the order across restarts. Each process keeps its own index
and rescans the directory before evicting, so the budget holds approximately when
several processes share one directory.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from storage.config import DiskTierConfig, tier_display_name
from storage.entry import CorruptEntry, EntryHeader, KVEntry
from storage.keys import ENGINE_KEY_RE, ENTRY_KEY_RE
from storage.serialization import MAGIC, decode_header, encode_header, header_size, layer_views, verify_layer
from storage.tier import Layer, StoreUnavailable, TierStats, over_budget, read_entry, report_corrupt

log = logging.getLogger("kvblend.storage")

SUFFIX = ".kv"
TMP_PREFIX = ".tmp."
ALIGN = 4096
_CLEAN_INTERVAL_S = 300.0  # how often a running tier looks for temp files of dead writers
_TEMP_ATTEMPTS = 3
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_FILE = {errno.ELOOP, errno.EMLINK, errno.ENXIO, errno.EOPNOTSUPP}  # link (Linux, BSD), socket
_RESCAN_MIN_INTERVAL_S = 2.0
RECENCY_S = 10.0  # a header hit refreshes the file's mtime (its LRU recency) when it is older than this
_WARN_INTERVAL_S = 30.0


@dataclass
class _FileInfo:
    size: int
    header: EntryHeader | None = None  # once read: the header the offsets belong to
    offsets: tuple[int, ...] | None = None


def _random_token() -> str:
    return secrets.token_hex(8)


def temp_name(key: str, token: str) -> str:
    """File name of a writer's temp file for `key` (never a valid entry name)."""
    return f"{TMP_PREFIX}{key}.{token}"


def open_regular(name: str, dir_fd: int) -> int:
    """A read-only descriptor of the regular file `name` in the directory open as `dir_fd`,
    never following a link and never blocking (a FIFO). FileNotFoundError if absent;
    CorruptEntry if something else than a regular file is there; other OSErrors as raised."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in _NOT_A_FILE:
            raise CorruptEntry(f"{name} is a symbolic link or a socket, not a file") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise CorruptEntry(f"{name} is not a regular file (mode {stat.filemode(mode)})")
    return fd


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

    def acquire(self, key: str, open_file: Callable[[], int], fresh: bool) -> tuple[_Handle, bool]:
        """A held descriptor of `key`'s file (`open_file()` opens it) and whether it was just
        opened; `fresh` forces a reopen.

        Raises OSError (FileNotFoundError: the entry is gone) or CorruptEntry (not a
        regular file). Pair with `release`.
        """
        if not fresh:
            with self._lock:
                handle = self._open.get(key)
                if handle is not None:
                    self._open.move_to_end(key)
                    handle.refs += 1
                    return handle, False
        handle = _Handle(open_file())
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

    def __init__(self, config: DiskTierConfig, *, namespace: str = "") -> None:
        self.config = config
        self.name = tier_display_name(config)
        self.namespace = namespace
        self.path = Path(config.path) / namespace if namespace else Path(config.path)
        self.budget = config.budget
        self._fsync = config.fsync == "always"
        self._stats = TierStats()
        self._lock = threading.Lock()
        self._handles = _Handles()
        self._index: OrderedDict[str, _FileInfo] = OrderedDict()  # LRU order, oldest first
        self._bytes = 0
        self._temp_bytes = 0  # temp files of live writers in other processes (or of dead ones not yet removed)
        self._foreign = 0  # *.kv files in the directory that are not the tier's (as of the last rescan)
        self._last_clean = 0.0
        self._last_rescan = 0.0
        self._last_warning = 0.0
        self._suppressed = 0
        self._dir_fd = -1  # the directory, held open: every name is resolved relative to it
        self._old_dir_fds: list[int] = []  # directories held before it moved (closed by close())
        self._dir_lock = threading.Lock()
        try:
            self._make_directory()
            self._open_directory()
        except OSError as e:
            self._failed("cannot create the cache directory", e)
        self._rescan()

    # ----------------------------------------------------------------- helpers
    def _make_directory(self) -> None:
        """Create the directory; a namespace's subdirectory must be a real directory: a link
        or file planted at its name is removed first (the configured path itself is the
        user's choice and may be a link)."""
        if self.namespace:
            try:
                mode = os.stat(self.path, follow_symlinks=False).st_mode
            except FileNotFoundError:
                mode = None
            if mode is not None and not stat.S_ISDIR(mode):
                log.warning("%s tier: %s is not a directory (mode %s); replacing it", self.name, self.path,
                            stat.filemode(mode))
                os.unlink(self.path)
        self.path.mkdir(parents=True, exist_ok=True)

    def _open_directory(self) -> None:
        """(Re)open the directory: O_NOFOLLOW for a namespace's subdirectory (a link planted
        at its name is refused), the configured path as the user gave it."""
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (os.O_NOFOLLOW if self.namespace else 0)
        fd = os.open(self.path, flags)
        with self._dir_lock:
            if self._dir_fd >= 0:
                # kept open until close(): a call that took it just before must not find its number
                # reused by another directory (directories move rarely; each keeps one descriptor)
                self._old_dir_fds.append(self._dir_fd)
            self._dir_fd = fd

    def _dir(self) -> int:
        """The directory's descriptor; FileNotFoundError while there is none."""
        fd = self._dir_fd
        if fd < 0:
            raise FileNotFoundError(errno.ENOENT, "the cache directory is not open", str(self.path))
        return fd

    def _moved(self) -> bool:
        """Whether the name `self.path` no longer refers to the directory held open (removed,
        or replaced by another directory or a link)."""
        try:
            held = os.fstat(self._dir())
            now = os.stat(self.path, follow_symlinks=not self.namespace)
        except OSError:
            return True
        return (held.st_dev, held.st_ino) != (now.st_dev, now.st_ino)

    def _follow_moved(self) -> bool:
        """Hold the directory now at `self.path` open instead, if it moved and is a real
        directory (for a namespace: not a link); True when it did."""
        if not self._moved():
            return False
        try:
            self._open_directory()
        except OSError:
            return False
        return True

    def _name(self, key: str) -> str:
        if not ENTRY_KEY_RE.match(key):
            raise ValueError(f"disk tier: key {key!r} is not a safe file name; use keys from storage.keys")
        return key + SUFFIX

    def _file(self, key: str) -> Path:
        """The path of `key`'s entry file (for tools and tests; the tier itself opens names
        relative to its directory's descriptor)."""
        return self.path / self._name(key)

    def _opener(self, key: str) -> Callable[[], int]:
        """Opens `key`'s entry file (open_regular, relative to the directory's descriptor)."""
        name = self._name(key)
        return lambda: open_regular(name, self._dir())

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

    def _rescan(self) -> None:
        """Rebuild the index from the directory's regular entry files, oldest mtime first
        (links and other non-regular files are ignored), and clean up temp files."""
        found: list[tuple[float, str, int]] = []
        temps: list[str] = []
        foreign = 0
        self._follow_moved()  # removed and made again (another process, a cleanup)
        with self._lock:
            known = set(self._index)
        try:
            dir_fd = self._dir()
            with os.scandir(dir_fd) as it:
                for de in it:
                    if de.name.startswith(TMP_PREFIX):
                        temps.append(de.name)
                        continue
                    key = de.name[: -len(SUFFIX)]
                    if not de.name.endswith(SUFFIX) or not ENTRY_KEY_RE.match(key):
                        continue
                    try:
                        st = de.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue
                    if key in known or _is_own(key, dir_fd):
                        found.append((st.st_mtime, key, st.st_size))
                    else:
                        foreign += 1
        except OSError:
            found = []
        found.sort()
        with self._lock:
            old = self._index
            self._index = OrderedDict(
                (key, _FileInfo(size, old[key].header, old[key].offsets) if key in old else _FileInfo(size))
                for _, key, size in found
            )
            self._bytes = sum(info.size for info in self._index.values())
            self._foreign = foreign
            self._last_rescan = time.monotonic()
        self._clean_temp_files(temps)

    def _clean_temp_files(self, names: list[str] | None = None) -> None:
        """Remove temp files whose writer is gone (its flock is free) and anything that is not
        a regular file under a temp name; count the bytes of live writers' temp files.

        Never follows a link; a file is removed only while this process holds its lock and
        its name still refers to it, so a live writer's file is never removed.
        """
        live = 0
        try:
            dir_fd = self._dir()
            if names is None:
                with os.scandir(dir_fd) as it:
                    names = [de.name for de in it if de.name.startswith(TMP_PREFIX)]
        except OSError:
            names, dir_fd = [], -1
        for name in names:
            try:
                fd = open_regular(name, dir_fd)
            except FileNotFoundError:
                continue
            except CorruptEntry:
                _unlink_quiet(name, dir_fd)  # a link, FIFO, socket or directory planted at a temp name
                continue
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    live += st.st_size  # a writer is busy with it
                    continue
                if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == st.st_ino:
                    os.unlink(name, dir_fd=dir_fd)
                    log.info("%s tier: removed %s (%d bytes) left by a writer that no longer runs",
                             self.name, name, st.st_size)
            except OSError:
                pass
            finally:
                os.close(fd)  # releases the lock after the unlink
        with self._lock:
            self._temp_bytes = live
            self._last_clean = time.monotonic()

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

    def _remember(self, key: str, size: int, header: EntryHeader, offsets: tuple[int, ...], touch: bool) -> None:
        with self._lock:
            info = self._index.get(key)
            if info is None:
                self._index[key] = _FileInfo(size, header, offsets)
                self._bytes += size
            else:
                self._bytes += size - info.size
                info.size, info.header, info.offsets = size, header, offsets
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
        try:
            return stat.S_ISREG(os.stat(self._name(key), dir_fd=self._dir(), follow_symlinks=False).st_mode)
        except OSError:
            return False

    def peek_header(self, key: str) -> EntryHeader | None:
        try:
            fd = open_regular(self._name(key), self._dir())  # CorruptEntry: not a regular file
        except OSError:
            return None
        try:
            return self._read_prelude(fd)[0]
        except OSError:
            return None
        finally:
            os.close(fd)

    def get_header(self, key: str) -> EntryHeader | None:
        """Read and verify the entry's header; refreshes the file's mtime (LRU recency).

        Opens the file afresh (so a replaced or deleted file is noticed) and keeps the
        descriptor for the layer reads that usually follow.
        """
        try:
            try:
                handle, _ = self._handles.acquire(key, self._opener(key), fresh=True)
            except FileNotFoundError:
                if not self._follow_moved():  # the directory made again elsewhere: look there once
                    raise
                handle, _ = self._handles.acquire(key, self._opener(key), fresh=True)
        except FileNotFoundError:
            self._forget(key)
            self._stats.add(misses=1)
            return None
        except CorruptEntry as e:
            self._stats.add(misses=1)
            report_corrupt(self, self._stats, key, e)
            return None
        except OSError as e:
            self._failed(f"cannot open {key}{SUFFIX}", e)
            self._stats.add(misses=1)
            return None
        try:
            header, offsets, size = self._read_prelude(handle.fd)
            try:  # recency survives restarts; a few seconds' precision spares a metadata write per hit
                if time.time() - os.fstat(handle.fd).st_mtime >= RECENCY_S:
                    os.utime(handle.fd)
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
        self._remember(key, size, header, offsets, touch=True)
        self._stats.add(hits=1)
        return header

    def get_layer(self, key: str, layer: int, header: EntryHeader | None = None) -> Layer | None:
        """Read one layer with a single preadv; the tensors own a fresh buffer."""
        return self._read(key, layer, header, None)

    def read_layer_into(self, key: str, layer: int, header: EntryHeader | None, out: torch.Tensor) -> bool:
        """Read layer `layer` (K bytes then V bytes) with one preadv straight into `out`, a
        contiguous (layer_nbytes,) uint8 CPU tensor (e.g. a pinned staging buffer), and verify it.

        False on a miss or a corrupt layer (counted like `get_layer`; `out` then holds garbage).
        """
        return self._read(key, layer, header, out) is not None

    def _read(self, key: str, layer: int, header: EntryHeader | None, out: torch.Tensor | None) -> Layer | None:
        """One verified layer read into `out` (or a fresh buffer); None on a miss, counted."""
        t0 = time.perf_counter()
        for fresh in (False, True):
            try:
                handle, opened = self._handles.acquire(key, self._opener(key), fresh=fresh)
            except FileNotFoundError:
                self._forget(key)
                self._stats.add(layer_misses=1)
                return None
            except CorruptEntry as e:
                self._stats.add(layer_misses=1)
                report_corrupt(self, self._stats, key, e)
                return None
            except OSError as e:
                self._failed(f"cannot open {key}{SUFFIX}", e)
                self._stats.add(layer_misses=1)
                return None
            try:
                got = self._read_layer(key, handle, layer, header, out)
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
            self._stats.add(layer_reads=1, bytes_read=got[0].nbytes + got[1].nbytes,
                            read_seconds=time.perf_counter() - t0)
            return got
        raise AssertionError("unreachable")

    def _read_layer(self, key: str, handle: _Handle, layer: int, header: EntryHeader | None,
                    out: torch.Tensor | None) -> Layer | None:
        """Read and verify one layer from an open entry file into `out` (or a fresh buffer);
        None if the entry changed since `header` was read. (Asking the kernel for an entry's
        remaining layers at its first read, POSIX_FADV_WILLNEED, measured slower: 0.25-0.38 of a
        raw read against 0.49-0.52 without, 2026-12-03.)"""
        fd = handle.fd
        with self._lock:
            info = self._index.get(key)
            offsets = info.offsets if info is not None and header is not None and info.header == header else None
        if offsets is None:
            file_header, offsets, size = self._read_prelude(fd)
            if header is not None and file_header != header:
                return None  # replaced by a different entry since `header` was read
            header = file_header
            self._remember(key, size, header, offsets, touch=False)
        if not 0 <= layer < header.num_layers:
            raise IndexError(f"layer {layer} out of range: entry has {header.num_layers} layers")
        n = header.layer_nbytes
        if out is None:
            out = torch.empty(n, dtype=torch.uint8)  # (layer_nbytes,) not zero-filled
        elif out.dtype != torch.uint8 or out.numel() != n or not out.is_contiguous():
            raise ValueError(f"read_layer_into: out must be a contiguous ({n},) uint8 tensor, got "
                             f"{tuple(out.shape)} {out.dtype}")
        array = out.numpy()
        got = os.preadv(fd, [array], offsets[layer])
        if got != n:
            raise CorruptEntry(f"layer {layer}: read {got} of {n} bytes (file truncated)")
        verify_layer(array, header, layer)
        return layer_views(out, header)

    def get_layers(self, key: str, layers: Sequence[int], header: EntryHeader | None = None) -> list[Layer | None]:
        return [self.get_layer(key, i, header) for i in layers]

    def get(self, key: str) -> KVEntry | None:
        return read_entry(self, key)

    # ------------------------------------------------------------------ writes
    def _make_room(self, need: int) -> None:
        """Evict least recently used files until `need` more bytes fit the budget."""
        with self._lock:
            over = self._bytes + self._temp_bytes + need > self.budget
        if over and time.monotonic() - self._last_rescan >= _RESCAN_MIN_INTERVAL_S:
            self._rescan()  # account for files other processes wrote or removed
        elif time.monotonic() - self._last_clean >= _CLEAN_INTERVAL_S:
            self._clean_temp_files()
        self._evict_lru(lambda _freed: self._bytes + self._temp_bytes + need > self.budget)

    def _evict_lru(self, more: Callable[[int], bool]) -> tuple[int, int]:
        """Evict least recently used entries while `more(bytes freed so far)` holds (asked
        under the lock); returns (entries, bytes) evicted."""
        victims: list[str] = []
        freed = 0
        with self._lock:
            while self._index and more(freed):
                key, info = self._index.popitem(last=False)
                self._bytes -= info.size
                freed += info.size
                victims.append(key)
        for key in victims:
            self._handles.drop(key)
            self._unlink(key)
        if victims:
            self._stats.add(evictions=len(victims))
        return len(victims), freed

    def put(self, key: str, entry: KVEntry) -> None:
        """Write `entry` atomically (temp file + os.replace), evicting LRU files past the budget.

        Failures are logged and counted; nothing partial is ever visible. Raises
        StoreUnavailable only when the tier is `required`.
        """
        t0 = time.perf_counter()
        final = self._name(key)
        head, offsets = file_layout(entry.header)
        size = offsets[-1] + entry.header.layer_nbytes
        if over_budget(self, self._stats, key, size, self.budget):
            return
        self._forget(key)
        self._make_room(size)
        for attempt in range(2):
            try:
                self._write(key, final, head, entry)
                break
            except OSError as e:
                # a file system fuller than the budget assumed: make room by evicting, once
                if attempt == 0 and e.errno in (errno.ENOSPC, errno.EDQUOT) and self._evict(size):
                    continue
                self._failed(f"cannot write entry {key}", e)
                return
        self._remember(key, size, entry.header, offsets, touch=True)
        self._stats.add(puts=1, bytes_written=size, write_seconds=time.perf_counter() - t0)

    def _write(self, key: str, final: str, head: bytes, entry: KVEntry) -> None:
        """Write the entry file `final` (a name in the directory) through a temp file and
        publish it; on OSError nothing is left behind (the error is raised)."""
        fd, tmp, dir_fd = -1, None, -1
        try:
            try:
                dir_fd = self._dir()
                fd, tmp = self._create_temp(key, dir_fd)
            except FileNotFoundError:
                if not self._moved():
                    raise
                if not os.path.lexists(self.path):
                    # removed under us (a cleanup, `rm -rf`), or never made: start it over
                    log.warning("%s tier: directory %s is missing; creating it (entries it held are gone)",
                                self.name, self.path)
                self._make_directory()  # a link or file planted at a namespace's name is removed first
                self._open_directory()
                self._rescan()
                dir_fd = self._dir()
                fd, tmp = self._create_temp(key, dir_fd)
            parts: list[memoryview] = [memoryview(head)]
            for k, v in entry.layers:
                parts.append(memoryview(k.view(torch.uint8).reshape(-1).numpy()))
                parts.append(memoryview(v.view(torch.uint8).reshape(-1).numpy()))
            _write_all(fd, parts)
            if self._fsync:
                os.fsync(fd)
            # renames over a link or file at `final`, never through it
            os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            tmp = None
            if self._fsync:
                os.fsync(dir_fd)
        finally:
            if tmp is not None:
                _unlink_quiet(tmp, dir_fd)
            if fd >= 0:
                os.close(fd)  # releases the writer's lock, after publishing

    def _evict(self, need: int) -> bool:
        """Evict least recently used entries holding at least `need` bytes (the file system
        is full below the budget); False when there was nothing to evict."""
        count, freed = self._evict_lru(lambda freed: freed < need)
        if count:
            log.warning("%s tier at %s: the file system is full; evicted %d entries (%d bytes) to make room",
                        self.name, self.path, count, freed)
        return count > 0

    def _create_temp(self, key: str, dir_fd: int) -> tuple[int, str]:
        """A new, locked temp file for `key` (descriptor, name in the directory `dir_fd`):
        O_EXCL | O_NOFOLLOW under an unpredictable name, so nothing planted in the directory
        is ever written through. Raises OSError after a few names were taken."""
        err: OSError = FileExistsError(errno.EEXIST, "temp file names taken")
        for _ in range(_TEMP_ATTEMPTS):
            name = temp_name(key, _random_token())
            try:
                fd = os.open(name, _CREATE_FLAGS, 0o644, dir_fd=dir_fd)
            except FileExistsError as e:
                err = e
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held until published: marks the file as being written
                if os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    return fd, name
            except OSError as e:  # removed by a cleaner between open and flock: try another name
                err = e
            os.close(fd)
        raise err

    def _unlink(self, key: str) -> None:
        try:
            dir_fd = self._dir()
        except FileNotFoundError:
            return
        _unlink_quiet(self._name(key), dir_fd)

    def delete(self, key: str) -> bool:
        self._forget(key)
        self._unlink(key)
        return True

    def keys(self) -> Iterator[str]:
        """Keys of the tier's own regular entry files in this namespace's directory."""
        out = []
        with self._lock:
            known = set(self._index)
        try:
            dir_fd = self._dir()
            with os.scandir(dir_fd) as it:
                for de in it:
                    key = de.name[: -len(SUFFIX)]
                    if (de.name.endswith(SUFFIX) and ENTRY_KEY_RE.match(key) and de.is_file(follow_symlinks=False)
                            and (key in known or _is_own(key, dir_fd))):
                        out.append(key)
        except OSError:
            pass
        return iter(out)

    def clear(self) -> bool:
        for key in list(self.keys()):
            self.delete(key)
        self._rescan()
        return True

    def close(self) -> None:
        """Close the kept descriptors."""
        self._handles.drop_all()
        with self._dir_lock:
            fds = [*self._old_dir_fds, self._dir_fd]
            self._dir_fd, self._old_dir_fds = -1, []
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def files(self) -> list[Path]:
        """Paths of the entry files now in the directory (used by benchmarks to drop page cache)."""
        return [self._file(k) for k in self.keys()]

    def stats(self) -> dict:
        """Counters; bytes_used includes `temp_bytes` (temp files of other writers, live or dead)."""
        with self._lock:
            entries, used, temp, foreign = len(self._index), self._bytes, self._temp_bytes, self._foreign
        return self._stats.snapshot(entries, used + temp) | {"budget": self.budget, "path": str(self.path),
                                                             "temp_bytes": temp, "foreign_files": foreign}


def _is_own(key: str, dir_fd: int) -> bool:
    """Whether the regular file `key`.kv is the tier's: its name is an engine key, or it
    starts with the entry magic (keys chosen through the Python API). Unreadable: not own."""
    if ENGINE_KEY_RE.match(key):
        return True
    try:
        fd = open_regular(key + SUFFIX, dir_fd)
    except (OSError, CorruptEntry):
        return False
    try:
        return os.pread(fd, len(MAGIC), 0) == MAGIC
    except OSError:
        return False
    finally:
        os.close(fd)


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


def _unlink_quiet(name: str, dir_fd: int) -> None:
    """Remove `name` in the directory open as `dir_fd` (a file, link, FIFO or socket; an
    empty directory), never what a link points to. Logs instead of raising."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except (IsADirectoryError, PermissionError) as e:
        try:
            os.rmdir(name, dir_fd=dir_fd)
        except OSError:
            log.warning("cannot remove %s: %s", name, e)
    except OSError as e:
        log.warning("cannot remove %s: %s", name, e)
