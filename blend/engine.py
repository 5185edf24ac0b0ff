"""BlendEngine: the Python API. Ingests documents as standalone chunk caches, answers
queries in four modes, and keeps chat sessions whose KV is offloaded and resumed.

Modes
  full    full prefill of the whole prompt (the reference)
  reuse   cached chunk KV placed at its prompt positions; only the query is computed
  prefix  the longest exactly-cached prefix is loaded, the rest computed (prefix caching)
  blend   CacheBlend: cached KV plus a selective recompute of the most deviating tokens

Path of one blend request: PromptBuilder lays out [prefix][chunks][query] -> each
cacheable segment is looked up in the TieredStore (a miss is computed standalone now
and written back) -> a LayerLoader thread places layer i+1.. of every segment into the
request's KVCache (re-rotated to its prompt positions) while the compute thread runs
layer i: all rows before the first check layer, the check layer selects the tokens
with the largest KV deviation, later layers recompute only those plus the query ->
logits of the last row -> decoding continues from the merged cache.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blend.config import EngineConfig, check_mode, check_ratio, load_config
from blend.model import LoadedModel, load_model
from blend.pipeline import LayerLoader, Placement
from blend.prompt import Prompt, PromptBuilder, Segment
from blend.runner import KVCache, Runner, SamplingParams
from blend.selector import deviation, query_attention, schedule_counts, select_top
from storage.entry import KVEntry
from storage.keys import chunk_key, prefix_block_key, tokens_digest
from storage.stack import TieredStore

log = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    ttft_s: float
    first_token_logprobs: torch.Tensor  # (vocab,) float32 log-probabilities of the first generated token
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Prefilled:
    logits: torch.Tensor  # (vocab,)
    cache: KVCache
    stats: dict[str, Any]


class BlendEngine:
    """Owns the model, the runner and the tier stack. One request at a time; `chat`
    rejects a second concurrent turn on the same session with `SessionBusy`."""

    def __init__(self, config: EngineConfig, *, model: LoadedModel | None = None, store: TieredStore | None = None):
        self.config = config
        self.lm = model or load_model(config.model, device=config.device, dtype=config.dtype)
        self.runner = Runner(self.lm)
        cfg = config.engine
        self.prompts = PromptBuilder(self.lm.tokenizer, cfg.system_prompt, cfg.query_template, cfg.chunk_tokens)
        entry_bytes = self.lm.dims.kv_bytes_per_token(_dtype_bytes(config.store.kv_dtype)) * cfg.chunk_tokens
        self.store = store or TieredStore.from_config(config.store, min_entry_bytes=entry_bytes)
        self.fingerprint = self.lm.fingerprint
        self.kv_dtype = config.store.kv_dtype
        self.namespace = config.store.namespace
        self.eos_ids = _eos_ids(self.lm)
        from blend.session import SessionManager  # chat sessions (offload / resume)

        self.sessions = SessionManager(self)
        self.last_selection: list[torch.Tensor] = []  # rows selected at each check layer by the last blend

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

    # ------------------------------------------------------------ chunk caches
    def _segment_key(self, seg: Segment, prompt: Prompt) -> tuple[str, int, list[int]]:
        """(store key, pos_start the keys are rotated at, context ids it is computed after)."""
        if seg.kind == "chunk" and self.config.engine.chunk_context == "system":
            context = list(prompt.prefix.token_ids)
            key = chunk_key(self.fingerprint, seg.token_ids, self.kv_dtype, self.namespace, tokens_digest(context))
            return key, len(context), context
        return chunk_key(self.fingerprint, seg.token_ids, self.kv_dtype, self.namespace), 0, []

    def compute_entry(self, token_ids: Sequence[int], context: Sequence[int] = ()) -> KVEntry:
        """KV of `token_ids` computed standalone (after `context`, if any), in the storage dtype."""
        ids = list(context) + list(token_ids)
        cache = self.runner.new_cache(len(ids))
        self.runner.prefill(torch.tensor(ids), cache)
        c = len(context)
        layers = [(cache.k[i][:, c:], cache.v[i][:, c:]) for i in range(self.runner.num_layers)]
        return KVEntry.from_tensors(layers, fingerprint=self.fingerprint, token_ids=list(token_ids), pos_start=c,
                                    kv_dtype=self.kv_dtype)

    def _resolve(self, prompt: Prompt, segments: Sequence[Segment], stats: dict[str, Any]) -> list[Placement]:
        """Look up every cacheable segment; compute and store the misses now."""
        placements = []
        for seg in segments:
            key, pos_start, context = self._segment_key(seg, prompt)
            located = self.store.lookup(key, tokens_digest=tokens_digest(seg.token_ids), fingerprint=self.fingerprint)

            def recompute(seg=seg, context=context) -> KVEntry:
                return self.compute_entry(seg.token_ids, context)

            entry = None
            if located is None:
                entry = recompute()
                self.store.put(key, entry)
                stats["chunk_misses"] += 1
                _count_lookup(stats, self.store, None)
            else:
                stats["chunk_hits"] += 1
                _count_lookup(stats, self.store, located.tier_index)
            placements.append(Placement(seg.start, len(seg.token_ids), pos_start, located, entry, recompute))
        return placements

    def ingest(self, documents: Sequence[str], *, sync: bool = True) -> list[str]:
        """Precompute each document chunk standalone and store it; returns the chunk keys.

        Idempotent: chunks already in the store are not recomputed. With sync=True the
        writes have reached every tier when this returns.
        """
        prompt = self.prompts.build("ingest", list(documents))
        keys = []
        for seg in prompt.segments:
            if seg.kind == "query":
                continue
            key, _, context = self._segment_key(seg, prompt)
            if seg.kind == "chunk":
                keys.append(key)
            if self.store.lookup(key, tokens_digest=tokens_digest(seg.token_ids), fingerprint=self.fingerprint) is None:
                self.store.put(key, self.compute_entry(seg.token_ids, context))
        if sync:
            self.store.flush()
        return keys

    # --------------------------------------------------------------- requests
    def build_prompt(self, query: str, documents: Sequence[str]) -> Prompt:
        return self.prompts.build(query, list(documents))

    def generate(self, query: str, documents: Sequence[str] = (), *, mode: str = "blend",
                 recompute_ratio: float | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 answer: str | None = None) -> GenerationResult:
        """Answer `query` over `documents` in `mode`.

        Side effects: chunk misses are computed and written to the store. With `answer`,
        stats["answer_nll"] is the mean negative log-likelihood of that text teacher-forced
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
        t0 = time.perf_counter()
        pre = self.prefill(prompt, mode=mode, ratio=ratio, capacity=len(prompt) + max_new)
        if pre.logits.device.type == "cuda":
            torch.cuda.synchronize(pre.logits.device)  # kernels are asynchronous: time finished work
        ttft = time.perf_counter() - t0
        logprobs = torch.log_softmax(pre.logits.float(), dim=-1).cpu()
        stats = pre.stats
        if answer is not None:
            stats["answer_nll"] = self.answer_nll(pre.cache, pre.logits, answer)
        tokens = self.runner.decode(pre.logits, pre.cache, max_new, self.eos_ids, sampling)
        stats["ttft_s"] = ttft
        stats["total_s"] = time.perf_counter() - t0
        stats["new_tokens"] = len(tokens)
        text = self.lm.tokenizer.decode([t for t in tokens if t not in self.eos_ids], skip_special_tokens=True)
        return GenerationResult(text.strip(), tokens, ttft, logprobs, stats)

    def answer_nll(self, cache: KVCache, first_logits: torch.Tensor, answer: str) -> float:
        """Mean NLL per token of `answer` teacher-forced after the prompt in `cache`.

        Works on a copy of the cache length: the cache is restored to the prompt afterwards.
        """
        ids = list(self.lm.tokenizer(answer.strip(), add_special_tokens=False).input_ids)
        if not ids:
            return float("nan")
        length = cache.length
        logits = [first_logits[None]]
        if len(ids) > 1:
            rest = self.runner.prefill(torch.tensor(ids[:-1]), cache, start=length, logit_rows=range(len(ids) - 1))
            logits.append(rest)
        cache.length = length  # decoding overwrites those slots
        logp = torch.log_softmax(torch.cat(logits).float(), dim=-1)
        return float(-logp[torch.arange(len(ids)), torch.tensor(ids)].mean())

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, *, mode: str, ratio: float = 0.15, capacity: int | None = None) -> _Prefilled:
        """Fill a KVCache for `prompt` in `mode` and return the last position's logits.

        The cache is allocated for `capacity` positions (default: the prompt) so that
        decoding can continue without reallocating."""
        capacity = max(capacity or 0, len(prompt))
        stats: dict[str, Any] = {
            "mode": mode, "context_tokens": sum(len(s.token_ids) for s in prompt.segments if s.kind != "query"),
            "query_tokens": len(prompt.query.token_ids), "chunk_hits": 0, "chunk_misses": 0, "hits_by_tier": {},
            "misses_by_tier": {},
            "recompute_ratio": ratio if mode == "blend" else (1.0 if mode == "full" else 0.0),
        }
        t0 = time.perf_counter()
        if mode == "full":
            cache = self.runner.new_cache(capacity)
            logits = self.runner.prefill(torch.tensor(prompt.token_ids), cache)[0]
            stats.update(recomputed_tokens=stats["context_tokens"], selected_per_layer=[], load_s=0.0,
                         exposed_load_s=0.0, loaded_tokens=0)
        elif mode == "prefix":
            logits, cache = self._prefix_prefill(prompt, stats, capacity)
        else:
            logits, cache = self._blend_prefill(prompt, 0.0 if mode == "reuse" else ratio, stats, capacity)
        elapsed = time.perf_counter() - t0
        stats["prefill_s"] = elapsed
        stats["compute_s"] = elapsed - stats["exposed_load_s"]
        return _Prefilled(logits, cache, stats)

    def _blend_prefill(self, prompt: Prompt, ratio: float, stats: dict[str, Any],
                       capacity: int) -> tuple[torch.Tensor, KVCache]:
        runner, cfg = self.runner, self.config.engine
        n, num_layers = len(prompt), runner.num_layers
        cached = [s for s in prompt.segments if s.kind != "query"]
        placements = self._resolve(prompt, cached, stats)
        ctx_rows = torch.cat([torch.arange(s.start, s.end) for s in cached]) if cached else torch.zeros(0, dtype=torch.long)
        query_rows = torch.arange(prompt.query.start, n)
        if ratio > 0 and ctx_rows.numel():
            check_layers = [c for c in cfg.check_layers if c < num_layers]
            counts = schedule_counts(ratio, cfg.filter_schedule[: len(check_layers)], ctx_rows.numel())
            if check_layers and len(check_layers) < len(cfg.check_layers):
                counts[-1] = schedule_counts(ratio, (1.0,), ctx_rows.numel())[0]
        else:
            check_layers, counts = [], []
        # cached K/V is needed from the first check layer that drops a context row on
        # (everything kept at every check layer, e.g. ratio 1, is a full prefill: no loads)
        partial = [c for c, kept in zip(check_layers, counts, strict=True) if kept < ctx_rows.numel()]
        load_from = partial[0] if partial else (num_layers if check_layers else 0)
        active = torch.arange(n) if check_layers else query_rows  # rows computed fresh at this layer
        is_ctx = torch.zeros(n, dtype=torch.bool)
        is_ctx[ctx_rows] = True
        cache = runner.new_cache(capacity)
        cache.length = n
        cos_all, sin_all = runner.rope(torch.arange(n))
        token_ids = torch.tensor(prompt.token_ids)
        h = runner.embed(token_ids[active])
        selected_per_layer: list[int] = []
        selections: list[torch.Tensor] = []  # selected prompt rows per check layer (introspection)
        recomputed = 0
        dev = runner.device
        with LayerLoader(self.store, runner, cache, placements, range(load_from, num_layers), cfg.prefetch_depth) as loader:
            for layer in range(num_layers):
                loader.wait(layer)
                rows = active.to(dev)
                q, k, v = runner.qkv(layer, h, cos_all[rows], sin_all[rows])
                keep = None
                check = layer in check_layers
                if check:
                    cand = is_ctx[active].to(dev)  # (T_active,) which active rows may be selected
                    cand_rows = rows[cand]
                    count = counts[check_layers.index(layer)]
                    dropping = count < cand_rows.numel()  # else everything is kept: no scores needed
                    if dropping:
                        dev_scores = deviation(k[:, cand], v[:, cand], cache.k[layer][:, cand_rows],
                                               cache.v[layer][:, cand_rows], cfg.deviation)  # before overwriting
                _write_rows(cache, layer, rows, k, v, n)
                if check:
                    scores = dev_scores if dropping else torch.zeros(cand_rows.numel())
                    if dropping and cfg.selection != "deviation":
                        q_rows = torch.searchsorted(active, query_rows).to(dev)
                        attn_scores = query_attention(q[:, q_rows], cache.k[layer][:, :n], runner.scaling)[cand_rows]
                        scores = attn_scores if cfg.selection == "attention" else _norm(dev_scores) * _norm(attn_scores)
                    chosen = select_top(scores, cand_rows, count)
                    selected_per_layer.append(int(chosen.numel()))
                    selections.append(chosen.cpu())
                    recomputed = int(chosen.numel())
                    keep_rows = torch.cat([chosen.cpu(), query_rows]).unique(sorted=True)
                    keep = torch.searchsorted(active, keep_rows)
                if keep is not None:
                    q, h, active = q[:, keep.to(dev)], h[keep.to(dev)], active[keep]
                if layer == num_layers - 1:  # only the last row's output is needed
                    q, h, active = q[:, -1:], h[-1:], active[-1:]
                attn = runner.attend(q, active.to(dev), cache.k[layer][:, :n], cache.v[layer][:, :n])
                h = runner.finish(layer, h, attn)
        self.last_selection = selections
        stats.update(
            recomputed_tokens=recomputed if check_layers else 0, selected_per_layer=selected_per_layer,
            check_layers=check_layers, load_s=loader.load_s, exposed_load_s=loader.exposed_load_s,
            bytes_loaded=dict(loader.bytes_by_tier), loaded_tokens=int(ctx_rows.numel()),
            recomputed_segments=loader.recomputed_segments,
        )
        stats["recompute_ratio"] = ratio
        return runner.logits(h[-1:])[0], cache

    # ---------------------------------------------------------- prefix caching
    def _prefix_blocks(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(start, end) of the full prefix blocks of a sequence."""
        b = self.config.engine.chunk_tokens
        return [(s, s + b) for s in range(0, len(token_ids) - b + 1, b)]

    def lookup_prefix(self, token_ids: Sequence[int], limit: int, tail_ends: Sequence[int] = ()) -> list[Placement]:
        """The chain of cached prefix blocks covering token_ids[:p], longest p <= limit.

        Full blocks of `chunk_tokens` come first; then a partial tail block (stored by a
        chat turn, see `store_prefix_blocks(tail=True)`) ending at one of `tail_ends` may
        extend the chain. The chain stops at the first block that is missing or fails
        verification.
        """
        placements = []
        ids = list(token_ids)
        reached = 0
        for start, end in self._prefix_blocks(ids):
            if end > limit:
                break
            placement = self._find_block(ids, start, end)
            if placement is None:
                break
            placements.append(placement)
            reached = end
        for end in sorted(set(tail_ends), reverse=True):
            if reached < end <= min(limit, reached + self.config.engine.chunk_tokens - 1):
                placement = self._find_block(ids, reached, end)
                if placement is not None:
                    placements.append(placement)
                    break
        return placements

    def _find_block(self, ids: list[int], start: int, end: int) -> Placement | None:
        """The stored prefix block ids[start:end] (keyed by ids[:end]), verified, or None."""
        key = prefix_block_key(self.fingerprint, ids[:end], self.kv_dtype, self.namespace)
        located = self.store.lookup(key, tokens_digest=tokens_digest(ids[start:end]), fingerprint=self.fingerprint)
        if located is None or located.header.pos_start != start:
            return None
        return Placement(start, end - start, start, located, None,
                         lambda: self._compute_prefix_block(ids, start, end))

    def _compute_prefix_block(self, ids: Sequence[int], start: int, end: int) -> KVEntry:
        """Recompute a prefix block exactly (all tokens before it as context)."""
        return self.compute_entry(ids[start:end], ids[:start])

    def store_prefix_blocks(self, token_ids: Sequence[int], cache: KVCache, *, skip_below: int = 0,
                            tail: bool = False) -> int:
        """Write the full prefix blocks of `token_ids` (whose KV is in `cache`) to the store,
        in the background; with `tail`, also the partial block after the last full one (a
        chat turn's end, so a resumed conversation recomputes only its new tokens). Blocks
        ending at or below `skip_below` are known cached. Returns the number queued."""
        ids = list(token_ids)[: cache.length]
        blocks = self._prefix_blocks(ids)
        full_end = blocks[-1][1] if blocks else 0
        if tail and len(ids) > full_end:
            blocks.append((full_end, len(ids)))
        queued = 0
        for start, end in blocks:
            if end <= skip_below:
                continue
            layers = [(cache.k[i][:, start:end], cache.v[i][:, start:end]) for i in range(self.runner.num_layers)]
            entry = KVEntry.from_tensors(layers, fingerprint=self.fingerprint, token_ids=ids[start:end],
                                         pos_start=start, kv_dtype=self.kv_dtype)
            self.store.put(prefix_block_key(self.fingerprint, ids[:end], self.kv_dtype, self.namespace), entry)
            queued += 1
        return queued

    def prefill_with_prefix(self, token_ids: Sequence[int], placements: list[Placement], stats: dict[str, Any],
                            cache: KVCache | None = None) -> tuple[torch.Tensor, KVCache]:
        """Load `placements` (a cached exact prefix) layer by layer while computing the rest."""
        n = len(token_ids)
        p = max((pl.start + pl.length for pl in placements), default=0)
        cache = cache or self.runner.new_cache(n)
        with LayerLoader(self.store, self.runner, cache, placements, range(self.runner.num_layers),
                         self.config.engine.prefetch_depth) as loader:
            logits = self.runner.prefill(torch.tensor(list(token_ids[p:])), cache, start=p, before_layer=loader.wait)[0]
        stats.update(loaded_tokens=p, recomputed_tokens=n - p, selected_per_layer=[], load_s=loader.load_s,
                     exposed_load_s=loader.exposed_load_s, bytes_loaded=dict(loader.bytes_by_tier),
                     recomputed_segments=loader.recomputed_segments)
        return logits, cache

    def _prefix_prefill(self, prompt: Prompt, stats: dict[str, Any], capacity: int) -> tuple[torch.Tensor, KVCache]:
        ids = prompt.token_ids
        limit = len(ids) - 1  # at least the last token is computed
        chain = self.lookup_prefix(ids, limit)
        chain_len = sum(pl.length for pl in chain)
        # segments whose cached KV is exact at their prompt position: the prefix, and the
        # first chunk when chunks are computed after the system part
        exact = [prompt.prefix]
        if self.config.engine.chunk_context == "system" and len(prompt.segments) > 2 and prompt.segments[1].kind == "chunk":
            exact.append(prompt.segments[1])
        exact_len = exact[-1].end if exact[-1].end <= limit else 0
        if exact_len > chain_len:
            chain = self._resolve(prompt, [s for s in exact if s.end <= limit], stats)
        else:
            stats["chunk_hits"] += len(chain)
            for pl in chain:
                stats["hits_by_tier"][pl.source] = stats["hits_by_tier"].get(pl.source, 0) + 1
        logits, cache = self.prefill_with_prefix(ids, chain, stats, self.runner.new_cache(capacity))
        self.store_prefix_blocks(ids, cache, skip_below=chain_len)
        return logits, cache

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


def _norm(scores: torch.Tensor) -> torch.Tensor:
    return scores / scores.mean().clamp_min(1e-12)


def _write_rows(cache: KVCache, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
    """Write fresh k/v (Hkv, T, D) for prompt rows `rows` into the layer's cache."""
    if rows.numel() == n:
        cache.k[layer][:, :n] = k
        cache.v[layer][:, :n] = v
    else:
        cache.k[layer][:, rows] = k
        cache.v[layer][:, rows] = v


def _count_lookup(stats: dict[str, Any], store: TieredStore, hit_index: int | None) -> None:
    """Per-tier hits and misses of one lookup: tiers above the hit (or all, on a miss) missed."""
    hits, misses = stats.setdefault("hits_by_tier", {}), stats.setdefault("misses_by_tier", {})
    for i, tier in enumerate(store.tiers):
        if hit_index is not None and i == hit_index:
            hits[tier.name] = hits.get(tier.name, 0) + 1
            return
        misses[tier.name] = misses.get(tier.name, 0) + 1


def _dtype_bytes(name: str) -> int:
    return {"float16": 2, "bfloat16": 2, "float32": 4}.get(name, 2)


def _eos_ids(lm: LoadedModel) -> tuple[int, ...]:
    ids = set()
    for source in (lm.tokenizer.eos_token_id, getattr(lm.model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(i) for i in source)
    im_end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>") if hasattr(lm.tokenizer, "convert_tokens_to_ids") else None
    if isinstance(im_end, int) and im_end != getattr(lm.tokenizer, "unk_token_id", None):
        ids.add(im_end)
    return tuple(sorted(ids))
