"""The HTTP application in process (FastAPI's TestClient over a tiny model): the paths the
end-to-end tests of `kvblend serve` (test_server.py) do not reach. /health before the
lifespan ran, unknown paths and methods as OpenAI's error object, a stream that passes the
request timeout after its first token (an error event, then [DONE], counted 504), a text
completion streamed with its usage chunk, and a delete that cannot reach a tier (503)."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from blend.server.app import ServerSettings, create_app
from tests.models import smollm2_tokenizer, tiny_model

DOCS = [{"id": "carrow", "title": "Carrow Point", "text": "The lighthouse at Carrow Point was built in 1871."},
        {"text": "Its light flashes white every twelve seconds."}]
CPU = {"kind": "cpu", "budget": "64MiB"}


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama", tokenizer=smollm2_tokenizer(), max_position_embeddings=32768)


def make_engine(lm, tiers=(CPU,)) -> BlendEngine:
    cfg = EngineConfig().with_overrides(store={"kv_dtype": "float32", "tiers": list(tiers)}, chunk_tokens=16,
                                        max_new_tokens=8, split="off")
    return BlendEngine(cfg, model=lm)


def events(lines) -> list:
    """The SSE events' payloads: parsed JSON, or the string "[DONE]"."""
    data = [line[len("data: "):] for line in lines if line]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def sample(client: TestClient, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def test_health_is_starting_until_the_lifespan_ran_and_unknown_paths_are_openai_errors(lm):
    with make_engine(lm) as engine:
        app = create_app(engine, ServerSettings("tiny", queue_size=5, warmup=False))
        before = TestClient(app).get("/health")  # outside `with`: no lifespan, not ready
        assert before.status_code == 503 and before.json()["status"] == "starting"
        with TestClient(app) as client:
            health = client.get("/health")
            assert health.status_code == 200
            state = health.json()
            assert (state["status"], state["model"], state["queue_size"], state["queue_depth"]) == ("ok", "tiny", 5, 0)
            assert state["running"] == state["waiting"] == 0 and state["max_num_seqs"] >= 1
            missing = client.get("/v1/nothing")
            assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
            wrong = client.get("/v1/chat/completions")
            assert wrong.status_code == 405 and wrong.json()["error"]["type"] == "invalid_request_error"
            models = client.get("/v1/models").json()["data"]
            assert [m["id"] for m in models] == ["tiny"] and models[0]["max_model_len"] == 32768
            unknown = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "Hi?", "max_tokens": 1})
            assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "model_not_found"


def test_a_stream_past_the_request_timeout_ends_with_an_error_event_and_counts_504(lm):
    settings = ServerSettings("tiny", warmup=False, request_timeout_s=2)
    with make_engine(lm) as engine, TestClient(create_app(engine, settings)) as client:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me everything."}],
                "documents": DOCS, "max_tokens": 20000, "stream": True}
        started = time.monotonic()
        with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200  # the first token came in time: the status is sent
            got = events(reply.iter_lines())
        assert time.monotonic() - started < 60
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert any(e["choices"][0]["delta"].get("content") for e in got[1:-2])  # tokens came before the end
        assert got[-1] == "[DONE]"
        error = got[-2]["error"]  # the scheduler's deadline or the handler's timer, whichever saw it first
        assert (error["type"], error["message"]) in {("timeout", "the request took longer than 2 s"),
                                                     ("cancelled", "the request was cancelled")}
        assert sample(client, "kvblend_requests_total", endpoint="chat", mode="blend", status="504") == 1
        assert sample(client, "kvblend_generated_tokens_total", mode="blend") > 0  # what it did generate
        # it left the batch: at the scheduler's next step (the handler's timer may have ended the stream first)
        deadline = time.monotonic() + 10
        while client.get("/health").json()["queue_depth"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert client.get("/health").json()["queue_depth"] == 0


def test_a_streamed_text_completion_ends_with_its_usage_and_equals_the_engine(lm):
    with make_engine(lm) as engine, TestClient(create_app(engine, ServerSettings("tiny", warmup=False))) as client:
        expected = engine.generate("Who built the lighthouse?", DOCS, mode="full", max_new_tokens=5)
        body = {"model": "tiny", "prompt": "Who built the lighthouse?", "documents": DOCS, "max_tokens": 5,
                "stream": True, "stream_options": {"include_usage": True}, "kvblend": {"mode": "full"}}
        with client.stream("POST", "/v1/completions", json=body) as reply:
            assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
            got = events(reply.iter_lines())
        assert got[-1] == "[DONE]"
        *deltas, final, usage, _ = got
        assert {e["object"] for e in got[:-1]} == {"text_completion"}
        assert len({e["id"] for e in got[:-1]}) == 1 and got[0]["id"].startswith("cmpl-")
        assert "".join(e["choices"][0]["text"] for e in deltas) == expected.text
        assert all(e["choices"][0]["finish_reason"] is None for e in deltas)
        assert final["choices"][0] == {"index": 0, "text": "", "logprobs": None,
                                       "finish_reason": expected.finish_reason}
        assert final["kvblend"]["new_tokens"] == len(expected.token_ids)
        assert usage["choices"] == [] and usage["usage"] == {
            "prompt_tokens": expected.prompt_tokens, "completion_tokens": len(expected.token_ids),
            "total_tokens": expected.prompt_tokens + len(expected.token_ids)}
        assert sample(client, "kvblend_requests_total", endpoint="completions", mode="full", status="200") == 1


@pytest.mark.redis
def test_a_delete_that_cannot_reach_a_tier_is_503_and_its_retry_deletes(lm, redis_server, redis_url):
    tiers = (CPU, {"kind": "redis", "url": redis_url, "backoff_initial_s": 0.01, "backoff_max_s": 0.01})
    with make_engine(lm, tiers) as engine, TestClient(create_app(engine, ServerSettings("tiny", warmup=False))) as client:
        stored = client.post("/v1/documents", json={"documents": [DOCS[0]]})
        assert stored.status_code == 200 and stored.json()["data"][0]["stored"]
        redis_server.stop()
        try:
            refused = client.delete("/v1/documents/carrow")
        finally:
            redis_server.start()
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["type"] == "store_unavailable" and "retry the delete" in error["message"]
        time.sleep(0.1)  # past the tier's backoff
        deleted = client.delete("/v1/documents/carrow")  # the id stayed known
        assert deleted.status_code == 200 and deleted.json()["keys"] == stored.json()["data"][0]["keys"]
        assert sample(client, "kvblend_requests_total", endpoint="documents", mode="delete", status="503") == 1
        assert sample(client, "kvblend_requests_total", endpoint="documents", mode="delete", status="200") == 1
