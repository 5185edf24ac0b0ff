"""`KVBlendConnector`: kvblend's tiered store behind vLLM's KV connector API (v1).

Loaded by vLLM with
  --kv-transfer-config '{"kv_connector":"KVBlendConnector","kv_connector_module_path":"blend.vllm.connector",
                         "kv_role":"kv_both","kv_load_failure_policy":"recompute",
                         "kv_connector_extra_config":{"config":"PATH"}}'
where PATH is a kvblend YAML: its `store:` section names the store (tiers, codecs, secret,
namespace), `engine.blend.load_stall_s` the longest a request waits on it.

Scheduler side (vLLM's scheduler process), no tensor read there:
- `get_num_new_matched_tokens`: the longest run of the prompt's full blocks, beyond vLLM's own
  prefix cache, whose entries the store holds (blend.vllm.blocks: content keys over the token chain).
  The header lookups run on a thread of their own: vLLM is answered None ("ask again") meanwhile,
  0 once they take longer than the stall, so a slow store never blocks a step. The scheduler process
  sees the shared tiers (disk, redis, redis-cluster); a `cpu` tier lives in the worker's process,
  which reports the keys it stored there (`KVBlendWorkerMeta`).
- loads are asynchronous (vLLM holds the request in WAITING_FOR_REMOTE_KVS until the worker's
  `get_finished` reports it); `build_connector_meta` hands the worker each step's loads, and each
  newly full block of the prompt the step computes (every chunk of a chunked prefill) to save.

Worker side (the model runner's process):
- a load is a job on the loader thread: per block the header looked up again and verified (model,
  tokens, positions, dims, dtype; sealed when the store has a secret), then layer by layer every
  block's layer read (storage.stack.read_layer_into) and copied into vLLM's paged cache, the next
  layer's reads under way while vLLM runs other requests. A block that misses, fails its checksum or
  does not arrive is reported in `get_block_ids_with_load_errors` (vLLM recomputes from the first
  one); a job past the stall is abandoned (it never writes the cache afterwards) and reported so.
- saves: `save_kv_layer` notes each layer's view of the blocks to save as the layer's attention
  has written them; `wait_for_save` (end of the forward) copies each block into one entry
  (blend.vllm.layout) and hands it to the store's write-behind queue (a full queue waits at most
  `PUT_WAIT_S`, then the write is dropped: a later miss, never a stalled forward).
- preemption: vLLM frees a preempted request's blocks; what was saved was copied in its own step,
  and a resumed request is looked up again. Aborted requests: a load in flight keeps its blocks
  (`request_finished` -> True) until the worker reports the job ended.

Counters (hits, tokens loaded and saved, load errors, bytes, seconds) go to vLLM's `/metrics` as
`kvblend:connector_*` (`KVBlendPromMetrics`) and to its log; the tokens loaded are also in vLLM's
own `vllm:external_prefix_cache_hits`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from blend.config import kvblend_home, load_config
from blend.vllm.blocks import BlockNames, model_fingerprint
from blend.vllm.layout import block_views, cache_dims, write_block
from storage.config import StoreConfig
from storage.dtypes import dtype_name
from storage.entry import KVEntry
from storage.serialization import layer_views
from storage.stack import TieredStore

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvblend_connector")  # under vllm.: vLLM's handler prints it

PUT_WAIT_S = 0.05  # a save that finds the store's write queue full waits this long, then is dropped
WORKER_KEYS_KEPT = 1 << 16  # keys of the worker's cpu tier the scheduler remembers (oldest forgotten)
COUNTERS = ("hit_blocks", "tokens_loaded", "tokens_saved", "blocks_saved", "saves_dropped",
            "load_errors", "loads_abandoned", "bytes_loaded", "bytes_saved", "load_s", "save_s")


# ---------------------------------------------------------------------------- metadata
@dataclass
class LoadBlock:
    block_id: int  # vLLM's block
    index: int  # the block's place in the prompt (0-based)
    key: str


@dataclass
class LoadJob:
    req_id: str
    tokens: list[int]  # the prompt's tokens up to the last block loaded
    blocks: list[LoadBlock]
    deadline: float  # time.time() after which the job is abandoned (its blocks reported failed)
    failed: bool = False  # nothing to read: reported failed at once


@dataclass
class SaveBlock:
    block_id: int
    index: int
    key: str
    tokens: list[int]  # the block's own tokens


@dataclass
class KVBlendMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveBlock] = field(default_factory=list)


@dataclass
class KVBlendWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker tells the scheduler after a step: keys it stored in its own process's tiers."""

    saved: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KVBlendWorkerMeta):
            return KVBlendWorkerMeta(self.saved + other.saved)
        return self


