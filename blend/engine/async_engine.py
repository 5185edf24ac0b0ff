"""`AsyncBlendEngine`: the Python API for asyncio code (RAG pipelines that already run
concurrently). Each call queues its request on the wrapped engine's scheduler and awaits
its events on the event loop; many awaited at once decode together in one batch.

    async with AsyncBlendEngine.from_config("configs/default.yaml") as engine:
        results = await asyncio.gather(*(engine.generate(q, docs) for q in questions))
        async for item in engine.generate_stream("When did it open?", docs):
            ...  # TextDelta, then the GenerationResult

Cancelling the awaiting task (asyncio.CancelledError) cancels the request at any moment, even
while it is being submitted: it leaves the decode batch (or the queue) at the scheduler's next step. The prompt is laid out off the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from blend.decode.result import GenerationResult, TextDelta
from blend.engine.engine import BlendEngine
from blend.engine.sequence import Finished, Handle, unwrap
from blend.prompt.document import Document, IngestedDocument

_FORCING = ("answer", "logprobs", "follow")


class AsyncBlendEngine:
    """An asyncio facade over one BlendEngine (which it owns: `close` closes it)."""

    def __init__(self, engine: BlendEngine):
        if not isinstance(engine, BlendEngine):
            raise TypeError(f"AsyncBlendEngine wraps a BlendEngine, got {type(engine).__name__}")
        self.engine = engine

    @classmethod
    def from_config(cls, path: str | Path | None = None, **overrides: Any) -> AsyncBlendEngine:
        """`BlendEngine.from_config` wrapped (loads the model now, in the calling thread)."""
        return cls(BlendEngine.from_config(path, **overrides))

    async def __aenter__(self) -> AsyncBlendEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Let running requests finish and close the engine (off the event loop)."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.close)

    async def _events(self, start: Callable[[Callable[[Any], None]], Handle]) -> AsyncIterator[Any]:
        """The events of an item queued by `start(sink)` (run off the loop), as they come;
        the `Finished` one last. Leaving early (or being cancelled) cancels the item."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Any] = asyncio.Queue()

        def sink(event: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        submitted: list[Handle] = []
        abandoned = threading.Event()

        def submit() -> Handle:
            handle = start(sink)
            submitted.append(handle)
            if abandoned.is_set():  # the caller was cancelled while this ran: nobody will await it
                handle.cancel()
            return handle

        try:
            handle = await loop.run_in_executor(None, submit)
        except asyncio.CancelledError:  # the submission goes on in its thread: its request is cancelled
            abandoned.set()  # by submit() when it ends, or here when it already has
            for handle in submitted:
                handle.cancel()
            raise
        done = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, Finished):
                    done = True
                yield event
                if done:
                    return
        finally:
            if not done:
                handle.cancel()

    async def generate(self, query: Any, documents: Sequence[Document | str] = (), **kwargs: Any
                       ) -> GenerationResult:
        """`BlendEngine.generate`, awaited (the same arguments and result)."""
        async for event in self._generation(query, documents, kwargs):
            if isinstance(event, Finished):
                return unwrap(event)
        raise AssertionError("unreachable")

    async def generate_stream(self, query: Any, documents: Sequence[Document | str] = (), **kwargs: Any
                              ) -> AsyncIterator[TextDelta | GenerationResult]:
        """`BlendEngine.generate_stream`, as an async iterator: `TextDelta`s, then the result."""
        async for event in self._generation(query, documents, kwargs):
            yield unwrap(event) if isinstance(event, Finished) else event

    def _generation(self, query: Any, documents: Sequence[Document | str], kwargs: dict[str, Any]
                    ) -> AsyncIterator[Any]:
        forcing = {k: kwargs.pop(k) for k in _FORCING if k in kwargs}
        req = self.engine.request(query, documents, **kwargs)  # bad arguments raise here, at the call
        return self._events(lambda sink: self.engine.submit(req, sink=sink, **forcing))

    async def chat(self, session_id: str, message: str, **kwargs: Any) -> GenerationResult:
        """`BlendEngine.chat`, awaited."""
        start = functools.partial(self.engine.submit_chat, session_id, message, **kwargs)
        async for event in self._events(lambda sink: start(sink=sink)):
            if isinstance(event, Finished):
                return unwrap(event)
        raise AssertionError("unreachable")

    async def ingest(self, documents: Sequence[Document | str], **kwargs: Any) -> list[IngestedDocument]:
        """`BlendEngine.ingest`, awaited (its forward passes share the scheduler with running requests)."""
        async for event in self._events(lambda sink: self.engine.submit_ingest(documents, sink=sink, **kwargs)):
            if isinstance(event, Finished):
                return unwrap(event)
        raise AssertionError("unreachable")
