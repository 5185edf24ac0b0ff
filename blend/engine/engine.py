"""BlendEngine: the Python API, a thin facade over the scheduler that owns the model.

Modes
  full    full prefill of the whole prompt (the reference)
  reuse   cached document KV placed at its prompt positions; only the query is computed
  prefix  the longest exactly-cached prefix is loaded, the rest computed (prefix caching)
  blend   CacheBlend: cached KV plus a selective recompute of the tokens that matter most

Path of one request: `GenerationRequest.create` checks the arguments -> `PromptBuilder`
lays out [prefix][documents][query] and the documents' block keys are hashed once ->
a `Sequence` (its prefill as a `PromptWork`, its `Generation`) is queued on the
`Scheduler` -> when admitted, `Prefiller.steps` looks the blocks up, computes the misses
(one forward pass per step), then runs the prefill (blend.engine.prefill) -> the sequence
joins the decode batch (`Runner.decode_step` for every running sequence at once) -> its
events (text deltas, then the result) reach the caller through its `Handle`.

Every public method that runs the model goes through the scheduler, so calls from many
threads at once are safe and each gets the output it would get alone (`generate_many`
submits a list at once; blend.engine.asyncio wraps it for asyncio code). Documents are
str or `blend.Document`, rendered by `blend.prompt.document.render_document` only. Every
argument is checked before any work (`blend.engine.request`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from blend.config import EngineConfig, load_config, naming_config
from blend.decode.generation import Generation, Prefilled, eos_ids
from blend.decode.result import GenerationResult, TextDelta
from blend.decode.sampling import SamplingParams
from blend.engine.prefill import ForcedOutputs, Prefiller, PromptWork
from blend.engine.request import GenerationRequest
from blend.engine.scheduler import DECODE_RESERVE, Scheduler, SchedulerConfig
from blend.engine.sequence import Finished, Handle, Task, unwrap
from blend.engine.sequence import Sequence as ScheduledSequence
from blend.kv.documents import Block, DocumentCache, IngestStopped
from blend.kv.loader import join_abandoned
from blend.kv.offload import KVParking
from blend.kv.prefix import EntryMaker, PrefixCache
from blend.model.cache import KVCache
from blend.model.loading import LoadedModel, in_own_thread, load_model
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
from blend.session.manager import SessionManager, Turn
from storage.dtypes import dtype_bytes, dtype_name
from storage.exit_hooks import ClosedAtExit
from storage.stack import EXIT_FLUSH_S, TieredStore
from storage.tier import StoreUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")
ACTIVE_KV_SHARE = 0.25  # max_active_kv auto: this share of the memory free when the engine starts
# at interpreter exit, an engine not closed is closed: its requests cancelled, then at most this
# long for the scheduler's step under way (and loader threads given up by stalled requests)
EXIT_STOP_S = 30.0

# engines still open are closed at interpreter exit (storage.exit_hooks) in the order their threads
# need: requests cancelled, the scheduler's step under way ended, loaders given up by stalled
# requests awaited, then the store flushed; filled after the first store's registry, so it runs first
_OPEN_ENGINES: ClosedAtExit[BlendEngine] = ClosedAtExit(
    "engine", lambda engine: engine._close(stop_s=EXIT_STOP_S, flush_s=EXIT_FLUSH_S))


class _TurnEnd:
    """How a chat turn's sequence tells its session that it ended."""

    def __init__(self, sessions: SessionManager, turn: Turn):
        self.sessions, self.turn = sessions, turn

    def finish(self, result: GenerationResult, cache: KVCache | None) -> None:
        assert cache is not None
        self.sessions.finish(self.turn, result, cache)

    def abort(self) -> None:
        self.sessions.abort(self.turn)


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