# ---------------------------------------------------------------------------- metrics
@dataclass
class KVBlendStats(KVConnectorStats):
    """The connector's counters over an interval (`COUNTERS`), summed across workers."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(v, 4) if isinstance(v, float) else v for name, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVBlendPromMetrics(KVConnectorPromMetrics):
    """`kvblend:connector_<counter>` Prometheus counters, one per `COUNTERS` entry."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name in COUNTERS:
            counter = self._counter_cls(name=f"kvblend:connector_{name}",
                                        documentation=f"kvblend KV connector: {name.replace('_', ' ')}",
                                        labelnames=labelnames)
            self.counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine and value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)


# ---------------------------------------------------------------------------- the connector
def _store_config(extra: dict[str, Any]) -> tuple[StoreConfig, float, str | None]:
    """The store section, the stall and the config's path from the connector's extra config."""
    path = extra.get("config")
    if path is not None and not isinstance(path, str):
        raise ValueError("kv_connector_extra_config.config must be the path of a kvblend YAML file")
    config = load_config(path)
    stall = float(config.engine.blend.load_stall_s) or 30.0  # 0 ("wait") still bounded here
    return config.store, stall, path


@dataclass
class _Lookup:
    first: int  # the first block looked up
    future: Future
    started: float


@dataclass
class _Request:
    tokens: list[int]  # the prompt
    block_ids: list[int] = field(default_factory=list)


