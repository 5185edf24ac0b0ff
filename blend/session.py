"""Chat sessions with KV offload and resume.

After every turn a session's KV is written to the tier stack as a chain of fixed-size
prefix blocks (`chunk_tokens`), each keyed by the digest of all tokens up to its end —
exact prefix caching, no recompute. The device-resident copy is kept while the session
is active and dropped ("offloaded") after `idle_seconds`, when the device-resident KV of
all sessions exceeds `active_budget`, or on `offload()`. The next turn reuses the
device copy if there is one, else loads the longest cached prefix chain layer by layer
through the pipelined loader and prefills only the rest.

The message history is kept in a small JSON file per session under `sessions_dir` so a
conversation resumes in a new process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from blend.runner import KVCache, SamplingParams

if TYPE_CHECKING:
    from blend.engine import BlendEngine, GenerationResult

log = logging.getLogger(__name__)
_SESSION_ID = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class SessionBusy(RuntimeError):
    """A turn is already running on this session."""


@dataclass
class Session:
    session_id: str
    messages: list[dict[str, str]] = field(default_factory=list)
    cache: KVCache | None = None  # device-resident KV, valid for cache_ids[:cache.length]
    cache_ids: list[int] = field(default_factory=list)
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionManager:
    def __init__(self, engine: BlendEngine):
        self.engine = engine
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.directory = Path(engine.config.engine.sessions_dir)

    # ---------------------------------------------------------------- storage
    def _path(self, session_id: str) -> Path:
        return self.directory / f"{session_id}.json"

    def _load(self, session_id: str) -> Session:
        if not _SESSION_ID.match(session_id):
            raise ValueError(f"bad session id {session_id!r}: use 1-128 letters, digits, '_', '-' or '.'")
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None:
                session = Session(session_id)
                try:
                    data = json.loads(self._path(session_id).read_text())
                    session.messages = [dict(role=str(m["role"]), content=str(m["content"])) for m in data["messages"]]
                except FileNotFoundError:
                    pass  # a session id that does not exist is a new session
                except (OSError, ValueError, KeyError, TypeError) as err:
                    log.warning("session %s: unreadable history (%s); starting a new session", session_id, err)
                self.sessions[session_id] = session
            return session

    def _save(self, session: Session) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._path(session.session_id)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps({"session_id": session.session_id, "messages": session.messages}))
        os.replace(tmp, path)

    # ----------------------------------------------------------------- policy
    def offload(self, session_id: str) -> None:
        """Drop the device-resident KV of a session (its blocks are in the tier stack)."""
        session = self.sessions.get(session_id)
        if session is not None and session.cache is not None:
            self.engine.store.flush()  # the blocks this session queued are durable first
            session.cache = None
            log.info("offloaded session %s", session_id)

    def drop(self, session_id: str) -> None:
        """Forget a session: history file and device KV (stored blocks age out of the tiers)."""
        with self._lock:
            self.sessions.pop(session_id, None)
        self._path(session_id).unlink(missing_ok=True)

    def resident_bytes(self) -> int:
        return sum(s.cache.nbytes() for s in self.sessions.values() if s.cache is not None)

    def enforce(self, now: float | None = None, keep: str | None = None) -> None:
        """Offload idle sessions and, over budget, the least recently used ones."""
        cfg = self.engine.config.engine
        now = time.monotonic() if now is None else now
        for s in list(self.sessions.values()):
            if s.cache is not None and s.session_id != keep and now - s.last_used >= cfg.idle_seconds:
                self.offload(s.session_id)
        resident = sorted((s for s in self.sessions.values() if s.cache is not None and s.session_id != keep),
                          key=lambda s: s.last_used)
        while resident and self.resident_bytes() > cfg.active_budget:
            self.offload(resident.pop(0).session_id)

    # ------------------------------------------------------------------- turn
    def turn(self, session_id: str, message: str, *, max_new_tokens: int | None = None) -> GenerationResult:
        from blend.engine import GenerationResult

        if not isinstance(message, str) or not message.strip():
            raise ValueError("empty message: pass some text")
        session = self._load(session_id)
        if not session.lock.acquire(blocking=False):
            raise SessionBusy(f"session {session_id!r} is already running a turn; wait for it to finish")
        try:
            engine, runner = self.engine, self.engine.runner
            cfg = engine.config.engine
            max_new = cfg.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
            messages = session.messages + [{"role": "user", "content": message}]
            ids = list(engine.lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                               return_dict=False))
            runner.check_length(len(ids) + max_new)
            stats: dict[str, Any] = {"mode": "chat", "history_tokens": len(ids), "chunk_hits": 0, "hits_by_tier": {}}
            t0 = time.perf_counter()
            logits, cache, loaded_end = self._prefill(session, ids, stats)
            ttft = time.perf_counter() - t0
            logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
            tokens = runner.decode(logits, cache, max_new, engine.eos_ids,
                                   SamplingParams(cfg.temperature, cfg.top_p))
            text = engine.lm.tokenizer.decode([t for t in tokens if t not in engine.eos_ids],
                                              skip_special_tokens=True).strip()
            all_ids = ids + tokens
            stats["stored_blocks"] = engine.store_prefix_blocks(all_ids, cache, skip_below=loaded_end)
            session.messages = messages + [{"role": "assistant", "content": text}]
            session.cache, session.cache_ids = cache, all_ids
            session.last_used = time.monotonic()
            self._save(session)
            stats.update(ttft_s=ttft, new_tokens=len(tokens))
            return GenerationResult(text, tokens, ttft, logprobs, stats)
        finally:
            session.lock.release()
            self.enforce(keep=session_id)

    def _prefill(self, session: Session, ids: list[int], stats: dict[str, Any]) -> tuple[torch.Tensor, KVCache, int]:
        """Reuse the device copy, else the stored prefix chain; compute the rest.

        Returns (last logits, cache, end of the prefix that is already in the store)."""
        engine, runner = self.engine, self.engine.runner
        limit = len(ids) - 1
        if session.cache is not None:
            common = _common_prefix(session.cache_ids[: session.cache.length], ids, limit)
            if common > 0:
                cache = session.cache
                logits = runner.prefill(torch.tensor(ids[common:]), cache, start=common)[0]
                stats.update(source="device", loaded_tokens=common, recomputed_tokens=len(ids) - common,
                             load_s=0.0, exposed_load_s=0.0)
                return logits, cache, _block_floor(common, engine.config.engine.chunk_tokens)
        chain = engine.lookup_prefix(ids, limit)
        for pl in chain:
            stats["chunk_hits"] += 1
            stats["hits_by_tier"][pl.source] = stats["hits_by_tier"].get(pl.source, 0) + 1
        logits, cache = engine.prefill_with_prefix(ids, chain, stats)
        stats["source"] = "store" if chain else "computed"
        return logits, cache, sum(pl.length for pl in chain)


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _block_floor(n: int, block: int) -> int:
    return n - n % block
