"""Chat sessions with KV offload and resume.

After every turn a session's KV is written to the tier stack as a chain of fixed-size
prefix blocks (`chunk_tokens`), each keyed by the digest of all tokens up to its end —
exact prefix caching, no recompute. The device-resident copy is kept while the session
is active and dropped ("offloaded") once it has been idle `idle_seconds`, when the
device-resident KV of all sessions exceeds `active_budget` (least recently used first),
or on `offload()`. The policy is enforced lazily, before and after every turn of any
session (and by `enforce()`, for a server that wants a timer): the outcome is the same
as offloading on time, since the blocks are in the store either way. The next turn
reuses the device copy if there is one, else loads the longest cached prefix chain
layer by layer through the pipelined loader and prefills only the rest. A partial last
block is not stored: a resume from the store recomputes up to `chunk_tokens - 1` tokens
of the previous conversation's tail plus the new message.

A turn may bring documents and a system prompt (`RagTurn`): the documents are placed
before the conversation (blend.conversation) and, in blend or reuse mode, their cached
chunk KV is blended in. Such KV is not exact, so it is never stored as prefix blocks
(that chain promises exact KV); it stays on the device for the next turn, and a turn
after an offload blends again. In full and prefix modes the KV is exact and is stored
as usual. Pass the same documents and system prompt on every turn to reuse the
conversation's KV; a turn that changes them recomputes from where the tokens differ.

The message history is kept in a small JSON file per session under `sessions_dir`
(re-read at the start of every turn) so a conversation resumes in a new process. One
turn at a time per session: a second concurrent turn — another thread, or another
process through a lock file next to the history — raises `SessionBusy`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from blend.config import BlendConfig
from blend.decode.generation import ExactKV, Prefilled
from blend.decode.result import GenerationResult
from blend.kv.prefix import PrefixCache, intact_end
from blend.kv.windowed import WindowedChain
from blend.model.cache import RING_SLACK, KVCache
from blend.model.plan import Done, PlanCursor, Want
from blend.model.runner import Rows
from blend.prompt.builder import Prompt, PromptBuilder
from blend.prompt.conversation import ROLES, Message, chat_ids
from blend.prompt.document import Document, clean_text
from blend.stats import LookupTally, RequestStats, tally_fields
from storage.entry import KVEntry
from storage.tier import StoreUnavailable

try:  # POSIX: the cross-process turn lock
    import fcntl
except ImportError:  # pragma: no cover - Windows: threads of one process are still serialized
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
_SESSION_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
LOCK_ATTEMPTS = 3  # lock files replaced under us (a concurrent drop) before giving up
MAX_HISTORY_BYTES = 64 << 20  # a session history file above this is refused (it is text messages)
# session files are opened like the disk tier's entries: never through a symlink, never blocking on a FIFO
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of a regular file at `path` (not through a symlink, never blocking on a FIFO
    or device), at most `limit` of them; OSError / ValueError otherwise."""
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, over the {limit} bytes a history may hold")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)[:limit]
    finally:
        os.close(fd)


class SessionBusy(RuntimeError):
    """A turn is already running on this session (in this process or another one)."""


def check_session_id(session_id: str) -> str:
    """Return `session_id` if it is usable as a file name; TypeError for a non-str,
    ValueError otherwise."""
    if not isinstance(session_id, str):
        raise TypeError(f"session id must be a str, got {type(session_id).__name__}")
    if not _SESSION_ID.match(session_id):
        raise ValueError(f"bad session id {session_id!r}: use 1-128 letters, digits, '_', '-' or '.', "
                         "starting with a letter, digit or '_'")
    return session_id


@dataclass
class Session:
    session_id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    cache: KVCache | None = None  # device-resident KV, valid for cache_ids[:cache.length]
    cache_ids: list[int] = field(default_factory=list)
    exact: bool = True  # the device KV is exact (no blended documents): its blocks may be stored
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)  # held for the whole turn


