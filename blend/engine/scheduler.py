"""The scheduler: one thread that owns the model and runs every request on it.

It keeps a FIFO of waiting items (generations and tasks), one prefill slot (the item whose
plan is under way) and a running set of sequences that are decoding. Policy and execution
are apart: `schedule()` decides the next `Step` from plain data (no model work, no I/O),
`_run_step` runs it. A step is one of:

    an advance     the plan in the prefill slot runs to its next pause (the head of the
                   queue is admitted first into an empty slot: a sequence while the running
                   set is below `max_num_seqs` and its KV fits `max_active_kv`; a task
                   always). A plan (blend.engine.prefill) is a generator: it asks for rows
                   (`Rows`: tokens at positions of its cache), or computes a bounded unit
                   itself (a missed document's pass, a group of blend layers), or ends with
                   its value; a sequence then samples its first token and joins the batch
    a forward pass the next `prefill_chunk_tokens` of the rows the plan asked for (all of
                   them when nothing decodes) and the next token of every running sequence,
                   in one `Runner.forward`: the linear layers once over every row, attention
                   per sequence over its own KV; each sequence samples with its own
                   parameters. With no rows pending it is a plain decode step.

Running sequences are never starved: a plan's rows carry every decode row alongside, and
between two decode passes at most `prefills_between_decodes` units run (1 by default), so
no stream waits longer than one chunk or one unit. A cancelled or timed-out item leaves at
the next step (a waiting one is dropped, a running one frees its slot); one that ends (end
of sequence, a stop string, max tokens) frees its slot at once. A failure of one item (its
plan raised, its rows were refused, or sampling from its logits failed: e.g. logits that
are not finite) ends that item with the error, its caller told; the others go on. Only a
failure of the loop itself (a decode pass: e.g. out of memory) fails every item.

Memory: a sequence's cache is allocated for its prompt and the first `DECODE_RESERVE` new
tokens and grows as it decodes. When growing would take the running set's KV past
`max_active_kv`, the newest running sequence is preempted: its KV is parked in the tiers
(blend.kv.offload, the prefix-block machinery) and it goes back to the head of the queue;
when it is admitted again its KV is read back (or, if the tiers lost it, recomputed: its
plan again, then the tokens it had decoded as rows) and it continues where it stopped,
with the same output.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from blend.decode.result import GenerationResult
from blend.engine.sequence import Finished, Sequence, Status, Task
from blend.kv.offload import KVParking
from blend.model.cache import KVCache
from blend.model.runner import Rows, Runner

log = logging.getLogger(__name__)
DECODE_RESERVE = 64  # new tokens a sequence's cache holds room for when its prefill allocates it
GROW_MIN = 64  # a cache that fills up grows by at least this many positions (or a quarter of itself)


class QueueFull(RuntimeError):
    """The scheduler's waiting queue is full; retry after `retry_after_s` seconds."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the server is busy (request queue full); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler shares the model (blend.config: engine.max_num_seqs, max_active_kv)."""

    max_num_seqs: int = 8  # sequences decoding together at most
    max_active_kv: int = 1 << 30  # bytes of KV the running sequences may hold allocated
    max_waiting: int = 1 << 20  # items that may wait; more are refused (QueueFull)
    prefills_between_decodes: int = 1  # prefill steps allowed between two decode steps
    prefill_chunk_tokens: int = 256  # a plan's rows per step while sequences decode (their rows ride along)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_active_kv", "max_waiting", "prefills_between_decodes",
                     "prefill_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


@dataclass
class SchedulerMetrics:
    """Counters of one scheduler (written by its thread only; read by anyone)."""

    decode_steps: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)  # decode steps per batch size
    generated_tokens: int = 0
    prefill_steps: int = 0
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    preemptions: int = 0
    resumes: int = 0
    resumes_recomputed: int = 0  # resumes whose parked KV was gone from the tiers
    resume_s: float = 0.0
    peak_active_kv: int = 0  # the most KV bytes the running set held at once
    prefill_s: float = 0.0  # time in prefill steps (requests' prefills, missed documents, tasks, resumes)
    decode_s: float = 0.0  # time in decode steps (the batched step, sampling and emitting included)
    prefill_chunks: int = 0  # steps that ran a plan's rows (a chunk of them), decode rows alongside
    decode_rows_in_prefill_steps: int = 0  # decode rows that rode along with a plan's chunk
    background_steps: int = 0  # background steps run while idle (a harvested document recomputed standalone)
    background_s: float = 0.0
    _recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096), repr=False)

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Output tokens per second over the last `window_s` seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window_s]
        return sum(n for _, n in recent) / window_s if recent else 0.0

    def mean_batch_size(self) -> float:
        steps = sum(self.batch_sizes.values())
        return sum(size * n for size, n in self.batch_sizes.items()) / steps if steps else 0.0


