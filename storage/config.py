"""Configuration models shared by every component, and the YAML loader.

Component configs are frozen pydantic dataclasses (`config_dataclass`): every construction
validates, unknown keys are rejected, and `dataclasses.replace` / `dataclasses.fields` keep
working. `from_mapping(cls, data, where)` builds one from a YAML mapping; each problem is
one line naming its key path, e.g. `configs/x.yaml: store.tiers[1].budget: must be > 0, got 0`.
Byte sizes accept "2GiB" (storage.units). Tiers are chosen by their `kind`; each tier config
names the class that implements it (`storage.tier.tier_class` imports it on demand).
Importing this module imports neither torch nor redis.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, TypeVar
from urllib.parse import urlsplit

import pydantic.dataclasses
import yaml
from pydantic import (
    AfterValidator,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
)

from storage.codec import CODEC_NAMES
from storage.dtypes import DTYPE_NAMES
from storage.keys import check_namespace, store_namespace
from storage.units import GIB, format_bytes, parse_bytes  # noqa: F401 - re-exported for config users

T = TypeVar("T")


# ----------------------------------------------------------------------------- models
def config_dataclass(cls: type[T]) -> type[T]:
    """Make `cls` a frozen, validating, keyword-only dataclass that rejects unknown keys and
    NaN/inf; a failed construction raises ValueError with one line per problem."""
    cls = pydantic.dataclasses.dataclass(frozen=True, kw_only=True,
                                         config=ConfigDict(extra="forbid", allow_inf_nan=False))(cls)
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            init(self, *args, **kwargs)
        except ValidationError as err:
            raise ValueError(format_errors(err, cls, cls.__name__)) from None

    cls.__init__ = __init__
    return cls


def _local_path(value: str, info: ValidationInfo) -> str:
    """A directory path: `~` expanded, a relative path resolved against the config file's
    directory (validation context `base_dir`); an existing non-directory is an error."""
    if not value:
        raise ValueError("is empty; give a directory (created if missing)")
    path = Path(value).expanduser()
    base = (info.context or {}).get("base_dir")
    if base is not None and not path.is_absolute():
        path = Path(base) / path
    if path.exists() and not path.is_dir():
        raise ValueError(f"{str(path)!r} exists and is not a directory; point it at a directory (created if missing)")
    return str(path)


def _redis_url(url: str) -> str:
    form = "use redis://[user:password@]host:port[/db] or rediss:// for TLS"
    shown = re.sub(r"(?<=:)[^:/@]*(?=@)", "***", url)  # never echo a password
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"{shown!r} is not a Redis URL; {form}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # a bad port, or an unclosed IPv6 bracket
        parts = None
    if parts is None or port == 0 or (not parts.hostname and not parts.path.strip("/")):
        raise ValueError(f"{shown!r}: the host or port is not valid (a port is 1..65535); {form}")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"{shown!r}: the database {db!r} is not a number; {form}")
    return url


def _tier_name(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_.-]{0,64}", name):
        raise ValueError(f"{name!r}: use up to 64 characters from A-Z a-z 0-9 _ . -")
    return name


def _secret(value: str) -> str:
    if len(value) < 16:
        raise ValueError("must be at least 16 characters (a random string, e.g. `openssl rand -hex 32`), or omitted")
    return value


# Field types: numbers are strict (no bools, no numeric strings; ints are accepted as floats).
PositiveInt = Annotated[int, Strict(), Field(ge=1)]
PositiveFloat = Annotated[float, Strict(), Field(gt=0)]
NonNegativeFloat = Annotated[float, Strict(), Field(ge=0)]
Ratio = Annotated[float, Strict(), Field(ge=0, le=1)]
Bytes = Annotated[int, BeforeValidator(lambda v: parse_bytes(v, "")), Field(gt=0)]  # 4096, "16KiB", "2GiB"
LocalPath = Annotated[StrictStr, AfterValidator(_local_path)]
DType = Literal[DTYPE_NAMES]  # type: ignore[valid-type]
CodecName = Literal[CODEC_NAMES]  # type: ignore[valid-type]
Section = BeforeValidator(lambda v: {} if v is None else v)  # an empty YAML section means defaults
TierName = Annotated[StrictStr, AfterValidator(_tier_name)]
RedisUrl = Annotated[StrictStr, AfterValidator(_redis_url)]


# ------------------------------------------------------------------------------ tiers
@config_dataclass
class CpuTierConfig:
    """CPU-memory tier: entries kept as tensors, LRU eviction past `budget` bytes."""

    TIER: ClassVar[str] = "storage.memory:CpuTier"
    kind: Literal["cpu"] = "cpu"
    budget: Bytes = 2 * GIB
    codec: CodecName = "none"  # how document entries are held: none | int8 | int4 (storage.codec)
    exact_codec: CodecName = "none"  # how exact entries (prefix blocks, chat sessions) are held
    name: TierName = ""  # display/stats name; defaults to the kind


@config_dataclass
class DiskTierConfig:
    """Local-disk tier: one file per entry under `path`, LRU eviction past `budget` bytes.

    fsync: "never" (default) relies on per-layer checksums: a file torn by a power loss
    fails verification and is deleted, i.e. it becomes a miss. "always" fsyncs each file
    and the directory before publishing it (durable, several ms per entry).
    """

    TIER: ClassVar[str] = "storage.disk:DiskTier"
    kind: Literal["disk"] = "disk"
    path: LocalPath
    budget: Bytes = 20 * GIB
    codec: CodecName = "int8"  # documents: none | int8 | int4 (storage.codec): ~1.9x / ~3.5x more entries in the budget
    # prefix blocks and chat sessions: none keeps them exact (prefix mode and chat resume equal computing them)
    exact_codec: CodecName = "none"
    fsync: Literal["always", "never"] = "never"
    required: StrictBool = False  # true: failed writes raise StoreUnavailable instead of being counted
    name: TierName = ""


@config_dataclass
class _RedisOptions:
    """What the Redis and Redis Cluster tiers share: key prefix, expiry, timeouts, pool, backoff."""

    key_prefix: StrictStr = "kvblend:"
    codec: CodecName = "int8"  # documents: none | int8 | int4 (storage.codec): fewer bytes over the network and in memory
    exact_codec: CodecName = "none"  # prefix blocks and chat sessions: none keeps them exact
    ttl_s: PositiveFloat | None = None  # expire entries after this many seconds; None: never
    required: StrictBool = False  # true: an unreachable server raises StoreUnavailable
    socket_timeout_s: PositiveFloat = 2.0
    connect_timeout_s: PositiveFloat = 1.0
    pool_size: PositiveInt = 16
    backoff_initial_s: PositiveFloat = 0.5
    backoff_max_s: PositiveFloat = 30.0
    name: TierName = ""

    def __post_init__(self) -> None:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError(f"need backoff_initial_s <= backoff_max_s, got {self.backoff_initial_s} and "
                             f"{self.backoff_max_s}")


@config_dataclass
class RedisTierConfig(_RedisOptions):
    """Redis tier: per-layer keys, pipelined writes, down-marking with exponential backoff."""

    TIER: ClassVar[str] = "storage.redis_tier:RedisTier"
    kind: Literal["redis"] = "redis"
    url: RedisUrl = "redis://127.0.0.1:6379/0"


@config_dataclass
class RedisClusterTierConfig(_RedisOptions):
    """Redis Cluster tier: startup node URLs; keys of one entry share a hash slot."""

    TIER: ClassVar[str] = "storage.cluster:RedisClusterTier"
    kind: Literal["redis-cluster"] = "redis-cluster"
    urls: tuple[RedisUrl, ...]  # startup nodes, e.g. [redis://127.0.0.1:7000, redis://127.0.0.1:7001]

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.urls:
            raise ValueError("urls is empty; list one or more node URLs, e.g. urls: [redis://127.0.0.1:7000]")


TierConfig = CpuTierConfig | DiskTierConfig | RedisTierConfig | RedisClusterTierConfig
SHARED_KINDS: tuple[str, ...] = ("redis", "redis-cluster")  # tiers other engines (people) may write to
AnyTier = Annotated[TierConfig, Field(discriminator="kind")]
TIER_CONFIGS: dict[str, type] = {cls.kind: cls for cls in typing.get_args(TierConfig)}  # kind -> config class


def tier_config_class(kind: str) -> type:
    """The config class of a tier kind; ValueError lists the valid kinds."""
    try:
        return TIER_CONFIGS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown tier kind {kind!r}; valid kinds are: {', '.join(TIER_CONFIGS)}") from None


def tier_display_name(cfg: TierConfig) -> str:
    """The name a tier reports in stats: `name` when set, else its kind."""
    return cfg.name or cfg.kind


# ------------------------------------------------------------------------------ store
@config_dataclass
class StoreConfig:
    """The tiered KV store: tiers are consulted in order (fastest first)."""

    namespace: Annotated[StrictStr, AfterValidator(check_namespace)] = ""  # prefix of every key; separates caches
    kv_dtype: DType = "float16"  # storage dtype: float16 | bfloat16 | float32
    tiers: tuple[AnyTier, ...] = (CpuTierConfig(),)
    write_queue: PositiveInt = 64  # background writes queued before put() blocks
    promote: StrictBool = True  # copy hits in lower tiers into the tiers above
    # key of the optional HMAC over each entry (env KVBLEND_STORE_SECRET); never printed
    secret: Annotated[StrictStr, AfterValidator(_secret)] | None = Field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("tiers is empty; configure at least one tier, e.g. - {kind: cpu, budget: 2GiB}")
        seen: dict[str, int] = {}
        for i, tier in enumerate(self.tiers):
            name = tier_display_name(tier)
            if name in seen:
                raise ValueError(f"tiers[{i}]: tier name {name!r} is already used by tiers[{seen[name]}]; "
                                 "give one of them a distinct `name:`")
            seen[name] = i

    @classmethod
    def from_mapping(cls, data: dict[str, Any] | None, where: str = "store", base_dir: Path | None = None) -> StoreConfig:
        """Build from the YAML `store:` mapping; each tier is chosen by its `kind`. Relative
        disk paths are resolved against `base_dir` (the config file's directory) if given."""
        return from_mapping(cls, data, where, base_dir)

    @property
    def key_namespace(self) -> str:
        """The namespace the store's keys and tiers use: `namespace`, followed by a digest of the
        secret when there is one (storage.keys.store_namespace): one secret's entries are invisible
        to an engine with another secret, or none."""
        return store_namespace(self.namespace, self.secret)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON, with the secret redacted."""
        return redacted(self)

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


def redacted(config: Any) -> dict[str, Any]:
    """`dataclasses.asdict(config)` with every `secret` that is set shown as "<redacted>"."""

    def scrub(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: "<redacted>" if k == "secret" and v is not None else scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [scrub(v) for v in value]
        return value

    return scrub(dataclasses.asdict(config))


# ------------------------------------------------------------------- building, errors
@functools.cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def from_mapping(cls: type[T], data: Any, where: str = "config", base_dir: Path | None = None) -> T:
    """Build the config dataclass `cls` from a YAML mapping (None: all defaults).

    Nested dataclasses accept mappings, tuples accept lists, byte sizes accept "2GiB",
    relative directory paths are resolved against `base_dir` when given. Raises ValueError
    with one line per problem, each `{where}: {key path}: {what is wrong}`.
    """
    try:
        return _adapter(cls).validate_python({} if data is None else data, context={"base_dir": base_dir})
    except ValidationError as err:
        raise ValueError(format_errors(err, cls, where)) from None


def format_errors(err: ValidationError, root: type, where: str) -> str:
    """One line per error of `err` (raised validating `root`): `{where}: {key path}: {message}`."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        if e["type"] in ("unexpected_keyword_argument", "extra_forbidden", "missing", "missing_argument"):
            loc, key = loc[:-1], loc[-1]  # reported at the mapping that has (or lacks) the key
        else:
            key = None
        path, tp = _walk(root, loc)
        message = _message(e, tp, key)
        lines.append(f"{where}: {path}: {message}" if path else f"{where}: {message}")
    return "\n".join(lines)


_EXPECTED = {"int": "an integer", "float": "a number", "finite": "a finite number", "bool": "true or false",
             "string": "a string", "tuple": "a list", "list": "a list", "dataclass": "a mapping", "dict": "a mapping"}
_BOUNDS = {"greater_than": ("gt", ">"), "greater_than_equal": ("ge", ">="), "less_than": ("lt", "<"),
           "less_than_equal": ("le", "<=")}


def _message(e: dict[str, Any], tp: Any, key: Any) -> str:
    kind, ctx, got = e["type"], e.get("ctx") or {}, _show(e.get("input"))
    if key is not None and kind in ("missing", "missing_argument"):
        return f"missing required key {key!r}"
    if key is not None:
        names = sorted(f.name for f in dataclasses.fields(tp))
        # the closest key here, or of a section below (engine: chunk_tokenz -> chunk_tokens under `blend:`)
        below = {k: home for k in _nested_keys(tp) - set(names) if (home := _nested_home(tp, k)) is not None}
        close = difflib.get_close_matches(str(key), [*names, *below], n=1)
        hint = ""
        if close:
            hint = f"did you mean {close[0]!r}{f' under `{below[close[0]]}:`' if close[0] in below else ''}? "
        home = _nested_home(tp, str(key))
        if home is not None:
            hint = f"it belongs under `{home}:` now; "
        return f"unknown key {key!r}; {hint}valid keys are: {', '.join(names)}"
    if kind.startswith("union_tag"):
        field = ctx.get("discriminator", "'kind'").strip("'")
        found = f"missing `{field}`" if kind == "union_tag_not_found" else f"unknown {field} {ctx.get('tag')!r}"
        plural = {"policy": "policies"}.get(field, field + "s")
        return f"{found}; valid {plural} are: {', '.join(_kinds(tp))}"
    if kind == "value_error":
        return str(ctx["error"])
    if kind in _BOUNDS:
        return f"must be {_BOUNDS[kind][1]} {ctx[_BOUNDS[kind][0]]}, got {got}"
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {got}"
    expected = _EXPECTED.get(kind.split("_")[0])
    return f"expected {expected}, got {got}" if expected else f"{e['msg']}, got {got}"


def _show(value: Any) -> str:
    return "a mapping" if isinstance(value, dict) else repr(value)[:80]


def _nested_home(tp: Any, key: str, depth: int = 2) -> str | None:
    """The section under `tp` (a field whose type is a config dataclass or a union of them,
    `depth` levels down at most) that has a key `key`, as a dotted path (`blend.selection`)."""
    for name, hint in _hints(tp).items():
        inner = _data_type(hint)
        members = [m for m in (typing.get_args(inner) or (inner,)) if dataclasses.is_dataclass(m)]
        if any(key in _hints(m) for m in members):
            return name
    for name, hint in _hints(tp).items() if depth > 1 else ():
        inner = _data_type(hint)
        for member in (m for m in (typing.get_args(inner) or (inner,)) if dataclasses.is_dataclass(m)):
            home = _nested_home(member, key, depth - 1)
            if home is not None:
                return f"{name}.{home}"
    return None


def _nested_keys(tp: Any, depth: int = 2) -> set[str]:
    """The keys of the sections under `tp` (config dataclasses or unions of them), `depth` levels down."""
    keys: set[str] = set()
    for hint in _hints(tp).values():
        inner = _data_type(hint)
        for member in (m for m in (typing.get_args(inner) or (inner,)) if dataclasses.is_dataclass(m)):
            keys |= set(_hints(member)) | (_nested_keys(member, depth - 1) if depth > 1 else set())
    return keys


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, include_extras=True) if dataclasses.is_dataclass(cls) else {}


