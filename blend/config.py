"""Engine configuration: a YAML file, or the packaged default, as frozen validated
dataclasses, with KVBLEND_* environment overrides.

Layout of a config file (see configs/default.yaml):
  model, device, dtype      what to load and where
  weights                   which weights the linear layers read (auto | quantized | dequantized)
  engine: BlendConfig       grouped by concern:
    blend:      BlendSettings       chunking, recompute ratio, `selection:` (QuerySelection |
                                    CheckLayerSelection), pipelining, the split, misses
    generation: GenerationSettings  a request's defaults (max_new_tokens, temperature, top_p)
    prompt:     PromptSettings      the RAG template (system_prompt, query_template)
    sessions:   SessionSettings     chat sessions (sessions_dir, idle_seconds, active_budget)
    scheduler:  SchedulerSettings   sharing the model (max_num_seqs, max_active_kv, ...)
  store:  StoreConfig       the KV tiers (storage.config)

The flat `engine:` keys of the layout before the groups (`engine.max_num_seqs`) are still
read, into their group, with one deprecation line each (`regroup_engine`);
`engine.prefill_chunk_tokens` is read without one (the name issue 40 gives it).

Where a config comes from (`load_config`), later wins: the file given (--config), else the
file named by $KVBLEND_CONFIG, else the packaged default `EngineConfig()` (CPU memory plus
a disk tier and chat sessions under `kvblend_home()`); then the KVBLEND_* variables of
ENV_OVERRIDES; then explicit overrides (CLI flags, keyword arguments). Relative directories
in a file (disk tier path, sessions_dir) are resolved against the file's directory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PlainValidator, Strict, StrictBool, StrictStr

from blend.modes import (  # noqa: F401 - MODES, check_mode, check_ratio: re-exported
    CHECK_LAYER_SELECTIONS,
    DEVIATIONS,
    MODES,
    QUERY_SELECTIONS,
    SELECTIONS,
    check_mode,
    check_ratio,
)
from blend.prompt.builder import QA
from storage.config import (
    Bytes,
    CpuTierConfig,
    DiskTierConfig,
    LocalPath,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    Ratio,
    RedisTierConfig,
    Section,
    StoreConfig,
    config_dataclass,
    from_mapping,
    load_yaml,
    redacted,
)
from storage.dtypes import DTYPE_NAMES
from storage.units import parse_bytes

ComputeDType = Literal[("auto", *DTYPE_NAMES)]  # type: ignore[valid-type]
WeightsPolicy = Literal["auto", "quantized", "dequantized"]  # blend.model.projections.WEIGHTS

log = logging.getLogger(__name__)

CONFIG_ENV = "KVBLEND_CONFIG"
HOME_ENV = "KVBLEND_HOME"
CHUNK_CONTEXTS = ("none", "system")


def kvblend_home() -> Path:
    """Where kvblend keeps caches (converted models, the default disk tier, chat sessions):
    $KVBLEND_HOME, else $XDG_CACHE_HOME/kvblend, else ~/.cache/kvblend. Creates nothing."""
    if os.environ.get(HOME_ENV):
        return Path(os.environ[HOME_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "kvblend"


def _yaml_switch(true_means: str) -> Callable[[Any], Any]:
    """YAML reads a bare `on` / `off` (or true / false) as a boolean: a validator taking it as
    the switch it names (`off`, or `true_means`)."""
    return lambda value: ({False: "off", True: true_means}[value] if isinstance(value, bool) else value)


def _auto_count(value: Any) -> int | str:
    """A whole number >= 1, or "auto"."""
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"must be a whole number >= 1 or auto, got {value!r}")


def _auto_bytes(value: Any) -> int | str:
    """A byte size > 0 (4096, "2GiB"), or "auto"."""
    if value == "auto":
        return value
    size = parse_bytes(value, "")
    if size <= 0:
        raise ValueError(f"must be a size > 0 (e.g. 2GiB) or auto, got {value!r}")
    return size


def _query_template(text: str) -> str:
    try:
        text.format(question="")
    except (KeyError, IndexError, ValueError) as err:
        raise ValueError(f"may only use the placeholder {{question}} ({err}); write a literal brace as {{{{ or }}}}") from None
    return text


def _check_schedule(check_layers: tuple[int, ...], schedule: tuple[float, ...]) -> None:
    layers = list(check_layers)
    if not layers:
        raise ValueError("check_layers must name at least one layer, e.g. [1]")
    if layers != sorted(set(layers)):
        raise ValueError(f"check_layers must be increasing layer indices, got {layers}")
    s = list(schedule)
    if len(s) != len(layers):
        raise ValueError(f"filter_schedule has {len(s)} entries but check_layers has {len(layers)}; give one "
                         "multiplier per check layer, e.g. [2.0, 1.5, 1.0] for [1, 2, 3]")
    if any(b > a for a, b in zip(s, s[1:], strict=False)) or s[-1] != 1.0:
        raise ValueError(f"filter_schedule must be non-increasing and end at 1.0 (the final set is the "
                         f"recompute ratio), got {s}")


CheckLayers = tuple[Annotated[int, Strict(), Field(ge=0)], ...]
StaleShift = Annotated[Literal["auto", "on", "off"], BeforeValidator(_yaml_switch("on"))]


@config_dataclass
class CheckLayerSelection:
    """A check-layer rule (the CacheBlend paper's `deviation`, or `attention`, `hybrid`): every
    row is computed up to the first check layer, where the candidates are ranked on their
    fresh vs loaded K/V (or the query's attention) and the top ones kept."""

    policy: Literal[CHECK_LAYER_SELECTIONS]  # type: ignore[valid-type]
    check_layers: CheckLayers = (1,)  # layers where rows are selected
    # per check layer: the selected fraction = recompute_ratio x this (non-increasing, ends at 1.0)
    filter_schedule: tuple[PositiveFloat, ...] = (1.0,)
    deviation: Literal[DEVIATIONS] = "v"  # type: ignore[valid-type]  # which cached tensor's deviation ranks rows
    # the first k tokens of every document whose KV is not exact at its position are always
    # recomputed (inside the ratio's budget)
    sink_tokens: Annotated[int, Strict(), Field(ge=0)] = 0
    # per layer and KV head, the logit offset between the recomputed rows' stale and fresh keys
    # (as the query rows see them) is subtracted from the scores of the keys left stale, in the
    # recompute and in every decoded token's attention (blend.recompute.stale; docs/EVAL.md)
    stale_bias: StrictBool = True
    # per layer and KV head, the mean offset between the recomputed rows' fresh and loaded K/V
    # (keys un-rotated) is added to the K/V left stale, before `stale_bias` is measured. auto: on,
    # except with `deviation`, whose recomputed rows are the most deviated by construction
    stale_shift: StaleShift = "auto"

    def __post_init__(self) -> None:
        _check_schedule(self.check_layers, self.filter_schedule)

    @property
    def query_layers(self) -> int:
        return 0

    @property
    def query_pool(self) -> float:
        return 1.0

    def with_policy(self, policy: str | None) -> Selection:
        return _with_policy(self, policy)


@config_dataclass
class QuerySelection:
    """Query-driven selection (`query`, the default: it won the MuSiQue dev comparison at every
    ratio, docs/EVAL.md): a query pass runs the query rows over the loaded KV and keeps the
    context rows they attend to most; no full early layers."""

    policy: Literal[QUERY_SELECTIONS] = "query"  # type: ignore[valid-type]
    # layers the query pass runs (0: all); the loads of later layers overlap the recompute
    query_layers: Annotated[int, Strict(), Field(ge=0)] = 0
    # the query pass keeps this many times the budget; the check layers narrow it to the budget
    # by query attention x KV deviation (1.0: no narrowing, the check layers are not used)
    query_pool: Annotated[float, Strict(), Field(ge=1.0, allow_inf_nan=False)] = 1.0
    check_layers: CheckLayers = (1,)  # with query_pool > 1: where the pool is narrowed
    filter_schedule: tuple[PositiveFloat, ...] = (1.0,)
    deviation: Literal[DEVIATIONS] = "v"  # type: ignore[valid-type]  # with query_pool > 1
    sink_tokens: Annotated[int, Strict(), Field(ge=0)] = 0  # as for CheckLayerSelection
    stale_bias: StrictBool = True  # as for CheckLayerSelection
    stale_shift: StaleShift = "auto"  # as for CheckLayerSelection

    def __post_init__(self) -> None:
        _check_schedule(self.check_layers, self.filter_schedule)
        if self.query_layers == 1:
            raise ValueError("query_layers must be 0 (all layers) or >= 2, got 1")

    def with_policy(self, policy: str | None) -> Selection:
        return _with_policy(self, policy)


Selection = QuerySelection | CheckLayerSelection
SHARED_KNOBS = ("check_layers", "filter_schedule", "deviation", "sink_tokens", "stale_bias", "stale_shift")
QUERY_KNOBS = ("query_layers", "query_pool")
SELECTION_KNOBS = (*SHARED_KNOBS, *QUERY_KNOBS)


def _with_policy(selection: Selection, policy: str | None) -> Selection:
    """The selection config of `policy` (None: this one), carrying the shared knobs over."""
    if policy is None or policy == selection.policy:
        return selection
    if policy not in SELECTIONS:
        raise ValueError(f"unknown selection {policy!r}; valid selections are: {', '.join(SELECTIONS)}")
    shared = {k: getattr(selection, k) for k in SHARED_KNOBS}
    return QuerySelection(**shared) if policy in QUERY_SELECTIONS else CheckLayerSelection(policy=policy, **shared)


def _selection_section(value: Any) -> Any:
    """`selection: deviation` (a policy name) is short for `selection: {policy: deviation}`; a
    mapping without `policy` is the default policy's."""
    if isinstance(value, str):
        return {"policy": value}
    if isinstance(value, dict) and "policy" not in value:
        return {"policy": QUERY_SELECTIONS[0], **value}
    return value


SelectionSection = Annotated[QuerySelection | CheckLayerSelection, Field(discriminator="policy"),
                             BeforeValidator(_selection_section)]


@config_dataclass
class BlendSettings:
    """`engine.blend`: how documents are stored, which tokens are recomputed, how loads are pipelined."""

    # block size of a document's stored KV (a document is computed whole, as one sequence)
    chunk_tokens: PositiveInt = 512
    # a longer document is split into consecutive documents of this many tokens (each computed on its own)
    max_document_tokens: PositiveInt = 4096
    recompute_ratio: Ratio = 0.15
    # which rows blend recomputes: a policy and its own knobs (QuerySelection, CheckLayerSelection)
    selection: SelectionSection = Field(default_factory=QuerySelection)
    # layers fetched ahead of compute; loads land in the request's preallocated cache, so depth
    # costs no memory, and a loader that runs ahead finishes early and stops competing for CPU
    prefetch_depth: PositiveInt = 32
    # the longest a request waits for one loaded layer: a tier that answers too slowly is given up
    # (skipped for its backoff where it has one) and the request is computed whole (0: wait forever)
    load_stall_s: NonNegativeFloat = 10.0
    # what each document is computed after: system (the fixed instruction part) | none (standalone);
    # system won on MuSiQue dev (docs/EVAL.md)
    chunk_context: Literal[CHUNK_CONTEXTS] = "system"  # type: ignore[valid-type]
    # load-or-compute split (blend.planning.split): compute a prefix instead of loading it when loads
    # would take longer than compute. auto: decided with a cost model calibrated once and then fixed
    # (deterministic: the same request, the same answer, whatever the load); adaptive: with live
    # estimates (a tier that turns slow is seen; the answer may change with the load); off: load all
    split: Annotated[Literal["auto", "adaptive", "off"], BeforeValidator(_yaml_switch("auto"))] = "auto"
    # a request whose documents miss (blend.planning.misses): auto prices the plans with the split's cost
    # model and runs the cheapest; standalone computes the missing documents on their own, then blends;
    # harvest runs a full prefill of the whole prompt (its answer exact) and stores each missing
    # document's KV cut out of it
    miss_policy: Literal["auto", "standalone", "harvest"] = "auto"
    # harvested documents (their K/V computed after other documents: they blend worse, docs/EVAL.md) are
    # recomputed on their own while the scheduler is idle, one forward pass per step; false keeps them
    recompute_harvested: StrictBool = True


@config_dataclass
class GenerationSettings:
    """`engine.generation`: a request's defaults (each request may give its own)."""

    max_new_tokens: PositiveInt = 32
    temperature: NonNegativeFloat = 0.0
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] = 1.0


@config_dataclass
class PromptSettings:
    """`engine.prompt`: the RAG prompt a question and its documents are laid out in."""

    system_prompt: StrictStr = QA.render_system()  # before the documents (blend.prompt.TEMPLATES['qa'])
    query_template: Annotated[StrictStr, AfterValidator(_query_template)] = QA.query  # after them; may use {question}


@config_dataclass
class SessionSettings:
    """`engine.sessions`: chat sessions (blend.session)."""

    sessions_dir: LocalPath = Field(default_factory=lambda: str(kvblend_home() / "sessions"))  # chat histories
    idle_seconds: NonNegativeFloat = 300.0  # chat sessions idle this long are offloaded from the device (0: after each turn)
    # device-resident chat KV above this offloads the least recently used sessions ("1GiB" accepted)
    active_budget: Bytes = 1 << 30


@config_dataclass
class SchedulerSettings:
    """`engine.scheduler`: how the scheduler (blend.engine.scheduler) shares the model."""

    # sequences decoding together at most (auto: 8 on CPU, 32 on CUDA)
    max_num_seqs: Annotated[int | Literal["auto"], PlainValidator(_auto_count)] = "auto"
    # KV bytes the running sequences may hold on the compute device; growing past it parks the newest
    # sequence's KV in the tiers until there is room (auto: a quarter of the memory free at start)
    max_active_kv: Annotated[int | Literal["auto"], PlainValidator(_auto_bytes)] = "auto"
    # retired: every step now carries every running sequence's decode row and at most one budget of
    # prefill work (`prefill_chunk_tokens`); a value given is ignored with one warning
    prefills_between_decodes: PositiveInt | None = None
    # a step's prefill work while sequences decode: this many rows through every layer (a blend's R rows
    # through g of L layers count R x g / L), every running sequence's decode row alongside
    # (blend.engine.scheduler); prefills are cut at multiples of it. Also read as
    # `engine.prefill_chunk_tokens` (the name issue 40 gives it), without a deprecation line
    prefill_chunk_tokens: PositiveInt = 256
    # background work (harvested documents recomputed standalone) takes all idle time and at most this
    # share of step time while requests wait or decode
    background_share: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    # while sequences decode, a step that carries prefill work takes about this many times a step of
    # the decode rows alone (the gap between a stream's tokens while others prefill; the scheduler
    # measures both); null: only `prefill_chunk_tokens` bounds it
    step_stretch: Annotated[float, Field(gt=1.0)] | None = 6.0
    # a request's answer never depends on what else runs (every row's numbers its own). With AVX-512 VNNI
    # decode rows read a GGUF's packed blocks at every batch size and this costs nothing; elsewhere `weights:
    # auto` then reads the dense weights at every row count (the unpacked blocks for small steps only would
    # make a decode row's bits depend on the batch); false: blocks for steps of few rows there
    batch_invariant: bool = True


@config_dataclass
class BlendConfig:
    """The `engine:` section, grouped by concern: `blend:` (storage, selection, pipelining),
    `generation:` (request defaults), `prompt:` (the RAG template), `sessions:` (chat),
    `scheduler:` (sharing the model). Each key lives in exactly one group (GROUP_OF)."""

    blend: Annotated[BlendSettings, Section] = Field(default_factory=BlendSettings)
    generation: Annotated[GenerationSettings, Section] = Field(default_factory=GenerationSettings)
    prompt: Annotated[PromptSettings, Section] = Field(default_factory=PromptSettings)
    sessions: Annotated[SessionSettings, Section] = Field(default_factory=SessionSettings)
    scheduler: Annotated[SchedulerSettings, Section] = Field(default_factory=SchedulerSettings)

    def check_model_layers(self, num_layers: int) -> None:
        """ValueError if a check layer is beyond a model of `num_layers` layers."""
        layers = self.blend.selection.check_layers
        if layers[-1] >= num_layers:
            raise ValueError(f"engine.blend.selection.check_layers {list(layers)} is beyond the model's {num_layers} "
                             f"layers (0..{num_layers - 1}); use layers below {num_layers}, e.g. [{min(1, num_layers - 1)}]")


ENGINE_GROUPS: dict[str, type] = {  # group -> its settings class (BlendConfig's fields)
    "blend": BlendSettings, "generation": GenerationSettings, "prompt": PromptSettings,
    "sessions": SessionSettings, "scheduler": SchedulerSettings}
# every engine key (a leaf) -> its group; leaves are unique across groups (tests/test_config.py checks it),
# so a flat name (an override, a key of the layout before the groups) says where it lives
GROUP_OF: dict[str, str] = {f.name: group for group, cls in ENGINE_GROUPS.items() for f in dataclasses.fields(cls)}
# flat spellings read without a deprecation line: the contract names of keys that live in a group
FLAT_ALIASES = frozenset({"prefill_chunk_tokens"})


def regroup_engine(data: Any, where: str) -> Any:
    """The config mapping `data` with the `engine:` section's flat keys of the layout before the
    groups (`engine.max_num_seqs`) moved into their group (`engine.scheduler.max_num_seqs`), the
    same value; one deprecation line (a log warning) per key, except FLAT_ALIASES. A key given
    both ways is a one-line ValueError naming both. Other data is returned unchanged."""
    if not isinstance(data, dict) or not isinstance(data.get("engine"), dict):
        return data
    engine = dict(data["engine"])
    flat = [k for k in engine if k in GROUP_OF]
    if not flat:
        return data
    for key in flat:
        group = GROUP_OF[key]
        section = engine.get(group)
        if section is None:
            section = {}
        elif not isinstance(section, dict):
            continue  # validation says `engine.<group>` is not a mapping
        if key in section:
            raise ValueError(f"{where}: engine.{key} and engine.{group}.{key} are both given; keep only "
                             f"engine.{group}.{key}")
        if key not in FLAT_ALIASES:
            log.warning("%s: engine.%s is deprecated: write engine.%s.%s", where, key, group, key)
        engine[group] = {**section, key: engine.pop(key)}
    return {**data, "engine": engine}


def _device(name: str) -> str:
    if not re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", name):
        raise ValueError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:<index> or mps")
    return name


def _model(name: str) -> str:
    """A model alias, `random:<shape>` or local path; a local directory's config.json must be JSON."""
    if not name.strip():
        raise ValueError("is empty; give an alias such as smollm2-135m-instruct or a local model directory")
    config_json = Path(name).expanduser() / "config.json"
    if config_json.is_file():
        try:
            json.loads(config_json.read_text(encoding="utf-8"))
        except (ValueError, OSError, RecursionError) as err:
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"{config_json}: not a valid model config.json ({reason}); restore the model's "
                             "files or point model at another directory") from None
    return name