@dataclass(frozen=True)
class Step:
    """One step's work as `Scheduler.schedule` decides it (plain data; `_run_step` runs it)."""

    admit: Sequence | Task | None = None  # taken from the queue into the prefill slot first
    advance: bool = False  # the plan in the prefill slot runs to its next pause
    chunk: tuple[int, int] | None = None  # rows a..b of the rows that plan asked for, computed this step
    decode: tuple[Sequence, ...] = ()  # running sequences whose next token this step computes
    grow: tuple[tuple[Sequence, int], ...] = ()  # full caches grown to these capacities first
    preempt: tuple[Sequence, ...] = ()  # the newest sequences parked in the tiers to make room


class _Outcome(enum.Enum):
    """What a plan did when it last advanced."""

    ROWS = "rows"  # asked for rows: the executor runs them (in chunks, decode rows alongside)
    UNIT = "unit"  # computed a bounded unit itself (a document miss's pass, a group of blend layers)
    ENDED = "ended"  # returned (or failed): the item joined the running set or ended


BACKGROUND_GRACE_S = 0.25  # idle this long before a background step starts


class PlanSource(Protocol):
    """Makes an item's typed work into its plan's steps, and hears how a sequence ended
    (blend.engine.work.Plans)."""

    def steps(self, item: Sequence | Task) -> Generator[Rows | None, Any, Any]: ...

    def ended(self, seq: Sequence, result: GenerationResult | None, cache: KVCache | None) -> None: ...


class Background(Protocol):
    """Work the scheduler runs only when idle, one bounded step at a time, on its own thread."""

    def background_pending(self) -> bool: ...

    def background_step(self) -> None: ...