class KVBlendConnector(KVConnectorBase_V1):
    """kvblend's store as vLLM's external KV cache (see the module docstring)."""

    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        if getattr(transfer, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvblend connector: kv_load_failure_policy is %r: a block that fails to load fails its "
                        "request; set \"kv_load_failure_policy\":\"recompute\" to recompute it instead",
                        transfer.kv_load_failure_policy)
        store_config, self._stall_s, self._config_path = _store_config(transfer.kv_connector_extra_config or {})
        model = vllm_config.model_config
        self._block_size = int(vllm_config.cache_config.block_size)
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", None):
            raise ValueError(f"kvblend connector: --kv-cache-dtype {cache_dtype} is not supported (entries hold "
                             "vLLM's KV exactly): leave it at auto")
        self._kv_dtype = dtype_name(model.dtype)
        self._layers = model.get_num_layers(vllm_config.parallel_config)
        self._kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
        self._head_dim = model.get_head_size()
        self._names = BlockNames(model_fingerprint(model.model, kvblend_home()), self._kv_dtype, self._block_size,
                                 store_config.key_namespace)
        self._lock = threading.Lock()
        self._counts: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            # the tiers this process can see: a cpu tier is the worker's own memory
            shared = tuple(t for t in store_config.tiers if t.kind != "cpu")
            self._store = TieredStore.from_config(_with_tiers(store_config, shared)) if shared else None
            self._lookups: dict[str, _Lookup] = {}
            self._running: dict[Future, float] = {}  # lookups under way (also those given up on), when begun
            self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="kvblend-lookup")
            self._found: dict[str, tuple[int, int, float]] = {}  # req_id -> (first block, blocks hit, when)
            self._pending_loads: dict[str, LoadJob] = {}
            self._loading: set[str] = set()
            self._requests: dict[str, _Request] = {}
            self._worker_keys: OrderedDict[str, None] = OrderedDict()
        else:
            self._store = TieredStore.from_config(store_config, put_wait_s=PUT_WAIT_S)
            self._caches: list[torch.Tensor] = []
            self._layer_of: dict[str, int] = {}
            self._layout = ""
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvblend-load")
            self._jobs: dict[str, tuple[LoadJob, Future, threading.Event]] = {}
            self._write_lock = threading.Lock()  # a job's writes into the cache vs its abandonment
            self._load_errors: set[int] = set()
            self._staged: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
            self._saved_keys: list[str] = []
        log.info("kvblend connector (%s): store %s, block %d, %s, stall %.1f s, config %s", role.name,
                 ", ".join(t.kind for t in store_config.tiers), self._block_size, self._kv_dtype, self._stall_s,
                 self._config_path or "default")

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def _count(self, **deltas: float) -> None:
        with self._lock:
            for name, value in deltas.items():
                self._counts[name] = self._counts.get(name, 0) + value

    # ====================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        tokens = list(request.prompt_token_ids or [])
        usable = (len(tokens) - 1) // self._block_size  # the last token is always computed
        first = num_computed_tokens // self._block_size
        if first >= usable:
            return 0, False
        rid = request.request_id
        lookup = self._lookups.get(rid)
        if lookup is None or lookup.first != first:
            if self._stuck():
                return 0, False
            lookup = _Lookup(first, self._lookup_pool.submit(self._find, tokens, first, usable), time.time())
            self._lookups[rid] = lookup
            self._running[lookup.future] = lookup.started
        if not lookup.future.done():
            if time.time() - lookup.started > self._stall_s:
                log.warning("kvblend connector: the store's lookups for request %s took over %.1f s; computed",
                            rid, self._stall_s)
                return 0, False
            return None, False
        try:
            hits = lookup.future.result()
        except Exception as err:  # noqa: BLE001 - a store that fails is a miss, logged
            log.warning("kvblend connector: lookup failed (%s: %s); computed", type(err).__name__, err)
            hits = 0
        self._found[rid] = (first, hits, lookup.started)
        return (hits * self._block_size, True) if hits else (0, False)

    def _stuck(self) -> bool:
        """Whether a lookup has been running past the stall (the store hangs): new requests then
        compute without asking it."""
        now = time.time()
        for future in [f for f in self._running if f.done()]:
            del self._running[future]
        return any(now - started > self._stall_s for started in self._running.values())

    def _find(self, tokens: list[int], first: int, usable: int) -> int:
        """How many consecutive blocks from `first` the store holds (header lookups, verified)."""
        hits = 0
        for b in range(first, usable):
            key = self._names.key(tokens, b)
            with self._lock:
                known = key in self._worker_keys
            if not known:
                if self._store is None:
                    break
                expected = self._names.expected(tokens, b, num_layers=self._layers, kv_heads=self._kv_heads,
                                                head_dim=self._head_dim)
                if self._store.lookup(key, expected) is None:
                    break
            hits += 1
        return hits

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        rid = request.request_id
        found = self._found.pop(rid, None)
        self._lookups.pop(rid, None)
        if num_external_tokens <= 0 or found is None or rid in self._loading:
            return
        first, hits, started = found
        count = num_external_tokens // self._block_size
        block_ids = blocks.get_block_ids()[0]
        tokens = list(request.prompt_token_ids or [])
        broken = count > hits or first + count > len(block_ids)
        if broken:  # vLLM waits for this load all the same: the worker reports it failed at once
            log.warning("kvblend connector: request %s: %d blocks allocated for %d external tokens from block "
                        "%d; not loaded, recomputed", rid, len(block_ids), num_external_tokens, first)
            count = max(0, min(count, len(block_ids) - first))
        loads = [LoadBlock(block_ids[b], b, self._names.key(tokens, b)) for b in range(first, first + count)]
        # the request waits at most the stall from its lookup's start (at least a second for the reads)
        deadline = max(started + self._stall_s, time.time() + 1.0)
        self._pending_loads[rid] = LoadJob(rid, tokens[:(first + count) * self._block_size], loads, deadline, broken)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVBlendMetadata(loads=list(self._pending_loads.values()))
        self._loading.update(self._pending_loads)
        self._pending_loads.clear()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            state = _Request(list(new.prompt_token_ids or []), list(new.block_ids[0]))
            self._requests[new.req_id] = state
            self._saves(meta, state, new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._requests.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                state.block_ids.extend(new_ids[0])
            self._saves(meta, state, cached.num_computed_tokens[i], scheduled.get(rid, 0))
        return meta

    def _saves(self, meta: KVBlendMetadata, state: _Request, computed: int, scheduled: int) -> None:
        """The prompt's blocks that become full in this step: [computed, computed + scheduled)."""
        bs = self._block_size
        end = min(computed + scheduled, len(state.tokens))
        for b in range(computed // bs, end // bs):
            if (b + 1) * bs <= computed or b >= len(state.block_ids):
                continue
            meta.saves.append(SaveBlock(state.block_ids[b], b, self._names.key(state.tokens, b),
                                        state.tokens[b * bs:(b + 1) * bs]))

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVBlendWorkerMeta) and meta.saved:
            with self._lock:
                for key in meta.saved:
                    self._worker_keys[key] = None
                    self._worker_keys.move_to_end(key)
                while len(self._worker_keys) > WORKER_KEYS_KEPT:
                    self._worker_keys.popitem(last=False)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._found.pop(rid, None)
        self._lookups.pop(rid, None)
        if self._pending_loads.pop(rid, None) is not None:
            return False, None  # never sent to the worker
        return rid in self._loading, None  # a load in flight keeps the blocks until the worker ends it

    # ====================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        first = kv_caches[names[0]]
        self._layout = "cpu" if first.dim() == 4 else "flash"
        _, heads, size, dim = cache_dims(first, self._layout)
        if (heads, size, dim) != (self._kv_heads, self._block_size, self._head_dim) or len(names) != self._layers:
            raise ValueError(f"kvblend connector: {len(names)} KV caches of {tuple(first.shape)} do not match the "
                             f"model's {self._layers} layers x {self._kv_heads} KV heads x {self._head_dim} in blocks "
                             f"of {self._block_size} ({self._layout} layout)")
        if dtype_name(first.dtype) != self._kv_dtype:
            raise ValueError(f"kvblend connector: KV cache dtype {first.dtype}, the model's {self._kv_dtype}")
        self._caches = [kv_caches[n] for n in names]
        self._layer_of = {n: i for i, n in enumerate(names)}
        log.info("kvblend connector: %d layers of %s KV cache (%s layout)", len(names), tuple(first.shape),
                 self._layout)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVBlendMetadata):
            return
        for job in meta.loads:
            self._count(hit_blocks=len(job.blocks))
            abandoned = threading.Event()
            self._jobs[job.req_id] = (job, self._loader.submit(self._load, job, abandoned), abandoned)

    def _load(self, job: LoadJob, abandoned: threading.Event) -> list[int]:
        """Read a job's blocks layer by layer into the paged cache; returns the block ids that failed
        (from the first block that misses or breaks: vLLM recomputes from there)."""
        t0 = time.monotonic()
        if job.failed:
            self._count(load_errors=len(job.blocks))
            return [b.block_id for b in job.blocks]
        store, names = self._store, self._names
        located = []
        for blk in job.blocks:
            if abandoned.is_set():
                break
            expected = names.expected(job.tokens, blk.index, num_layers=self._layers, kv_heads=self._kv_heads,
                                      head_dim=self._head_dim)
            hit = store.lookup(blk.key, expected)
            if hit is None:
                break
            located.append(hit)
        good = len(located)
        buf = None
        for layer in range(self._layers):
            for j in range(good):
                if abandoned.is_set():
                    return [b.block_id for b in job.blocks]
                hit = located[j]
                if buf is None or buf.numel() != hit.header.layer_nbytes:
                    buf = torch.empty(hit.header.layer_nbytes, dtype=torch.uint8)
                if not store.read_layer_into(hit, layer, buf):
                    good = j
                    break
                k, v = layer_views(buf, hit.header)
                if not hit.header.codec.raw:
                    from storage.entry import decode_layer

                    k, v = decode_layer(hit.header, k, v)
                with self._write_lock:
                    if abandoned.is_set():
                        return [b.block_id for b in job.blocks]
                    write_block(self._caches[layer], job.blocks[j].block_id, self._layout, k, v)
        failed = [b.block_id for b in job.blocks[good:]]
        per_block = located[0].header.layer_nbytes * self._layers if located else 0
        self._count(tokens_loaded=good * self._block_size, bytes_loaded=good * per_block,
                    load_errors=len(failed), load_s=time.monotonic() - t0)
        if failed:
            log.warning("kvblend connector: request %s: %d of %d blocks did not load (missing, corrupt or "
                        "unreachable); vLLM recomputes them", job.req_id, len(failed), len(job.blocks))
        return failed

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once get_finished reported its load

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVBlendMetadata) or not meta.saves:
            return
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for save in meta.saves:  # views: the block stays as this layer wrote it until the step ends
            self._staged.setdefault(save.key, {})[layer] = block_views(kv_layer, save.block_id, self._layout)

    def wait_for_save(self) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, KVBlendMetadata) or not meta.saves:
            self._staged.clear()
            return
        t0 = time.monotonic()
        saved = dropped = nbytes = 0
        for save in meta.saves:
            layers = self._staged.pop(save.key, {})
            if len(layers) != self._layers:
                continue  # a layer not seen (should not happen): not stored
            entry = KVEntry.from_tensors([layers[i] for i in range(self._layers)], fingerprint=self._names.fingerprint,
                                         token_ids=save.tokens, pos_start=save.index * self._block_size,
                                         kv_dtype=self._kv_dtype)
            before = self._store.puts_dropped
            try:
                self._store.put(save.key, entry, exact=True)
            except Exception as err:  # noqa: BLE001 - a store that fails loses the save, never the request
                log.warning("kvblend connector: save of a block failed (%s: %s)", type(err).__name__, err)
                dropped += 1
                continue
            if self._store.puts_dropped > before:
                dropped += 1
                continue
            saved += 1
            nbytes += entry.nbytes
            self._saved_keys.append(save.key)
        self._staged.clear()
        self._count(blocks_saved=saved, tokens_saved=saved * self._block_size, saves_dropped=dropped,
                    bytes_saved=nbytes, save_s=time.monotonic() - t0)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        now = time.time()
        for rid, (job, future, abandoned) in list(self._jobs.items()):
            if future.done():
                try:
                    failed = future.result()
                except Exception as err:  # noqa: BLE001 - a load that fails is a recompute
                    log.warning("kvblend connector: load of request %s failed (%s: %s); recomputed", rid,
                                type(err).__name__, err)
                    failed = [b.block_id for b in job.blocks]
                    self._count(load_errors=len(failed))
            elif now > job.deadline:
                with self._write_lock:
                    abandoned.set()  # the job writes nothing into the cache after this
                log.warning("kvblend connector: load of request %s took over %.1f s; abandoned, recomputed", rid,
                            self._stall_s)
                failed = [b.block_id for b in job.blocks]
                self._count(load_errors=len(failed), loads_abandoned=1)
            else:
                continue
            self._load_errors.update(failed)
            done.add(rid)
            del self._jobs[rid]
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._saved_keys:
            return None
        meta, self._saved_keys = KVBlendWorkerMeta(self._saved_keys), []
        return meta

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._lock:
            counts, self._counts = self._counts, {}
        return KVBlendStats(data=counts) if any(counts.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVBlendStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KVBlendPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        """Queued writes flushed (at most EXIT_FLUSH_S), the store closed."""
        store = getattr(self, "_store", None)
        if store is not None:
            from storage.stack import EXIT_FLUSH_S

            store.close(timeout=EXIT_FLUSH_S)


def _with_tiers(config: StoreConfig, tiers: tuple) -> StoreConfig:
    """`config` with other tiers (a frozen pydantic dataclass)."""
    import dataclasses

    return dataclasses.replace(config, tiers=tiers)