class BlendEngine:
    """The Python API (see the module docstring). Thread-safe: every call that runs the model
    is queued on the engine's scheduler; `chat` rejects a second concurrent turn on the same
    session with `SessionBusy`."""

    def __init__(self, config: EngineConfig, *, model: LoadedModel | None = None, store: TieredStore | None = None):
        # built in a thread that ends with it: no OpenMP pool of the setup's torch work stays on
        # the caller's thread beside the scheduler's (see in_own_thread, run_exclusive)
        in_own_thread(lambda: self._build(config, model, store), "kvblend-engine-setup")

    def _build(self, config: EngineConfig, model: LoadedModel | None, store: TieredStore | None) -> None:
        self.config = config
        cfg = config.engine
        self.lm = model or load_model(config.model, device=config.device, dtype=config.dtype)
        cfg.check_model_layers(self.lm.dims.num_layers)
        # the store first: its settings are checked against the model's entry size before anything is built
        entry_bytes = self.lm.dims.kv_bytes_per_token(dtype_bytes(config.store.kv_dtype)) * cfg.blend.chunk_tokens
        self.store = store or TieredStore.from_config(config.store, min_entry_bytes=entry_bytes)
        self.runner = Runner(self.lm)
        self.prompts = PromptBuilder(self.lm.tokenizer, cfg.prompt.system_prompt, cfg.prompt.query_template, cfg.blend.max_document_tokens,
                                     self.lm.dims.max_positions)
        self.fingerprint = self.lm.fingerprint
        self.kv_dtype = config.store.kv_dtype
        self.eos = eos_ids(self.lm)
        maker = EntryMaker(self.runner, self.fingerprint, self.kv_dtype)
        stall_s = cfg.blend.load_stall_s or None  # LayerLoader's longest wait for one layer (0: none)
        namespace = self.store.namespace  # the configured one, with the secret's digest when there is one
        self.document_kv = DocumentCache(self.store, maker, namespace=namespace, chunk_context=cfg.blend.chunk_context,
                                         block_tokens=cfg.blend.chunk_tokens, stall_s=stall_s)
        # prefix blocks (prefix mode, chat sessions) are exact: the compute dtype, each tier's
        # `exact_codec` (none by default), so loading them equals computing them
        exact = EntryMaker(self.runner, self.fingerprint, dtype_name(self.runner.dtype))
        self.prefix_cache = PrefixCache(self.store, exact, namespace=namespace, block_tokens=cfg.blend.chunk_tokens,
                                        prefetch_depth=cfg.blend.prefetch_depth, stall_s=stall_s)
        # load-or-compute split (blend.planning.split): `auto` decides with a cost model calibrated
        # once and then fixed (the same request, the same split, whatever the load), `adaptive` with
        # the live estimates every request feeds
        self.splitter = Splitter(PrefillCosts.for_model(self.lm.model), LoadCosts(self.runner.device.type),
                                 {t.name: getattr(t.config, "kind", t.name) for t in self.store.tiers}, mode=cfg.blend.split,
                                 runner=self.runner)
        self.sessions = SessionManager(cfg, self.prefix_cache, self.prompts, self.eos)
        self.prefiller = Prefiller(cfg, self.runner, self.store, self.document_kv, self.prefix_cache, self.splitter,
                                   self.sessions, self.lm.tokenizer, stall_s)
        parking = KVParking(self.store, self.runner, self.fingerprint, namespace=namespace,
                            block_tokens=cfg.blend.chunk_tokens, prefetch_depth=cfg.blend.prefetch_depth, stall_s=stall_s)
        self.kv_bytes_per_token = self.lm.dims.kv_bytes_per_token(dtype_bytes(dtype_name(self.runner.dtype)))
        device = self.runner.device
        scheduling = SchedulerConfig(
            max_num_seqs=default_max_num_seqs(device) if cfg.scheduler.max_num_seqs == "auto" else cfg.scheduler.max_num_seqs,
            max_active_kv=(max(int(free_memory(device) * ACTIVE_KV_SHARE), 1) if cfg.scheduler.max_active_kv == "auto"
                           else cfg.scheduler.max_active_kv),
            prefills_between_decodes=cfg.scheduler.prefills_between_decodes,
            prefill_chunk_tokens=cfg.scheduler.prefill_chunk_tokens)
        # idle time (no request waiting, no sequence decoding) recomputes harvested documents standalone
        self.scheduler = Scheduler(self.runner, parking, scheduling, kv_bytes_per_token=self.kv_bytes_per_token,
                                   background=self.document_kv if cfg.blend.recompute_harvested else None)
        self.documents = DocumentIndex()
        _OPEN_ENGINES.add(self)

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
        """Let queued and running requests finish, flush pending cache writes and close the
        tiers; later calls raise ValueError.

        An engine still open when the interpreter exits is closed by an exit hook, so a script
        may end without calling this: its queued and running requests are cancelled, the
        scheduler's step under way ends (at most `EXIT_STOP_S`), queued writes are flushed
        (at most `storage.stack.EXIT_FLUSH_S`, the rest dropped with a warning), and the
        process exits normally."""
        self._close()

    def _close(self, *, stop_s: float | None = None, flush_s: float | None = None) -> None:
        """Stop in order: the scheduler (with `stop_s`: its items cancelled, its thread awaited
        that long), loader threads given up by stalled requests, then the store (its flush
        bounded by `flush_s`)."""
        if self._closed:
            return
        self._closed = True
        _OPEN_ENGINES.discard(self)
        exiting = stop_s is not None
        if not self.scheduler.stop(stop_s, cancel=exiting):
            log.warning("the engine's scheduler is still in a step after %.0f s; closing the store beside it", stop_s)
        if exiting:
            join_abandoned(stop_s)
        self.store.close(timeout=flush_s)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this BlendEngine is closed; create a new one (BlendEngine.from_config)")

    def __enter__(self) -> BlendEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- documents
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
        The forward passes run on the scheduler between decode steps of running requests.
        `stop` (e.g. a server job's deadline) is asked before each forward pass (one long
        document, or several short ones packed); when it answers True the call raises
        `IngestStopped`; what was computed so far stays stored (and known by id).
        A document that cannot fit the model's positions with the prompt's fixed part (no
        request could use it) is refused with ValueError before anything is computed or written.
        """
        handle = self.submit_ingest(documents, sync=sync, stop=stop)
        finished = _last(handle.events())
        if finished.cancelled:
            raise IngestStopped("ingest stopped before it finished; the documents computed stay stored", [])
        return unwrap(finished)

    def submit_ingest(self, documents: Sequence[Document | str], *, sync: bool = True,
                      stop: Callable[[], bool] | None = None, sink: Callable[[Any], None] | None = None,
                      deadline: float | None = None) -> Handle:
        """`ingest` queued: its handle's `Finished` holds the list of IngestedDocument (or
        `cancelled` once `stop` or the deadline stopped it)."""
        self._check_open()
        if not isinstance(sync, bool):
            raise TypeError(f"sync must be a bool, got {type(sync).__name__}")
        if stop is not None and not callable(stop):
            raise TypeError(f"stop must be a callable returning a bool, got {type(stop).__name__}")
        docs = check_documents(documents)
        names = [f"documents[{i}]" + (f" ({d.id!r})" if isinstance(d, Document) and d.id is not None else "")
                 for i, d in enumerate(docs) if render_document(d)]
        fix = "split it into shorter documents"
        kept = [d for d in docs if render_document(d)]
        for name, doc in zip(names, kept, strict=True):  # before tokenizing megabytes
            try:
                self.prompts.check_text_fits("ingest", [doc], self.runner.max_positions, fix)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        prompt = self.prompts.build("ingest", docs)
        self.prompts.check_documents_fit(prompt, names)  # one no request could use: refused, nothing written
        handle = Handle(sink, deadline)

        def stopped() -> bool:
            return handle.stopped() or (stop is not None and bool(stop()))

        self.scheduler.submit(Task("ingest", lambda: self._ingest_steps(docs, prompt, sync, stopped), handle))
        return handle

    def _ingest_steps(self, docs: tuple[Document | str, ...], prompt: Prompt, sync: bool,
                      stop: Callable[[], bool]) -> Generator[None, None, list[IngestedDocument]]:
        kept = [d for d in docs if render_document(d)]
        keys: list[list[str]] = [[] for _ in kept]
        cached = [True] * len(kept)
        stopped: IngestStopped | None = None
        try:
            segments = yield from self.document_kv.ingest_steps(prompt, stop)
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

    # ------------------------------------------------------------ generation
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
        documents placed before it (blend.prompt.conversation). `selection` overrides the
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
        req = self.request(query, documents, mode=mode, recompute_ratio=recompute_ratio,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                           stop=stop, selection=selection)
        return self.submit(req, answer=answer, logprobs=logprobs, follow=follow).result()

    def generate_stream(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str] = (), *,
                        mode: str = "blend", recompute_ratio: float | None = None,
                        max_new_tokens: int | None = None, temperature: float | None = None,
                        top_p: float | None = None, seed: int | None = None, stop: str | Sequence[str] | None = None,
                        selection: str | None = None) -> Iterator[TextDelta | GenerationResult]:
        """`generate` streamed: yields a `TextDelta` per generated token (new final text,
        possibly "") and ends with the `GenerationResult` (the same tokens and text as
        `generate`; the deltas concatenate to its text).

        Arguments are checked and the prompt is laid out now (TypeError/ValueError); the
        request is queued at the first `next()`. Closing the iterator early cancels it (it
        leaves the decode batch at the next step).
        """
        req = self.request(query, documents, mode=mode, recompute_ratio=recompute_ratio,
                           max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                           stop=stop, selection=selection)
        handle = Handle()
        seq = self._sequence(req, handle)
        return self._stream(seq)

    def _stream(self, seq: ScheduledSequence) -> Iterator[TextDelta | GenerationResult]:
        self._check_open()  # a stream created before `close` and started after it
        self.scheduler.submit(seq)
        ended = False
        try:
            for event in seq.handle.events():
                if isinstance(event, Finished):
                    ended = True
                    yield unwrap(event)
                    return
                yield event
        finally:
            if not ended:
                seq.handle.cancel()

    def generate_many(self, requests: Sequence[Mapping[str, Any] | GenerationRequest]) -> list[GenerationResult]:
        """Run several requests through the scheduler at once (prefills interleaved, decode
        steps batched); results in the order given, each the one `generate` would give alone.

        Each request is `generate`'s keyword arguments as a mapping (`query` and optionally
        `documents`, `mode`, `recompute_ratio`, `max_new_tokens`, `temperature`, `top_p`,
        `seed`, `stop`, `selection`, `answer`, `logprobs`, `follow`) or a GenerationRequest.
        Every request is checked before any is queued; if one fails, the others are
        cancelled and its error is raised.
        """
        if isinstance(requests, Mapping | str | bytes) or not isinstance(requests, Sequence):
            raise TypeError("requests must be a list of request mappings (generate's keyword arguments) "
                            "or GenerationRequest objects")
        sequences = []
        for i, spec in enumerate(requests):
            try:
                sequences.append(self._sequence_of(spec))
            except (TypeError, ValueError) as err:
                raise type(err)(f"requests[{i}]: {err}") from None
        for seq in sequences:
            self.scheduler.submit(seq)
        results = []
        try:
            for seq in sequences:
                results.append(seq.handle.result())
        finally:
            for seq in sequences[len(results):]:
                seq.handle.cancel()
        return results

    def _sequence_of(self, spec: Mapping[str, Any] | GenerationRequest) -> ScheduledSequence:
        if isinstance(spec, GenerationRequest):
            return self._sequence(spec, Handle())
        if not isinstance(spec, Mapping):
            raise TypeError(f"a request must be a mapping of generate's arguments, got {type(spec).__name__}")
        extra_keys = {"answer", "logprobs", "follow"}
        args = dict(spec)
        if "query" not in args:
            raise ValueError("a request needs its `query`")
        extra = {k: args.pop(k) for k in list(args) if k in extra_keys}
        query, documents = args.pop("query"), args.pop("documents", ())
        known = {"mode", "recompute_ratio", "max_new_tokens", "temperature", "top_p", "seed", "stop", "selection"}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown request key(s) {', '.join(unknown)}; valid keys are: "
                             f"{', '.join(sorted(known | extra_keys | {'query', 'documents'}))}")
        req = self.request(query, documents, **args)
        return self._sequence(req, Handle(), **self._forcing_args(extra))

    def _forcing_args(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        answer, logprobs, follow = extra.get("answer"), extra.get("logprobs", False), extra.get("follow")
        if answer is not None and not isinstance(answer, str):
            raise TypeError(f"answer must be a str or None, got {type(answer).__name__}")
        if not isinstance(logprobs, bool):
            raise TypeError(f"logprobs must be a bool, got {type(logprobs).__name__}")
        vocab = self.runner.lm_head.weight.shape[0]
        if follow is not None and (not isinstance(follow, Sequence) or isinstance(follow, str | bytes) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in follow)):
            raise TypeError(f"follow must be a sequence of token ids in [0, {vocab}) or None")
        return {"answer": answer, "logprobs": logprobs, "follow": tuple(follow) if follow is not None else None}

    def request(self, query: object, documents: object = (), **kwargs: Any) -> GenerationRequest:
        """`generate`'s arguments checked into a GenerationRequest (config defaults filled in)."""
        self._check_open()
        return GenerationRequest.create(self.config.engine, query, documents, **kwargs)

    def submit(self, req: GenerationRequest, *, sink: Callable[[Any], None] | None = None,
               deadline: float | None = None, answer: str | None = None, logprobs: bool = False,
               follow: Sequence[int] | None = None) -> Handle:
        """Queue a checked request; its handle gets the `TextDelta`s and then one `Finished`
        holding the GenerationResult (events go to `sink` when given, e.g. an event loop's
        queue, else `handle.events()` / `handle.result()` wait for them). `deadline`
        (time.monotonic) cancels it once passed. Raises QueueFull when the queue is full."""
        forcing = self._forcing_args({"answer": answer, "logprobs": logprobs, "follow": follow})
        seq = self._sequence(req, Handle(sink, deadline), **forcing)
        self.scheduler.submit(seq)
        return seq.handle

    def check_fits(self, req: GenerationRequest) -> None:
        """Refuse a request whose text cannot fit the model's positions, without tokenizing it
        (the exact check, on tokens, follows when the prompt is built)."""
        self.prompts.check_text_fits(req.query, req.documents, self.runner.max_positions)

    def _sequence(self, req: GenerationRequest, handle: Handle, *, answer: str | None = None,
                  logprobs: bool = False, follow: tuple[int, ...] | None = None) -> ScheduledSequence:
        """The request laid out as a scheduled sequence (checks that it fits; nothing queued)."""
        self._check_open()
        self.check_fits(req)
        prompt = self.prompts.build(req.query, req.documents)
        shorten = "use fewer or shorter documents" if isinstance(req.query, str) else (
            "shorten the conversation (fewer or shorter messages)"
            + (" or use fewer or shorter documents" if req.documents else ""))
        self.runner.check_length(len(prompt), req.max_new_tokens, shorten)
        if follow:
            self.runner.check_length(len(prompt), len(follow), shorten)
        blocks = self.document_kv.segment_blocks(prompt) if req.mode != "full" or _has_ids(req.documents) else None
        warnings = self._note_documents(prompt, req.documents, blocks)
        capacity = len(prompt) + min(req.max_new_tokens, DECODE_RESERVE)
        work = PromptWork(prompt, blocks, req.mode, req.recompute_ratio, req.selection, capacity, answer, follow)
        forced = ForcedOutputs()
        generation = Generation(self.lm.tokenizer, self.eos, req.max_new_tokens,
                                SamplingParams(req.temperature, req.top_p, req.seed), req.stop, logprobs=logprobs)
        seq = ScheduledSequence(lambda: self.prefiller.steps(work, forced), generation, handle,
                                kv_bytes=capacity * self.kv_bytes_per_token, mode=req.mode, warnings=warnings)
        seq.forced = forced
        return seq

    def _note_documents(self, prompt: Prompt, documents: Sequence[Document | str],
                        blocks: dict[int, list[Block]] | None) -> tuple[str, ...]:
        """Warn about empty documents (skipped) and documents whose id was ingested with
        other text; remember the ones with ids (and their block keys)."""
        warnings = []
        kept = [d for d in documents if render_document(d)]
        if len(kept) < len(documents):
            warnings.append(f"skipped {len(documents) - len(kept)} empty document(s): they add nothing to the prompt")
        keys: list[list[str]] = [[] for _ in kept]
        for i, seg in enumerate(prompt.segments):
            if seg.kind == "document" and blocks is not None:
                keys[seg.doc_index].extend(b.key for b in blocks[i])
        for i, doc in enumerate(kept):
            if not isinstance(doc, Document) or doc.id is None:
                continue
            if self.documents.differs(doc.id, doc):
                message = (f"document {doc.id!r} differs from the version seen before under that id "
                           "(title or text): its KV is computed, not loaded")
                log.warning(message)
                warnings.append(message)
            self.documents.record(doc.id, doc, keys[i])
        return tuple(warnings)

    def warmup(self) -> float:
        """Run one short request through prefill and decoding so that the first real
        request's TTFT does not pay one-time costs (kernel selection, allocator, chat
        template) and, under `engine.blend.split: auto`, so that the split's cost model is calibrated
        (blend.planning.split). Full mode: nothing is read from or written to the store.
        Returns the seconds it took."""
        t0 = time.perf_counter()
        words = " ".join(["warm-up"] * max(1, min(self.config.engine.blend.chunk_tokens, 256) // 3))
        self.generate("warm-up", [words], mode="full", max_new_tokens=2)
        if self.splitter.needs_calibration:
            self.run_exclusive(self.splitter.cost_model, "calibrate the split's cost model")
        return time.perf_counter() - t0

    def run_exclusive(self, fn: Callable[[], T], name: str = "exclusive") -> T:
        """Run `fn()` on the scheduler's thread between two steps (no request runs meanwhile)
        and return its value. For torch work of your own beside the engine (a benchmark's
        timed prefill, metrics over logits): with libgomp every thread that starts parallel
        work keeps its own OpenMP pool, and once the pools hold more threads than there are
        cores their workers stop spinning between parallel regions, which made the scheduler's
        small ops slower for as long as the process lived (measured on 2 cores: blend@0.05
        +25%, reuse +17%, full prefill +4%). A thread that ends frees its pool."""
        self._check_open()

        def steps() -> Generator[None, None, T]:
            return fn()
            yield  # a generator of one step

        handle = Handle()
        self.scheduler.submit(Task(name, steps, handle))
        return handle.result()

    def prefill(self, prompt: Prompt, *, mode: str, ratio: float = 0.15, capacity: int | None = None,
                selection: str | None = None) -> Prefilled:
        """Fill a KVCache for `prompt` in `mode` and return it with the last position's
        logits (a task on the scheduler: serialised with every other request). The cache
        holds `capacity` positions (default: the prompt) and belongs to the caller."""
        self._check_open()
        work = PromptWork(prompt, None, mode, ratio, selection, max(capacity or 0, len(prompt)))
        handle = Handle()
        self.scheduler.submit(Task("prefill", lambda: self.prefiller.steps(work), handle))
        return handle.result()

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
        The turn decodes in the scheduler's batch like any request.
        """
        return self.submit_chat(session_id, message, documents=documents, system=system, mode=mode,
                                recompute_ratio=recompute_ratio, max_new_tokens=max_new_tokens,
                                temperature=temperature, top_p=top_p, seed=seed, stop=stop).result()

    def submit_chat(self, session_id: str, message: str, *, documents: Sequence[Document | str] = (),
                    system: str | None = None, mode: str | None = None, recompute_ratio: float | None = None,
                    max_new_tokens: int | None = None, temperature: float | None = None,
                    top_p: float | None = None, seed: int | None = None, stop: str | Sequence[str] | None = None,
                    sink: Callable[[Any], None] | None = None, deadline: float | None = None) -> Handle:
        """`chat` queued: the handle gets the turn's deltas, then its `Finished`."""
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
        turn = self.sessions.begin(session_id, message, max_new_tokens=req.max_new_tokens, system=system,
                                   documents=req.documents, blended=req.mode in ("blend", "reuse"))
        try:
            work = None
            capacity = len(turn.ids) + req.max_new_tokens
            if turn.prompt is not None:
                blocks = self.document_kv.segment_blocks(turn.prompt)
                self._note_documents(turn.prompt, req.documents, blocks)
                if turn.blended:
                    work = PromptWork(turn.prompt, blocks, req.mode, req.recompute_ratio, None, capacity)
            generation = Generation(self.lm.tokenizer, self.eos, req.max_new_tokens,
                                    SamplingParams(req.temperature, req.top_p, req.seed), req.stop)
            handle = Handle(sink, deadline)
            seq = ScheduledSequence(lambda: self.prefiller.turn_steps(turn, work), generation, handle,
                                    kv_bytes=capacity * self.kv_bytes_per_token, end=_TurnEnd(self.sessions, turn),
                                    mode=req.mode)
            self.scheduler.submit(seq)
        except BaseException:
            self.sessions.abort(turn)
            raise
        return handle

    def offload(self, session_id: str) -> None:
        """Move a session's KV off the compute device (its blocks stay in the tier stack)."""
        self._check_open()
        self.sessions.offload(session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session entirely (its history and its device-resident KV)."""
        self._check_open()
        self.sessions.drop(session_id)


def _has_ids(documents: Sequence[Document | str]) -> bool:
    return any(isinstance(d, Document) and d.id is not None for d in documents)


def _last(events: Iterator[Any]) -> Finished:
    finished = None
    for event in events:
        finished = event
    assert isinstance(finished, Finished)
    return finished