def default_store() -> StoreConfig:
    """The packaged default store: 2GiB of CPU memory, then 20GiB of disk under kvblend_home()."""
    return StoreConfig(tiers=(CpuTierConfig(), DiskTierConfig(path=str(kvblend_home() / "disk"))))


@config_dataclass
class EngineConfig:
    """The whole config file; `EngineConfig()` is the packaged default."""

    model: Annotated[StrictStr, AfterValidator(_model)] = "smollm2-135m-instruct"
    device: Annotated[StrictStr, AfterValidator(_device)] = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: ComputeDType = "auto"  # compute dtype; auto: bfloat16 where the CPU / GPU computes it natively (auto_dtype)
    # which weights the linear layers read (blend.model.projections): auto: a GGUF model's quantized blocks for
    # decode rows (bfloat16 on a CPU, native kernel), the dequantized weights for prefill and in float32;
    # quantized: the blocks for every row (an error where there are none); dequantized: never the blocks
    weights: WeightsPolicy = "auto"
    engine: Annotated[BlendConfig, Section] = Field(default_factory=BlendConfig)
    store: Annotated[StoreConfig, Section] = Field(default_factory=default_store)

    @classmethod
    def from_mapping(cls, data: Any, where: str = "config", base_dir: Path | None = None) -> EngineConfig:
        """Build from a YAML mapping; errors are one line each, `{where}: {key path}: ...`.
        Relative directories are resolved against `base_dir` when given. Keys of the `engine:`
        layout before its groups are read into their group, one deprecation line each (regroup_engine)."""
        return from_mapping(cls, regroup_engine(data, where), where, base_dir)

    def to_dict(self) -> dict[str, Any]:
        """Plain values for JSON, with the store secret redacted."""
        return redacted(self)

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """Return a copy with overrides applied; keys are top-level fields or engine keys by
        their own name (`max_num_seqs=8` sets engine.scheduler.max_num_seqs).

        `store=` accepts a StoreConfig or a mapping. Unknown keys or bad values raise
        ValueError (unknown keys list the valid ones).
        """
        return _override(self, overrides, "override")


