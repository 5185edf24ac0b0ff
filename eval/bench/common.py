"""What the benchmarks share: dropping files from the page cache so a disk tier reads a
disk, and building a store that holds exactly one tier of a kind."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from storage.config import StoreConfig, TierConfig, tier_config_class

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def drop_page_cache(paths: Path | Iterable[Path]) -> bool:
    """Evict files (or every file under a directory) from the OS page cache: fsync, then
    POSIX_FADV_DONTNEED (no root needed). Returns False where the OS has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    if isinstance(paths, Path):
        paths = paths.rglob("*") if paths.is_dir() else [paths]
    for path in paths:
        if not path.is_file():
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
        finally:
            os.close(fd)
    return True


def one_tier(kind: str, configured: StoreConfig | None = None, *, scratch: Path, redis_url: str | None = None,
             cluster_urls: list[str] | None = None, key_prefix: str = "kvblend-bench:",
             budget: int | None = None) -> TierConfig:
    """The config of one benchmark tier of `kind`: the configured tier of that kind if any
    (else the defaults), pointed at scratch space (a disk directory under `scratch`, a
    private Redis key prefix) and `required`, so an unusable tier fails loudly.
    """
    cls = tier_config_class(kind)  # ValueError listing the kinds
    base = next((t for t in configured.tiers if t.kind == kind), None) if configured is not None else None
    changes: dict[str, Any] = {}
    if budget is not None and "budget" in {f.name for f in dataclasses.fields(cls)}:
        changes["budget"] = budget
    if kind == "cpu":
        return dataclasses.replace(base or cls(), **changes)
    if kind == "disk":
        return dataclasses.replace(base or cls(path=str(scratch)), path=str(scratch), required=True, **changes)
    if kind == "redis":
        base = base or cls()
        return dataclasses.replace(base, url=redis_url or base.url, key_prefix=key_prefix, required=True, ttl_s=None)
    urls = tuple(cluster_urls or (base.urls if base is not None else ()))
    if not urls:
        raise ValueError("a redis-cluster tier needs node URLs: pass --cluster-urls U,U,U or configure one")
    return dataclasses.replace(base or cls(urls=urls), urls=urls, key_prefix=key_prefix, required=True, ttl_s=None)


def one_tier_store(kind: str, config: StoreConfig, **kwargs: Any) -> StoreConfig:
    """`config` (namespace, kv_dtype) with `one_tier(kind, config, ...)` as its only tier, no promotion."""
    return dataclasses.replace(config, tiers=(one_tier(kind, config, **kwargs),), promote=False)