def _data_type(tp: Any) -> Any:
    """Annotated[X, ...] -> X and X | None -> X."""
    while typing.get_origin(tp) is Annotated or type(None) in typing.get_args(tp):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


TAG_FIELDS = ("kind", "policy")  # the fields that tell the members of a config union apart


def _kinds(tp: Any) -> dict[str, type]:
    """{tag: class} of a discriminated union of config dataclasses, keyed on a member's `kind`
    or `policy` values (a Literal of one or more; empty for other types)."""
    found: dict[str, type] = {}
    for cls in typing.get_args(tp):
        if not dataclasses.is_dataclass(cls):
            continue
        for name in TAG_FIELDS:
            tag = _hints(cls).get(name)
            if tag is not None:
                found.update({value: cls for value in typing.get_args(_data_type(tag))})
                break
    return found


def _walk(root: type, loc: tuple) -> tuple[str, Any]:
    """The key path (`store.tiers[1].budget`) of pydantic location `loc` under `root`, and the type there."""
    path, tp = "", root
    for item in loc:
        tp = _data_type(tp)
        if isinstance(item, int):
            path, tp = f"{path}[{item}]", (typing.get_args(tp) or (None,))[0]
        elif item in _kinds(tp):
            tp = _kinds(tp)[item]  # a union tag: part of pydantic's location, not of the file
        else:
            path, tp = f"{path}.{item}".lstrip("."), _hints(tp).get(item)
    return path, _data_type(tp)


