"""BlendEngine: the Python API. It owns the model, the runner and the tier stack, and
orchestrates a request through the modules that do the work.

Modes
  full    full prefill of the whole prompt (the reference)
  reuse   cached document KV placed at its prompt positions; only the query is computed
  prefix  the longest exactly-cached prefix is loaded, the rest computed (prefix caching)
  blend   CacheBlend: cached KV plus a selective recompute of the tokens that matter most

Path of one blend request: `PromptBuilder` lays out [prefix][documents][query] ->
`DocumentCache.resolve` looks every cacheable segment's block chain up in the
`TieredStore` (a miss is computed now, as one sequence, and written back) ->
`plan_recompute` fixes which rows each layer computes -> a `LayerLoader` thread places
layer i+1.. of every block into the request's `KVCache` (re-rotated to its prompt
positions) while `run_layers` computes layer i -> `Decoder.finish` decodes from the
merged cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from blend.config import EngineConfig, check_mode, check_ratio, load_config
from blend.documents import DocumentCache
from blend.generation import Decoder, GenerationResult, Prefilled
from blend.model import LoadedModel, load_model
from blend.pipeline import LayerLoader
from blend.prefix import EntryMaker, PrefixCache
from blend.prompt import Prompt, PromptBuilder
from blend.recompute import plan_recompute, run_layers
from blend.runner import Runner, SamplingParams
from blend.selector import check_policy
from blend.session import SessionManager
from blend.stats import LookupTally, RequestStats, tally_fields
from storage.dtypes import dtype_bytes
from storage.stack import TieredStore

log = logging.getLogger(__name__)


class BlendEngine:
    """One request at a time (callers serialise `generate`); `chat` rejects a second
    concurrent turn on the same session with `SessionBusy`."""

    def __init__(self, config: EngineConfig, *, model: LoadedModel | None = None, store: TieredStore | None = None):
        self.config = config
        cfg = config.engine
        self.lm = model or load_model(config.model, device=config.device, dtype=config.dtype)
        self.runner = Runner(self.lm)
        self.prompts = PromptBuilder(self.lm.tokenizer, cfg.system_prompt, cfg.query_template, cfg.max_document_tokens)
        entry_bytes = self.lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) * cfg.chunk_tokens
        self.store = store or TieredStore.from_config(config.store, min_entry_bytes=entry_bytes)
        self.fingerprint = self.lm.fingerprint
        self.kv_dtype = config.store.kv_dtype
        maker = EntryMaker(self.runner, self.fingerprint, self.kv_dtype)
        self.documents = DocumentCache(self.store, maker, namespace=config.store.namespace,
                                       chunk_context=cfg.chunk_context, block_tokens=cfg.chunk_tokens)
        self.prefix_cache = PrefixCache(self.store, maker, namespace=config.store.namespace,
                                        block_tokens=cfg.chunk_tokens, prefetch_depth=cfg.prefetch_depth)
        self.decoder = Decoder(self.lm, self.runner)
        self.sessions = SessionManager(cfg, self.prefix_cache, self.decoder)

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> BlendEngine:
        """Build from a YAML config; overrides (e.g. recompute_ratio=0.3, model=...) win over the file."""
        return cls(load_config(path, **overrides))

    def close(self) -> None:
        """Flush pending cache writes and close the tiers."""
        self.store.close()

    def __enter__(self) -> BlendEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- requests
    def ingest(self, documents: Sequence[str], *, sync: bool = True) -> list[str]:
        """Precompute each document's KV and store it block by block; returns the block keys
        of the documents, in order.

        Idempotent: documents already in the store are not recomputed. With sync=True the
        writes have reached every tier when this returns.
        """
        keys = self.documents.ingest(self.prompts.build("ingest", list(documents)))
        if sync:
            self.store.flush()
        return keys

    def build_prompt(self, query: str, documents: Sequence[str]) -> Prompt:
        return self.prompts.build(query, list(documents))

    def generate(self, query: str, documents: Sequence[str] = (), *, mode: str = "blend",
                 recompute_ratio: float | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 answer: str | None = None, selection: str | None = None) -> GenerationResult:
        """Answer `query` over `documents` in `mode`; `selection` overrides the config's
        token-selection policy for this request (blend mode).

        Side effects: document misses are computed and written to the store. With `answer`,
        stats.answer_nll is the mean negative log-likelihood of that text teacher-forced
        after the prompt (decoding continues from the same cache).
        """
        check_mode(mode)
        cfg = self.config.engine
        ratio = check_ratio(cfg.recompute_ratio if recompute_ratio is None else recompute_ratio)
        max_new = cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
        sampling = SamplingParams(cfg.temperature if temperature is None else temperature,
                                  cfg.top_p if top_p is None else top_p, seed)
        prompt = self.build_prompt(query, documents)
        self.runner.check_length(len(prompt) + max_new)
        pre, ttft, t0 = self.decoder.timed(lambda: self.prefill(prompt, mode=mode, ratio=ratio, selection=selection,
                                                                  capacity=len(prompt) + max_new))
        return self.decoder.finish(pre, ttft, t0, max_new, sampling, answer)

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, *, mode: str, ratio: float = 0.15, capacity: int | None = None,
                selection: str | None = None) -> Prefilled:
        """Fill a KVCache for `prompt` in `mode` and return the last position's logits.

        The cache holds `capacity` positions (default: the prompt), so decoding continues
        without reallocating."""
        capacity = max(capacity or 0, len(prompt))
        t0 = time.perf_counter()
        if mode == "full":
            pre = self._full(prompt, capacity)
        elif mode == "prefix":
            pre = self._prefix(prompt, capacity)
        else:
            pre = self._blend(prompt, 0.0 if mode == "reuse" else ratio, capacity, mode,
                              check_policy(selection or self.config.engine.selection))
        pre.stats = pre.stats.replace(prefill_s=time.perf_counter() - t0)
        return pre

    def _stats(self, prompt: Prompt, mode: str, ratio: float, **fields: Any) -> RequestStats:
        context = prompt.query.start
        return RequestStats(mode=mode, recompute_ratio=ratio, context_tokens=context,
                            query_tokens=len(prompt) - context, **fields)

    def _full(self, prompt: Prompt, capacity: int) -> Prefilled:
        cache = self.runner.new_cache(capacity)
        logits = self.runner.prefill(torch.tensor(prompt.token_ids), cache)[0]
        context = prompt.query.start
        return Prefilled(logits, cache, self._stats(prompt, "full", 1.0, loaded_tokens=0, recomputed_tokens=context))

    def _blend(self, prompt: Prompt, ratio: float, capacity: int, mode: str, selection: str) -> Prefilled:
        cfg = self.config.engine
        tally = LookupTally([t.name for t in self.store.tiers])
        placements = self.documents.resolve(prompt, [s for s in prompt.segments if s.kind != "query"], tally)
        plan = plan_recompute(prompt, ratio, cfg.check_layers, cfg.filter_schedule, self.runner.num_layers,
                              policy=selection, placements=placements, sink_tokens=cfg.sink_tokens,
                              query_layers=cfg.query_layers, query_pool=cfg.query_pool)
        cache = self.runner.new_cache(capacity)
        cache.length = plan.n
        with LayerLoader(self.store, self.runner, cache, placements, range(plan.load_from, self.runner.num_layers),
                         cfg.prefetch_depth) as loader:
            logits, chosen = run_layers(self.runner, cache, torch.tensor(prompt.token_ids), plan, loader,
                                        policy=selection, deviation_kind=cfg.deviation)
        stats = self._stats(prompt, mode, ratio, loaded_tokens=0 if plan.full else int(plan.ctx_rows.numel()),
                            recomputed_tokens=chosen.recomputed_tokens, load=loader.report(),
                            selection=chosen, **tally_fields(tally))
        return Prefilled(logits, cache, stats)

    def _prefix(self, prompt: Prompt, capacity: int) -> Prefilled:
        """The longest exactly cached prefix: prefix blocks of this very prompt, or the
        cached segments that are exact at their position (the system part, and the first
        document when documents are computed after it)."""
        ids = prompt.token_ids
        limit = len(ids) - 1  # at least the last token is computed
        tally = LookupTally([t.name for t in self.store.tiers])
        chain = self.prefix_cache.lookup(ids, limit)
        chain_len = sum(pl.length for pl in chain)
        exact = [prompt.prefix]
        if self.config.engine.chunk_context == "system" and len(prompt.segments) > 2 and prompt.segments[1].kind == "document":
            exact.append(prompt.segments[1])
        exact_len = exact[-1].end if exact[-1].end <= limit else 0
        if exact_len > chain_len:
            chain = self.documents.resolve(prompt, [s for s in exact if s.end <= limit], tally)
        else:
            for pl in chain:
                tally.hit_from("prefix_blocks", pl.source)
        cache = self.runner.new_cache(capacity)
        logits, load = self.prefix_cache.prefill(ids, chain, cache)
        loaded = max((pl.start + pl.length for pl in chain), default=0)
        stored = self.prefix_cache.store_blocks(ids, cache, skip_below=chain_len)
        stats = self._stats(prompt, "prefix", 0.0, loaded_tokens=loaded, recomputed_tokens=max(0, prompt.query.start - loaded),
                            load=load, stored_blocks=stored, **tally_fields(tally))
        return Prefilled(logits, cache, stats)

    # ------------------------------------------------------------------- chat
    def chat(self, session_id: str, message: str, *, max_new_tokens: int | None = None) -> GenerationResult:
        """One conversation turn; the conversation's KV is stored as prefix blocks after it."""
        return self.sessions.turn(session_id, message, max_new_tokens=max_new_tokens)

    def offload(self, session_id: str) -> None:
        """Move a session's KV off the compute device (its blocks stay in the tier stack)."""
        self.sessions.offload(session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session entirely (its history and its device-resident KV)."""
        self.sessions.drop(session_id)
