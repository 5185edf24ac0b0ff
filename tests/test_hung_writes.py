"""A store write that hangs holds no request (issue 49, item 2): nothing on the scheduler's
thread waits for the store's writer. A lookup of a document whose write is still queued behind
the hung one is served from the write queue (the entry as the top tier will hold it: the same
numbers as a hit once it lands); a put into a full queue waits at most `load_stall_s`; a sync
ingest waits for its writes on its caller's thread."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from storage.config import CpuTierConfig
from storage.memory import CpuTier
from storage.stack import TieredStore
from tests.test_engine import DOCS, QUESTION
from tests.test_misses import _model

NEW = ["The Ferrand canal was dug between 1820 and 1826 by four hundred labourers from Lyon. " * 2,
       "Its lock keeper, Agathe Roux, kept a diary of every barge that passed for forty years. " * 2,
       "The canal closed to traffic in 1958 after the railway took its coal trade. " * 2]
HANG_S = 12.0


class HungFirstWrite:
    """A CPU tier whose first write hangs until `release` is set (at most HANG_S seconds)."""

    def __init__(self) -> None:
        self.inner = CpuTier(CpuTierConfig(budget=64 << 20))
        self.name, self.config = self.inner.name, self.inner.config
        self.release, self.puts = threading.Event(), 0

    def put(self, key: str, entry: Any) -> None:
        self.puts += 1
        if self.puts == 1:
            self.release.wait(HANG_S)
        self.inner.put(key, entry)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_engine(tier: HungFirstWrite) -> BlendEngine:
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "64MiB"}]},
                                        chunk_tokens=24, split="off", load_stall_s=1, miss_policy="standalone")
    return BlendEngine(cfg, model=_model(), store=TieredStore([tier], kv_dtype="float32"))


def hang_the_writer(store: TieredStore) -> None:
    """A write of an entry no request looks up: the writer hangs in it, what is queued next waits."""
    from eval.bench.load import ChunkShape, random_entry

    _, entry = random_entry(ChunkShape(layers=2, kv_heads=2, head_dim=8, tokens=4, kv_dtype="float32"), seed=1)
    store.put("d-unrelated", entry)
    time.sleep(0.2)


def timed(fn) -> tuple[Any, float]:
    t0 = time.monotonic()
    return fn(), time.monotonic() - t0


def test_a_hung_store_write_holds_no_request():
    tier = HungFirstWrite()
    with make_engine(tier) as engine:
        hang_the_writer(engine.store)
        a = engine.generate(QUESTION, NEW, mode="blend", max_new_tokens=2)  # misses: writes queue behind
        assert a.stats.miss.missed == 4  # the three documents and the system part
        got: dict[str, tuple[Any, float]] = {}
        threads = [threading.Thread(target=lambda: got.__setitem__("B", timed(lambda: engine.generate(
                       QUESTION, NEW, mode="blend", max_new_tokens=2)))),
                   threading.Thread(target=lambda: got.__setitem__("C", timed(lambda: engine.generate(
                       "What is a canal?", DOCS[1:], mode="full", max_new_tokens=2))))]
        for t in threads:
            t.start()
            time.sleep(0.02)  # B first, then C behind it in the queue
        for t in threads:
            t.join(60)
        still_hung = not tier.release.is_set() and tier.puts == 1
        (b, b_s), (_, c_s) = got["B"], got["C"]
        assert still_hung, "the hung write ended before the requests did"
        assert c_s < 4.0 and b_s < 4.0, (b_s, c_s)  # not the hung write's 12 s
        assert b.stats.miss.missed == 0 and engine.store.queued_hits >= 3  # served from the write queue
        tier.release.set()
        engine.store.flush()
        # once written, the same request hits the tier: the same numbers as from the queue
        d = engine.generate(QUESTION, NEW, mode="blend", max_new_tokens=2)
        assert d.stats.miss.missed == 0
        assert torch.equal(d.first_token_logprobs, b.first_token_logprobs) and d.token_ids == b.token_ids


def test_a_sync_ingest_waits_for_its_writes_on_its_own_thread():
    tier = HungFirstWrite()
    with make_engine(tier) as engine:
        hang_the_writer(engine.store)
        ingested: list[Any] = []
        waiting = threading.Thread(target=lambda: ingested.append(engine.ingest(NEW)))  # sync: awaits its writes
        waiting.start()
        time.sleep(0.5)
        _, seconds = timed(lambda: engine.generate("What is a canal?", DOCS[1:], mode="full", max_new_tokens=2))
        assert seconds < 4.0 and waiting.is_alive()  # the request ran while the ingest waits for the store
        tier.release.set()
        waiting.join(30)
        assert [doc.stored for doc in ingested[0]] == [True, True, True]


def test_a_put_into_a_full_queue_behind_a_hung_write_waits_at_most_put_wait_s():
    from eval.bench.load import ChunkShape, random_entry

    _, entry = random_entry(ChunkShape(layers=2, kv_heads=2, head_dim=8, tokens=4, kv_dtype="float32"), seed=1)
    tier = HungFirstWrite()
    store = TieredStore([tier], kv_dtype="float32", write_queue=2, put_wait_s=0.2)
    try:
        _, seconds = timed(lambda: [store.put(f"d-{i}", entry) for i in range(6)])
        assert seconds < 2.0 and store.puts_dropped >= 2
        located = store.lookup("d-1", _expected(entry))  # queued: served from the queue, not waited for
        assert located is not None and located.held is not None
        tier.release.set()
        store.flush()
        assert store.contains("d-1") == tier.name
    finally:
        store.close()


def _expected(entry):
    from storage.entry import Expected

    return Expected.matching(entry.header)