MAX_CONFIG_BYTES = 1 << 20  # a config is a few hundred bytes; prompts files a few kilobytes
MAX_CONFIG_VALUES = 10_000  # scalars, lists and mappings after YAML aliases are expanded


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """How many values `node` stands for once every alias is expanded (shared nodes are
    counted once per use, computed once); a node that contains itself counts as unbounded."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        return MAX_CONFIG_VALUES + 1
    open_.add(key)
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(child, sizes, open_) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, sizes, open_) + _expanded_size(v, sizes, open_) for k, v in node.value)
    open_.discard(key)
    sizes[key] = size = min(size, MAX_CONFIG_VALUES + 1)
    return size


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML config file into a dict; every error is one line naming the file.

    Bounded: at most MAX_CONFIG_BYTES of text and MAX_CONFIG_VALUES values with aliases
    expanded, so a small file of nested aliases ("billion laughs") is refused at once."""
    p = Path(path)
    if not p.is_file():
        problem = "is not a file" if p.exists() else "not found"
        raise FileNotFoundError(f"config file {str(p)!r} {problem}; pass --config with the path of a YAML file")
    size = p.stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{p}: {size} bytes is too large for a config (at most {MAX_CONFIG_BYTES}); "
                         "check that --config names the YAML config")
    try:
        loader = yaml.SafeLoader(p.read_text(encoding="utf-8"))
        try:  # compose the node graph, bound it, then build the values from it (one parse)
            root = loader.get_single_node()
            if root is not None and _expanded_size(root, {}, set()) > MAX_CONFIG_VALUES:
                raise ValueError(f"{p}: expands to more than {MAX_CONFIG_VALUES} values once its YAML aliases "
                                 "(*name) are expanded; write the settings out, a config is a few dozen keys")
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not UTF-8 text; save the file as UTF-8") from None
    except RecursionError:
        raise ValueError(f"{p}: nested too deeply to read; a config is a few levels of keys") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{p}: invalid YAML{at}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{p}: the top level of a config must be a mapping of keys, got {data!r:.80}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ValueError(f"{p}: key {bad[0]!r} is not a name; keys are words such as model, engine, store")
    return data
