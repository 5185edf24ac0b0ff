"""Engine configuration: one YAML file -> frozen dataclasses (unknown keys rejected).

Layout of a config file (see configs/default.yaml):
  model, device, dtype      what to load and where
  engine: BlendConfig       chunking, selection, pipelining, decoding defaults
  store:  StoreConfig       the KV tiers (storage.config)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blend.prompt import QA
from storage.config import StoreConfig, from_mapping, load_yaml

MODES = ("full", "reuse", "prefix", "blend")
DEFAULT_CONFIG = "configs/default.yaml"
CHUNK_CONTEXTS = ("none", "system")

@dataclass(frozen=True)
class BlendConfig:
    """How documents are stored, which tokens are recomputed, how loads are pipelined."""

    chunk_tokens: int = 512  # block size of a document's stored KV (a document is computed whole)
    # a longer document is split into consecutive documents of this many tokens (each computed on its own)
    max_document_tokens: int = 4096
    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    filter_schedule: tuple[float, ...] = (1.0,)
    deviation: str = "v"
    # query (query-driven, no full early layers) | deviation (the paper's rule) | hybrid | attention;
    # query won the MuSiQue dev comparison at every ratio (docs/EVAL.md)
    selection: str = "query"
    # layers fetched ahead of compute; loads land in the request's preallocated cache, so depth
    # costs no memory, and a loader that runs ahead finishes early and stops competing for CPU
    prefetch_depth: int = 32
    # what each document is computed after: system (the fixed instruction part) | none (standalone);
    # system won on MuSiQue dev (docs/EVAL.md)
    chunk_context: str = "system"
    # the first k tokens of every document whose KV is not exact at its position are always
    # recomputed (inside the ratio's budget)
    sink_tokens: int = 0
    # selection `query`: layers the query pass runs (0: all); the loads of later layers overlap the recompute
    query_layers: int = 0
    # selection `query`: the query pass keeps this many times the budget; the check layers narrow it
    # to the budget by query attention x KV deviation (1.0: no narrowing, no check layer)
    query_pool: float = 1.0
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    system_prompt: str = QA.render_system()  # before the documents (blend.prompt.TEMPLATES['qa'])
    query_template: str = QA.query  # after them; may use {question}
    sessions_dir: str = ".kvblend-cache/sessions"  # chat histories (JSON per session)
    idle_seconds: float = 300.0  # chat sessions idle this long are offloaded from the device
    # device-resident chat KV above this offloads the least recently used sessions ("1GiB" accepted)
    active_budget: int = field(default=1 << 30, metadata={"bytes": True})

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"engine.chunk_tokens must be >= 1, got {self.chunk_tokens}")
        check_ratio(self.recompute_ratio)
        if not self.check_layers:
            raise ValueError("engine.check_layers must name at least one layer, e.g. [1]")
        if list(self.check_layers) != sorted(set(self.check_layers)) or self.check_layers[0] < 0:
            raise ValueError(f"engine.check_layers must be increasing layer indices >= 0, got {list(self.check_layers)}")
        if len(self.filter_schedule) != len(self.check_layers):
            raise ValueError(
                f"engine.filter_schedule has {len(self.filter_schedule)} entries but check_layers has "
                f"{len(self.check_layers)}; give one multiplier per check layer, e.g. [2.0, 1.5, 1.0] for [1, 2, 3]"
            )
        s = self.filter_schedule
        if any(b > a for a, b in zip(s, s[1:], strict=False)) or s[-1] != 1.0 or s[-1] <= 0:
            raise ValueError(
                f"engine.filter_schedule must be non-increasing and end at 1.0 (the final set is the "
                f"recompute ratio), got {list(s)}"
            )
        from blend.selector import DEVIATIONS, SELECTIONS  # the policy's registry (imports torch)

        if self.deviation not in DEVIATIONS:
            raise ValueError(f"engine.deviation must be one of {', '.join(DEVIATIONS)}, got {self.deviation!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"engine.selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.chunk_context not in CHUNK_CONTEXTS:
            raise ValueError(f"engine.chunk_context must be one of {', '.join(CHUNK_CONTEXTS)}, got {self.chunk_context!r}")
        if self.max_document_tokens < 1:
            raise ValueError(f"engine.max_document_tokens must be >= 1, got {self.max_document_tokens}")
        if self.sink_tokens < 0:
            raise ValueError(f"engine.sink_tokens must be >= 0, got {self.sink_tokens}")
        if self.query_layers < 0 or self.query_layers == 1:
            raise ValueError(f"engine.query_layers must be 0 (all layers) or >= 2, got {self.query_layers}")
        if not self.query_pool >= 1.0:
            raise ValueError(f"engine.query_pool must be >= 1.0, got {self.query_pool}")
        if self.prefetch_depth < 1:
            raise ValueError(f"engine.prefetch_depth must be >= 1, got {self.prefetch_depth}")
        if self.max_new_tokens < 1:
            raise ValueError(f"engine.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        try:
            self.query_template.format(question="")
        except (KeyError, IndexError, ValueError) as err:
            raise ValueError(f"engine.query_template may only use the placeholder {{question}} ({err})") from None


def check_ratio(ratio: float) -> float:
    if not isinstance(ratio, int | float) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"recompute ratio must be within [0, 1], got {ratio!r}")
    return float(ratio)


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes are: {', '.join(MODES)}")
    return mode


@dataclass(frozen=True)
class EngineConfig:
    """The whole config file."""

    model: str = "smollm2-135m-instruct"
    device: str = "auto"
    dtype: str = "float32"
    engine: BlendConfig = field(default_factory=BlendConfig)
    store: StoreConfig = field(default_factory=StoreConfig)

    @classmethod
    def from_mapping(cls, data: dict[str, Any], where: str = "config") -> EngineConfig:
        data = dict(data)
        data["store"] = StoreConfig.from_mapping(data.pop("store", None) or {}, where=f"{where}.store")
        data["engine"] = from_mapping(BlendConfig, data.pop("engine", None) or {}, f"{where}.engine")
        return from_mapping(cls, data, where)  # rejects unknown top-level keys

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        """Return a copy with overrides applied; keys are top-level fields or engine fields.

        `store=` accepts a StoreConfig or a mapping. Unknown keys raise ValueError listing
        the valid ones.
        """
        top_fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"engine", "store"}
        engine_fields = {f.name for f in dataclasses.fields(BlendConfig)}
        top: dict[str, Any] = {}
        engine: dict[str, Any] = {}
        store = self.store
        for key, value in overrides.items():
            if key in top_fields:
                top[key] = value
            elif key in engine_fields:
                engine[key] = tuple(value) if isinstance(value, list) else value
            elif key == "store":
                store = value if isinstance(value, StoreConfig) else StoreConfig.from_mapping(value)
            else:
                raise ValueError(
                    f"unknown override {key!r}; valid keys are: {', '.join(sorted(top_fields | engine_fields | {'store'}))}"
                )
        return dataclasses.replace(self, **top, engine=dataclasses.replace(self.engine, **engine), store=store)


def load_config(path: str | Path, **overrides: Any) -> EngineConfig:
    """Read a YAML config file; overrides (top-level or engine keys, or store=) win."""
    config = EngineConfig.from_mapping(load_yaml(path), where=str(path))
    return config.with_overrides(**overrides) if overrides else config
