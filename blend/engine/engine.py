"""BlendEngine: the Python API, a thin facade over the scheduler that owns the model.

Modes
  full    full prefill of the whole prompt (the reference)
  reuse   cached document KV placed at its prompt positions; only the query is computed
  prefix  the longest exactly-cached prefix is loaded, the rest computed (prefix caching)
  blend   CacheBlend: cached KV plus a selective recompute of the tokens that matter most

The engine is a facade: its parts are built by blend.engine.parts, requests are laid out by
blend.engine.layout, ingests and document ids are kept by blend.kv.ingest.

Path of one request: `GenerationRequest.create` checks the arguments -> the layout stage
(`RequestLayout.lay_out`): `PromptBuilder` lays out [prefix][documents][query] and the
documents' block keys are hashed once -> a `Sequence` (its prefill as a `PromptWork`, its
`Generation`) is queued on the `Scheduler` -> when admitted, `Prefiller.plan` makes its plan, a
cursor (blend.engine.prefill) that the scheduler advances between steps: it looks the blocks
up, computes the misses (one forward pass per step), then runs the prefill -> the sequence joins the decode batch (`Runner.decode_step` for every running sequence at once) -> its
events (text deltas, then the result) reach the caller through its `Handle`.

Every public method that runs the model goes through the scheduler, so calls from many
threads at once are safe and each gets the output it would get alone (`generate_many`
submits a list at once; blend.engine.async_engine wraps it for asyncio code). Documents are
str or `blend.Document`, rendered by `blend.prompt.document.render_document` only. Every
argument is checked before any work (`blend.engine.request`).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, Unpack

from blend.config import EngineConfig, load_config, naming_config
from blend.decode.generation import Prefilled
from blend.decode.result import GenerationResult, TextDelta
from blend.engine.layout import NO_FORCING, Forcing, LaidOut
from blend.engine.parts import build_parts
from blend.engine.prefill import PromptWork
from blend.engine.request import ChatOptions, GenerationRequest, RequestOptions, check_ingest_options
from blend.engine.sequence import Handle, Task, results, unwrap
from blend.engine.sequence import Sequence as ScheduledSequence
from blend.engine.work import ExclusiveWork, IngestWork, TurnWork
from blend.kv.documents import IngestStopped
from blend.kv.loader import join_abandoned
from blend.model.loading import LoadedModel, in_own_thread
from blend.prompt.builder import Prompt, PromptTemplate
from blend.prompt.conversation import Message
from blend.prompt.document import Document, IngestedDocument
from storage.exit_hooks import ClosedAtExit
from storage.stack import EXIT_FLUSH_S, TieredStore

if TYPE_CHECKING:  # blend.engine.handoff imports transformers: only when it is used
    import torch

    from blend.engine.handoff import Prepared

log = logging.getLogger(__name__)
T = TypeVar("T")
# at interpreter exit, an engine not closed is closed: its requests cancelled, then at most this
# long for the scheduler's step under way (and loader threads given up by stalled requests)
EXIT_STOP_S = 30.0

# engines still open are closed at interpreter exit (storage.exit_hooks) in the order their threads
# need: requests cancelled, the scheduler's step under way ended, loaders given up by stalled
# requests awaited, then the store flushed; filled after the first store's registry, so it runs first
_OPEN_ENGINES: ClosedAtExit[BlendEngine] = ClosedAtExit(
    "engine", lambda engine: engine._close(stop_s=EXIT_STOP_S, flush_s=EXIT_FLUSH_S, cancel=True))


def settle_garbage() -> None:
    """Collect once, then move every object alive now (the model, the tokenizer, the engine's
    parts) out of the garbage collector's reach for good (`gc.freeze`): a full collection then
    scans only what requests made since. Measured with SmolLM2 loaded (2 cores): a full
    collection 175 ms before, under 0.1 ms after; it holds the GIL, so whichever thread runs it
    holds the scheduler's thread too."""
    gc.collect()
    gc.freeze()