@dataclass
class Turn:
    """One chat turn in flight, from `SessionManager.begin` to `finish` or `abort`: the session
    is held (any other turn on it raises SessionBusy) and the prompt is laid out.

    `prompt` is set when documents come with the turn (they are placed before the
    conversation); `blended` says the documents' cached KV is blended in (mode blend or
    reuse: the turn's KV is then not exact and never stored: `exact`). Where the KV came from
    comes back in the prefill's result (`Prefilled.exact_kv`) and goes to `finish`; nothing of
    the turn is written after `begin` but `ended`.
    """

    session: Session
    messages: list[dict[str, str]]  # the history plus the new user message
    ids: list[int]
    prompt: Prompt | None
    blended: bool
    max_new_tokens: int
    lock_fd: int | None
    exact: bool = True
    ended: bool = False
    resume_at: tuple[int, ...] = ()  # more ends a stored chain may stop at (a hybrid model: the last prompt's)

    def device_prefix(self) -> int:
        """Tokens of the turn the session's device-resident KV already holds."""
        cache = self.session.cache
        if cache is None:
            return 0
        return _common_prefix(self.session.cache_ids[: cache.length], self.ids, len(self.ids) - 1)

    def blends(self) -> bool:
        """Whether this turn's documents are blended in: documents in blend/reuse mode that are
        not all on the device already."""
        return self.prompt is not None and self.blended and self.device_prefix() < self.prompt.query.start


