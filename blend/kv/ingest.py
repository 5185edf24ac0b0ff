"""Ingest bookkeeping: the documents an engine computes ahead of requests and the ones it
knows by id.

    `Ingestor.prepare`  an ingest checked and laid out before any work (a document that no
                        request could use, too long for the positions with the prompt's fixed
                        part, refused): `IngestJob`
    `Ingestor.plan`    on the scheduler, a plan (`IngestPlan`): `DocumentCache.ingest_plan` (the
                        documents' passes as items of the scheduler's steps), one
                        `IngestedDocument` per document, the ids recorded with their block keys
                        (also after a stop); nothing waits for the store
    `Ingestor.confirm`  off the scheduler's thread (sync): the writes awaited, `stored` filled in
    `Ingestor.note`     a request's documents with ids recorded with their block keys; a
                        changed version under a known id is a warning
    `Ingestor.delete`   a known id's blocks removed from every tier (`delete_document`)

`DocumentIndex` holds the ids: in memory, known to the process that ingested or served them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from blend.kv.documents import Block, DocumentCache, IngestStopped
from blend.model.plan import Done, PlanCursor, Want
from blend.prompt.builder import Prompt, PromptBuilder
from blend.prompt.document import Document, IngestedDocument, check_documents, document_id, render_document
from storage.stack import TieredStore
from storage.tier import StoreUnavailable

log = logging.getLogger(__name__)


class DocumentIndex:
    """The documents an engine has seen by id: the digest of their rendered text and
    their block keys. Thread-safe. Used to delete a document by id and to warn when a
    request's version of a document differs from the one ingested under the same id.
    In memory: ids are known to the process that ingested (or served) them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._docs: dict[str, tuple[str, tuple[str, ...]]] = {}

    @staticmethod
    def digest(document: Document | str) -> str:
        return hashlib.sha256(render_document(document).encode("utf-8")).hexdigest()

    def record(self, doc_id: str, document: Document | str, keys: Iterable[str]) -> None:
        """Remember what `doc_id` renders to now and which keys hold it; the keys of the
        versions it rendered to before stay attached (deleting the id removes them too)."""
        with self._lock:
            earlier = self._docs.get(doc_id, ("", ()))[1]
            self._docs[doc_id] = (self.digest(document), tuple(dict.fromkeys((*earlier, *keys))))

    def differs(self, doc_id: str, document: Document | str) -> bool:
        """True if `doc_id` is known and `document` renders to other text than it did."""
        with self._lock:
            known = self._docs.get(doc_id)
        return known is not None and known[0] != self.digest(document)

    def __contains__(self, doc_id: object) -> bool:
        with self._lock:
            return doc_id in self._docs

    def own_keys(self, doc_id: str) -> tuple[str, ...]:
        """The keys of `doc_id` that no other known document uses. KeyError if unknown."""
        with self._lock:
            keys = self._docs[doc_id][1]
            shared = {k for other_id, (_, other) in self._docs.items() if other_id != doc_id for k in other}
        return tuple(k for k in keys if k not in shared)

    def forget(self, doc_id: str) -> None:
        """Remove `doc_id` (no error if unknown)."""
        with self._lock:
            self._docs.pop(doc_id, None)


@dataclass(frozen=True)
class IngestJob:
    """An ingest checked and laid out: its documents as given (empty ones are reported, not
    computed) and the prompt that holds the non-empty ones as document segments."""

    documents: tuple[Document | str, ...]
    prompt: Prompt


