"""The scheduler: one thread that owns the model and runs every request on it.

It keeps a FIFO of waiting items (generations and tasks), the items whose plans are under way
(prefilling, several at once) and a running set of sequences that are decoding. Policy and
execution are apart: `schedule()` decides the next `Step` from plain data (the queue, the plans
under way and what each wants next, the running set, the budget; no model work, no I/O),
`_run_step` runs it. Every step is one `Runner.forward` (the one layer loop) of:

    every running sequence's next token (a decode row each, every step; a sequence whose prefill
        ends in the step's own advances, its first token just out, rides in that same step);
    the plans' work, in FIFO order, while the step's budget lasts: `prefill_chunk_tokens` x
        layers row-layers (a plan's R rows through g layers cost R x g; the same bound when
        nothing decodes: the oldest plan's first token comes first; none for a plan alone),
        and while sequences decode no more than makes the step about `step_stretch` times the
        slowest decode step measured (`StepPace`: decode steps and each kind of work priced by
        what they have cost lately): the gap a stream sees while others prefill.
        A plan is a cursor (blend.model.plan: its progress as data) whose `want` is its model
        work and whose `take` gets the outputs back: token rows (`Rows`, or a list of them: a
        pass of documents) run as chunks cut at fixed positions, each chunk a layer range per
        step where the budget is smaller (`RowsCursor`), or a `Cursor` (a blend's passes: whole
        layer ranges of all its rows, layer-synchronous, blend.recompute.layers.BlendPass)
        driven until it ends; a plan's planning between its wants (lookups, pricing, a missed
        document's entries placed) runs in its `take`, right before the step;
    the lowest priority, background work (a harvested document recomputed on its own,
        blend.kv.documents.DocumentCache.background_plan): the budget left whenever the
        machine is idle, and at most `background_share` of the step time while requests wait
        or decode; first, whatever its share, while a request waits for the entries it computes.

A blend whose next layer's loads have not arrived sits the step out while others run (it asks
only for ready layers), so a slow tier never holds another stream's token. Running sequences
are never starved: their rows ride in every step and a step carries at most one budget of
prefill work. A cancelled or timed-out item leaves at the next step (a waiting one is dropped,
a prefilling one's plan is closed, a running one frees its slot); one that ends (end of
sequence, a stop string, max tokens) frees its slot at once. A failure of one item (its plan
raised, its rows were refused or its loads stalled, or sampling from its logits failed) ends
that item with the error (a plan may catch it: a stalled blend runs its full plan), its caller
told; the others go on. Only a failure of the loop itself (e.g. out of memory) fails every item.

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
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from blend.decode.result import GenerationResult
from blend.engine.sequence import Finished, Handle, Sequence, Status, Task
from blend.kv.offload import KVParking
from blend.model.cache import KVCache
from blend.model.plan import PAUSE, Done, PlanCursor, Want
from blend.model.runner import Cursor, Output, Rows, RowsCursor, Runner, cost

log = logging.getLogger(__name__)
DECODE_RESERVE = 256  # new tokens a sequence's cache holds room for when its prefill allocates it (a
# cache that grows copies itself on the scheduler's thread: ~80 ms for 2k positions of SmolLM2 on 2 cores)
GROW_MIN = 64  # a cache that fills up grows by at least this many positions (or a quarter of itself)


class QueueFull(RuntimeError):
    """The scheduler's waiting queue is full; retry after `retry_after_s` seconds."""

    def __init__(self, retry_after_s: int):
        super().__init__(f"the server is busy (request queue full); retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler shares the model (blend.config: engine.max_num_seqs, max_active_kv, ...)."""

    max_num_seqs: int = 8  # sequences decoding together at most
    max_active_kv: int = 1 << 30  # bytes of KV the running sequences may hold allocated
    max_waiting: int = 1 << 20  # items that may wait; more are refused (QueueFull)
    prefill_chunk_tokens: int = 256  # a step's prefill work while sequences decode: this many rows x layers
    background_share: float = 0.1  # at most this share of step time for background work while requests run
    # while sequences decode, a step with prefill work takes about this many decode steps' time (None: no
    # bound but `prefill_chunk_tokens`)
    step_stretch: float | None = 6.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_active_kv", "max_waiting", "prefill_chunk_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
        if not 0.0 <= self.background_share <= 1.0:
            raise ValueError(f"background_share must be between 0 and 1, got {self.background_share!r}")
        if self.step_stretch is not None and not self.step_stretch > 1.0:
            raise ValueError(f"step_stretch must be more than 1 (or None), got {self.step_stretch!r}")


class StepPace:
    """What steps have cost lately, from the last `WINDOW` steps of each: a step of b decode rows
    alone (`decode_time`: the fastest of them, since a collection, a first call's one-time check or
    a load decoding on the same cores only slow a step down), and a row-layer (`cost`'s unit) of
    each kind of plans' work (`rate_of`: the median; kinds are a blend's query pass, its recompute
    pass, token rows; the decode rows' share of a mixed step taken off, the rest shared between
    the kinds by their work at the rates known). `seconds` is the time of plans' work that makes a
    step `stretch` times as long as the slowest decode step measured (among batch sizes seen
    `MIN_SEEN` times); `row_layers` turns a time into a kind's row-layers."""

    WINDOW = 15
    MIN_SEEN = 3

    def __init__(self) -> None:
        self.decode_s: dict[int, collections.deque] = {}
        self.rate: dict[str, collections.deque] = {}

    def _add(self, table: dict, key: Any, value: float) -> None:
        table.setdefault(key, collections.deque(maxlen=self.WINDOW)).append(value)

    @staticmethod
    def _median(values: collections.deque) -> float:
        ordered = sorted(values)
        return ordered[len(ordered) // 2]

    def decode_time(self, rows: int) -> float | None:
        """A step of `rows` decode rows alone (the nearest batch measured; None: none yet): the fastest
        of its last steps (a decode step beside a load's decoding on the same cores runs up to 3x
        slower; the step it takes undisturbed is the reference)."""
        if not self.decode_s:
            return None
        nearest = rows if rows in self.decode_s else min(self.decode_s, key=lambda b: (abs(b - rows), b))
        return min(self.decode_s[nearest])

    def rate_of(self, kind: str) -> float | None:
        """Seconds a row-layer of `kind` takes (the slowest kind known where this one is not)."""
        if kind in self.rate:
            return self._median(self.rate[kind])
        return max((self._median(v) for v in self.rate.values()), default=None)

    def observe(self, decode_rows: int, work: dict[str, float], step_s: float) -> None:
        """A step ran: `decode_rows` decode rows and `work` row-layers of plans' work per kind in `step_s`."""
        total = sum(work.values())
        if total <= 0:
            if decode_rows:
                self._add(self.decode_s, decode_rows, step_s)
            return
        alone = self.decode_time(decode_rows) if decode_rows else 0.0
        if alone is None:
            return
        plans_s = max(step_s - alone, 0.1 * step_s)
        weights = {k: w * (self.rate_of(k) or 1.0) for k, w in work.items() if w > 0}
        whole = sum(weights.values())
        for kind, weight in weights.items():
            self._add(self.rate, kind, plans_s * weight / whole / work[kind])

    def seconds(self, decode_rows: int, stretch: float) -> float | None:
        """Seconds of plans' work beside `decode_rows` decode rows (None: nothing measured yet): the
        step takes `stretch` times the slowest decode step measured (the largest batch's), so a
        few decode rows leave the plans more room than a full batch does, never less than
        `stretch` - 1 times their own step."""
        alone = self.decode_time(decode_rows)
        if alone is None or not self.rate:
            return None
        seen = [min(v) for v in self.decode_s.values() if len(v) >= self.MIN_SEEN] or [alone]
        return max(stretch * max(seen) - alone, (stretch - 1.0) * alone)

    def row_layers(self, kind: str, seconds: float) -> float:
        """The row-layers of `kind` that take `seconds`."""
        rate = self.rate_of(kind)
        return seconds / rate if rate else float("inf")


def work_kind(cursor: Cursor) -> str:
    """What `StepPace` prices a cursor's work as: its type, and its phase where it has one."""
    return f"{type(cursor).__name__}:{getattr(cursor, 'phase', '')}"


@dataclass
class SchedulerMetrics:
    """Counters of one scheduler (written by its thread only; read by anyone)."""

    decode_steps: int = 0
    batch_sizes: collections.Counter = field(default_factory=collections.Counter)  # decode steps per batch size
    generated_tokens: int = 0
    prefill_steps: int = 0  # plans' advances (each runs a plan to its next want)
    finished: int = 0
    cancelled: int = 0
    failed: int = 0
    preemptions: int = 0
    resumes: int = 0
    resumes_recomputed: int = 0  # resumes whose parked KV was gone from the tiers
    resume_s: float = 0.0
    peak_active_kv: int = 0  # the most KV bytes the running set held at once
    prefill_s: float = 0.0  # step time of plans' work (requests' prefills, missed documents, tasks, resumes)
    decode_s: float = 0.0  # step time of decode rows (the batched rows, sampling and emitting included)
    decode_only_s: float = 0.0  # forward time of the decode steps that carried nothing else (`decode_steps`)
    prefill_chunks: int = 0  # steps that ran plans' work (decode rows alongside)
    decode_rows_in_prefill_steps: int = 0  # decode rows that rode along with plans' work
    shared_steps: int = 0  # steps whose plans' work came from two plans or more
    background_steps: int = 0  # steps that ran background work (a harvested document recomputed standalone)
    background_s: float = 0.0  # their share of step time (by row-layers)
    background_busy_steps: int = 0  # ... of them, steps while requests were under way (its share of busy time)
    background_awaited_steps: int = 0  # ... of them, steps where it ran first: a request waited for its entries
    _recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096), repr=False)

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Output tokens per second over the last `window_s` seconds."""
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if now - t <= window_s]
        return sum(n for _, n in recent) / window_s if recent else 0.0

    def mean_batch_size(self) -> float:
        steps = sum(self.batch_sizes.values())
        return sum(size * n for size, n in self.batch_sizes.items()) / steps if steps else 0.0


class _Slot:
    """A plan under way: its item, its plan (a cursor, blend.model.plan), the cursor of the model
    work it last asked for and what goes back into it at its next advance."""

    def __init__(self, item: Sequence | Task | None, plan: PlanCursor, background: bool = False):
        self.item, self.plan, self.background = item, plan, background
        self.cursor: Cursor | None = None
        self.reply: Any = None
        self.error: Exception | None = None

    def wants(self) -> bool:
        """Whether it has model work pending (else its next advance runs first)."""
        return self.cursor is not None and not self.cursor.done


@dataclass(frozen=True)
class Step:
    """One step's work as `Scheduler.schedule` decides it (plain data; `_run_step` runs it)."""

    admit: tuple[Sequence | Task, ...] = ()  # taken from the queue: their plans start
    advance: tuple[_Slot, ...] = ()  # plans that run to their next want first (planning, units)
    plans: tuple[_Slot, ...] = ()  # plans whose work the step carries, in this order, while the budget lasts
    budget: int | None = None  # row-layers of plans' work (None: no bound: a plan alone)
    seconds: float | None = None  # ... and at most this much time of it (`StepPace`; None: no such bound)
    decode: tuple[Sequence, ...] = ()  # running sequences whose next token this step computes
    grow: tuple[tuple[Sequence, int], ...] = ()  # full caches grown to these capacities first
    preempt: tuple[Sequence, ...] = ()  # the newest sequences parked in the tiers to make room
    background: bool = False  # a background plan starts (none is under way and it may run)
    awaited: bool = False  # ... a request waits for its entries: it runs first, whatever its share


