"""CPU and disk tiers: round trips, LRU budgets, restart, corruption, write failures, concurrency."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from eval.bench.load import ChunkShape, random_entry
from storage.config import CpuTierConfig, DiskTierConfig
from storage.disk import SUFFIX, DiskTier, file_layout
from storage.memory import CpuTier
from storage.tier import StoreUnavailable, Tier

SMALL = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16)
ROOT = Path(__file__).resolve().parents[1]


def file_size(entry) -> int:
    head, offsets = file_layout(entry.header)
    return offsets[-1] + entry.header.layer_nbytes


def make_tier(kind: str, tmp_path: Path, budget: int = 1 << 30) -> Tier:
    if kind == "cpu":
        return CpuTier(CpuTierConfig(budget=budget))
    return DiskTier(DiskTierConfig(path=str(tmp_path / "disk"), budget=budget))


def assert_same(a, b) -> None:
    assert a[0].dtype == b[0].dtype and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_every_dtype(kind, kv_dtype, tmp_path):
    tier = make_tier(kind, tmp_path)
    _, entry = random_entry(dataclasses.replace(SMALL, kv_dtype=kv_dtype), seed=3)
    assert tier.get_header("k") is None and tier.get_layer("k", 0) is None and tier.get("k") is None
    tier.put("k", entry)
    assert tier.contains("k") and list(tier.keys()) == ["k"]
    assert tier.get_header("k") == entry.header
    got = tier.get("k")
    assert got is not None and got.header == entry.header
    for a, b in zip(got.layers, entry.layers, strict=True):
        assert_same(a, b)
    stats = tier.stats()
    assert stats["hits"] >= 2 and stats["misses"] == 2 and stats["entries"] == 1 and stats["corrupt"] == 0
    tier.delete("k")
    assert not tier.contains("k") and tier.get_header("k") is None
    tier.close()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_single_layer_reads(kind, tmp_path):
    tier = make_tier(kind, tmp_path)
    _, entry = random_entry(SMALL, seed=1)
    tier.put("k", entry)
    k, v = tier.get_layer("k", 2)  # without header: the tier reads it
    assert k.shape == (2, 16, 8) and k.is_contiguous()
    assert_same((k, v), entry.layers[2])
    again = tier.get_layer("k", 2, entry.header)
    # reads are read-only: the cpu tier hands out views of what it stores, the disk tier fresh buffers
    assert (again[0].data_ptr() == k.data_ptr()) == (kind == "cpu")
    assert_same(again, entry.layers[2])
    layers = tier.get_layers("k", [0, 2], entry.header)
    assert_same(layers[0], entry.layers[0]) and assert_same(layers[1], entry.layers[2]) is None
    with pytest.raises(IndexError, match="out of range"):
        tier.get_layer("k", 3, entry.header)


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_lru_eviction_respects_budget(kind, tmp_path):
    entries = [random_entry(SMALL, seed=i)[1] for i in range(3)]
    one = entries[0].nbytes if kind == "cpu" else file_size(entries[0])
    tier = make_tier(kind, tmp_path, budget=int(one * 2.5))
    tier.put("a", entries[0])
    tier.put("b", entries[1])
    assert tier.get_header("a") is not None  # a is now more recent than b
    tier.put("c", entries[2])
    assert sorted(tier.keys()) == ["a", "c"]
    stats = tier.stats()
    assert stats["evictions"] == 1 and stats["bytes_used"] <= int(one * 2.5) and stats["entries"] == 2
    big = CpuTier(CpuTierConfig(budget=10)) if kind == "cpu" else DiskTier(
        DiskTierConfig(path=str(tmp_path / "tiny"), budget=10))
    big.put("x", entries[0])  # larger than the whole budget: skipped, counted
    assert not big.contains("x") and big.stats()["errors"] == 1


def test_disk_tier_leaves_files_that_are_not_its_own_alone(tmp_path):
    """A directory the user pointed the tier at may hold their own `*.kv` files: the tier
    never lists, evicts or clears them, while its entries (engine keys, and API keys whose
    files start with the entry magic) are evicted and cleared as usual."""
    from storage.keys import document_block_key

    entries = [random_entry(SMALL, seed=i)[1] for i in range(3)]
    size = file_size(entries[0])
    disk = tmp_path / "disk"
    disk.mkdir()
    theirs = {"x.kv": b"the user's notes\n", "model.kv": b"", "KVBLEND.kv": b"KVBLEN"}
    for name, data in theirs.items():
        (disk / name).write_bytes(data)
        os.utime(disk / name, (1, 1))  # the oldest files in the directory: first in line for eviction
    engine_key = document_block_key("fp", [1, 2, 3], "float16", start=0)
    tier = make_tier("disk", tmp_path, budget=int(size * 2.5))
    assert tier.stats()["foreign_files"] == 3 and tier.stats()["bytes_used"] == 0
    tier.put("a", entries[0])
    tier.put(engine_key, entries[1])
    tier.put("c", entries[2])  # over the budget: evicts "a", the oldest of the tier's own
    assert sorted(tier.keys()) == sorted(["c", engine_key]) and tier.stats()["evictions"] == 1
    restarted = make_tier("disk", tmp_path, budget=int(size * 2.5))  # indexed from the directory alone
    assert sorted(restarted.keys()) == sorted(["c", engine_key]) and restarted.stats()["entries"] == 2
    assert restarted.clear() and list(restarted.keys()) == []
    assert {p.name: p.read_bytes() for p in disk.iterdir()} == theirs
    tier.close()
    restarted.close()


def test_disk_restart_rebuilds_index_in_lru_order(tmp_path):
    entries = [random_entry(SMALL, seed=i)[1] for i in range(3)]
    size = file_size(entries[0])
    first = make_tier("disk", tmp_path, budget=int(size * 2.5))
    first.put("a", entries[0])
    first.put("b", entries[1])
    os.utime(first.path / f"a{SUFFIX}", (1, 1))  # make the order unambiguous
    os.utime(first.path / f"b{SUFFIX}", (2, 2))
    assert first.get_header("a") is not None  # touching a makes it the most recent
    first.close()
    second = make_tier("disk", tmp_path, budget=int(size * 2.5))
    assert second.stats()["entries"] == 2 and second.stats()["bytes_used"] == 2 * size
    assert_same(second.get_layer("a", 1), entries[0].layers[1])
    second.put("c", entries[2])
    assert sorted(second.keys()) == ["a", "c"]


def test_disk_directory_removed_while_running_is_recreated_on_the_next_write(tmp_path, caplog):
    import shutil

    entries = [random_entry(SMALL, seed=i)[1] for i in range(2)]
    tier = make_tier("disk", tmp_path)
    tier.put("a", entries[0])
    shutil.rmtree(tier.path)
    assert tier.get_header("a") is None  # gone: a miss
    with caplog.at_level(logging.WARNING):
        tier.put("b", entries[1])
    assert "is missing; creating it" in caplog.text
    assert_same(tier.get_layer("b", 1), entries[1].layers[1])
    stats = tier.stats()
    assert stats["entries"] == 1 and stats["bytes_used"] == file_size(entries[1]) and stats["errors"] == 0
    tier.close()


def _damage(path: Path, how: str, entry) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[file_layout(entry.header)[1][1] + 5] ^= 0x40  # a byte inside layer 1
    elif how == "truncate":
        data = data[: len(data) - 100]
    elif how == "magic":
        data[0:8] = b"NOTKVBLN"
    elif how == "header":
        i = data.index(b'"num_tokens":') + len(b'"num_tokens":')
        data[i] = ord("9")  # a header that contradicts its own sizes
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "magic", "header"])
def test_disk_corrupt_entry_is_a_deleted_counted_logged_miss(how, tmp_path, caplog):
    tier = make_tier("disk", tmp_path)
    _, entry = random_entry(SMALL, seed=2)
    tier.put("k", entry)
    _damage(tier.path / f"k{SUFFIX}", how, entry)
    fresh = make_tier("disk", tmp_path)  # no cached descriptors or offsets
    with caplog.at_level(logging.WARNING, logger="kvblend.storage"):
        if how == "flip":  # the header is fine: the damage shows on reading layer 1
            header = fresh.get_header("k")
            assert header is not None
            assert_same(fresh.get_layer("k", 0, header), entry.layers[0])
            assert fresh.get_layer("k", 1, header) is None
        else:
            assert fresh.get_header("k") is None
    assert "corrupt" in caplog.text and "k" in caplog.text
    assert not (tier.path / f"k{SUFFIX}").exists()
    assert fresh.stats()["corrupt"] == 1
    assert fresh.get("k") is None


def test_disk_write_failure_is_logged_counted_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    tier = make_tier("disk", tmp_path)
    _, entry = random_entry(SMALL)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    for name in ("writev", "replace"):
        with monkeypatch.context() as m:
            m.setattr(os, name, full)
            with caplog.at_level(logging.WARNING, logger="kvblend.storage"):
                tier.put(f"k{name}", entry)  # must not raise
        assert os.listdir(tier.path) == []  # no temp file, no partial entry
        assert tier.get_header(f"k{name}") is None
    assert tier.stats()["errors"] == 2 and "No space left" in caplog.text
    tier.put("ok", entry)  # the tier still works afterwards
    assert tier.get("ok") is not None


def test_disk_unwritable_directory_and_required(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="kvblend.storage"):
        tier = DiskTier(DiskTierConfig(path=str(blocker / "cache"), budget=1 << 20))
        _, entry = random_entry(SMALL)
        tier.put("k", entry)
    assert tier.get_header("k") is None and tier.stats()["errors"] >= 1
    assert "cannot" in caplog.text
    with pytest.raises(StoreUnavailable, match="required: false"):
        DiskTier(DiskTierConfig(path=str(blocker / "cache"), budget=1 << 20, required=True))


def test_concurrent_threads_never_see_torn_entries(tmp_path):
    entries = {f"k{i}": random_entry(SMALL, seed=i)[1] for i in range(6)}
    for kind in ("cpu", "disk"):
        one = file_size(entries["k0"]) if kind == "disk" else entries["k0"].nbytes
        tier = make_tier(kind, tmp_path, budget=one * 3)  # constant eviction
        errors: list[str] = []

        def writer(tier=tier):
            for _ in range(40):
                for key in entries:
                    tier.put(key, entries[key])

        def reader(tier=tier, errors=errors):
            for _ in range(60):
                for key, entry in entries.items():
                    got = tier.get_layer(key, 1)
                    if got is not None and not (torch.equal(got[0], entry.layers[1][0])
                                                and torch.equal(got[1], entry.layers[1][1])):
                        errors.append(key)

        threads = [threading.Thread(target=writer), threading.Thread(target=writer)]
        threads += [threading.Thread(target=reader) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == [] and tier.stats()["corrupt"] == 0, kind


_OTHER_PROCESS = """
import sys, time
from eval.bench.load import ChunkShape, random_entry
from storage.config import DiskTierConfig
from storage.disk import DiskTier
shape = ChunkShape(layers=3, kv_heads=2, head_dim=8, tokens=16)
tier = DiskTier(DiskTierConfig(path=sys.argv[1], budget=int(sys.argv[2])))
entries = [random_entry(shape, seed=i)[1] for i in range(6)]
print("ready", flush=True)
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    for i, e in enumerate(entries):
        tier.put(f"k{i}", e)
        if i % 2:
            tier.delete(f"k{i - 1}")