class SessionManager:
    """The chat sessions of one engine. Thread-safe: turns on one session are exclusive."""

    def __init__(self, config: BlendConfig, prefix: PrefixCache, prompts: PromptBuilder, eos: Sequence[int]):
        self.config, self.prefix, self.prompts, self.eos = config, prefix, prompts, tuple(eos)
        self.runner = prefix.runner
        # a model with sliding-window layers stores and resumes their last window only (blend.kv.windowed)
        self.windowed = WindowedChain(prefix) if prefix.runner.dims.hybrid else None
        self.tier_names = [t.name for t in prefix.store.tiers]
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()  # guards `sessions`
        self.directory = Path(config.sessions.sessions_dir)

    # ---------------------------------------------------------------- storage
    def _path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.json"

    def _get(self, session_id: str) -> Session:
        """The in-memory session, created empty if unknown (the history is read per turn)."""
        check_session_id(session_id)
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None:
                session = self.sessions[session_id] = Session(session_id)
            return session

    def _read_history(self, session_id: str) -> list[dict[str, str]] | None:
        """Messages from the session's JSON file; None if there is none (a new session)."""
        path = self._path(session_id)
        try:
            data = json.loads(_read_regular(path, MAX_HISTORY_BYTES).decode("utf-8"))
            if not isinstance(data, dict) or "messages" not in data:
                raise ValueError("expected a JSON object with the session's messages")
            if data.get("session_id", session_id) != session_id:
                raise ValueError(f"it holds session {data.get('session_id')!r}")
            messages = data["messages"]
            if not isinstance(messages, list) or not all(
                    isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                    for m in messages):
                raise ValueError(f"messages must be a list of {{role: {' | '.join(ROLES)}, content: text}}")
            return [{"role": m["role"], "content": m["content"]} for m in messages]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:  # Recursion: nested too deep
            raise ValueError(f"session {session_id!r}: history file {path} is unreadable ({str(err)[:200]}); "
                             "repair it, or delete it (engine.drop) to start the session over") from None

    def _save(self, session_id: str, messages: list[dict[str, str]]) -> None:
        """Write the history atomically (temp file + rename); a failed write leaves the old
        file and no temp file, and is a one-line error naming the file."""
        path = self._path(session_id)
        # a fresh, unguessable temp name created exclusively, never through a link planted there
        tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(8)}")
        created = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, _CREATE_FLAGS, 0o600)
            created = True
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(json.dumps({"session_id": session_id, "messages": messages}))
            os.replace(tmp, path)
        except OSError as err:
            if created:  # a partly written temp file of ours (never a file someone else put there)
                with suppress(OSError):
                    tmp.unlink(missing_ok=True)
            raise ValueError(f"session {session_id!r}: cannot write its history {path} ({err.strerror or err}); "
                             "free space or fix the sessions directory (engine.sessions.sessions_dir); the turn is not "
                             "part of the conversation") from None

    def _acquire(self, session: Session) -> int | None:
        """Hold the session for a turn: its thread lock, and a file lock against other processes
        (the descriptor returned; `_release` frees both, from any thread).

        Raises SessionBusy at once (never waits) if either is held elsewhere.
        """
        if not session.lock.acquire(blocking=False):
            raise SessionBusy(f"session {session.session_id!r} is already running a turn; wait for it to finish")
        try:
            return self._lock_file(session.session_id) if fcntl is not None else None
        except BaseException:
            session.lock.release()
            raise

    @staticmethod
    def _release(session: Session, fd: int | None) -> None:
        if fd is not None:
            os.close(fd)  # releases the flock
        session.lock.release()

    @contextmanager
    def _exclusive(self, session: Session) -> Iterator[None]:
        fd = self._acquire(session)
        try:
            yield
        finally:
            self._release(session, fd)

    def _lock_file(self, session_id: str) -> int:
        """A descriptor holding the flock of `<id>.lock`. A lock file that another process's
        `drop` unlinked between our open and our flock guards nothing: open it anew."""
        lock = self.directory / f"{session_id}.lock"
        for _ in range(LOCK_ATTEMPTS):
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                fd = os.open(lock, _LOCK_FLAGS, 0o644)
            except OSError as err:  # read-only, a symlink or a directory in its place
                raise ValueError(f"session {session_id!r}: cannot open its lock file {lock} "
                                 f"({err.strerror or err}); fix the sessions directory (engine.sessions.sessions_dir) "
                                 "or remove what is in the lock file's place") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                try:
                    current = os.stat(lock, follow_symlinks=False)
                except FileNotFoundError:
                    current = None
                if current is not None and os.path.samestat(os.fstat(fd), current):
                    return fd
            except BlockingIOError:
                os.close(fd)
                raise SessionBusy(f"session {session_id!r} is running a turn in another process; "
                                  "wait for it to finish") from None
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # locked a file that is no longer the session's lock: try again
        raise SessionBusy(f"session {session_id!r} is being dropped and recreated by another process; try again")

    # ----------------------------------------------------------------- policy
    def offload(self, session_id: str) -> None:
        """Drop a session's device-resident KV; its blocks stay in the tier stack.

        Waits for the queued block writes first, so a resume finds the whole chain.
        Raises SessionBusy while a turn runs on the session; no-op for unknown sessions.
        """
        session = self.sessions.get(check_session_id(session_id))
        if session is None:
            return
        with self._exclusive(session):
            self._offload(session)

    def _offload(self, session: Session) -> None:
        if session.cache is not None:
            # the queued blocks need not be written yet (a lookup is served from the write queue): only a
            # store that failed a write keeps the device copy; never a wait for the writer (this runs on
            # the scheduler's thread after a turn)
            self.prefix.store.check()
            session.cache = None
            log.info("offloaded session %s", session.session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session: its history file and device KV (stored blocks age out of the tiers).

        Raises SessionBusy while a turn runs on it; dropping an unknown session is a no-op.
        """
        session = self._get(session_id)
        with self._exclusive(session):
            with self._lock:
                self.sessions.pop(session_id, None)
            for path in (self._path(session_id), self.directory / f"{session_id}.lock"):
                try:
                    path.unlink(missing_ok=True)
                except OSError as err:
                    raise ValueError(f"session {session_id!r}: cannot remove {path} ({err.strerror or err}); "
                                     "remove it by hand") from None
            session.cache, session.messages = None, []

    def set_history(self, session_id: str, messages: Sequence[Mapping[str, str]]) -> None:
        """Replace a session's history (e.g. to import a conversation) and drop its device KV.

        Computes nothing: the next turn loads whatever prefix blocks of the new history the
        store holds and prefills the rest. Raises SessionBusy while a turn runs on it.
        """
        history = [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
        session = self._get(session_id)
        with self._exclusive(session):
            self._save(session_id, history)
            session.messages, session.cache, session.cache_ids = history, None, []

    def resident_bytes(self) -> int:
        """Bytes of device-resident chat KV over all sessions."""
        return sum(s.cache.nbytes() for s in list(self.sessions.values()) if s.cache is not None)

    def enforce(self, now: float | None = None) -> list[str]:
        """Offload sessions idle for `idle_seconds`, then, while the resident KV exceeds
        `active_budget`, the least recently used ones. Sessions in a turn are skipped.
        A store that cannot take the blocks (StoreUnavailable) keeps the device copy.
        Returns the ids offloaded."""
        cfg = self.config
        now = time.monotonic() if now is None else now
        resident = sorted((s for s in list(self.sessions.values()) if s.cache is not None), key=lambda s: s.last_used)
        offloaded = []
        for session in resident:
            idle = now - session.last_used >= cfg.sessions.idle_seconds
            if not idle and self.resident_bytes() <= cfg.sessions.active_budget:
                continue
            if not session.lock.acquire(blocking=False):
                continue  # in a turn: it is not idle, and it re-checks the budget after the turn
            try:
                self._offload(session)
                offloaded.append(session.session_id)
            except StoreUnavailable as err:
                log.warning("session %s stays on the device: the store cannot take its blocks (%s)",
                            session.session_id, err)
            finally:
                session.lock.release()
        return offloaded

    # ------------------------------------------------------------------- turn
    def begin(self, session_id: str, message: str, *, max_new_tokens: int | None = None, system: str | None = None,
              documents: Sequence[Document | str] = (), blended: bool = False) -> Turn:
        """Start one turn: hold the session, read its history, lay the prompt out (with
        `documents` placed before the conversation; `blended`: their cached KV is blended in)
        and check it fits. Every turn that begins ends with `finish` or `abort`.

        `system` is a system message put before the history for this turn (not stored in
        it). Raises SessionBusy if a turn is already running on `session_id`, ValueError on
        bad input (the session is then released).
        """
        if not isinstance(message, str) or not message.strip():
            raise ValueError("empty message: pass some text")
        if system is not None and not isinstance(system, str):
            raise TypeError(f"system must be a str or None, got {type(system).__name__}")
        # text UTF-8 cannot encode (lone surrogates, e.g. undecodable bytes from argv) is stored
        # and tokenized with U+FFFD in their place, as documents and messages are elsewhere
        message = clean_text(message)
        system = None if system is None else clean_text(system)
        cfg = self.config
        max_new = cfg.generation.max_new_tokens if max_new_tokens is None else max_new_tokens
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new!r}")
        session = self._get(session_id)
        self.enforce()
        fd = self._acquire(session)
        try:
            return self._lay_out(session, message, max_new, system, tuple(documents), blended, fd)
        except BaseException:
            self._release(session, fd)
            raise

    def _lay_out(self, session: Session, message: str, max_new: int, system: str | None,
                 documents: tuple[Document | str, ...], blended: bool, fd: int | None) -> Turn:
        history = self._read_history(session.session_id)
        if history is not None:  # the file wins: another process may have advanced the conversation
            session.messages = history
        messages = session.messages + [{"role": "user", "content": message}]
        shown = ([{"role": "system", "content": system}] if system is not None else []) + messages
        shorten = ("the conversation is too long: drop the session (engine.drop) and start a new one"
                   + (", or use fewer or shorter documents" if documents else ""))
        try:  # before tokenizing: a history of megabytes would take minutes to be refused
            self.prompts.check_text_fits([Message(m["role"], m["content"]) for m in shown], documents,
                                         self.runner.max_positions, fix=shorten)
        except ValueError as err:
            raise ValueError(f"session {session.session_id!r}: {err}") from None
        if documents:
            prompt = self.prompts.build(tuple(Message(m["role"], m["content"]) for m in shown), documents)
            ids = list(prompt.token_ids)
        else:
            prompt = None
            ids = chat_ids(self.prompts.tokenizer, shown)
        try:
            self.runner.check_length(len(ids), max_new, shorten)
        except ValueError as err:
            raise ValueError(f"session {session.session_id!r}: {err}") from None
        resume_at: tuple[int, ...] = ()  # the previous turn's prompt end: a hybrid model stored a window there
        if self.windowed is not None and not documents:
            previous = [i for i, m in enumerate(shown[:-1]) if m["role"] == "user"]
            if previous:
                resume_at = (len(chat_ids(self.prompts.tokenizer, shown[: previous[-1] + 1])),)
        return Turn(session, messages, ids, prompt, blended and bool(documents), max_new, fd,
                    exact=not (blended and documents), resume_at=resume_at)

    def prefill_plan(self, turn: Turn, capacity: int) -> TurnPrefill:
        """The exact prefill of a turn, as a plan (`TurnPrefill`) whose value is its `Prefilled`."""
        return TurnPrefill(self, turn, capacity)

    def prompt_window(self, turn: Turn, cache: KVCache, exact: bool) -> tuple[str, KVEntry] | None:
        """A hybrid model's window at the end of the turn's prompt, taken before decoding moves
        the rings on (stored by `finish`, so that the next turn resumes there: its reply,
        re-rendered, may tokenize otherwise)."""
        if self.windowed is not None and exact and turn.prompt is None and cache.length >= len(turn.ids):
            return self.windowed.window_entry(turn.ids, cache, len(turn.ids))
        return None

    def finish(self, turn: Turn, result: GenerationResult, cache: KVCache, kv: ExactKV | None = None) -> None:
        """End a turn that generated `result` from `cache`: queue its exact blocks (`kv`: what its
        prefill found, `TurnPrefill`; None: computed whole, or blended), save the history (first: a
        turn that cannot be saved is not in the conversation), keep the KV on the device for the
        next turn, release the session, run the offload policy."""
        if turn.ended:
            return
        kv = kv if kv is not None else ExactKV(exact=turn.exact)
        session = turn.session
        try:
            all_ids = turn.ids + result.token_ids
            if kv.exact and self.windowed is not None:
                also = [(len(turn.ids), kv.prompt_window)] if kv.prompt_window is not None else []
                stored = self.windowed.store_blocks(all_ids, cache, skip_below=kv.stored_end, also=also)
                result.stats = result.stats.replace(stored_blocks=stored)
            elif kv.exact:
                stored = self.prefix.store_blocks(all_ids, cache, skip_below=kv.stored_end, tail=True)
                result.stats = result.stats.replace(stored_blocks=stored)
            history = turn.messages + [{"role": "assistant", "content": result.text}]
            self._save(session.session_id, history)
            session.messages = history
            session.cache, session.cache_ids, session.exact = cache, all_ids, kv.exact
            session.last_used = time.monotonic()
        except BaseException:
            session.cache = None
            raise
        finally:
            turn.ended = True
            self._release(session, turn.lock_fd)
        self.enforce()

    def abort(self, turn: Turn) -> None:
        """End a turn that failed or was cancelled: its device KV is dropped (it may be partly
        overwritten), the history is unchanged, the session released."""
        if turn.ended:
            return
        turn.ended = True
        turn.session.cache = None
        self._release(turn.session, turn.lock_fd)
        self.enforce()


class TurnPrefill(PlanCursor):
    """The exact prefill of a turn, as a plan whose computed rows are its wants (`Rows`): the
    device copy reused, else the stored prefix chain loaded (`PrefixLoad`); the rest computed.
    The cache holds `capacity` positions. Its `Prefilled.exact_kv` says where the KV came from
    (`ExactKV`: the end of the prefix whose blocks are intact in the store, whether it is exact,
    a hybrid model's window at the prompt's end). Raises LoadStalled when a tier was too slow
    (the caller computes the turn whole)."""

    def __init__(self, manager: SessionManager, turn: Turn, capacity: int):
        super().__init__()
        self.manager, self.turn, self.capacity = manager, turn, capacity
        self.t0 = 0.0
        self.cache: KVCache | None = None
        self.common = 0  # positions of the device copy kept
        self.session_exact = True  # ... and whether that copy was exact
        self.chain: list = []
        self.tally: LookupTally | None = None

    def _stats(self, source: str, loaded: int, **fields: Any) -> RequestStats:
        return turn_stats(self.turn.ids, source, loaded, prefill_s=time.perf_counter() - self.t0, **fields)

    def _next(self, output: Any, error: BaseException | None) -> Want:
        if self.stage == "start":
            return self._start()
        manager, turn, ids, cache = self.manager, self.turn, self.turn.ids, self.cache
        assert cache is not None
        if self.stage == "device":  # the rest computed after the device copy
            # the blocks below were stored by the turn that filled the device copy
            stored_end = _block_floor(self.common, manager.prefix.block_tokens)
            exact = turn.exact and self.session_exact
            kv = ExactKV(stored_end, exact, manager.prompt_window(turn, cache, exact))
            self.stage = "done"
            return Done(Prefilled(output[0], cache, self._stats("device", self.common), tuple(ids), exact_kv=kv))
        logits, load = output  # the chain loaded, the rest computed
        # (a block whose stored layers were unreadable failed the load: LoadFailed, the turn computed in full)
        windowed, chain = manager.windowed, self.chain
        if windowed is not None:  # positions loaded: the global chain's (the window lies inside it)
            loaded = sum(pl.length for pl in chain if pl.entry is None and pl.layers == windowed.full_layers)
            if any(pl.layers == windowed.sliding_layers and pl.entry is not None for pl in chain):
                loaded = 0  # the window was computed from the whole conversation
            stored_end = windowed.intact_end(chain, load)
        else:
            loaded = sum(pl.length for pl in chain if pl.entry is None)
            stored_end = intact_end(chain, load)
        assert self.tally is not None
        kv = ExactKV(stored_end, turn.exact, manager.prompt_window(turn, cache, turn.exact))
        self.stage = "done"
        return Done(Prefilled(logits, cache, self._stats("store" if loaded else "computed", loaded, load=load,
                                                         **tally_fields(self.tally)), tuple(ids), exact_kv=kv))

    def _start(self) -> Want:
        manager, turn = self.manager, self.turn
        session, ids = turn.session, turn.ids
        limit = len(ids) - 1  # at least the last token is computed: its logits start decoding
        self.t0 = time.perf_counter()
        if session.cache is not None:
            common = _common_prefix(session.cache_ids[: session.cache.length], ids, limit)
            # a ring layer holds the windows of its last RING_SLACK positions: rewinding further needs the store
            rewinds = session.cache.length - common
            if common > 0 and (rewinds < RING_SLACK or not any(session.cache.rings)):
                cache, self.session_exact = session.cache, session.exact
                session.cache = None  # in use by this turn: a failed turn leaves none behind
                cache.ensure_capacity(self.capacity)
                self.cache, self.common, self.stage = cache, common, "device"
                return Rows(torch.tensor(ids[common:]), cache, common)
        # the previous turn's tail block ends where its generation stopped: at (or just
        # before) the end-of-turn token that now closes the assistant message
        ends = [i for i, t in enumerate(ids) if t in manager.eos]
        tails = sorted({e for i in ends[-2:] for e in (i, i - 1)} | set(turn.resume_at), reverse=True)
        windowed = manager.windowed
        self.chain = (windowed or manager.prefix).lookup(ids, limit, tail_ends=tails)
        self.tally = LookupTally(manager.tier_names)
        for pl in self.chain:
            self.tally.hit_from("prefix_blocks", pl.source)
        # a hybrid model: sliding layers are rings holding the loaded window, then the new tokens
        self.cache = manager.runner.new_cache(self.capacity, ring=windowed is not None)
        self.stage = "store"
        return self.run(manager.prefix.prefill_plan(ids, self.chain, self.cache))


def turn_stats(ids: Sequence[int], source: str, loaded: int, **fields: Any) -> RequestStats:
    """The statistics of a chat turn's prefill (mode `chat`)."""
    return RequestStats(mode="chat", recompute_ratio=0.0, context_tokens=len(ids), query_tokens=0,
                        loaded_tokens=loaded, recomputed_tokens=len(ids) - loaded, source=source, **fields)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _block_floor(n: int, block: int) -> int:
    return n - n % block