class PlanSource(Protocol):
    """Makes an item's typed work into its plan (a cursor), and hears how a sequence ended
    (blend.engine.work.Plans)."""

    def plan(self, item: Sequence | Task) -> PlanCursor: ...

    def ended(self, seq: Sequence, result: GenerationResult | None, cache: KVCache | None) -> None: ...


class Background(Protocol):
    """Work the scheduler runs at the lowest priority, as a plan of its own
    (blend.kv.documents.DocumentCache)."""

    def background_pending(self) -> bool: ...

    def background_awaited(self) -> bool: ...

    def background_plan(self) -> PlanCursor | None: ...

    def drop_background(self) -> int: ...


MAX_PREFILLING = 8  # plans under way at once at most (their work shares the steps' budget)


class Scheduler:
    """Owns the model through `runner`; runs submitted `Sequence`s and `Task`s (see the module
    docstring). Thread-safe: `submit`, `stop` and the properties may be called from any thread."""

    def __init__(self, runner: Runner, parking: KVParking, config: SchedulerConfig, *, plans: PlanSource,
                 kv_bytes_per_token: int, name: str = "kvblend-scheduler", background: Background | None = None):
        self.runner, self.parking, self.config, self.plans = runner, parking, config, plans
        runner.chunk_tokens = config.prefill_chunk_tokens  # forward cuts prefills at the same positions
        self._background = background  # lowest priority: see the module docstring
        self.kv_bytes_per_token = kv_bytes_per_token  # compute dtype, every layer
        self.metrics = SchedulerMetrics()
        self._name = name
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence | Task] = collections.deque()
        self._running: list[Sequence] = []
        self._prefilling: list[_Slot] = []  # plans under way, in FIFO order
        self._bg: _Slot | None = None  # the background plan under way
        self._busy_s = 0.0  # step time while requests were under way (the background share's base)
        self.pace = StepPace()  # what steps cost so far (the budget beside decode rows)
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
            return len(self._waiting) + len(self._running) + len(self._prefilling)

    def active_kv_bytes(self) -> int:
        """KV bytes the running sequences (and those prefilling) hold allocated."""
        held = sum(s.cache.allocated_bytes() for s in list(self._running) if s.cache is not None)
        for slot in list(self._prefilling):
            if isinstance(slot.item, Sequence) and slot.item.cache is not None:
                held += slot.item.cache.allocated_bytes()
        return held

    def busy(self) -> QueueFull:
        """The refusal of a full queue, with a retry estimate from the items ahead and the mean
        time an item takes."""
        ahead = len(self._waiting) + len(self._running)
        return QueueFull(max(1, min(60, round(self._service_s * ahead / self.config.max_num_seqs))))

    def on_thread(self) -> bool:
        """Whether the caller is the scheduler's own thread (which must never wait on itself)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, item: Sequence | Task, *, front: bool = False) -> Handle:
        """Queue an item (FIFO) and return its handle. Raises QueueFull when `max_waiting` items wait,
        ValueError once stopped."""
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
        return item.handle

    def stop(self, timeout: float | None = None, *, cancel: bool = False) -> bool:
        """Refuse new items, let the queued and running ones finish (`cancel`: cancel every one:
        each ends at the next step, as `Handle.cancel` does), end the thread. Returns whether
        the thread has ended (False: still in a step after `timeout` seconds)."""
        with self._cond:
            self._stopping = True
            thread = self._thread
            if cancel:
                items = [*self._waiting, *list(self._running),
                         *[slot.item for slot in list(self._prefilling) if slot.item is not None]]
                for item in items:
                    item.handle.cancel()
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return thread is None or not thread.is_alive()

    # -------------------------------------------------------------------- loop
    def _idle(self) -> bool:
        return not (self._waiting or self._running or self._prefilling)

    def _background_due(self) -> bool:
        """Whether background work waits (none once stopping: its entries are optional)."""
        return not self._stopping and (
            self._bg is not None or (self._background is not None and self._background.background_pending()))

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cond:
                    while self._idle() and not self._stopping and not self._background_due():
                        self._cond.wait()
                    if self._stopping and self._idle():
                        self._close_background()
                        return
                try:
                    self._step()
                except BaseException as err:  # noqa: BLE001 - every caller is told, then the thread ends
                    self._fail_all(err)
                    if not isinstance(err, Exception):
                        raise

    def _step(self) -> None:
        self._reap()
        self._run_step(self.schedule())

    # ------------------------------------------------------------------ policy
    def schedule(self) -> Step:
        """The next step, decided from plain data (the queue, the plans under way and whether each
        has work pending, the running set, the step times so far; no model work, no I/O):

        - the heads of the queue are admitted while they may start (a sequence while the
          running set and the sequences prefilling are fewer than `max_num_seqs` and its KV
          fits `max_active_kv`; a task always; at most MAX_PREFILLING plans under way);
        - plans with no work pending advance to their next want first (while sequences decode,
          one plan per step: an admitted one, or the oldest waiting to advance);
        - every running sequence's next token, and the plans' work in FIFO order within a
          budget of `prefill_chunk_tokens` x layers row-layers (bounded when nothing decodes too:
          the oldest plan first, its first token before the next plans' work; unbounded for a plan
          alone: nothing decoding, nothing else under way or waiting, no background work), while
          sequences decode at most what `pace` says fits beside them (`step_stretch`);
          before it, caches that are full grow, and where growing would take the running set
          past `max_active_kv` the newest sequences are preempted;
        - background work: a plan of its own, started when none is under way, given the budget
          left when nothing else runs, else only while its share of the busy step time stays
          under `background_share`; while a request waits for its entries (it claimed them), it
          runs first in every step, whatever its share.
        """
        admit: list[Sequence | Task] = []
        with self._cond:
            queue = list(self._waiting)
        seqs = len(self._running) + sum(isinstance(s.item, Sequence) for s in self._prefilling)
        kv = None
        for head in queue:
            if len(self._prefilling) + len(admit) >= MAX_PREFILLING:
                break
            if isinstance(head, Sequence):
                if seqs and seqs >= self.config.max_num_seqs:
                    break
                if seqs:  # the running set's KV and what the sequences prefilling will hold
                    kv = self._planned_kv() if kv is None else kv
                    if kv + self._estimate(head) > self.config.max_active_kv:
                        break
                    kv += self._estimate(head)
                seqs += 1
            admit.append(head)
        slots = tuple(self._prefilling)
        grow, preempt = self._room()
        decode = tuple(s for s in self._running if s not in preempt)
        # plans with no work pending advance (their planning: lookups, pricing, a unit); while sequences
        # decode, one per step (the oldest first), so planning never adds up inside one token's wait
        advance = tuple(s for s in slots if not s.wants())
        if decode:  # (one admitted now advances in this step: it counts as the one)
            advance = advance[:1]
            admit = [] if advance else admit[:1]
        # bounded even when nothing decodes: the oldest plan's prefill goes first, so its first token
        # comes before the next plans' work (one step of all of them would hold every first token)
        alone = not decode and len(slots) + len(admit) == 1 and len(queue) == len(admit)
        # one plan and nobody else: no one to share the step with (no step boundaries to pay)
        budget, seconds = self._bounds(len(decode), alone and not self._background_due())
        busy = bool(slots or admit or decode)
        # a request waiting for the background plan's entries lifts it out of its share (no priority inversion)
        awaited = self._bg is not None and self._background is not None and self._background.background_awaited()
        background = self._background is not None and not self._stopping and (
            not busy or awaited or self.metrics.background_s <= self.config.background_share * self._busy_s)
        start_bg = background and self._bg is None and self._background.background_pending()
        return Step(admit=tuple(admit), advance=advance, plans=slots, budget=budget, seconds=seconds, decode=decode,
                    grow=grow, preempt=preempt, background=start_bg or (background and self._bg is not None),
                    awaited=awaited)

    def _bounds(self, decode_rows: int, unbounded: bool = False) -> tuple[int | None, float | None]:
        """A step's bounds on the plans' work beside `decode_rows` decode rows: row-layers
        (`prefill_chunk_tokens` x layers; None where `unbounded`) and seconds (the streams' gap: about
        `step_stretch` decode steps, `StepPace`; None without decode rows, a stretch or a measure)."""
        budget = None if unbounded else self.config.prefill_chunk_tokens * self.runner.num_layers
        seconds = None
        if decode_rows and self.config.step_stretch is not None:
            seconds = self.pace.seconds(decode_rows, self.config.step_stretch)
        return budget, seconds

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
            active = self._planned_kv() if active is None else active
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

    def _planned_kv(self) -> int:
        """KV bytes the running set holds and the sequences prefilling will hold once started."""
        held = sum(s.cache.allocated_bytes() for s in self._running if s.cache is not None)
        for slot in self._prefilling:
            if isinstance(slot.item, Sequence):
                held += slot.item.cache.allocated_bytes() if slot.item.cache is not None else self._estimate(slot.item)
        return held

    def _estimate(self, seq: Sequence) -> int:
        """KV bytes a waiting sequence will hold once started."""
        if seq.parked is not None:
            tokens = len(seq.parked.token_ids) + min(DECODE_RESERVE, seq.generation.max_new_tokens)
            return tokens * self.kv_bytes_per_token
        return seq.kv_bytes

    # -------------------------------------------------------------- execution
    def _run_step(self, step: Step) -> None:
        """Run what `schedule` decided: admissions, the plans' advances, then one forward pass of
        the decode rows and the plans' work within the budget."""
        t0 = time.perf_counter()
        for item in step.admit:
            self._start(item)
        fresh = [s for s in self._prefilling if s not in step.plans]  # admitted now: their first advance
        for slot in [*step.advance, *fresh]:
            if slot in self._prefilling:
                self._advance(slot)
        if step.background and self._bg is None and self._background is not None:
            plan = self._background.background_plan()
            if plan is not None:
                self._bg = _Slot(None, plan, background=True)
        if self._bg is not None and not self._bg.wants():
            self._advance(self._bg)
        planning_s = time.perf_counter() - t0
        for seq in step.preempt:
            self._preempt(seq)
        for seq, capacity in step.grow:
            assert seq.cache is not None
            seq.cache.ensure_capacity(capacity)
        self.metrics.peak_active_kv = max(self.metrics.peak_active_kv, self.active_kv_bytes())
        step = self._with_joined(step)
        decode = tuple(s for s in step.decode if s in self._running)
        items: list[Rows] = [Rows(torch.tensor([s.generation.pending]), s.cache, s.cache.length) for s in decode]
        taken: list[tuple[_Slot, int, int]] = []  # (slot, first item, count) of each plan's work in `items`
        left, time_left = step.budget, step.seconds
        work_by_kind: dict[str, float] = collections.defaultdict(float)
        others = bool(decode)
        order = [s for s in self._prefilling if s.wants()]
        if step.background and self._bg is not None and self._bg.wants():
            order.insert(0 if step.awaited else len(order), self._bg)
        spent_bg = spent = 0
        for slot in order:
            if (left is not None and left <= 0) or (time_left is not None and time_left <= 0 and taken):
                break
            assert slot.cursor is not None
            kind = work_kind(slot.cursor)
            bound = left
            if time_left is not None:  # the time left in this kind's row-layers
                fits = self.pace.row_layers(kind, max(time_left, 0.0))
                bound = fits if bound is None else min(bound, fits)
            try:
                want = slot.cursor.want(bound, ready_only=others or bool(taken) or len(order) > 1)
            except Exception as err:  # noqa: BLE001 - its plan hears it at its next advance
                slot.error, slot.cursor = err, None
                continue
            if not want:
                continue
            work = cost(want, self.runner.key_rows)
            if bound is not None and taken and work > bound:  # the budget is spent: it waits its turn
                break  # (an unused want is forgotten: the next want asks again)
            taken.append((slot, len(items), len(want)))
            items.extend(want)
            spent += work
            spent_bg += work if slot.background else 0
            work_by_kind[kind] += work
            left = None if left is None else left - work
            if time_left is not None:
                time_left -= work * (self.pace.rate_of(kind) or 0.0)
        if not items:
            self._busy_s += planning_s if not self._idle() else 0.0
            if not step.admit and not step.advance and not self._prefilling and self._bg is None:
                time.sleep(0.001)  # nothing ran and nothing could: cannot happen
            elif not taken and any(s.wants() for s in self._prefilling):
                self._wait_loads()
            return
        t1 = time.perf_counter()
        outs = self.runner.forward(items)
        step_s = time.perf_counter() - t1
        for slot, first, count in taken:
            try:
                slot.cursor.take(outs[first:first + count])
            except Exception as err:  # noqa: BLE001 - handed to its plan at its next advance
                slot.error, slot.cursor = err, None
        self.pace.observe(len(decode), work_by_kind, step_s)
        rows_cost = len(decode) * self.runner.num_layers + spent
        bg_s = step_s * spent_bg / rows_cost if rows_cost else 0.0
        if spent_bg:
            self.metrics.background_steps += 1
            self.metrics.background_s += bg_s
            self.metrics.background_busy_steps += bool(decode or spent > spent_bg or self._prefilling or self._waiting)
            self.metrics.background_awaited_steps += step.awaited
        if not (spent_bg and spent_bg == spent and not decode):
            self._busy_s += step_s + planning_s - bg_s
        if taken:
            self.metrics.prefill_chunks += 1
            self.metrics.decode_rows_in_prefill_steps += len(decode)
            self.metrics.shared_steps += len({id(s) for s, _, _ in taken if not s.background}) > 1
            self.metrics.prefill_s += step_s * (spent - spent_bg) / rows_cost + planning_s
        self.metrics.decode_s += step_s * len(decode) * self.runner.num_layers / rows_cost
        if not taken:
            self.metrics.decode_only_s += step_s
        self._emit(decode, outs[: len(decode)], with_plans=bool(taken))

    def _with_joined(self, step: Step) -> Step:
        """`step` with the sequences whose prefill ended in its advances (their first token just
        emitted) among its decode rows, and the plans' work bounded as for those rows: decided from
        the queue before the advances, the step would leave them out, and carry a plan's work
        unbounded where nothing decoded yet, so a new stream's second token waited a step more
        (on an AMD EPYC, 8 clients: 420-480 ms steps of a blend's 15 layers right after a first
        token, gaps of two steps after others). A joiner's cache has room for its next position
        (allocated for the prompt and `DECODE_RESERVE` tokens; a resumed one that is full waits for
        the next step's growth)."""
        joined = tuple(s for s in self._running if s not in step.decode
                       and s.cache is not None and s.cache.length < s.cache.capacity)
        if not joined:
            return step
        decode = (*step.decode, *joined)
        budget, seconds = self._bounds(len(decode))
        return replace(step, decode=decode, budget=budget, seconds=seconds)

    def _wait_loads(self) -> None:
        """Nothing could run this step but plans waiting for their loads: a short wait, not a spin."""
        time.sleep(0.0005)

    def _start(self, head: Sequence | Task) -> None:
        """Move `head` from the queue into the plans under way and make its plan's steps."""
        with self._cond:
            self._waiting.remove(head)
        now = time.monotonic()
        if isinstance(head, Task):
            head.started = now
            plan = self.plans.plan(head)
        else:
            head.status = Status.PREFILLING
            if head.parked is not None:
                plan = Resume(self, head)
            else:
                head.started = now
                plan = self.plans.plan(head)
        self._prefilling.append(_Slot(head, plan))

    # ------------------------------------------------------------------ prefill
    def _advance(self, slot: _Slot) -> None:
        """A plan takes what its last work gave back (or the error its work raised) and plans to its
        next want: model work (`Rows`, a list of them, or a `Cursor`), a pause (a unit it computed
        itself, or a wait), or its end (its value: a sequence samples its first token and joins
        the running set; a task ends)."""
        self.metrics.prefill_steps += not slot.background
        reply, error = slot.reply, slot.error
        if isinstance(slot.cursor, RowsCursor) and slot.cursor.done and error is None:
            reply = slot.cursor.value()
        slot.reply, slot.error, slot.cursor = None, None, None
        try:
            asked = slot.plan.take(reply, error)
        except Exception as err:  # noqa: BLE001 - handed to the caller, which raises it
            self._ended(slot, error=err)
            return
        if isinstance(asked, Done):
            self._ended(slot, value=asked.value)
            return
        if asked is PAUSE:
            return
        if isinstance(asked, (Rows, list)):
            if isinstance(asked, list) and not all(isinstance(r, Rows) for r in asked):
                asked = TypeError("a plan wanted a list of something other than Rows")
            else:
                slot.cursor = RowsCursor(asked, self.config.prefill_chunk_tokens, self.runner.key_rows)
                return
        elif hasattr(asked, "want") and hasattr(asked, "take"):
            slot.cursor = asked
            return
        err = asked if isinstance(asked, Exception) else TypeError(
            f"a plan wanted {type(asked).__name__}, not Rows, a list of Rows, a Cursor, PAUSE or Done")
        slot.plan.close()
        self._ended(slot, error=err)

    def _ended(self, slot: _Slot, *, value: Any = None, error: Exception | None = None) -> None:
        """A plan ended (returned, or raised `error`)."""
        if slot.background:
            self._bg = None
            if error is not None:  # the work is optional: the entry stays as it was
                log.warning("background work failed (%s: %s); the harvested entry stays", type(error).__name__,
                            str(error).splitlines()[0][:200] if str(error) else "")
            return
        if slot in self._prefilling:
            self._prefilling.remove(slot)
        item = slot.item
        assert item is not None
        if error is not None:
            self._end(item, error=error)
        elif isinstance(item, Task):
            self._end(item, value=value)
        else:
            try:
                self._join(item, value)
            except Exception as err:  # noqa: BLE001 - this sequence fails alone: its caller gets the error
                self._fail(item, err)

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
        seq.follow_logprobs = pre.follow_logprobs
        seq.exact_kv = pre.exact_kv
        seq.ttft_s = time.monotonic() - (seq.started or time.monotonic())
        self._emit_token(seq, pre.logits)
        if seq.generation.done:
            self._end(seq)
        else:
            seq.status = Status.RUNNING
            over = bool(self._running) and self.active_kv_bytes() + pre.cache.allocated_bytes() > self.config.max_active_kv
            self._running.append(seq)
            if over:  # the running set grew while it prefilled: the newest (it) is parked until there is room
                self._preempt(seq)
            self.metrics.peak_active_kv = max(self.metrics.peak_active_kv, self.active_kv_bytes())

    def _emit_token(self, seq: Sequence, logits: torch.Tensor) -> None:
        delta = seq.generation.push(logits)
        self.metrics.generated_tokens += 1
        if delta is not None:
            seq.handle.emit(delta)

    # ------------------------------------------------------------------- decode
    def _emit(self, decode: tuple[Sequence, ...], outs: list[Output], with_plans: bool) -> None:
        """Each decoding sequence samples its next token from its row's logits (its own parameters)."""
        size = len(decode)
        if not size:
            return
        if not with_plans:
            self.metrics.decode_steps += 1
            self.metrics.batch_sizes[size] += 1
        self.metrics._recent.append((time.monotonic(), size))
        for seq, out in zip(decode, outs, strict=True):
            if out.error is not None:  # a decode row failed alone (cannot happen short of a bug)
                self._fail(seq, out.error)
                continue
            seq.decode_steps += 1
            seq.batch_total += size
            try:
                self._emit_token(seq, out.logits[0])
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

    # ------------------------------------------------------------------ ending
    def _reap(self) -> None:
        """Cancelled or timed-out items leave: waiting ones are dropped, running ones stop."""
        with self._cond:
            gone = [item for item in self._waiting if item.handle.stopped()]
            for item in gone:
                self._waiting.remove(item)
        for item in gone:
            self._end(item, cancelled=True)
        for slot in list(self._prefilling):
            item = slot.item
            # a task (an ingest) sees its stop itself, between documents
            if item is not None and item.handle.stopped() and not isinstance(item, Task):
                self._prefilling.remove(slot)
                slot.plan.close()
                self._end(item, cancelled=True)
        for seq in [s for s in self._running if s.handle.stopped()]:
            self._end(seq, cancelled=True)
        if self._stopping:
            self._close_background()

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

    def _close_background(self) -> None:
        """The engine stops: the background plan under way ends (what it wrote stays) and none
        starts; the harvested documents it had not recomputed keep their harvested entries (said
        once, with how many)."""
        left = 0
        if self._bg is not None:
            self._bg.plan.close()
            self._bg = None
            left += 1
        if self._background is not None:
            left += self._background.drop_background()
        if left:
            log.info("the engine stopped before the standalone recompute of %d harvested document%s: "
                     "their harvested entries stay stored", left, "" if left == 1 else "s")

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
        slots, self._prefilling = self._prefilling, []
        for slot in slots:  # their claims and loaders released (a plan holds them until it ends or is closed)
            _quietly(slot.plan.close)
        self._close_background()
        items: list[Sequence | Task] = [*waiting, *[s.item for s in slots if s.item is not None], *self._running]
        for item in items:
            self._end(item, error=err if isinstance(err, Exception) else RuntimeError(str(err)))
        self._running.clear()