print("corrupt", tier.stats()["corrupt"])
"""


def test_two_processes_share_one_directory(tmp_path):
    entries = {f"k{i}": random_entry(SMALL, seed=i)[1] for i in range(6)}
    directory = tmp_path / "shared"
    budget = file_size(entries["k0"]) * 3
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    other = subprocess.Popen([sys.executable, "-c", _OTHER_PROCESS, str(directory), str(budget), "1.5"],
                             env=env, stdout=subprocess.PIPE, text=True)
    assert other.stdout.readline().strip() == "ready"
    tier = DiskTier(DiskTierConfig(path=str(directory), budget=budget))
    reads = hits = 0
    while other.poll() is None:
        for key, entry in entries.items():
            header = tier.get_header(key)
            for i in range(SMALL.layers):
                got = tier.get_layer(key, i, header) if header is not None else tier.get_layer(key, i)
                reads += 1
                if got is not None:
                    hits += 1
                    assert_same(got, entry.layers[i])
        tier.put("k0", entries["k0"])  # this process writes and evicts too
    out, _ = other.communicate()
    assert other.returncode == 0 and out.strip().splitlines()[-1] == "corrupt 0"
    assert tier.stats()["corrupt"] == 0 and hits > 0 and reads > hits // 2


def test_disk_fsync_always_round_trip_and_bad_keys(tmp_path):
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "d"), fsync="always"))
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    assert_same(tier.get_layer("k", 0), entry.layers[0])
    with pytest.raises(ValueError, match="safe file name"):
        tier.put("../escape", entry)


def test_a_namespace_directory_swapped_for_a_link_while_running_is_never_followed(tmp_path):
    """The tier holds its directory open: a namespace subdirectory renamed away and replaced
    by a link to another directory takes no write, listing or clearing there."""
    entries = [random_entry(SMALL, seed=i)[1] for i in range(3)]
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "disk")), namespace="ns1")
    tier.put("a", entries[0])
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / f"b{SUFFIX}").write_bytes(b"someone else's file")
    tier.path.rename(tmp_path / "disk" / "ns1.moved")
    tier.path.symlink_to(outside, target_is_directory=True)
    tier.put("c", entries[2])
    assert sorted(os.listdir(outside)) == [f"b{SUFFIX}"]  # nothing written through the link
    assert sorted(tier.keys()) == ["a", "c"] and tier.get_header("b") is None
    assert_same(tier.get_layer("a", 1), entries[0].layers[1])
    tier.clear()
    assert (outside / f"b{SUFFIX}").read_bytes() == b"someone else's file"
    assert os.listdir(tmp_path / "disk" / "ns1.moved") == []  # what it cleared was its own
    tier.close()


def test_a_disk_directory_made_again_by_another_process_is_followed(tmp_path):
    """Removed and made again (another process's cleanup): the tier reads and writes the new
    directory, not the removed one it held."""
    import shutil

    entries = [random_entry(SMALL, seed=i)[1] for i in range(2)]
    first = make_tier("disk", tmp_path)
    first.put("a", entries[0])
    shutil.rmtree(first.path)
    second = make_tier("disk", tmp_path)
    second.put("b", entries[1])
    assert first.get_header("b") is not None  # a miss where it held the old one: it looked again
    assert_same(first.get_layer("b", 1), entries[1].layers[1])
    first.put("c", entries[0])
    assert sorted(second.keys()) == ["b", "c"]
    first.close()
    second.close()


def test_disk_index_and_reads_ignore_links_fifos_and_directories(tmp_path):
    tier = make_tier("disk", tmp_path)
    _, entry = random_entry(SMALL)
    tier.put("real", entry)
    outside = tmp_path / "outside"
    other = DiskTier(DiskTierConfig(path=str(outside)))
    other.put("elsewhere", entry)
    (tier.path / f"link{SUFFIX}").symlink_to(outside / f"elsewhere{SUFFIX}")
    os.mkfifo(tier.path / f"fifo{SUFFIX}")
    (tier.path / f"dir{SUFFIX}").mkdir()
    fresh = make_tier("disk", tmp_path)
    assert sorted(fresh.keys()) == ["real"] and fresh.stats()["entries"] == 1
    assert not fresh.contains("link") and not fresh.contains("fifo")
    for key in ("link", "fifo", "dir"):
        assert fresh.get_header(key) is None and fresh.get_layer(key, 0) is None
    assert fresh.stats()["corrupt"] == 3  # found by the header reads, removed (an empty directory too)
    assert sorted(os.listdir(tier.path)) == [f"real{SUFFIX}"]
    assert (outside / f"elsewhere{SUFFIX}").exists()  # a link is removed, never what it points to
    victim = outside / "victim"
    victim.write_bytes(b"keep")
    (tier.path / f"k{SUFFIX}").symlink_to(victim)
    fresh.put("k", entry)  # publishing renames over the link
    assert victim.read_bytes() == b"keep" and fresh.get("k") is not None


def test_cpu_read_of_a_replaced_entry_is_a_miss(tmp_path):
    tier = make_tier("cpu", tmp_path)
    _, a = random_entry(SMALL, seed=1)
    _, b = random_entry(dataclasses.replace(SMALL, layers=2), seed=2)
    tier.put("k", a)
    tier.put("k", b)  # replaced between a lookup of `a` and its layer reads
    assert tier.get_layer("k", 2, a.header) is None and tier.get_layer("k", 1, b.header) is not None


def test_disk_namespace_directory_is_never_a_link(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "disk").mkdir()
    (tmp_path / "disk" / "alpha").symlink_to(outside)
    tier = DiskTier(DiskTierConfig(path=str(tmp_path / "disk")), namespace="alpha")
    _, entry = random_entry(SMALL)
    tier.put("k", entry)
    assert (tmp_path / "disk" / "alpha").is_dir() and not (tmp_path / "disk" / "alpha").is_symlink()
    assert os.listdir(outside) == [] and tier.get("k") is not None


def test_a_full_file_system_below_the_budget_evicts_lru_entries_and_retries(tmp_path, caplog, monkeypatch):
    """ENOSPC (a disk smaller than the tier's budget): the least recently used entries make
    room and the write is retried once; with nothing left to evict it is a counted failure."""
    import errno as errno_codes

    import storage.disk as disk

    entries = [random_entry(SMALL, seed=i)[1] for i in range(4)]
    tier = make_tier("disk", tmp_path)  # a budget far above what the "disk" below holds
    for key, entry in zip("abc", entries, strict=False):
        tier.put(key, entry)
    tier.get_header("a")  # a is now the most recently used: b goes first
    capacity = 3 * file_size(entries[0])
    write_all = disk._write_all

    def bounded(fd, parts):  # a file system of `capacity` bytes
        used = sum(p.stat().st_size for p in tier.path.iterdir() if p.name.endswith(disk.SUFFIX))
        if used + sum(len(p) for p in parts) > capacity:
            raise OSError(errno_codes.ENOSPC, "No space left on device")
        write_all(fd, parts)

    monkeypatch.setattr(disk, "_write_all", bounded)
    with caplog.at_level(logging.WARNING):
        tier.put("d", entries[3])
    assert "file system is full; evicted 1 entries" in caplog.text
    assert sorted(tier.keys()) == ["a", "c", "d"] and tier.stats()["errors"] == 0
    assert_same(tier.get_layer("d", 1), entries[3].layers[1])
    assert not [p for p in tier.path.iterdir() if not p.name.endswith(disk.SUFFIX)]  # no temp file left
    monkeypatch.setattr(disk, "_write_all", lambda fd, parts: (_ for _ in ()).throw(
        OSError(errno_codes.ENOSPC, "No space left on device")))
    tier.put("e", entries[0])  # evicts once, still no room: counted, nothing published
    assert tier.stats()["errors"] == 1 and tier.get_header("e") is None
    tier.close()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_peek_header_changes_nothing(kind, tmp_path):
    """peek_header (listings): the header of a stored entry, None for an absent one, and no
    counter, recency or deletion changes; an unreadable entry raises instead of being deleted."""
    entries = [random_entry(SMALL, seed=i)[1] for i in range(3)]
    one = file_size(entries[0]) if kind == "disk" else entries[0].nbytes
    tier = make_tier(kind, tmp_path, budget=int(one * 2.5))
    tier.put("a", entries[0])
    tier.put("b", entries[1])
    before = tier.stats()
    assert tier.peek_header("a") == entries[0].header and tier.peek_header("absent") is None
    after = tier.stats()
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    tier.put("c", entries[2])  # over the budget: the least recently used goes, still "a" after the peek
    assert tier.peek_header("a") is None and tier.peek_header("b") == entries[1].header
    if kind == "disk":
        from storage.entry import CorruptEntry

        path = tier.path / f"b{SUFFIX}"
        path.write_bytes(b"junk" * 8)
        with pytest.raises(CorruptEntry):
            tier.peek_header("b")
        assert path.exists() and tier.stats()["corrupt"] == 0
    tier.close()
