"""Configuration plumbing shared by every component: frozen dataclasses built from YAML
mappings that reject unknown keys, and human-friendly byte sizes ("512MiB").

Component configs (tiers, the store, the engine) are frozen dataclasses; `from_mapping`
builds one from a plain dict, checking every key against the dataclass fields and
naming the valid ones when a key is unknown.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from storage.dtypes import check_dtype
from storage.units import format_bytes, parse_bytes  # noqa: F401 - re-exported for config users

T = TypeVar("T")

def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Coerce a YAML value into the annotated type (nested dataclasses, tuples, Optional)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _coerce(value, args[0], where)
        if isinstance(value, dict) and all(dataclasses.is_dataclass(a) for a in args):
            return _coerce_tagged(value, args, where)
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(value).__name__}")
        return from_mapping(tp, value, where)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        return tuple(_coerce(v, inner, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _coerce_tagged(value: dict[str, Any], classes: list[Any], where: str) -> Any:
    """Pick one of several dataclasses by the mapping's `kind` (each class's `kind` default)."""
    by_kind: dict[str, Any] = {}
    for c in classes:
        kind_field = {f.name: f for f in dataclasses.fields(c)}.get("kind")
        if kind_field is None or not isinstance(kind_field.default, str):
            raise TypeError(f"{where}: union member {c.__name__} needs a `kind: str` field with a default")
        by_kind[kind_field.default] = c
    kind = value.get("kind")
    if kind not in by_kind:
        problem = "missing `kind`" if kind is None else f"unknown kind {kind!r}"
        raise ValueError(f"{where}: {problem}; valid kinds are: {', '.join(by_kind)}")
    return from_mapping(by_kind[kind], value, where)


def from_mapping(cls: type[T], data: dict[str, Any] | None, where: str = "config") -> T:
    """Build the frozen dataclass `cls` from `data`, rejecting unknown keys.

    Nested dataclass fields accept mappings; tuple fields accept lists. Fields whose
    metadata has `"bytes": True` accept sizes like "2GiB". Missing keys take the
    dataclass defaults; a missing key without a default is an error naming it.
    """
    data = dict(data or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ValueError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys are: "
            f"{', '.join(sorted(fields))}"
        )
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        f = fields[name]
        if f.metadata.get("bytes"):
            kwargs[name] = parse_bytes(value, f"{where}.{name}")
        else:
            kwargs[name] = _coerce(value, hints[name], f"{where}.{name}")
    missing = [
        n for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where}: missing required key(s): {', '.join(missing)}")
    return cls(**kwargs)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict; errors name the file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} not found; pass --config with a path such as configs/default.yaml")
    with p.open() as fh:
        data = yaml.safe_load(fh) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the top level of a config must be a mapping, got {type(data).__name__}")
    return data


# --------------------------------------------------------------------------------------
# Store configuration: one frozen dataclass per tier kind plus the store itself.
# --------------------------------------------------------------------------------------

FSYNC_POLICIES = ("always", "never")
_NAMESPACE_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.]{0,63})?$")
_TIER_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{0,64}$")
_REDIS_SCHEMES = ("redis://", "rediss://")


def _check_tier_common(cfg: Any, expected_kind: str) -> None:
    if cfg.kind != expected_kind:
        raise ValueError(f"{type(cfg).__name__}.kind must be {expected_kind!r}, got {cfg.kind!r}")
    if not _TIER_NAME_RE.match(cfg.name):
        raise ValueError(f"tier name {cfg.name!r}: use up to 64 characters from A-Z a-z 0-9 _ . -")


def _check_redis_url(url: str, where: str) -> None:
    if not isinstance(url, str) or not url.startswith(_REDIS_SCHEMES):
        raise ValueError(
            f"{where}: {url!r} is not a Redis URL; use redis://[user:password@]host:port[/db] "
            "or rediss:// for TLS"
        )


@dataclass(frozen=True)
class CpuTierConfig:
    """CPU-memory tier: entries kept as tensors, LRU eviction past `budget` bytes."""

    kind: str = "cpu"
    budget: int = field(default=2 * 1024**3, metadata={"bytes": True})
    name: str = ""  # display/stats name; defaults to the kind

    def __post_init__(self) -> None:
        _check_tier_common(self, "cpu")
        if self.budget <= 0:
            raise ValueError(f"cpu tier: budget must be > 0, got {self.budget}; set e.g. budget: 2GiB")


@dataclass(frozen=True)
class DiskTierConfig:
    """Local-disk tier: one file per entry under `path`, LRU eviction past `budget` bytes.

    fsync: "never" (default) relies on per-layer checksums: a file torn by a power loss
    fails verification and is deleted, i.e. it becomes a miss. "always" fsyncs each file
    and the directory before publishing it (durable, several ms per entry).
    """

    path: str
    kind: str = "disk"
    budget: int = field(default=20 * 1024**3, metadata={"bytes": True})
    fsync: str = "never"
    required: bool = False  # true: failed writes raise StoreUnavailable instead of being counted
    name: str = ""

    def __post_init__(self) -> None:
        _check_tier_common(self, "disk")
        if not self.path:
            raise ValueError("disk tier: path is empty; set path: .kvblend-cache/disk")
        if self.budget <= 0:
            raise ValueError(f"disk tier: budget must be > 0, got {self.budget}; set e.g. budget: 20GiB")
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(f"disk tier: fsync must be one of {', '.join(FSYNC_POLICIES)}, got {self.fsync!r}")


@dataclass(frozen=True)
class RedisTierConfig:
    """Redis tier: per-layer keys, pipelined writes, down-marking with exponential backoff."""

    kind: str = "redis"
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kvblend:"
    ttl_s: float | None = None  # expire entries after this many seconds; None: never
    required: bool = False  # true: an unreachable server raises StoreUnavailable
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    pool_size: int = 16
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    name: str = ""

    def __post_init__(self) -> None:
        _check_tier_common(self, "redis")
        _check_redis_url(self.url, "redis tier url")
        _check_redis_common(self)


@dataclass(frozen=True)
class RedisClusterTierConfig:
    """Redis Cluster tier: startup node URLs; keys of one entry share a hash slot."""

    urls: tuple[str, ...]
    kind: str = "redis-cluster"
    key_prefix: str = "kvblend:"
    ttl_s: float | None = None
    required: bool = False
    socket_timeout_s: float = 2.0
    connect_timeout_s: float = 1.0
    pool_size: int = 16
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    name: str = ""

    def __post_init__(self) -> None:
        _check_tier_common(self, "redis-cluster")
        if not self.urls:
            raise ValueError(
                "redis-cluster tier: urls is empty; list one or more node URLs, "
                "e.g. urls: [redis://127.0.0.1:7000, redis://127.0.0.1:7001]"
            )
        for i, url in enumerate(self.urls):
            _check_redis_url(url, f"redis-cluster tier urls[{i}]")
        _check_redis_common(self)


def _check_redis_common(cfg: RedisTierConfig | RedisClusterTierConfig) -> None:
    if cfg.ttl_s is not None and cfg.ttl_s <= 0:
        raise ValueError(f"{cfg.kind} tier: ttl_s must be > 0 or omitted (no expiry), got {cfg.ttl_s}")
    if cfg.pool_size < 1:
        raise ValueError(f"{cfg.kind} tier: pool_size must be >= 1, got {cfg.pool_size}")
    if cfg.socket_timeout_s <= 0 or cfg.connect_timeout_s <= 0:
        raise ValueError(f"{cfg.kind} tier: socket_timeout_s and connect_timeout_s must be > 0")
    if not 0 < cfg.backoff_initial_s <= cfg.backoff_max_s:
        raise ValueError(
            f"{cfg.kind} tier: need 0 < backoff_initial_s <= backoff_max_s, "
            f"got {cfg.backoff_initial_s} and {cfg.backoff_max_s}"
        )


TierConfig = CpuTierConfig | DiskTierConfig | RedisTierConfig | RedisClusterTierConfig
TIER_CONFIGS: dict[str, type] = {
    "cpu": CpuTierConfig,
    "disk": DiskTierConfig,
    "redis": RedisTierConfig,
    "redis-cluster": RedisClusterTierConfig,
}


def tier_config_class(kind: str) -> type:
    """The config class of a tier kind; ValueError lists the valid kinds."""
    try:
        return TIER_CONFIGS[kind]
    except KeyError:
        raise ValueError(f"unknown tier kind {kind!r}; valid kinds are: {', '.join(TIER_CONFIGS)}") from None


def tier_display_name(cfg: TierConfig) -> str:
    """The name a tier reports in stats: `name` when set, else its kind."""
    return cfg.name or cfg.kind


@dataclass(frozen=True)
class StoreConfig:
    """The tiered KV store: tiers are consulted in order (fastest first)."""

    namespace: str = ""  # prefix of every key; separates caches sharing a tier
    kv_dtype: str = "float16"  # storage dtype: float16 | bfloat16 | float32
    tiers: tuple[TierConfig, ...] = (CpuTierConfig(),)
    write_queue: int = 64  # background writes queued before put() blocks
    promote: bool = True  # copy hits in lower tiers into the tiers above
    secret: str | None = field(default=None, repr=False)  # HMAC key: entries must carry a valid tag (never printed)

    def __post_init__(self) -> None:
        check_dtype(self.kv_dtype, "store.kv_dtype")
        if not _NAMESPACE_RE.match(self.namespace):
            raise ValueError(
                f"store.namespace: {self.namespace!r} must be up to 64 characters from A-Z a-z 0-9 _ . (not starting with .)"
            )
        if self.write_queue < 1:
            raise ValueError(f"store.write_queue must be >= 1, got {self.write_queue}")
        if not self.tiers:
            raise ValueError("store.tiers is empty; configure at least one tier, e.g. - {kind: cpu, budget: 2GiB}")
        seen: dict[str, int] = {}
        for i, tier in enumerate(self.tiers):
            if not isinstance(tier, tuple(TIER_CONFIGS.values())):
                raise ValueError(f"store.tiers[{i}]: expected a tier config, got {tier!r}")
            name = tier_display_name(tier)
            if name in seen:
                raise ValueError(
                    f"store.tiers[{i}]: tier name {name!r} is already used by store.tiers[{seen[name]}]; "
                    "give one of them a distinct `name:`"
                )
            seen[name] = i

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None, where: str = "store") -> StoreConfig:
        """Build from the YAML `store:` mapping; each tier is chosen by its `kind`."""
        return from_mapping(cls, data, where)

    def validate_for(self, entry_bytes: int) -> None:
        """Check that every budgeted tier can hold one entry of `entry_bytes` bytes.

        The engine calls this with the size of one chunk entry (see
        `storage.entry.entry_nbytes`). Raises ValueError naming the tier, its budget, the
        entry size and the setting to change. Does not touch any tier.
        """
        for i, tier in enumerate(self.tiers):
            budget = getattr(tier, "budget", None)
            if budget is not None and budget < entry_bytes:
                raise ValueError(
                    f"store.tiers[{i}] ({tier_display_name(tier)}): budget {format_bytes(budget)} is smaller "
                    f"than one chunk entry ({format_bytes(entry_bytes)}, {entry_bytes} bytes); set its budget "
                    f"to at least {format_bytes(entry_bytes)} (a useful cache holds many entries, e.g. "
                    f"{format_bytes(entry_bytes * 64)}) or remove the tier"
                )