def _quietly(fn: Callable[[], None]) -> None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - ending a failed item must not fail the loop
        log.warning("cleaning up a failed request: %s", err)


class Resume(PlanCursor):
    """A preempted sequence's cache restored from the tiers, or recomputed: its prefill's plan
    again, then the tokens it had decoded as rows of their own (chunked like any)."""

    def __init__(self, scheduler: Scheduler, seq: Sequence):
        super().__init__()
        self.scheduler, self.seq = scheduler, seq
        self.t0 = 0.0
        self.parked: Any = None  # blend.kv.offload.ParkedKV, taken off the sequence
        self.cache: KVCache | None = None

    def _next(self, output: Any, error: BaseException | None) -> Want:
        sched, seq = self.scheduler, self.seq
        if self.stage == "start":
            self.t0 = time.perf_counter()
            parked = seq.parked
            assert parked is not None
            self.parked = parked
            n = len(parked.token_ids)
            capacity = n + min(DECODE_RESERVE, seq.generation.max_new_tokens)
            cache = sched.parking.restore(parked, capacity)
            sched.parking.release(parked)
            seq.parked = None
            if cache is None:  # the tiers lost it: the prefill again, then the tokens it had decoded
                self.stage = "prefill"
                return self.run(sched.plans.plan(seq))
            return self._done(cache)
        if self.stage == "prefill":
            pre = output
            n = len(self.parked.token_ids)
            self.cache, seq.exact_kv = pre.cache, pre.exact_kv
            done = list(self.parked.token_ids[len(pre.token_ids):])
            sched.metrics.resumes_recomputed += 1
            if done:
                self.cache.ensure_capacity(n + 1)
                self.stage = "decoded"
                return Rows(torch.tensor(done), self.cache, len(pre.token_ids), ())
        assert self.cache is not None
        return self._done(self.cache)

    def _done(self, cache: KVCache) -> Want:
        seq, metrics = self.seq, self.scheduler.metrics
        seq.cache = cache
        seq.resume_s += time.perf_counter() - self.t0
        metrics.resumes += 1
        metrics.resume_s += time.perf_counter() - self.t0
        self.stage = "done"
        return Done(None)