class Scheduler:
    """Owns the model through `runner`; runs submitted `Sequence`s and `Task`s (see the module
    docstring). Thread-safe: `submit`, `stop` and the properties may be called from any thread."""

    def __init__(self, runner: Runner, parking: KVParking, config: SchedulerConfig, *, plans: PlanSource,
                 kv_bytes_per_token: int, name: str = "kvblend-scheduler", background: Background | None = None):
        self.runner, self.parking, self.config, self.plans = runner, parking, config, plans
        self._background = background  # lowest priority: one bounded step when nothing else would run
        self.kv_bytes_per_token = kv_bytes_per_token  # compute dtype, every layer
        self.metrics = SchedulerMetrics()
        self._name = name
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence | Task] = collections.deque()
        self._running: list[Sequence] = []
        self._current: Sequence | Task | None = None  # the item whose prefill is under way
        self._rows: Rows | None = None  # rows the current item's plan asked for, not all computed yet
        self._rows_done = 0  # ... how many of them are
        self._rows_logits: list[torch.Tensor] = []  # ... the logits of their wanted rows so far
        self._reply: torch.Tensor | None = None  # sent into the plan at its next advance (its rows' logits)
        self._since_decode = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._service_s = 1.0  # moving average of an item's time from start to end (Retry-After)

    # ------------------------------------------------------------------ callers
    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def depth(self) -> int:
        """Items waiting, prefilling or decoding."""
        with self._cond:
            return len(self._waiting) + len(self._running) + (self._current is not None)

    def active_kv_bytes(self) -> int:
        """KV bytes the running sequences (and the one prefilling) hold allocated."""
        running = list(self._running)
        current = self._current
        held = sum(s.cache.allocated_bytes() for s in running if s.cache is not None)
        if isinstance(current, Sequence) and current.cache is not None:
            held += current.cache.allocated_bytes()
        return held

    def busy(self) -> QueueFull:
        """The refusal of a full queue, with a retry estimate from the items ahead and the mean
        time an item takes."""
        ahead = len(self._waiting) + len(self._running)
        return QueueFull(max(1, min(60, round(self._service_s * ahead / self.config.max_num_seqs))))

    def on_thread(self) -> bool:
        """Whether the caller is the scheduler's own thread (which must never wait on itself)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, item: Sequence | Task, *, front: bool = False) -> None:
        """Queue an item (FIFO). Raises QueueFull when `max_waiting` items wait, ValueError once stopped."""
        if self.on_thread():
            raise RuntimeError("the engine was called from its own scheduler thread (e.g. inside an event sink): "
                               "that would wait on itself; call it from another thread")
        with self._cond:
            if self._stopping:
                raise ValueError("this BlendEngine is closed; create a new one (BlendEngine.from_config)")
            if len(self._waiting) >= self.config.max_waiting:
                raise self.busy()
            if front:
                self._waiting.appendleft(item)
            else:
                self._waiting.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self, timeout: float | None = None, *, cancel: bool = False) -> bool:
        """Refuse new items, let the queued and running ones finish (`cancel`: cancel every one:
        each ends at the next step, as `Handle.cancel` does), end the thread. Returns whether
        the thread has ended (False: still in a step after `timeout` seconds)."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            if cancel:
                current = self._current
                for item in [*self._waiting, *list(self._running), *([current] if current is not None else [])]:
                    item.handle.cancel()
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    # -------------------------------------------------------------------- loop
    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while not (self._waiting or self._running or self._current) and not self._stopping:
                        pending = self._background is not None and self._background.background_pending()
                        # background work only after BACKGROUND_GRACE_S of idleness (a closed-loop client's
                        # next request, sent as the last one ends, finds the model free)
                        if not self._cond.wait(BACKGROUND_GRACE_S if pending else None) and pending:
                            break
                    idle = not (self._waiting or self._running or self._current)
                    if self._stopping and idle:
                        return
                try:
                    if idle:  # no request waits, no sequence decodes: background work, one bounded step
                        self._background_once()
                    else:
                        self._step()
                except BaseException as err:  # noqa: BLE001 - every caller is told, then the thread ends
                    self._fail_all(err)
                    if not isinstance(err, Exception):
                        raise

    def _background_once(self) -> None:
        """One background step; its failure (a store gone, say) is logged and is nobody's request's."""
        assert self._background is not None
        t0 = time.perf_counter()
        try:
            self._background.background_step()
        except Exception as err:  # noqa: BLE001 - the work is optional: the entry stays as it was
            log.warning("background step failed (%s: %s); the harvested entry stays",
                        type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
        self.metrics.background_s += time.perf_counter() - t0
        self.metrics.background_steps += 1

    def _step(self) -> None:
        self._reap()
        self._run_step(self.schedule())

    # ------------------------------------------------------------------ policy
    def schedule(self) -> Step:
        """The next step, decided from plain data (the queue, the prefill slot, the running
        set; no model work, no I/O):

        - the plan in the prefill slot advances to its next pause, or the head of the queue
          is admitted into the empty slot and starts (a sequence while fewer than
          `max_num_seqs` run and its KV fits `max_active_kv`; a task always), unless its
          rows are pending or `prefills_between_decodes` units ran since the last decode;
        - else one forward pass: the next `prefill_chunk_tokens` of the rows the plan asked
          for (all of them when no sequence decodes), every running sequence's next token
          alongside; before it, caches that are full grow, and where growing would take the
          running set past `max_active_kv` the newest sequences are preempted.
        """
        units_due = not (self._running and self._since_decode >= self.config.prefills_between_decodes)
        if self._rows is None and units_due:
            if self._current is not None:
                return Step(advance=True)
            head = self._admissible()
            if head is not None:
                return Step(admit=head, advance=True)
        if self._rows is None and not self._running:
            return Step()
        grow, preempt = self._room()
        decode = tuple(s for s in self._running if s not in preempt)
        chunk = None
        if self._rows is not None:
            n, a = len(self._rows), self._rows_done
            chunk = (a, min(n, a + self.config.prefill_chunk_tokens) if decode else n)
        return Step(chunk=chunk, decode=decode, grow=grow, preempt=preempt)

    def _admissible(self) -> Sequence | Task | None:
        """The head of the queue when it may start now."""
        with self._cond:
            if not self._waiting:
                return None
            head = self._waiting[0]
        if isinstance(head, Sequence) and self._running:
            if len(self._running) >= self.config.max_num_seqs:
                return None
            if self.active_kv_bytes() + self._estimate(head) > self.config.max_active_kv:
                return None
        return head

    def _room(self) -> tuple[tuple[tuple[Sequence, int], ...], tuple[Sequence, ...]]:
        """Room for one more position in every running cache: (sequence, new capacity) for the
        caches that are full, and the newest sequences to preempt while that growth would take
        the running set past `max_active_kv` (never the last one)."""
        alive = list(self._running)
        active: int | None = None  # summed only when some cache is full
        grow: list[tuple[Sequence, int]] = []
        preempt: list[Sequence] = []
        for seq in list(alive):
            if seq not in alive:  # preempted for an older one
                continue
            cache = seq.cache
            assert cache is not None
            if cache.length < cache.capacity:
                continue
            active = self.active_kv_bytes() if active is None else active
            limit = len(seq.prompt_ids) + seq.generation.max_new_tokens
            grown = min(max(cache.capacity + GROW_MIN, cache.capacity * 5 // 4), max(limit, cache.length + 1))
            extra = cache.growth_bytes(grown)  # per layer type: a sliding layer's ring does not grow
            while len(alive) > 1 and active + extra > self.config.max_active_kv:
                victim = alive.pop()  # the newest
                preempt.append(victim)
                active -= victim.cache.allocated_bytes() if victim.cache is not None else 0
                if victim is seq:
                    break
            if seq in alive:
                grow.append((seq, grown))
                active += extra
        return tuple(grow), tuple(preempt)

    # -------------------------------------------------------------- execution
    def _run_step(self, step: Step) -> None:
        """Run what `schedule` decided: a plan's advance, or one forward pass."""
        if step.advance:
            if step.admit is not None:
                self._start(step.admit)
            t0 = time.perf_counter()
            outcome = self._advance()
            self.metrics.prefill_s += time.perf_counter() - t0
            if outcome is not _Outcome.ROWS:  # a unit computed, or an end (a first token sampled): the
                self._since_decode += 1  # next plan's first unit waits for a decode pass
            return
        if step.chunk is None and not step.decode:
            if self._waiting:  # nothing runs and nothing could start: cannot happen
                time.sleep(0.001)  # (admission always admits into an empty running set)
            return
        for seq in step.preempt:
            self._preempt(seq)
        for seq, capacity in step.grow:
            assert seq.cache is not None
            seq.cache.ensure_capacity(capacity)
        self.metrics.peak_active_kv = max(self.metrics.peak_active_kv, self.active_kv_bytes())
        t0 = time.perf_counter()
        self._forward(step.chunk, step.decode)
        if step.chunk is not None:
            self.metrics.prefill_s += time.perf_counter() - t0
        else:
            self.metrics.decode_s += time.perf_counter() - t0
        self._since_decode = 0

    def _start(self, head: Sequence | Task) -> None:
        """Move `head` from the queue into the prefill slot and make its plan's steps."""
        with self._cond:
            self._waiting.remove(head)
        now = time.monotonic()
        if isinstance(head, Task):
            head.started = now
            head.steps = self.plans.steps(head)
        else:
            head.status = Status.PREFILLING
            if head.parked is not None:
                head.steps = self._resume(head)
            else:
                head.started = now
                head.steps = self.plans.steps(head)
        self._current = head

    def _estimate(self, seq: Sequence) -> int:
        """KV bytes a waiting sequence will hold once started."""
        if seq.parked is not None:
            tokens = len(seq.parked.token_ids) + min(DECODE_RESERVE, seq.generation.max_new_tokens)
            return tokens * self.kv_bytes_per_token
        return seq.kv_bytes

    # ------------------------------------------------------------------ prefill
    def _advance(self, error: Exception | None = None) -> _Outcome:
        """The current item's plan runs to its next pause (`error`: thrown into it, e.g. its
        loads stalled in the executor): it asks for rows (`Rows`: run by `_forward`),
        computed a unit itself (None), or ended (its prefill's value: the sequence joins the
        running set; a task ends)."""
        item = self._current
        assert item is not None and item.steps is not None
        self.metrics.prefill_steps += 1
        reply, self._reply = self._reply, None
        try:
            request = item.steps.send(reply) if error is None else item.steps.throw(error)
        except StopIteration as done:
            value = done.value
        except Exception as err:  # noqa: BLE001 - handed to the caller, which raises it
            self._current = None
            self._end(item, error=err)
            return _Outcome.ENDED
        else:
            if request is None:
                return _Outcome.UNIT
            if not isinstance(request, Rows):
                err = TypeError(f"a plan yielded {type(request).__name__}, not Rows or None")
                self._current = None
                item.steps.close()
                self._end(item, error=err)
                return _Outcome.ENDED
            self._rows, self._rows_done, self._rows_logits = request, 0, []
            return _Outcome.ROWS
        self._current = None
        if isinstance(item, Task):
            self._end(item, value=value)
            return _Outcome.ENDED
        try:
            self._join(item, value)
        except Exception as err:  # noqa: BLE001 - this sequence fails alone: its caller gets the error
            self._fail(item, err)
        return _Outcome.ENDED

    def _join(self, seq: Sequence, value: Any) -> None:
        """A sequence whose prefill ended: its first token sampled and emitted, then it joins the
        running set (or ends)."""
        if seq.generation.tokens:  # resumed after a preemption: it continues with its pending token
            seq.status = Status.RUNNING
            self._running.append(seq)
            return
        pre = value  # blend.decode.generation.Prefilled
        pre.cache.compact_()  # sliding-window layers: rings of their window from here on (memory bounded)
        seq.cache, seq.stats, seq.prompt_ids = pre.cache, pre.stats, pre.token_ids
        seq.ttft_s = time.monotonic() - (seq.started or time.monotonic())
        self._emit_token(seq, pre.logits)
        if seq.generation.done:
            self._end(seq)
        else:
            seq.status = Status.RUNNING
            self._running.append(seq)
            self.metrics.peak_active_kv = max(self.metrics.peak_active_kv, self.active_kv_bytes())

    def _emit_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        delta = seq.generation.push(logits)
        self.metrics.generated_tokens += 1
        if delta is not None:
            seq.handle.emit(delta)

    # ------------------------------------------------------------------- decode
    def _forward(self, chunk: tuple[int, int] | None, decode: tuple[Sequence, ...]) -> None:
        """One forward pass (`Runner.forward`): rows a..b of the rows the plan asked for
        (`chunk`) and the next token of every sequence in `decode`, the linear layers once over
        every row, attention per sequence; each decoding sequence samples with its own
        parameters. When the chunk ends the rows, their logits go back into the plan at its
        next advance. A failure here is the plan's (its loads stalled, its rows were refused):
        thrown into it; nothing was emitted, and the decode rows run again next step (their
        slots are rewritten)."""
        items = [Rows(torch.tensor([s.generation.pending]), s.cache, s.cache.length) for s in decode]
        rows = self._rows
        if chunk is not None:
            assert rows is not None
            a, b = chunk
            items.insert(0, rows if (a, b) == (0, len(rows)) else rows.chunk(a, b))
        try:
            out = self.runner.forward(items)  # per item: (rows, vocab)
        except Exception as err:  # noqa: BLE001 - see above; a pure decode step's failure fails every item
            if chunk is None:
                raise
            self._rows = None
            self._advance(error=err)
            return
        if chunk is not None:
            assert rows is not None
            self._rows_logits.append(out.pop(0))
            self._rows_done = chunk[1]
            self.metrics.prefill_chunks += 1
            self.metrics.decode_rows_in_prefill_steps += len(decode)
            if self._rows_done == len(rows):
                logits, self._rows, self._rows_logits = self._rows_logits, None, []
                self._reply = logits[0] if len(logits) == 1 else torch.cat(logits)
        size = len(decode)
        if not size:
            return
        if chunk is None:
            self.metrics.decode_steps += 1
            self.metrics.batch_sizes[size] += 1
        self.metrics._recent.append((time.monotonic(), size))
        for b, seq in enumerate(decode):
            seq.decode_steps += 1
            seq.batch_total += size
            try:
                self._emit_token(seq, out[b][0])
                if seq.generation.done:
                    self._end(seq)
            except Exception as err:  # noqa: BLE001 - this sequence fails alone; the batch goes on
                self._fail(seq, err)

    def _preempt(self, seq: Sequence) -> None:
        """Park `seq`'s KV in the tiers and put it back at the head of the queue."""
        cache = seq.cache
        assert cache is not None
        ids = (list(seq.prompt_ids) + seq.generation.tokens)[: cache.length]
        seq.parked = self.parking.park(ids, cache)
        seq.cache = None
        seq.preemptions += 1
        seq.status = Status.WAITING
        self._running.remove(seq)
        self.metrics.preemptions += 1
        log.info("preempted sequence %d (%d positions parked in the tiers)", seq.id, len(ids))
        with self._cond:
            self._waiting.appendleft(seq)

    def _resume(self, seq: Sequence) -> Generator[Rows | None, Any, None]:
        """Restore a preempted sequence's cache from the tiers, or recompute it: its prefill's
        plan again, then the tokens it had decoded as rows of their own (chunked like any)."""
        t0 = time.perf_counter()
        parked = seq.parked
        assert parked is not None
        n = len(parked.token_ids)
        capacity = n + min(DECODE_RESERVE, seq.generation.max_new_tokens)
        cache = self.parking.restore(parked, capacity)
        self.parking.release(parked)
        seq.parked = None
        if cache is None:  # the tiers lost it: the prefill again, then the tokens it had decoded
            pre = yield from self.plans.steps(seq)
            cache = pre.cache
            done = list(parked.token_ids[len(pre.token_ids):])
            if done:
                cache.ensure_capacity(n + 1)
                yield Rows(torch.tensor(done), cache, len(pre.token_ids), ())
            self.metrics.resumes_recomputed += 1
        seq.cache = cache
        seq.resume_s += time.perf_counter() - t0
        self.metrics.resumes += 1
        self.metrics.resume_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ ending
    def _reap(self) -> None:
        """Cancelled or timed-out items leave: waiting ones are dropped, running ones stop."""
        with self._cond:
            gone = [item for item in self._waiting if item.handle.stopped()]
            for item in gone:
                self._waiting.remove(item)
        for item in gone:
            self._end(item, cancelled=True)
        current = self._current
        if current is not None and current.handle.stopped() and not isinstance(current, Task):
            self._current = None  # a task (an ingest) sees its stop itself, between documents
            self._rows, self._reply = None, None
            if current.steps is not None:
                current.steps.close()
            self._end(current, cancelled=True)
        for seq in [s for s in self._running if s.handle.stopped()]:
            self._end(seq, cancelled=True)

    def _end(self, item: Sequence | Task, *, value: object = None, error: BaseException | None = None,
             cancelled: bool = False) -> None:
        """Finish an item: its last events, its slot and memory freed."""
        now = time.monotonic()
        started = item.started if item.started is not None else now
        queued_s, run_s = started - item.handle.submitted, now - started
        self._service_s = 0.8 * self._service_s + 0.2 * run_s
        if isinstance(item, Task):
            stopped = error is not None and item.handle.stopped()  # a task may end early by raising once stopped
            if stopped or cancelled:
                self.metrics.cancelled += 1
                item.handle.emit(Finished(cancelled=True, queued_s=queued_s, run_s=run_s))
            else:
                self.metrics.failed += error is not None
                self.metrics.finished += error is None
                item.handle.emit(Finished(value=value, error=error, queued_s=queued_s, run_s=run_s))
            return
        seq = item
        if seq in self._running:
            self._running.remove(seq)
        seq.status = Status.FINISHED
        if seq.parked is not None:
            self.parking.release(seq.parked)
            seq.parked = None
        if error is not None or cancelled:
            _quietly(lambda: self.plans.ended(seq, None, None))
            seq.cache = None
            self.metrics.cancelled += cancelled
            self.metrics.failed += error is not None
            seq.handle.emit(Finished(error=error, cancelled=cancelled, queued_s=queued_s, run_s=run_s))
            return
        rest = seq.generation.rest()
        if rest is not None:
            seq.handle.emit(rest)
        result = seq.result(total_s=now - started)
        cache, seq.cache = seq.cache, None
        try:
            self.plans.ended(seq, result, cache)
        except Exception as err:  # noqa: BLE001 - e.g. a chat history that cannot be saved
            self.metrics.failed += 1
            seq.handle.emit(Finished(error=err, queued_s=queued_s, run_s=run_s))
            return
        self.metrics.finished += 1
        seq.handle.emit(Finished(value=result, queued_s=queued_s, run_s=run_s))

    def _fail(self, seq: Sequence, err: Exception) -> None:
        """One sequence failed outside the batched model call (e.g. sampling from logits that are not
        finite): it ends with the error, its slot and memory freed; the others go on."""
        log.warning("sequence %d failed: %s", seq.id, err, exc_info=True)
        if seq.handle.finished:  # it had ended and its caller was told
            if seq in self._running:
                self._running.remove(seq)
            return
        self._end(seq, error=err)

    def _fail_all(self, err: BaseException) -> None:
        """The loop itself failed (e.g. out of memory in a decode step): every item is told."""
        log.error("scheduler step failed: %s", err, exc_info=isinstance(err, Exception))
        with self._cond:
            waiting = list(self._waiting)
            self._waiting.clear()
        current, self._current = self._current, None
        self._rows, self._reply = None, None
        items: list[Sequence | Task] = [*waiting, *([current] if current is not None else []), *self._running]
        for item in items:
            self._end(item, error=err if isinstance(err, Exception) else RuntimeError(str(err)))
        self._running.clear()


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - ending a failed item must not fail the loop
        log.warning("cleaning up a failed request: %s", err)