def _override(config: EngineConfig, overrides: dict[str, Any], where: str) -> EngineConfig:
    """`config` with `overrides`: top-level fields, `store`, or engine keys by their own name
    (`max_num_seqs`, each set in its group: GROUP_OF), a selection knob at a time or whole."""
    top_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"engine", "store"}
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    store = config.store
    knobs = {k: overrides[k] for k in SELECTION_KNOBS if k in overrides}
    if "selection" in overrides or knobs:  # the selection section, a knob at a time or whole
        overrides = {k: v for k, v in overrides.items() if k not in knobs}
        groups["blend"] = {"selection": _selection_override(config.engine.blend.selection,
                                                            overrides.pop("selection", None), knobs, where)}
    for key, value in overrides.items():
        if key in top_fields:
            top[key] = value
        elif key in GROUP_OF:
            groups.setdefault(GROUP_OF[key], {})[key] = tuple(value) if isinstance(value, list) else value
        elif key == "store":
            store = value if isinstance(value, StoreConfig) else StoreConfig.from_mapping(value, where=f"{where}: store")
        else:
            valid = ", ".join(sorted(top_fields | set(GROUP_OF) | {"store"}))
            raise ValueError(f"{where}: unknown key {key!r}; valid keys are: {valid}")
    try:
        engine = {group: dataclasses.replace(getattr(config.engine, group), **values) for group, values in groups.items()}
        return dataclasses.replace(config, **top, engine=dataclasses.replace(config.engine, **engine), store=store)
    except ValueError as err:  # "SchedulerSettings: max_num_seqs: ..." -> "{where}: max_num_seqs: ..."
        classes = "|".join(["EngineConfig", "BlendConfig", *(c.__name__ for c in ENGINE_GROUPS.values())])
        raise ValueError(re.sub(rf"(?m)^({classes}): ", f"{where}: ", str(err))) from None


