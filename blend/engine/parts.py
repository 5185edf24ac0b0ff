"""An engine's parts built from its config: the model and runner, the store, the document and
prefix caches, the split, the sessions, the prefiller, the request layout, the ingestor and the
scheduler. The one place the engine's settings (`config.engine`) are read to build them; the
caches' keys are in the store's namespace (`TieredStore.namespace`).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import torch

from blend.config import EngineConfig
from blend.decode.generation import eos_ids
from blend.engine.layout import RequestLayout
from blend.engine.prefill import Prefiller
from blend.engine.scheduler import Scheduler, SchedulerConfig
from blend.engine.work import Plans
from blend.kv.documents import DocumentCache
from blend.kv.ingest import Ingestor
from blend.kv.offload import KVParking
from blend.kv.prefix import EntryMaker, PrefixCache
from blend.model import native
from blend.model.loading import LoadedModel, load_model, resolve_device
from blend.model.native import qpack_native
from blend.model.runner import Runner
from blend.planning.planner import LoadCosts, PrefillCosts
from blend.planning.split import Splitter
from blend.prompt.builder import PromptBuilder
from blend.session.manager import SessionManager
from storage.dtypes import dtype_bytes, dtype_name
from storage.stack import TieredStore

log = logging.getLogger(__name__)

ACTIVE_KV_SHARE = 0.25  # max_active_kv auto: this share of the memory free when the engine starts


def default_max_num_seqs(device: torch.device) -> int:
    return 32 if device.type == "cuda" else 8


def free_memory(device: torch.device) -> int:
    """Bytes free on the compute device now (CUDA: the driver's count; else the host's available memory)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


@dataclass(frozen=True)
class EngineParts:
    """What `build_parts` made; the engine holds each part under the same name."""

    lm: LoadedModel
    runner: Runner
    store: TieredStore
    prompts: PromptBuilder
    document_kv: DocumentCache
    prefix_cache: PrefixCache
    splitter: Splitter
    sessions: SessionManager
    prefiller: Prefiller
    ingestor: Ingestor
    layout: RequestLayout
    scheduler: Scheduler
    eos: tuple[int, ...]
    kv_bytes_per_token: int  # compute-dtype K/V bytes of one token on the device


def build_parts(config: EngineConfig, model: LoadedModel | None = None, store: TieredStore | None = None
                ) -> EngineParts:
    """Every part of an engine (`model`, `store`: given ones are used, else loaded / opened
    from the config). Starts the scheduler's thread."""
    cfg = config.engine
    # the native kernels a first start builds compile beside the model's load (subprocesses: on 2 cores
    # 6.9 s one after another before the runner, ~4 s side by side)
    kernels = None
    if (model.device if model is not None else resolve_device(config.device)).type == "cpu":
        kernels = threading.Thread(target=native.prebuild, name="kvblend-kernel-build", daemon=True)
        kernels.start()
    lm = model or load_model(config.model, device=config.device, dtype=config.dtype, weights=config.weights)
    if kernels is not None:
        kernels.join()
    cfg.check_model_layers(lm.dims.num_layers)
    # the store first: its settings are checked against the model's entry size before anything is built
    entry_bytes = lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) * cfg.blend.chunk_tokens
    # a put waits at most load_stall_s for room in the write queue (then the write is dropped): a store
    # whose writer hangs holds no request on the scheduler's thread
    store = store or TieredStore.from_config(config.store, min_entry_bytes=entry_bytes,
                                             put_wait_s=cfg.blend.load_stall_s or None)
    # batch-invariant: where the blocks are packed (AVX-512 VNNI, AVX2) `weights: auto` reads them for every decode
    # row and the dense weights for every other row (the same bits in any step); elsewhere it would pick by the
    # row count, so the dense weights are read at every row count
    invariant = (config.engine.scheduler.batch_invariant and lm.weights == "auto"
                 and not qpack_native())
    runner = Runner(lm, weights="dequantized" if invariant else None)
    prompts = PromptBuilder(lm.tokenizer, cfg.prompt.system_prompt, cfg.prompt.query_template,
                            cfg.blend.max_document_tokens, lm.dims.max_positions)
    eos = tuple(eos_ids(lm))
    maker = EntryMaker(runner, lm.fingerprint, config.store.kv_dtype)
    stall_s = cfg.blend.load_stall_s or None  # LayerLoader's longest wait for one layer (0: none)
    namespace = store.namespace  # the configured one, with the secret's digest when there is one
    document_kv = DocumentCache(store, maker, namespace=namespace, chunk_context=cfg.blend.chunk_context,
                                block_tokens=cfg.blend.chunk_tokens, stall_s=stall_s)
    # prefix blocks (prefix mode, chat sessions) are exact: the compute dtype, each tier's
    # `exact_codec` (none by default), so loading them equals computing them
    exact = EntryMaker(runner, lm.fingerprint, dtype_name(runner.dtype))
    prefix_cache = PrefixCache(store, exact, namespace=namespace, block_tokens=cfg.blend.chunk_tokens,
                               prefetch_depth=cfg.blend.prefetch_depth, stall_s=stall_s)
    # load-or-compute split (blend.planning.split): `auto` decides with a cost model calibrated
    # once and then fixed (the same request, the same split, whatever the load), `adaptive` with
    # the live estimates every request feeds
    splitter = Splitter(PrefillCosts.for_model(lm.model), LoadCosts(runner.device.type),
                        {t.name: getattr(t.config, "kind", t.name) for t in store.tiers}, mode=cfg.blend.split,
                        runner=runner)
    sessions = SessionManager(cfg, prefix_cache, prompts, eos)
    prefiller = Prefiller(cfg, runner, store, document_kv, prefix_cache, splitter, sessions, lm.tokenizer, stall_s)
    kv_bytes_per_token = lm.dims.kv_bytes_per_token(dtype_bytes(dtype_name(runner.dtype)))
    ingestor = Ingestor(document_kv, store)
    layout = RequestLayout(cfg, prompts, runner, document_kv, ingestor, lm.tokenizer, eos, kv_bytes_per_token)
    parking = KVParking(store, runner, lm.fingerprint, namespace=namespace, block_tokens=cfg.blend.chunk_tokens,
                        prefetch_depth=cfg.blend.prefetch_depth, stall_s=stall_s)
    device = runner.device
    sched = cfg.scheduler
    scheduling = SchedulerConfig(
        max_num_seqs=default_max_num_seqs(device) if sched.max_num_seqs == "auto" else sched.max_num_seqs,
        max_active_kv=(max(int(free_memory(device) * ACTIVE_KV_SHARE), 1) if sched.max_active_kv == "auto"
                       else sched.max_active_kv),
        prefill_chunk_tokens=sched.prefill_chunk_tokens, background_share=sched.background_share,
        step_stretch=sched.step_stretch)
    if sched.prefills_between_decodes is not None:
        log.warning("engine.scheduler.prefills_between_decodes no longer applies (every step carries every "
                    "decode row and at most prefill_chunk_tokens of prefill work); remove it")
    # harvested documents recomputed standalone: all idle time, a share of busy time (background_share)
    scheduler = Scheduler(runner, parking, scheduling, plans=Plans(prefiller, sessions, ingestor),
                          kv_bytes_per_token=kv_bytes_per_token,
                          background=document_kv if cfg.blend.recompute_harvested else None)
    return EngineParts(lm, runner, store, prompts, document_kv, prefix_cache, splitter, sessions, prefiller,
                       ingestor, layout, scheduler, eos, kv_bytes_per_token)