class Ingestor:
    """An engine's documents: ingests (checked, then computed and stored as scheduler steps),
    the ids of the documents it ingested or served (`index`), deletes by id."""

    def __init__(self, cache: DocumentCache, store: TieredStore):
        self.cache, self.store = cache, store
        self.index = DocumentIndex()

    def prepare(self, documents: object, prompts: PromptBuilder, positions: int) -> IngestJob:
        """`documents` checked (TypeError / ValueError naming the document and the fix) and laid
        out with `prompts` (the fixed part a request's documents are computed after). Nothing
        is computed or written."""
        docs = check_documents(documents)
        kept = [d for d in docs if render_document(d)]
        names = [f"documents[{i}]" + (f" ({d.id!r})" if isinstance(d, Document) and d.id is not None else "")
                 for i, d in enumerate(docs) if render_document(d)]
        for name, doc in zip(names, kept, strict=True):  # before tokenizing megabytes
            try:
                prompts.check_text_fits("ingest", [doc], positions, "split it into shorter documents")
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        prompt = prompts.build("ingest", docs)
        prompts.check_documents_fit(prompt, names)  # one no request could use: refused, nothing written
        return IngestJob(docs, prompt)

    def plan(self, job: IngestJob, stop: Callable[[], bool]) -> IngestPlan:
        """The ingest as a plan of the scheduler (`IngestPlan`: one forward pass per step)."""
        return IngestPlan(self, job, stop)

    def confirm(self, results: list[IngestedDocument]) -> list[IngestedDocument]:
        """An ingest's `results` once the store's queued writes are done (`flush`: a required
        tier's failure raised), each saying whether some tier holds every block (`stored`).
        Blocks the caller's thread, never the scheduler's (`Handle(then=...)`)."""
        self.store.flush()
        return [dataclasses.replace(r, stored=bool(r.keys) and all(self.store.contains(key) for key in r.keys))
                for r in results]

    def note(self, prompt: Prompt, documents: Sequence[Document | str],
             blocks: dict[int, list[Block]] | None) -> tuple[str, ...]:
        """Record a request's documents that have ids with their block keys (`blocks`: the
        prompt's, DocumentCache.segment_blocks; None: no keys); returns a warning per document
        whose id was seen before with other text (title or text)."""
        warnings = []
        kept = [d for d in documents if render_document(d)]
        keys: list[list[str]] = [[] for _ in kept]
        for i, seg in enumerate(prompt.segments):
            if seg.kind == "document" and blocks is not None:
                keys[seg.doc_index].extend(b.key for b in blocks[i])
        for i, doc in enumerate(kept):
            if not isinstance(doc, Document) or doc.id is None:
                continue
            if self.index.differs(doc.id, doc):
                message = (f"document {doc.id!r} differs from the version seen before under that id "
                           "(title or text): its KV is computed, not loaded")
                log.warning(message)
                warnings.append(message)
            self.index.record(doc.id, doc, keys[i])
        return tuple(warnings)

    def delete(self, doc_id: str) -> tuple[str, ...]:
        """Remove a known document's blocks from every tier (those another known document also
        uses are kept); returns the keys deleted. KeyError if the id is unknown.

        Side effects: the delete wins over every write of these keys planned before it (queued,
        under way, or still to come from a request in flight or the background recompute of a
        harvested document: `TieredStore.delete`), and those documents leave the background
        queue; nothing waits for the store's writer. A tier that cannot be reached keeps its
        copy: then the id stays known (a retry deletes again) and StoreUnavailable names the tier."""
        if not isinstance(doc_id, str):
            raise TypeError(f"document id must be a str, got {type(doc_id).__name__}")
        try:
            keys = self.index.own_keys(doc_id)
        except KeyError:
            raise KeyError(f"document id {doc_id!r} is unknown to this engine (ids live in the process that "
                           "ingested or served them); nothing deleted") from None
        unreached: set[str] = set()
        for key in keys:
            unreached.update(self.store.delete(key))
        if unreached:  # the id stays known: a retry deletes again
            raise StoreUnavailable(f"document {doc_id!r}: tier {', '.join(sorted(unreached))} could not be reached, "
                                   "so its blocks may stay there (the other tiers dropped them); retry the delete "
                                   "once it is back: the id stays known")
        self.cache.forget(keys)
        self.index.forget(doc_id)
        return keys


class IngestPlan(PlanCursor):
    """An ingest as scheduler steps (one forward pass each, `DocumentCache.ingest_plan`); its
    value, one `IngestedDocument` per document given (`stored` None: `Ingestor.confirm` fills it
    in, off the scheduler's thread: waiting for the writer there would hold every request).
    `stop` is asked before each pass: then `IngestStopped`, after the blocks stored so far are
    recorded under their ids (a delete finds them)."""

    handles = (IngestStopped,)  # the documents stored so far recorded, then raised

    def __init__(self, ingestor: Ingestor, job: IngestJob, stop: Callable[[], bool]):
        super().__init__()
        self.ingestor, self.job, self.stop = ingestor, job, stop

    def _next(self, output: Any, error: BaseException | None) -> Want:
        if self.stage == "start":
            self.stage = "passes"
            return self.run(self.ingestor.cache.ingest_plan(self.job.prompt, self.stop))
        stopped: IngestStopped | None = None
        if isinstance(error, IngestStopped):
            output, stopped = error.stored, error
        kept = [d for d in self.job.documents if render_document(d)]
        keys: list[list[str]] = [[] for _ in kept]
        cached = [True] * len(kept)
        for stored in output:
            keys[stored.segment.doc_index].extend(stored.keys)
            cached[stored.segment.doc_index] &= stored.cached
        results, k = [], 0
        for doc in self.job.documents:
            doc_keys, was_cached = (), False
            if render_document(doc):
                doc_keys, was_cached = tuple(keys[k]), cached[k]
                k += 1
            results.append(IngestedDocument(document_id(doc), doc_keys, was_cached, None))
            if doc_keys:  # after a stop: the blocks stored so far, so that a delete finds them
                self.ingestor.index.record(document_id(doc), doc, doc_keys)
        self.stage = "done"
        if stopped is not None:
            raise stopped
        return Done(results)