def _selection_override(current: Selection, value: Any, knobs: dict[str, Any], where: str) -> Selection:
    """The selection config after an override: `value` a policy name (its knobs carried over),
    a mapping or a config; `knobs` set on it (one a policy does not have is refused)."""
    if value is None:
        selection = current
    elif isinstance(value, str):
        selection = current.with_policy(value)
    elif isinstance(value, QuerySelection | CheckLayerSelection):
        selection = value
    else:
        selection = from_mapping(BlendSettings, {"selection": value}, where).selection
    if not knobs:
        return selection
    fields = {f.name: getattr(selection, f.name) for f in dataclasses.fields(selection)}
    unknown = [k for k in knobs if k not in fields]
    if unknown:
        raise ValueError(f"{where}: {', '.join(unknown)} is not a knob of selection {selection.policy!r} "
                         f"(only of {', '.join(QUERY_SELECTIONS)}); choose that selection or leave it out")
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in knobs.items()}
    return type(selection)(**(fields | values))


def _set_redis_url(config: EngineConfig, url: str) -> EngineConfig:
    """Point every redis tier at `url`; without one, add a redis tier after the others."""
    tiers = config.store.tiers
    if any(t.kind == "redis" for t in tiers):
        tiers = tuple(dataclasses.replace(t, url=url) if t.kind == "redis" else t for t in tiers)
    else:
        tiers = (*tiers, RedisTierConfig(url=url))
    return _override(config, {"store": dataclasses.replace(config.store, tiers=tiers)}, "KVBLEND_REDIS_URL")


