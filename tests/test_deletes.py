"""A delete wins over every write of its document planned before it (issue 49, item 1):
a write queued behind a slow one, a write under way, a write still to come from a request in
flight, the background recompute of a harvested document. Nothing deleted is stored again
but by a request or ingest made after the delete; a second delete is then a KeyError while
nothing is stored, not while the data is back."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.prompt.document import Document
from storage.config import CpuTierConfig
from storage.memory import CpuTier
from storage.stack import TieredStore
from tests.test_engine import DOCS, QUESTION
from tests.test_misses import HeldWrites, _model

IDS = ["carrow", "ostend", "flash"]


def documents() -> list[Document]:
    return [Document(text, id=doc_id) for doc_id, text in zip(IDS, DOCS, strict=True)]


def make_engine(tmp_path, **knobs: Any) -> BlendEngine:
    """float32, one disk tier in codec none, documents that miss harvested (one full prefill) and
    recomputed standalone in the background once the engine is idle."""
    tiers = [{"kind": "disk", "path": str(tmp_path / "disk"), "budget": "256MiB", "codec": "none"}]
    knobs.setdefault("split", "off")
    knobs.setdefault("miss_policy", "harvest")
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": tiers}, chunk_tokens=24, **knobs)
    return BlendEngine(cfg, model=_model())


def document_keys(engine: BlendEngine) -> dict[str, list[str]]:
    prompt = engine.build_prompt(QUESTION, documents())
    return {doc_id: engine.document_kv.keys(seg, prompt) for doc_id, seg in zip(IDS, prompt.documents, strict=True)}


def stored(engine: BlendEngine, keys: list[str]) -> list[str]:
    return [key for key in keys if engine.store.contains(key) is not None]


def settle(engine: BlendEngine, seconds: float = 2.0) -> None:
    """Idle long enough for every background step to run, then every write flushed."""
    deadline = time.monotonic() + 30
    time.sleep(seconds)
    while engine.document_kv.background_pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # the last background step's writes are queued after it left the queue
    engine.store.flush()


@pytest.mark.parametrize("delay", [0.0, 0.2])
def test_a_deleted_harvested_document_is_not_stored_again_by_the_background_recompute(tmp_path, delay):
    with make_engine(tmp_path) as engine:
        keys = document_keys(engine)
        result = engine.generate(QUESTION, documents(), mode="blend", max_new_tokens=2)
        assert result.stats.miss.plan == "harvest"
        time.sleep(delay)
        for doc_id in IDS:
            assert engine.delete_document(doc_id)
        settle(engine)
        for doc_id in IDS:
            assert stored(engine, keys[doc_id]) == [], f"{doc_id} came back"
            with pytest.raises(KeyError, match="unknown to this engine"):
                engine.delete_document(doc_id)  # forgotten, and nothing of it is stored
        # a new request with the documents stores them again (and knows their ids again)
        engine.generate(QUESTION, documents(), mode="blend", max_new_tokens=2)
        engine.store.flush()
        assert all(stored(engine, keys[doc_id]) == keys[doc_id] for doc_id in IDS)
        assert engine.delete_document("carrow") and stored(engine, keys["carrow"]) == []


def test_the_store_drops_a_background_write_planned_before_a_delete_of_its_key(tmp_path):
    """The property lives in the store, not in the queue's bookkeeping: a harvested document
    still on the background queue when its keys are deleted straight from the store (no
    `forget`) is recomputed, and its writes are dropped."""
    with make_engine(tmp_path) as engine:
        keys = document_keys(engine)
        gate = threading.Event()
        engine.generate(QUESTION, documents(), mode="blend", max_new_tokens=2)
        busy = threading.Thread(target=engine.run_exclusive, args=(lambda: gate.wait(10),))
        busy.start()  # the scheduler is not idle: the background recompute waits
        time.sleep(0.1)
        engine.store.flush()
        for doc_id in IDS:
            for key in keys[doc_id]:
                engine.store.delete(key)
        assert engine.document_kv.background_pending()
        gate.set()
        busy.join()
        settle(engine)
        assert engine.document_kv.background.done >= len(IDS)  # recomputed ...
        assert all(stored(engine, keys[doc_id]) == [] for doc_id in IDS)  # ... and not written
        assert engine.store.puts_superseded >= sum(len(k) for k in keys.values())


def test_a_request_in_flight_when_its_documents_are_deleted_does_not_store_them(tmp_path):
    """A request laid out (its ids recorded) before the delete, its misses computed after it:
    its writes were planned before the delete and are dropped; its answer is unchanged."""
    with make_engine(tmp_path, miss_policy="standalone") as engine:
        keys = document_keys(engine)
        gate = threading.Event()
        busy = threading.Thread(target=engine.run_exclusive, args=(lambda: gate.wait(10),))
        busy.start()
        time.sleep(0.1)
        handle = engine.submit(engine.request(QUESTION, documents(), mode="blend", max_new_tokens=2))
        for doc_id in IDS:
            engine.delete_document(doc_id)  # known from the request's layout; nothing stored yet
        gate.set()
        busy.join()
        result = handle.result()
        assert result.stats.miss.plan == "standalone"
        settle(engine)
        assert all(stored(engine, keys[doc_id]) == [] for doc_id in IDS)


def test_a_delete_wins_over_a_queued_write_and_over_one_under_way():
    from eval.bench.load import ChunkShape, random_entry

    _, entry = random_entry(ChunkShape(layers=2, kv_heads=2, head_dim=8, tokens=4, kv_dtype="float32"), seed=1)
    held = HeldWrites(CpuTier(CpuTierConfig(budget=64 << 20)))
    store = TieredStore([held], kv_dtype="float32")
    try:
        store.put("d-first", entry)  # the writer holds this one ...
        store.put("d-queued", entry)  # ... while this one waits behind it
        time.sleep(0.1)
        assert store.delete("d-queued") == [] and store.delete("d-first") == []  # under way, and queued
        held.release.set()
        store.flush()
        assert store.contains("d-queued") is None and store.contains("d-first") is None
        planned = time.monotonic() - 1.0  # planned before the delete, put after it: dropped
        store.put("d-queued", entry, planned=planned)
        store.put("d-queued", entry, sync=True, planned=planned)
        store.flush()
        assert store.contains("d-queued") is None and store.puts_superseded >= 4
        store.put("d-queued", entry)  # planned after the delete: stored
        store.flush()
        assert store.contains("d-queued") == held.name
    finally:
        store.close()