class BlendEngine:
    """The Python API (see the module docstring). Thread-safe: every call that runs the model is
    queued on the engine's scheduler; `chat` rejects a second concurrent turn with `SessionBusy`."""

    def __init__(self, config: EngineConfig, *, model: LoadedModel | None = None, store: TieredStore | None = None):
        self.config, self._closed = config, False
        self._closing = threading.Lock()  # a second `close` waits for the first to end
        # built in a thread that ends with it: no OpenMP pool of the setup's torch work stays on
        # the caller's thread beside the scheduler's (see in_own_thread, run_exclusive)
        parts = in_own_thread(lambda: build_parts(config, model, store), "kvblend-engine-setup")
        self.lm, self.runner, self.store, self.prompts = parts.lm, parts.runner, parts.store, parts.prompts
        self.document_kv, self.prefix_cache, self.splitter = parts.document_kv, parts.prefix_cache, parts.splitter
        self.sessions, self.prefiller, self.scheduler = parts.sessions, parts.prefiller, parts.scheduler
        self.layout, self.ingestor = parts.layout, parts.ingestor  # request layout; ingests and ids (blend.kv.ingest)
        self.eos, self.kv_bytes_per_token = parts.eos, parts.kv_bytes_per_token
        self.fingerprint, self.kv_dtype = self.lm.fingerprint, config.store.kv_dtype
        _OPEN_ENGINES.add(self)

    @classmethod
    def from_config(cls, path: str | Path | None = None, **overrides: Any) -> BlendEngine:
        """Build from a YAML config (None: $KVBLEND_CONFIG, else the packaged default; see
        blend.config.load_config); overrides (e.g. recompute_ratio=0.3, model=...) win over it.
        A setting found wrong only once the model or store is known names the file too."""
        config = load_config(path, **overrides)
        with naming_config(path):
            return cls(config)

    def close(self, timeout: float | None = None, *, cancel: bool = False) -> None:
        """Let queued and running requests finish (`cancel`: end each now, its caller told it was
        cancelled), flush pending writes, close the tiers; later calls raise ValueError.
        `timeout` (seconds; None: as long as it takes) bounds the wait for the scheduler and,
        again, the flush (the writes still queued then are dropped with a warning). An engine
        open at interpreter exit is closed by an exit hook: its requests cancelled, the step under
        way ended (at most `EXIT_STOP_S`), queued writes flushed (at most
        `storage.stack.EXIT_FLUSH_S`)."""
        self._close(stop_s=timeout, flush_s=timeout, cancel=cancel)

    def _close(self, *, stop_s: float | None = None, flush_s: float | None = None, cancel: bool = False) -> None:
        """Stop in order: the scheduler (`cancel`: its items cancelled; its thread awaited `stop_s`),
        loader threads given up by stalled requests, the store (its flush bounded by `flush_s`)."""
        with self._closing:
            if self._closed:
                return
            self._closed = True
            _OPEN_ENGINES.discard(self)
            if not self.scheduler.stop(stop_s, cancel=cancel):
                log.warning("the engine's scheduler is still in a step after %.0f s; closing the store beside it",
                            stop_s)
            if stop_s is not None:
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
    def ingest(self, documents: Sequence[Document | str], *, sync: bool = True, stop: Callable[[], bool] | None = None,
               template: PromptTemplate | None = None) -> list[IngestedDocument]:
        """Precompute each document's KV (after `template`'s fixed part; None: the configured one) and
        store it block by block, between decode steps. Per document: its id, block keys, whether every
        block was cached before and (sync: writes awaited) whether a tier holds every block now.
        Idempotent; empty documents skipped; ids remembered. `stop` is asked before each pass (True:
        `IngestStopped`, what was computed stays stored); a document no request could use: ValueError."""
        finished = self.submit_ingest(documents, sync=sync, stop=stop, template=template).finished_event()
        if finished.cancelled:
            raise IngestStopped("ingest stopped before it finished; the documents computed stay stored", [])
        return unwrap(finished)

    def submit_ingest(self, documents: Sequence[Document | str], *, sync: bool = True,
                      stop: Callable[[], bool] | None = None, sink: Callable[[Any], None] | None = None,
                      deadline: float | None = None, template: PromptTemplate | None = None) -> Handle:
        """`ingest` queued: its handle's `Finished` holds the list of IngestedDocument (or
        `cancelled` once `stop` or the deadline stopped it)."""
        self._check_open()
        check_ingest_options(sync, stop)
        job = self.ingestor.prepare(documents, self.layout.builder(template), self.runner.max_positions)
        # sync: the writes awaited on a thread of the handle's, never on the scheduler's (a hung store
        # write would hold every request there)
        handle = Handle(sink, deadline, then=self.ingestor.confirm if sync else None)
        return self.scheduler.submit(Task("ingest", IngestWork(job, sync, stop), handle))

    def delete_document(self, doc_id: str) -> tuple[str, ...]:
        """Remove a document this engine ingested (or served with an explicit id) from every tier;
        returns the keys deleted (blocks another known document uses are kept). KeyError if the id
        is unknown to this engine; StoreUnavailable (the id stays known) if a tier could not be
        reached. The delete wins over every write of those blocks planned before it (queued, under
        way, a request in flight, the background recompute of a harvested document): nothing
        deleted is stored again but by a request or ingest made after it (blend.kv.ingest.Ingestor.delete)."""
        self._check_open()
        return self.ingestor.delete(doc_id)

    # ------------------------------------------------------------ generation
    def build_prompt(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str], *,
                     template: PromptTemplate | None = None) -> Prompt:
        """The prompt of a question (str) or a conversation (messages) over `documents`."""
        return self.layout.build_prompt(query, documents, template)

    def generate(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str] = (), *,
                 answer: str | None = None, logprobs: bool = False, follow: Sequence[int] | None = None,
                 **options: Unpack[RequestOptions]) -> GenerationResult:
        """Answer `query` (a question, or a conversation: {"role", "content"} messages) over
        `documents`; `options` (blend.engine.request.RequestOptions): mode (default blend),
        recompute_ratio, max_new_tokens, temperature, top_p, seed, stop, selection, and this
        request's own `template` (PromptTemplate) and `split` (e.g. "off"). Document misses are
        computed and stored. Teacher forcing (eval): `answer` gives stats.answer_nll (its mean
        NLL after the prompt); `logprobs`, result.token_logprobs (T, vocab) of each decoding
        step; `follow` (token ids), result.follow_logprobs (len, vocab) before each forced id."""
        return self.submit(self.request(query, documents, **options), answer=answer, logprobs=logprobs,
                           follow=follow).result()

    def generate_stream(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str] = (),
                        **options: Unpack[RequestOptions]) -> Iterator[TextDelta | GenerationResult]:
        """`generate` streamed: a `TextDelta` per generated token (new final text, possibly ""),
        then the `GenerationResult` (the deltas concatenate to its text). Arguments are checked
        and the prompt laid out now; the request is queued at the first `next()`; closing the
        iterator early cancels it."""
        return self._stream(self._sequence(self.request(query, documents, **options), Handle()))

    def _stream(self, seq: ScheduledSequence) -> Iterator[TextDelta | GenerationResult]:
        self._check_open()  # a stream created before `close` and started after it
        self.scheduler.submit(seq)
        yield from seq.handle.stream()

    def generate_many(self, requests: Sequence[Mapping[str, Any] | GenerationRequest]) -> list[GenerationResult]:
        """Several requests through the scheduler at once (prefills interleaved, decode steps
        batched); results in order, each the one `generate` would give alone. A request is
        `generate`'s keyword arguments as a mapping (with `query`) or a GenerationRequest. All
        are checked and laid out before any is queued; if one fails, the others are cancelled."""
        self._check_open()
        sequences = [self._sequence(req, Handle(), out=out) for req, out in self.layout.lay_out_many(requests)]
        return results([self.scheduler.submit(seq) for seq in sequences])

    def request(self, query: object, documents: object = (), **kwargs: Any) -> GenerationRequest:
        """`generate`'s arguments checked into a GenerationRequest (config defaults filled in)."""
        self._check_open()
        return self.layout.request(query, documents, **kwargs)

    def submit(self, req: GenerationRequest, *, sink: Callable[[Any], None] | None = None,
               deadline: float | None = None, answer: str | None = None, logprobs: bool = False,
               follow: Sequence[int] | None = None) -> Handle:
        """Queue a checked request; its handle gets the `TextDelta`s, then one `Finished` holding the
        GenerationResult (to `sink`, else `handle.events()` / `handle.result()`). `deadline`
        (time.monotonic) cancels it once passed. QueueFull when the queue is full."""
        return self.scheduler.submit(self._sequence(req, Handle(sink, deadline),
                                                    self.layout.forcing(answer, logprobs, follow)))

    def check_fits(self, req: GenerationRequest) -> None:
        """Refuse a request whose text cannot fit the model's positions, without tokenizing it."""
        self.layout.check_fits(req)

    def _sequence(self, req: GenerationRequest, handle: Handle, forcing: Forcing = NO_FORCING, *,
                  out: LaidOut | None = None) -> ScheduledSequence:
        """The request (`out`: already laid out) as a scheduled sequence (nothing queued)."""
        self._check_open()
        out = out or self.layout.lay_out(req, forcing)
        return ScheduledSequence(out.work, out.generation, handle, kv_bytes=out.kv_bytes, mode=req.mode,
                                 warnings=out.warnings)

    def warmup(self) -> float:
        """One short full-mode request (nothing read or written in the store), so that the first
        real TTFT pays no one-time costs (kernel selection, allocator, chat template), and under
        `engine.blend.split: auto` the split's cost model calibrated; then what is alive is kept
        out of the garbage collector's full passes (`settle_garbage`). Returns the seconds it took."""
        t0 = time.perf_counter()
        words = " ".join(["warm-up"] * max(1, min(self.document_kv.block_tokens, 256) // 3))
        self.generate("warm-up", [words], mode="full", max_new_tokens=8)  # decode steps: the first pays one-time checks
        if self.splitter.needs_calibration:
            self.run_exclusive(self.splitter.cost_model, "calibrate the split's cost model")
        settle_garbage()
        return time.perf_counter() - t0

    def run_exclusive(self, fn: Callable[[], T], name: str = "exclusive") -> T:
        """`fn()` run on the scheduler's thread between two steps, its value returned: torch work of
        your own beside the engine (a thread of yours keeps its own OpenMP pool, and more pool
        threads than cores slow the scheduler's small ops: 2 cores, blend@0.05 +25%)."""
        return self._task(name, ExclusiveWork(fn))

    def prefill(self, prompt: Prompt, *, mode: str, ratio: float = 0.15, capacity: int | None = None,
                selection: str | None = None) -> Prefilled:
        """A KVCache filled for `prompt` in `mode` (a task on the scheduler) with the last position's
        logits; it holds `capacity` positions (default: the prompt) and belongs to the caller."""
        return self._task("prefill", PromptWork(prompt, None, mode, ratio, selection, max(capacity or 0, len(prompt))))

    def _task(self, name: str, work: PromptWork | ExclusiveWork) -> Any:
        """`work` run as a task on the scheduler (between steps, or as a prefill's steps); its result."""
        self._check_open()
        return self.scheduler.submit(Task(name, work, Handle())).result()

    def prepare(self, query: str | Sequence[Message | dict], documents: Sequence[Document | str] = (),
                **options: Any) -> Prepared:
        """The prompt prefilled in `mode` (default blend) as ids and a transformers cache to continue
        from (options: mode, recompute_ratio, selection, template, carry_bias; blend.engine.handoff)."""
        from blend.engine.handoff import prepare

        return prepare(self, query, documents, **options)

    def transformers_model(self) -> torch.nn.Module:
        """The transformers model with the engine's weights, reading `prepare`'s caches."""
        from blend.engine.handoff import transformers_model

        return transformers_model(self)

    # ------------------------------------------------------------------- chat
    def chat(self, session_id: str, message: str, *, documents: Sequence[Document | str] = (),
             system: str | None = None, **options: Unpack[ChatOptions]) -> GenerationResult:
        """One conversation turn, its KV kept for the next (exact KV stored as prefix blocks,
        blend.session); `options`: blend.engine.request.ChatOptions. `documents` go before the
        conversation, their cached KV blended in under mode blend (the default) or reuse (full,
        prefix: exact). `system` adds a system message for this turn (with documents: the
        configured system prompt). SessionBusy if the session is in a turn."""
        return self.submit_chat(session_id, message, documents=documents, system=system, **options).result()

    def submit_chat(self, session_id: str, message: str, *, documents: Sequence[Document | str] = (),
                    system: str | None = None, sink: Callable[[Any], None] | None = None,
                    deadline: float | None = None, **options: Unpack[ChatOptions]) -> Handle:
        """`chat` queued: the handle gets the turn's deltas, then its `Finished`."""
        self._check_open()
        req = self.layout.chat_request(message, documents, system, **options)
        self.check_fits(req)
        turn = self.sessions.begin(session_id, message, max_new_tokens=req.max_new_tokens, system=system,
                                   documents=req.documents, blended=req.mode in ("blend", "reuse"))
        try:
            out = self.layout.turn(req, turn)
            return self.scheduler.submit(ScheduledSequence(TurnWork(turn, out.work), out.generation,
                                                           Handle(sink, deadline), kv_bytes=out.kv_bytes, mode=req.mode))
        except BaseException:
            self.sessions.abort(turn)
            raise

    def offload(self, session_id: str) -> None:
        """Move a session's KV off the compute device (its blocks stay in the tier stack)."""
        self._check_open()
        self.sessions.offload(session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session entirely (its history and its device-resident KV)."""
        self._check_open()
        self.sessions.drop(session_id)
