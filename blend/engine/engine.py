"""BlendEngine: the Python API. It owns the model, the runner and the tier stack, and
orchestrates a request through the modules that do the work.

Modes
  full    full prefill of the whole prompt (the reference)
  reuse   cached document KV placed at its prompt positions; only the query is computed
  prefix  the longest exactly-cached prefix is loaded, the rest computed (prefix caching)
  blend   CacheBlend: cached KV plus a selective recompute of the tokens that matter most

Path of one blend request: `PromptBuilder` lays out [prefix][documents][query] ->
`DocumentCache.resolve` looks every cacheable segment's block chain up in the
`TieredStore` (a miss is computed now, as one sequence, and written back) -> the
`Splitter` may compute a prefix instead of loading it (blend.split) -> `plan_recompute`
fixes which rows each layer computes -> a `LayerLoader` thread places layer i+1.. of
every block into the request's `KVCache` (re-rotated to its prompt positions) while
`run_layers` computes layer i -> `Decoder.stream` decodes from the merged cache.

Public surface: `ingest` (per document: id, block keys, cached), `generate` /
`generate_stream` (a question or a conversation over documents; text deltas, stop
strings), `chat` (sessions, optionally with documents and a system prompt),
`delete_document`, `warmup`. Documents are str or `blend.Document`, rendered by
`blend.document.render_document` only. Every argument is checked before any work
(`blend.request`). One request at a time: callers serialise (the HTTP server runs
the engine on one worker thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from blend.config import EngineConfig, load_config, naming_config
from blend.decode.decoder import Decoder, GenerationResult, Prefilled, TextDelta
from blend.decode.sampling import SamplingParams
from blend.engine.request import GenerationRequest
from blend.kv.documents import DocumentCache, IngestStopped
from blend.kv.loader import LayerLoader, LoadStalled
from blend.kv.prefix import EntryMaker, PrefixCache
from blend.model.loading import LoadedModel, load_model
from blend.model.runner import Runner
from blend.planning.planner import LoadCosts, PrefillCosts
from blend.planning.split import Splitter
from blend.prompt.builder import Prompt, PromptBuilder
from blend.prompt.conversation import Message, check_messages
from blend.prompt.document import (
    Document,
    DocumentIndex,
    IngestedDocument,
    check_documents,
    document_id,
    render_document,
)
from blend.recompute.layers import run_layers
from blend.recompute.plan import plan_recompute
from blend.recompute.selector import check_policy, uses_check_layers
from blend.recompute.stale import shift_applies
from blend.session.manager import RagTurn, SessionManager
from blend.stats import LookupTally, RequestStats, tally_fields
from storage.dtypes import dtype_bytes
from storage.stack import TieredStore
from storage.tier import StoreUnavailable

log = logging.getLogger(__name__)


class BlendEngine:
    """One request at a time (callers serialise `generate`); `chat` rejects a second
    concurrent turn on the same session with `SessionBusy`."""

    def __init__(self, config: EngineConfig, *, model: LoadedModel | None = None, store: TieredStore | None = None):
        self.config = config
        cfg = config.engine
        self.lm = model or load_model(config.model, device=config.device, dtype=config.dtype)
        cfg.check_model_layers(self.lm.dims.num_layers)
        self.runner = Runner(self.lm)
        self.prompts = PromptBuilder(self.lm.tokenizer, cfg.system_prompt, cfg.query_template, cfg.max_document_tokens,
                                     self.lm.dims.max_positions)
        entry_bytes = self.lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) * cfg.chunk_tokens
        self.store = store or TieredStore.from_config(config.store, min_entry_bytes=entry_bytes)
        self.fingerprint = self.lm.fingerprint
        self.kv_dtype = config.store.kv_dtype
        maker = EntryMaker(self.runner, self.fingerprint, self.kv_dtype)
        self._stall_s = cfg.load_stall_s or None  # LayerLoader's longest wait for one layer (0: none)
        self.document_kv = DocumentCache(self.store, maker, namespace=config.store.namespace,
                                         chunk_context=cfg.chunk_context, block_tokens=cfg.chunk_tokens,
                                         stall_s=self._stall_s)
        self.prefix_cache = PrefixCache(self.store, maker, namespace=config.store.namespace,
                                        block_tokens=cfg.chunk_tokens, prefetch_depth=cfg.prefetch_depth,
                                        stall_s=self._stall_s)
        self.decoder = Decoder(self.lm, self.runner)
        # load-or-compute split: the model's live cost model, fed by every request (blend.split)
        self.splitter = Splitter(PrefillCosts.for_model(self.lm.model), LoadCosts(self.runner.device.type),
                                 {t.name: getattr(t.config, "kind", t.name) for t in self.store.tiers}, mode=cfg.split)
        self.sessions = SessionManager(cfg, self.prefix_cache, self.decoder, self.prompts)
        self._warm = False  # set after the first prefill (not a cost sample: see `prefill`)
        self.documents = DocumentIndex()

    @classmethod
    def from_config(cls, path: str | Path | None = None, **overrides: Any) -> BlendEngine:
        """Build from a YAML config (None: $KVBLEND_CONFIG, else the packaged default; see
        blend.config.load_config); overrides (e.g. recompute_ratio=0.3, model=...) win over it.
        A setting found wrong only once the model or store is known names the file too."""
        config = load_config(path, **overrides)
        with naming_config(path):
            return cls(config)

    _closed = False

    def close(self) -> None:
        """Flush pending cache writes and close the tiers; later calls raise ValueError."""
        self._closed = True
        self.store.close()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this BlendEngine is closed; create a new one (BlendEngine.from_config)")

    def __enter__(self) -> BlendEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- requests
    def ingest(self, documents: Sequence[Document | str], *, sync: bool = True,
               stop: Callable[[], bool] | None = None) -> list[IngestedDocument]:
        """Precompute each document's KV (one sequence) and store it block by block; returns
        per document its id, block keys and whether it was already cached (every block had
        a valid entry in some tier before this call).

        Idempotent: blocks already in the store are not recomputed. With sync=True the
        writes have reached every tier when this returns, and `stored` says whether some
        tier now holds every block (False when no tier accepted them: an unusable disk
        path, Redis down; the tiers log why). An empty document is skipped with a warning
        (no keys, not cached, not stored). Remembers each document by id (`delete_document`).
        `stop` (e.g. a server job's deadline) is asked before each forward pass (one long
        document, or several short ones packed); when it answers True the call raises
        `IngestStopped`; what was computed so far stays stored (and known by id).
        """
        self._check_open()
        if not isinstance(sync, bool):
            raise TypeError(f"sync must be a bool, got {type(sync).__name__}")
        if stop is not None and not callable(stop):
            raise TypeError(f"stop must be a callable returning a bool, got {type(stop).__name__}")
        docs = check_documents(documents)
        prompt = self.prompts.build("ingest", docs)
        kept = [d for d in docs if render_document(d)]
        keys: list[list[str]] = [[] for _ in kept]
        cached = [True] * len(kept)
        stopped: IngestStopped | None = None
        try:
            segments = self.document_kv.ingest(prompt, stop)
        except IngestStopped as err:
            segments, stopped = err.stored, err
        for stored in segments:
            keys[stored.segment.doc_index].extend(stored.keys)
            cached[stored.segment.doc_index] &= stored.cached
        if sync:
            self.store.flush()
        results, k = [], 0
        for doc in docs:
            doc_keys, was_cached = (), False
            if render_document(doc):
                doc_keys, was_cached = tuple(keys[k]), cached[k]
                k += 1
            stored = bool(doc_keys) and all(self.store.contains(key) for key in doc_keys) if sync else None
            results.append(IngestedDocument(document_id(doc), doc_keys, was_cached, stored))
            if doc_keys:  # after a stop: the blocks stored so far, so that a delete finds them
                self.documents.record(document_id(doc), doc, doc_keys)
        if stopped is not None:
            raise stopped
        return results

    def delete_document(self, doc_id: str) -> tuple[str, ...]:
        """Remove a document this engine ingested (or served with an explicit id) from
        every tier; returns the keys deleted. Blocks that another known document also
        uses are kept. KeyError if the id is unknown to this engine.

        Side effects: waits for queued writes first, so no write lands after the delete.
        A tier that cannot be reached keeps its copy: then the id stays known (a retry
        deletes again) and StoreUnavailable names the tier.
        """
        if not isinstance(doc_id, str):
            raise TypeError(f"document id must be a str, got {type(doc_id).__name__}")
        self._check_open()
        try:
            keys = self.documents.own_keys(doc_id)
        except KeyError:
            raise KeyError(f"document id {doc_id!r} is unknown to this engine (ids live in the process that "
                           "ingested or served them); nothing deleted") from None
        self.store.flush()
        unreached: set[str] = set()
        for key in keys:
            unreached.update(self.store.delete(key))
        if unreached:  # the id stays known: a retry deletes again
            raise StoreUnavailable(f"document {doc_id!r}: tier {', '.join(sorted(unreached))} could not be reached, "
                                   "so its blocks may stay there (the other tiers dropped them); retry the delete "
                                   "once it is back: the id stays known")
        self.documents.forget(doc_id)
        return keys

    def build_prompt(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str]) -> Prompt:
        """The prompt of a question (str) or a conversation (messages) over `documents`."""
        question = query if isinstance(query, str) else check_messages(query)
        return self.prompts.build(question, check_documents(documents))

    def generate(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str] = (), *,
                 mode: str = "blend", recompute_ratio: float | None = None, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
                 stop: str | Sequence[str] | None = None, answer: str | None = None,
                 selection: str | None = None, logprobs: bool = False,
                 follow: Sequence[int] | None = None) -> GenerationResult:
        """Answer `query` over `documents` in `mode`.

        `query` is a question (laid out with the configured system prompt and query
        template) or a conversation: a list of {"role", "content"} messages, with the
        documents placed before it (blend.conversation). `selection` overrides the
        config's token-selection policy for this request (blend mode); `stop` ends the
        generation at the first of these strings (not included in the text).

        Side effects: document misses are computed and written to the store. With `answer`,
        stats.answer_nll is the mean negative log-likelihood of that text teacher-forced
        after the prompt (decoding continues from the same cache). With `logprobs`,
        result.token_logprobs (T, vocab) are the log-probs of each decoding step; with
        `follow` (token ids), result.follow_logprobs (len, vocab) are the log-probs before
        each of those ids teacher-forced after the prompt (eval compares modes token by
        token along full prefill's answer this way).
        """
        if answer is not None and not isinstance(answer, str):
            raise TypeError(f"answer must be a str or None, got {type(answer).__name__}")
        if not isinstance(logprobs, bool):
            raise TypeError(f"logprobs must be a bool, got {type(logprobs).__name__}")
        vocab = self.runner.lm_head.weight.shape[0]
        if follow is not None and (not isinstance(follow, Sequence) or isinstance(follow, str | bytes) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in follow)):
            raise TypeError(f"follow must be a sequence of token ids in [0, {vocab}) or None")
        *_, result = self._stream(self._request(query, documents, mode, recompute_ratio, max_new_tokens,
                                                temperature, top_p, seed, stop, selection), answer,
                                  logprobs=logprobs, follow=tuple(follow) if follow is not None else None)
        return result

    def generate_stream(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str] = (), *,
                        mode: str = "blend", recompute_ratio: float | None = None,
                        max_new_tokens: int | None = None, temperature: float | None = None,
                        top_p: float | None = None, seed: int | None = None, stop: str | Sequence[str] | None = None,
                        selection: str | None = None) -> Iterator[TextDelta | GenerationResult]:
        """`generate` streamed: yields a `TextDelta` per generated token (new final text,
        possibly "") and ends with the `GenerationResult` (the same tokens and text as
        `generate`; the deltas concatenate to its text).

        Arguments are checked now (TypeError/ValueError); the prefill runs at the first
        `next()`. Closing the iterator early stops decoding.
        """
        return self._stream(self._request(query, documents, mode, recompute_ratio, max_new_tokens, temperature,
                                          top_p, seed, stop, selection))

    def _request(self, query, documents, mode, recompute_ratio, max_new_tokens, temperature, top_p, seed, stop,
                 selection) -> GenerationRequest:
        self._check_open()
        return GenerationRequest.create(self.config.engine, query, documents, mode=mode,
                                        recompute_ratio=recompute_ratio, max_new_tokens=max_new_tokens,
                                        temperature=temperature, top_p=top_p, seed=seed, stop=stop,
                                        selection=selection)

    def check_fits(self, req: GenerationRequest) -> None:
        """Refuse a request whose text cannot fit the model's positions, without tokenizing it
        (the exact check, on tokens, follows when the prompt is built)."""
        self.prompts.check_text_fits(req.query, req.documents, self.runner.max_positions)

    def _stream(self, req: GenerationRequest, answer: str | None = None, *, logprobs: bool = False,
                follow: tuple[int, ...] | None = None) -> Iterator[TextDelta | GenerationResult]:
        self.check_fits(req)
        prompt = self.prompts.build(req.query, req.documents)
        shorten = "use fewer or shorter documents" if isinstance(req.query, str) else (
            "shorten the conversation (fewer or shorter messages)"
            + (" or use fewer or shorter documents" if req.documents else ""))
        self.runner.check_length(len(prompt), req.max_new_tokens, shorten)
        warnings = self._note_documents(prompt, req.documents)
        sampling = SamplingParams(req.temperature, req.top_p, req.seed)
        if follow:
            self.runner.check_length(len(prompt), len(follow), shorten)
        return self._decode(prompt, req, sampling, answer, warnings, logprobs, follow)

    def _decode(self, prompt: Prompt, req: GenerationRequest, sampling: SamplingParams, answer: str | None,
                warnings: tuple[str, ...], logprobs: bool = False, follow: tuple[int, ...] | None = None
                ) -> Iterator[TextDelta | GenerationResult]:
        self._check_open()  # a stream created before `close` and started after it
        pre, ttft, t0 = self.decoder.timed(lambda: self.prefill(
            prompt, mode=req.mode, ratio=req.recompute_ratio, selection=req.selection,
            capacity=len(prompt) + req.max_new_tokens))
        for item in self.decoder.stream(pre, ttft, t0, req.max_new_tokens, sampling, req.stop, answer,
                                        logprobs=logprobs, follow=follow):
            if isinstance(item, GenerationResult):
                item.warnings = warnings
            yield item

    def _note_documents(self, prompt: Prompt, documents: Sequence[Document | str]) -> tuple[str, ...]:
        """Warn about empty documents (skipped) and documents whose id was ingested with
        other text; remember the ones with ids."""
        warnings = []
        kept = [d for d in documents if render_document(d)]
        if len(kept) < len(documents):
            warnings.append(f"skipped {len(documents) - len(kept)} empty document(s): they add nothing to the prompt")
        keys = None
        for i, doc in enumerate(kept):
            if not isinstance(doc, Document) or doc.id is None:
                continue
            if self.documents.differs(doc.id, doc):
                message = (f"document {doc.id!r} differs from the version seen before under that id "
                           "(title or text): its KV is computed, not loaded")
                log.warning(message)
                warnings.append(message)
            keys = keys if keys is not None else self._keys_by_document(prompt, len(kept))
            self.documents.record(doc.id, doc, keys[i])
        return tuple(warnings)

    def _keys_by_document(self, prompt: Prompt, n_documents: int) -> list[list[str]]:
        """The store keys of each (non-empty) document's blocks, in order."""
        keys: list[list[str]] = [[] for _ in range(n_documents)]
        for seg in prompt.documents:
            keys[seg.doc_index].extend(self.document_kv.keys(seg, prompt))
        return keys

    def warmup(self) -> float:
        """Run one short request through prefill and decoding so that the first real
        request's TTFT does not pay one-time costs (kernel selection, allocator, chat
        template). Full mode: nothing is read from or written to the store. Returns the
        seconds it took."""
        t0 = time.perf_counter()
        words = " ".join(["warm-up"] * max(1, min(self.config.engine.chunk_tokens, 256) // 3))
        self.generate("warm-up", [words], mode="full", max_new_tokens=2)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def prefill(self, prompt: Prompt, *, mode: str, ratio: float = 0.15, capacity: int | None = None,
                selection: str | None = None) -> Prefilled:
        """Fill a KVCache for `prompt` in `mode` and return the last position's logits.

        The cache holds `capacity` positions (default: the prompt), so decoding continues
        without reallocating."""
        capacity = max(capacity or 0, len(prompt))
        tuned = len(self.runner.tuner.tunings)
        t0 = time.perf_counter()
        try:
            if mode == "full":
                pre = self._full(prompt, capacity)
            elif mode == "prefix":
                pre = self._prefix(prompt, capacity)
            else:
                pre = self._blend(prompt, 0.0 if mode == "reuse" else ratio, capacity, mode,
                                  check_policy(selection or self.config.engine.selection))
        except LoadStalled as err:  # a tier too slow to wait for (now suspended): computed whole
            pre = self._full(prompt, capacity)
            pre.stats = pre.stats.replace(stalled_tiers=err.tiers)
        if pre.logits.device.type == "cuda":  # timed to the logits, as TTFT is
            torch.cuda.synchronize(pre.logits.device)
        pre.stats = pre.stats.replace(prefill_s=time.perf_counter() - t0)
        # the engine's first prefill pays one-time costs (kernel selection, allocator, lazy
        # init: often several times slower), and a request that timed attention kernels
        # measured them: neither is a sample of the model's speed
        if self._warm and len(self.runner.tuner.tunings) == tuned:
            self.splitter.observe(pre.stats, self.runner.num_layers)
        self._warm = True
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
        placements = self.document_kv.resolve(prompt, [s for s in prompt.segments if s.kind != "query"], tally)
        # hook: the load-or-compute split (blend.split) may compute a prefix instead of loading it
        split = self.splitter.plan(prompt, placements, ratio, cfg.check_layers, cfg.filter_schedule,
                                   self.runner.num_layers, query_pass=not uses_check_layers(selection))
        plan = plan_recompute(prompt, ratio, cfg.check_layers, cfg.filter_schedule, self.runner.num_layers,
                              policy=selection, placements=placements, sink_tokens=cfg.sink_tokens,
                              query_layers=cfg.query_layers, query_pool=cfg.query_pool,
                              fresh=split.computed_tokens)
        cache = self.runner.new_cache(capacity)
        cache.length = plan.n
        with LayerLoader(self.store, self.runner, cache, split.loaded, range(plan.load_from, self.runner.num_layers),
                         cfg.prefetch_depth, stall_s=self._stall_s) as loader:
            logits, chosen = run_layers(self.runner, cache, torch.tensor(prompt.token_ids), plan, loader,
                                        policy=selection, deviation_kind=cfg.deviation, stale_bias=cfg.stale_bias,
                                        stale_shift=shift_applies(cfg.stale_shift, selection))
        stats = self._stats(prompt, mode, ratio, loaded_tokens=0 if plan.full else int(plan.ctx_rows.numel()),
                            recomputed_tokens=chosen.recomputed_tokens + split.computed_tokens, load=loader.report(),
                            selection=chosen, split=split.report, **tally_fields(tally))
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
            chain = self.document_kv.resolve(prompt, [s for s in exact if s.end <= limit], tally)
        else:
            for pl in chain:
                tally.hit_from("prefix_blocks", pl.source)
        cache = self.runner.new_cache(capacity)
        # hook: the load-or-compute split (blend.split) may compute the chain's first blocks instead
        split = self.splitter.plan_prefix(len(ids), chain, self.runner.num_layers)
        logits, load = self.prefix_cache.prefill(ids, chain, cache, computed=split.computed_tokens)
        end = max((pl.start + pl.length for pl in chain), default=0)
        loaded = end - split.computed_tokens
        stored = self.prefix_cache.store_blocks(ids, cache, skip_below=chain_len)
        stats = self._stats(prompt, "prefix", 0.0, loaded_tokens=loaded, recomputed_tokens=max(0, prompt.query.start - loaded),
                            load=load, stored_blocks=stored, split=split.report, **tally_fields(tally))
        return Prefilled(logits, cache, stats)

    # ------------------------------------------------------------------- chat
    def chat(self, session_id: str, message: str, *, documents: Sequence[Document | str] = (),
             system: str | None = None, mode: str | None = None, recompute_ratio: float | None = None,
             max_new_tokens: int | None = None, temperature: float | None = None, top_p: float | None = None,
             seed: int | None = None, stop: str | Sequence[str] | None = None) -> GenerationResult:
        """One conversation turn; the conversation's KV is kept for the next turn.

        With `documents`, they are placed before the conversation and, in `mode` blend
        (the default with documents) or reuse, their cached KV is blended in; full or
        prefix treat the whole prompt exactly. `system` adds a system message for this
        turn (without documents: the chat template's own default applies; with
        documents: the configured system prompt). Exact KV is stored as prefix blocks
        after the turn (blend.session). Raises SessionBusy if the session is in a turn.
        """
        self._check_open()
        if not isinstance(message, str):
            raise TypeError(f"message must be a str, got {type(message).__name__}")
        if not message.strip():
            raise ValueError("empty message: pass some text")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, got {type(system).__name__}")
        req = GenerationRequest.create(self.config.engine, message, documents,
                                       mode="blend" if mode is None else mode,
                                       recompute_ratio=recompute_ratio, max_new_tokens=max_new_tokens,
                                       temperature=temperature, top_p=top_p, seed=seed, stop=stop)
        self.check_fits(req)
        rag = None
        if req.documents:
            docs = req.documents

            def build(messages: Sequence[Message]) -> Prompt:
                prompt = self.prompts.build(tuple(messages), docs)
                self._note_documents(prompt, docs)
                return prompt

            def prefill(prompt: Prompt, capacity: int) -> Prefilled:
                return self.prefill(prompt, mode=req.mode, ratio=req.recompute_ratio, capacity=capacity)

            rag = RagTurn(build=build, prefill=prefill, exact=req.mode in ("full", "prefix"), documents=docs)
        return self.sessions.turn(session_id, message, max_new_tokens=req.max_new_tokens,
                                  sampling=SamplingParams(req.temperature, req.top_p, req.seed), stop=req.stop,
                                  system=system, rag=rag)

    def offload(self, session_id: str) -> None:
        """Move a session's KV off the compute device (its blocks stay in the tier stack)."""
        self._check_open()
        self.sessions.offload(session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session entirely (its history and its device-resident KV)."""
        self._check_open()
        self.sessions.drop(session_id)