def _set_ratio(config: EngineConfig, text: str) -> EngineConfig:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"KVBLEND_RECOMPUTE_RATIO: expected a number within [0, 1], got {text!r}") from None
    return _override(config, {"recompute_ratio": value}, "KVBLEND_RECOMPUTE_RATIO")


def _whole(text: str, var: str) -> int | str:
    if text.strip() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{var}: expected a whole number >= 1 or auto, got {text!r}") from None


def _positive(text: str, var: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{var}: expected a whole number >= 1, got {text!r}")
    return value


def _setter(key: str, var: str) -> Callable[[EngineConfig, str], EngineConfig]:
    return lambda config, value: _override(config, {key: value}, var)


# Environment variables that override a config (documented in README.md), applied in this order.
ENV_OVERRIDES: dict[str, Callable[[EngineConfig, str], EngineConfig]] = {
    "KVBLEND_MODEL": _setter("model", "KVBLEND_MODEL"),
    "KVBLEND_DEVICE": _setter("device", "KVBLEND_DEVICE"),
    "KVBLEND_DTYPE": _setter("dtype", "KVBLEND_DTYPE"),
    "KVBLEND_WEIGHTS": _setter("weights", "KVBLEND_WEIGHTS"),
    "KVBLEND_RECOMPUTE_RATIO": _set_ratio,
    "KVBLEND_MAX_NUM_SEQS": lambda config, text: _override(config, {"max_num_seqs": _whole(text, "KVBLEND_MAX_NUM_SEQS")},
                                                            "KVBLEND_MAX_NUM_SEQS"),
    "KVBLEND_PREFILL_CHUNK_TOKENS": lambda config, text: _override(
        config, {"prefill_chunk_tokens": _positive(text, "KVBLEND_PREFILL_CHUNK_TOKENS")}, "KVBLEND_PREFILL_CHUNK_TOKENS"),
    "KVBLEND_REDIS_URL": _set_redis_url,
    "KVBLEND_STORE_SECRET": lambda config, secret: _override(
        config, {"store": dataclasses.replace(config.store, secret=secret)}, "KVBLEND_STORE_SECRET"),
}


def apply_env(config: EngineConfig, environ: dict[str, str] | None = None) -> EngineConfig:
    """`config` with the KVBLEND_* overrides that are set (non-empty) in `environ` (default os.environ)."""
    environ = os.environ if environ is None else environ
    for var, apply in ENV_OVERRIDES.items():
        if environ.get(var):
            try:
                config = apply(config, environ[var])
            except ValueError as err:  # "RedisTierConfig: url: ..." -> "KVBLEND_REDIS_URL: url: ..."
                raise ValueError(re.sub(r"(?m)^[A-Z]\w*Config: ", f"{var}: ", str(err))) from None
    return config


@contextlib.contextmanager
def naming_config(path: str | Path | None) -> Iterator[None]:
    """A setting found wrong only once the model or the store is known (a ValueError whose
    message starts with its key path, e.g. `store.tiers[0] ...`) names the config file too,
    as parse errors do."""
    try:
        yield
    except ValueError as err:
        source = str(path) if path else os.environ.get(CONFIG_ENV)
        if source and str(err).startswith(("engine.", "store.")):
            raise ValueError(f"{source}: {err}") from None
        raise


def load_config(path: str | Path | None = None, **overrides: Any) -> EngineConfig:
    """The effective config: the YAML file at `path` (else $KVBLEND_CONFIG, else the packaged
    default), then the KVBLEND_* environment overrides, then `overrides` (top-level or engine
    keys, or store=). Reads files only; creates nothing. ValueError/FileNotFoundError, one
    line per problem, naming the file and key."""
    if path is not None and not isinstance(path, str | os.PathLike):
        raise TypeError(f"config path must be a str or a path, got {type(path).__name__}")
    if isinstance(path, str) and not path.strip():
        raise ValueError("the config path (--config) is empty; give the path of a YAML file, or leave it out "
                         f"for ${CONFIG_ENV} or the built-in default")
    source = str(path) if path else os.environ.get(CONFIG_ENV) or None
    if source is None:
        config = EngineConfig()
    else:
        try:
            data = load_yaml(source)
        except FileNotFoundError as err:
            if path:
                raise
            raise FileNotFoundError(f"{CONFIG_ENV}: {err}") from None
        config = EngineConfig.from_mapping(data, where=source, base_dir=Path(source).resolve().parent)
    config = apply_env(config)
    return config.with_overrides(**overrides) if overrides else config
