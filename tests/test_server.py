"""`kvblend serve` end to end: a real server process on a free loopback port, a tiny
model saved to a temp dir, the official `openai` client and plain HTTP.

The in-process engine over the same saved model is the reference: the server must give
the same tokens, streamed or not, one by one or concurrently.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from blend.engine.engine import BlendEngine
from blend.prompt.document import Document
from tests.models import smollm2_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]
LONG = 20000  # tokens: minutes of decoding, so a test that relies on cancellation cannot pass without it
DOCS = [
    {"id": "carrow", "title": "Carrow Point", "text": "The lighthouse at Carrow Point was built in 1871 by Maud Tillery."},
    {"id": "ostend", "text": "Tillery later moved to Ostend, where she designed a tidal mill with four wheels."},
    {"text": "The Carrow Point light flashes white every twelve seconds."},
]
QUESTIONS = ["Who built the lighthouse?", "Where did Tillery move?", "How often does the light flash?",
             "What did Tillery design?", "When was the lighthouse built?", "How many wheels?",
             "Who is Maud Tillery?", "What colour is the light?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `kvblend serve` process; `stop()` sends SIGTERM and waits for it to exit."""

    def __init__(self, config: Path, workdir: Path, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"server-{self.port}.log"
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        code = "from blend.cli import main; raise SystemExit(main())"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, "serve", "--config", str(config), "--port", str(self.port),
             "--served-model-name", "tiny", *args],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=env, cwd=workdir)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"server did not start:\n{self.log.read_text()}")

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, **kwargs)


def sample(metrics: dict, name: str, **labels: str) -> float:
    return metrics.get((name, tuple(sorted(labels.items()))), 0.0)


# documents no test stores before it sends them
UNSEEN = [{"id": f"unseen-{i}", "text": f"Unseen passage {i}: the ferry to Lenwick left at {i + 5} o'clock, "
           "carrying mail, coal and the harbour master's cat, and came back after dark."} for i in range(3)]


def disk_config(tmp_path: Path, model: str) -> Path:
    """A config of `model` over one disk tier under `tmp_path` (what a restarted server finds), documents
    in blocks of 16, no load-or-compute split."""
    config = tmp_path / "disk.yaml"
    config.write_text(f"""
model: {model}
device: cpu
engine:
  blend: {{chunk_tokens: 16, split: "off"}}
  sessions: {{sessions_dir: {tmp_path / "sessions"}}}
store:
  kv_dtype: float32
  tiers:
    - {{kind: disk, path: {tmp_path / "disk"}, budget: 256MiB, codec: none}}
""")
    return config


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer(), max_position_embeddings=32768)
    lm.model.save_pretrained(root / "model")
    smollm2_tokenizer().save_pretrained(root / "model")
    config = root / "serve.yaml"
    config.write_text(f"""
model: {root / "model"}
device: cpu
engine:
  blend:
    chunk_tokens: 16
    split: "off"  # the tiny model may compute faster than the cpu tier loads: keep the blend counts fixed
    # harvested entries stay (recomputed standalone only when idle: when, depends on the load; the
    # server and the in-process engine must hold the same entries to give the same tokens)
    recompute_harvested: false
  generation:
    max_new_tokens: 8
  sessions:
    sessions_dir: {root / "sessions"}
store:
  kv_dtype: float32
  tiers:
    - {{kind: cpu, budget: 64MiB}}
""")
    return root, config


@pytest.fixture(scope="module")
def server(setup):
    root, config = setup
    server = Server(config, root, "--queue-size", "8", "--request-timeout", "600")
    yield server
    code = server.stop()
    assert code == 0, server.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def engine(setup):
    _, config = setup
    with BlendEngine.from_config(config) as engine:
        yield engine


def chat_body(question: str, docs=DOCS, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": question}], "documents": docs, **extra}


def test_openai_client_gets_the_in_process_tokens(server, engine):
    client = server.client()
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": QUESTIONS[0]}]
    for options in ({"max_tokens": 12}, {"max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "seed": 11}):
        expected = engine.generate(messages, DOCS, mode="blend", max_new_tokens=options["max_tokens"],
                                   temperature=options.get("temperature"), top_p=options.get("top_p"),
                                   seed=options.get("seed"))
        reply = client.chat.completions.create(model="tiny", messages=messages, extra_body={"documents": DOCS},
                                               **options)
        assert reply.choices[0].message.content == expected.text
        assert reply.choices[0].finish_reason == expected.finish_reason
        assert reply.usage.completion_tokens == len(expected.token_ids)
        assert reply.usage.prompt_tokens == expected.prompt_tokens
        stream = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"documents": DOCS}, **options)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == expected.text
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason == expected.finish_reason
        assert finals[0].model_extra["kvblend"]["new_tokens"] == len(expected.token_ids)
        assert chunks[-1].usage.completion_tokens == len(expected.token_ids)

    completion = client.completions.create(model="tiny", prompt=QUESTIONS[1], max_tokens=6,
                                           extra_body={"documents": DOCS, "kvblend": {"mode": "full"}})
    expected = engine.generate(QUESTIONS[1], DOCS, mode="full", max_new_tokens=6)
    assert completion.choices[0].text == expected.text
    streamed = client.completions.create(model="tiny", prompt=QUESTIONS[1], max_tokens=6, stream=True,
                                         extra_body={"documents": DOCS, "kvblend": {"mode": "full"}})
    assert "".join(c.choices[0].text for c in streamed) == expected.text


def test_documents_hit_the_cache_on_the_second_request(server, engine):
    docs = [{"id": "fresh", "title": "Harrow", "text": "The Harrow bridge was finished in 1888 by forty masons."},
            {"text": "Its central arch spans sixty metres over the river Dell."}]
    body = chat_body("When was the bridge finished?", docs, max_tokens=3, kvblend={"mode": "blend",
                                                                                  "recompute_ratio": 0.1})
    first = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["kvblend"]
    second = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["kvblend"]
    chunks = first["documents"]["misses"]
    assert chunks >= 2 and first["documents"]["hits"] == 0
    assert second["documents"] == {"hits": chunks, "misses": 0} and second["hits_by_tier"]["cpu"] >= chunks
    assert second["recompute_ratio"] == 0.1 and 0 < second["recomputed_tokens"] < second["context_tokens"]
    assert second["ttft_s"] > 0 and second["warnings"] == []

    # ingest: per document its id, keys and whether it was cached; the keys are the engine's
    ingested = httpx.post(server.url + "/v1/documents", json={"documents": docs}, timeout=120).json()["data"]
    local = engine.ingest([{"id": "fresh", "title": "Harrow", "text": docs[0]["text"]}, docs[1]["text"]])
    assert [d["id"] for d in ingested] == [d.id for d in local]
    assert [d["keys"] for d in ingested] == [list(d.keys) for d in local]
    assert [d["cached"] for d in ingested] == [True, True] and [d["stored"] for d in ingested] == [True, True]
    empty = httpx.post(server.url + "/v1/documents", json={"documents": [docs[1], {"text": " ", "title": ""}]},
                       timeout=60)
    assert empty.status_code == 400 and "documents[1] is empty" in empty.json()["error"]["message"]
    deleted = httpx.delete(server.url + "/v1/documents/fresh", timeout=60)
    assert deleted.status_code == 200 and deleted.json()["keys"] == ingested[0]["keys"]
    assert httpx.delete(server.url + "/v1/documents/fresh", timeout=60).status_code == 404
    third = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["kvblend"]
    assert len(ingested[0]["keys"]) > 1  # a chain of blocks, all deleted: one document miss
    assert third["documents"] == {"hits": 1, "misses": 1}
    changed = chat_body("When?", [{"id": "fresh", "text": docs[0]["text"]}], max_tokens=1)
    warned = httpx.post(server.url + "/v1/chat/completions", json=changed, timeout=120).json()["kvblend"]
    assert len(warned["warnings"]) == 1 and "fresh" in warned["warnings"][0]


def test_concurrent_requests_equal_sequential_ones(server):
    bodies = [chat_body(q, DOCS[: 1 + i % 3], max_tokens=6) for i, q in enumerate(QUESTIONS)]

    def send(body: dict) -> tuple[int, str, int]:
        response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        answer = response.json()
        return response.status_code, answer["choices"][0]["message"]["content"], answer["usage"]["prompt_tokens"]

    one_by_one = [send(b) for b in bodies]
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(send, bodies))
    assert together == one_by_one and {status for status, _, _ in together} == {200}
    assert len({prompt for _, _, prompt in together}) > 1  # the requests really differ


def test_concurrent_streams_through_the_openai_client_decode_together_and_equal_sequential_ones(server):
    """8 streamed requests at once (the scheduler's batch), with a 9th long one whose client goes
    away mid-batch: each of the 8 gets its sequential answer, the decode steps were batched."""
    client = server.client()

    def stream(i: int) -> str:
        chunks = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": QUESTIONS[i]}], max_tokens=12, stream=True,
            extra_body={"documents": DOCS[: 1 + i % 3]})
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    one_by_one = [stream(i) for i in range(8)]
    before = server.metrics()
    leaving = httpx.Client(timeout=120)
    long_body = chat_body("Tell me everything.", max_tokens=LONG, stream=True)
    with leaving.stream("POST", server.url + "/v1/chat/completions", json=long_body) as r:
        lines = r.iter_lines()
        next(lines)
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(stream, i) for i in range(8)]
            for _ in range(20):  # the long request decodes beside the others, then its client leaves
                next(lines)
        # (leaving the block closes its connection mid-batch)
        together = [f.result() for f in futures]
    leaving.close()
    after = server.metrics()
    assert together == one_by_one
    steps = sample(after, "kvblend_decode_batch_size_count") - sample(before, "kvblend_decode_batch_size_count")
    sizes = sample(after, "kvblend_decode_batch_size_sum") - sample(before, "kvblend_decode_batch_size_sum")
    assert steps > 0 and sizes / steps > 1.5  # decoded in batches, not one by one
    batched_once = sample(after, "kvblend_decode_batch_size_bucket", le="8.0") - sample(
        before, "kvblend_decode_batch_size_bucket", le="8.0")
    assert batched_once > sample(after, "kvblend_decode_batch_size_bucket", le="4.0") - sample(
        before, "kvblend_decode_batch_size_bucket", le="4.0")  # some steps ran 5-8 sequences at once


def test_metrics_count_what_was_sent(server):
    before = server.metrics()
    client = server.client()
    replies = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": q}], max_tokens=4,
                                              extra_body={"documents": DOCS[:2]}) for q in QUESTIONS[:3]]
    full = client.completions.create(model="tiny", prompt=QUESTIONS[3], max_tokens=2,
                                     extra_body={"documents": DOCS[:1], "kvblend": {"mode": "full"}})
    bad = httpx.post(server.url + "/v1/chat/completions", json=chat_body("q", max_tokens=0), timeout=30)
    assert bad.status_code == 422
    invalid = httpx.post(server.url + "/v1/chat/completions", json=chat_body("q", temperature=-1), timeout=30)
    assert invalid.status_code == 400
    after = server.metrics()

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("kvblend_requests_total", endpoint="chat", mode="blend", status="200") == 3
    assert delta("kvblend_requests_total", endpoint="completions", mode="full", status="200") == 1
    assert delta("kvblend_requests_total", endpoint="chat", mode="blend", status="400") == 1
    assert delta("kvblend_ttft_seconds_count", mode="blend") == 3
    assert delta("kvblend_request_seconds_count", mode="full") == 1
    assert delta("kvblend_generated_tokens_total", mode="blend") == sum(r.usage.completion_tokens for r in replies)
    assert delta("kvblend_prompt_tokens_total", mode="blend") == sum(r.usage.prompt_tokens for r in replies)
    assert delta("kvblend_prompt_tokens_total", mode="full") == full.usage.prompt_tokens
    blend_recomputed = sum(r.model_extra["kvblend"]["recomputed_tokens"] for r in replies)
    assert delta("kvblend_recomputed_tokens_total", mode="blend") == blend_recomputed
    hits = sum(r.model_extra["kvblend"]["documents"]["hits"] for r in replies)
    assert hits > 0 and delta("kvblend_cache_lookups_total", kind="documents", result="hit") == hits
    assert delta("kvblend_cache_tier_hits_total", tier="cpu") == sum(
        r.model_extra["kvblend"]["hits_by_tier"].get("cpu", 0) for r in replies)
    assert sample(after, "kvblend_queue_depth") == 0 and sample(after, "kvblend_queue_capacity") == 8
    assert ("kvblend_exposed_load_seconds_total", ()) in after


def test_a_client_that_disconnects_frees_the_engine(server):
    before = server.metrics()
    body = chat_body("Tell me everything.", max_tokens=LONG, stream=True)
    with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # the first chunks, then the client goes away
        assert got[0].startswith("data: ")
    # a non-streaming client that gives up (read timeout) is cancelled too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=chat_body("Go on.", max_tokens=LONG), timeout=3)
    # the next request is served (behind the two long ones only if they were not cancelled)
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat_body(QUESTIONS[0], max_tokens=3), timeout=300)
    assert reply.status_code == 200
    deadline = time.monotonic() + 30
    while True:  # the streaming handler records its end when the server notices the disconnect
        after = server.metrics()
        cancelled = sample(after, "kvblend_requests_total", endpoint="chat", mode="blend", status="499") - sample(
            before, "kvblend_requests_total", endpoint="chat", mode="blend", status="499")
        if cancelled == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cancelled == 2
    generated = sample(after, "kvblend_generated_tokens_total", mode="blend") - sample(
        before, "kvblend_generated_tokens_total", mode="blend")
    assert 3 <= generated < LONG  # the long generations stopped early


def test_a_full_queue_answers_503_with_retry_after(server):
    body = chat_body("Keep going.", max_tokens=LONG, stream=True)
    clients, held = [], []
    try:
        http = httpx.Client(timeout=300)
        clients.append(http)
        running = http.stream("POST", server.url + "/v1/chat/completions", json=body)
        lines = running.__enter__().iter_lines()
        held += [running, lines]  # a dropped line iterator closes the response, too
        next(lines)  # it runs on the engine now

        batch = httpx.get(server.url + "/health", timeout=10).json()["max_num_seqs"]

        def send(n: int) -> None:
            for _ in range(n):
                waiter = httpx.Client(timeout=300)
                clients.append(waiter)
                pending = waiter.stream("POST", server.url + "/v1/chat/completions", json=body)
                held.append(pending)  # referenced until the end: a collected stream closes its connection
                threading.Thread(target=_enter_quietly, args=(pending,), daemon=True).start()

        def until(what: str, n: int) -> dict:
            deadline = time.monotonic() + 60
            while (health := httpx.get(server.url + "/health", timeout=10).json())[what] < n:
                assert time.monotonic() < deadline, f"{what} did not reach {n}: {health}"
                time.sleep(0.1)
            return health

        send(batch - 1)  # the batch fills up (admitted one prefill step at a time) ...
        until("running", batch)
        send(8)  # ... then the queue (it holds 8)
        health = until("waiting", 8)
        assert health["running"] == batch
        refused = httpx.post(server.url + "/v1/chat/completions", json=chat_body("Me too?", max_tokens=2), timeout=30)
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) >= 1
        assert "busy" in refused.json()["error"]["message"]
    finally:
        for http in clients:
            http.close()  # disconnect everyone: the running job stops, the queued ones are skipped
    deadline = time.monotonic() + 120
    while httpx.get(server.url + "/health", timeout=10).json()["queue_depth"] > 0:
        assert time.monotonic() < deadline, "cancelled requests still occupy the engine"
        time.sleep(0.2)
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat_body(QUESTIONS[1], max_tokens=2), timeout=120)
    assert reply.status_code == 200


def _enter_quietly(stream) -> None:
    try:
        stream.__enter__()
    except httpx.HTTPError:
        pass  # the test closes the client


MALFORMED = [
    ("chat", b"{not json", 400),
    ("chat", b"[1, 2]", 422),
    ("chat", b'"just a string"', 422),
    ("chat", {}, 422),
    ("chat", {"messages": "hello"}, 422),
    ("chat", {"messages": []}, 422),
    ("chat", {"messages": [{"role": "tool", "content": "x"}]}, 422),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, 422),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 422),
    ("chat", {"messages": [{"role": "system", "content": "only a system message"}]}, 400),
    ("chat", {"messages": [{"role": "user", "content": "   "}]}, 400),
    ("chat", {"max_tokens": 0}, 422),
    ("chat", {"max_tokens": 2.9}, 422),
    ("chat", {"max_tokens": True}, 422),
    ("chat", {"max_tokens": "8"}, 422),
    ("chat", {"temperature": -1}, 400),
    ("chat", {"temperature": "hot"}, 422),
    ("chat", {"temperature": True}, 422),
    ("chat", {"top_p": 0}, 400),
    ("chat", {"top_p": 1.5}, 400),
    ("chat", {"stop": 5}, 422),
    ("chat", {"stop": [""]}, 400),
    ("chat", {"stop": ["x"] * 17}, 422),
    ("chat", {"seed": "x"}, 422),
    ("chat", {"seed": -1}, 400),
    ("chat", {"n": 2}, 422),
    ("chat", {"stream": "yes"}, 422),
    ("chat", {"documents": "one document"}, 422),
    ("chat", {"documents": [None, 5]}, 422),
    ("chat", {"documents": [{"txt": "x"}]}, 422),
    ("chat", {"documents": [{"text": "x", "id": ""}]}, 422),
    ("chat", {"kvblend": {"mode": "fast"}}, 422),
    ("chat", {"kvblend": {"recompute_ratio": 2}}, 400),
    ("chat", {"kvblend": {"recompute_ratio": True}}, 422),
    ("chat", {"kvblend": {"ratio": 0.1}}, 422),
    ("chat", {"kvblend": {"selection": "best"}}, 400),
    ("chat", {"documents": [{"text": "word " * 40000}]}, 400),  # longer than the model's positions
    ("chat", {"documents": [{"text": "word " * 40000}], "stream": True}, 400),
    ("chat", {"logprobs": True}, 422),  # not implemented: refused, not silently ignored
    ("chat", {"frequency_penalty": 0.5}, 422),
    ("completions", {"prompt": "q", "echo": True}, 422),
    ("completions", {}, 422),
    ("completions", {"prompt": ["a", "b"]}, 422),
    ("completions", {"prompt": 5}, 422),
    ("completions", {"prompt": "q", "max_tokens": -3}, 422),
    ("documents", {}, 422),
    ("documents", {"documents": []}, 422),
    ("documents", {"documents": "text"}, 422),
    ("documents", {"documents": [{"text": 5}]}, 422),
    # more tokens than the model's 32768 positions (about one a character), in too few characters
    # for the text check: refused from its tokens at ingest, nothing computed
    ("documents", {"documents": [{"text": " ".join(str(i * 7919 % 100000) for i in range(7000))}]}, 400),
]


@pytest.mark.parametrize("endpoint,body,status", MALFORMED)
def test_malformed_bodies_get_400_or_422_with_a_message(server, endpoint, body, status):
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "documents": "/v1/documents"}[endpoint]
    if isinstance(body, dict) and body and endpoint == "chat" and "messages" not in body:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    if isinstance(body, dict) and endpoint == "completions" and body:
        body = {"max_tokens": 2, **body}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(server.url + path, content=content, headers={"content-type": "application/json"},
                          timeout=120)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and "Traceback" not in response.text


def test_unparsable_bodies_and_other_content_types_say_what_to_send(server):
    url = server.url + "/v1/chat/completions"
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    for content in (b'{"messages": "caf\xe9"}', b"[" * 5000 + b"]" * 5000):
        bad = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
        assert bad.status_code == 400 and "send UTF-8 JSON" in bad.json()["error"]["message"], bad.text
    plain = httpx.post(url, content=body, headers={"content-type": "text/plain"}, timeout=60)
    assert plain.status_code == 415, plain.text
    assert "Content-Type: application/json (got 'text/plain')" in plain.json()["error"]["message"]


def test_bodies_over_the_limit_get_413_before_parsing_and_huge_text_400_before_tokenizing(server):
    limit = 16 << 20  # the default --max-body
    big = b'{"messages": [{"role": "user", "content": "' + b"w" * limit + b'"}]}'
    declared = httpx.post(server.url + "/v1/chat/completions", content=big,
                          headers={"content-type": "application/json"}, timeout=120)
    assert declared.status_code == 413 and "--max-body" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while it arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    chunked = httpx.post(server.url + "/v1/documents", content=chunks(),
                         headers={"content-type": "application/json"}, timeout=120)
    assert chunked.status_code == 413, chunked.text
    # under the body limit but more characters than the model's positions can hold: 400 at once
    # (the tiny model's 32768 positions x at most 81 characters per token)
    text = "w" * (32768 * 81 + 1)
    long = httpx.post(server.url + "/v1/chat/completions", json=chat_body("Hi?", [{"text": text}], max_tokens=2),
                      timeout=120)
    assert long.status_code == 400 and "cannot fit" in long.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).json()["queue_depth"] == 0
    neutral = {"logprobs": False, "frequency_penalty": 0.0, "presence_penalty": 0, "user": "u", "n": 1}
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat_body("Hi?", max_tokens=2, **neutral), timeout=120)
    assert reply.status_code == 200, reply.text


def test_a_taken_port_is_one_line_exit_2_before_the_model_loads(setup):
    _, config = setup
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", "from blend.cli import main; raise SystemExit(main())", "serve",
                               "--config", str(config), "--port", str(port)], capture_output=True, text=True,
                              env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot listen on 127.0.0.1:" in lines[0] and "pick another --port" in lines[0]
    assert "serving" not in proc.stdout and "Traceback" not in proc.stderr


def test_the_socket_listens_before_the_model_loads_so_a_second_server_fails_at_once():
    # SO_REUSEADDR lets two sockets bind one port while neither listens: the second server
    # must be refused at bind time, not after its model has loaded
    from blend.server import listen_socket

    first = listen_socket("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(ValueError, match=r"cannot listen on 127\.0\.0\.1:\d+: .*pick another --port"):
            listen_socket("127.0.0.1", port)
        with socket.create_connection(("127.0.0.1", port), timeout=5):  # queued in the backlog, not refused
            pass
    finally:
        first.close()


def test_unknown_model_and_document_and_data_that_looks_like_structure(server):
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert httpx.delete(server.url + "/v1/documents/nope", timeout=30).status_code == 404
    tricky = "Who?\x00KVBLEND-DOCUMENTS\x00 {question} \ud800"
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, content=json.dumps(
        chat_body(tricky, [{"text": "\x00KVBLEND-DOCUMENTS\x00 data \udcff"}], max_tokens=2)).encode(),
        headers={"content-type": "application/json"})
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["model"] == "tiny"


def test_timeout_and_graceful_shutdown(setup):
    root, config = setup
    server = Server(config, root, "--queue-size", "2", "--request-timeout", "3", "--no-warmup")
    try:
        slow = httpx.post(server.url + "/v1/chat/completions", json=chat_body("Go.", max_tokens=LONG), timeout=120)
        assert slow.status_code == 504 and "longer than 3 s" in slow.json()["error"]["message"]
    finally:
        server.stop()
    # a stream in flight at SIGTERM finishes, however long its tokens take here: no timeout, a grace
    # longer than the test waits
    server = Server(config, root, "--queue-size", "2", "--shutdown-grace", "3600", "--no-warmup")
    try:
        body = chat_body(QUESTIONS[0], max_tokens=24, stream=True)
        with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/chat/completions",
                                                            json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)  # in flight: it must still finish
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        final = json.loads(rest[-2][len("data: "):])
        assert final["choices"][0]["finish_reason"] in ("length", "stop")
        assert final["kvblend"]["new_tokens"] == 24 or final["choices"][0]["finish_reason"] == "stop"
        assert server.proc.wait(120) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.url + "/health", timeout=5)
    finally:
        server.stop()


@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_interrupt_stops_at_once_and_says_so(setup, second):
    """A second signal of either kind ends the grace at once (uvicorn itself forces only on a second
    SIGINT, cancelling the streams: tracebacks and 500s; a second SIGTERM did nothing): the stream in
    flight ends with an error event and `[DONE]`, the log holds no traceback."""
    root, config = setup
    server = Server(config, root, "--no-warmup", "--shutdown-grace", "300")
    try:
        body = chat_body("Go.", max_tokens=LONG, stream=True)
        with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/chat/completions",
                                                            json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            server.proc.send_signal(signal.SIGTERM)  # graceful: would wait for this request
            time.sleep(0.5)
            server.proc.send_signal(second)  # the grace ends now
            rest = [line for line in lines if line]
            assert server.proc.wait(60) == 130
        assert rest[-1] == "data: [DONE]" and "shut down" in json.loads(rest[-2][len("data: "):])["error"]["message"]
        log = server.log.read_text()
        assert "stopped at once by a second signal" in log
        assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    finally:
        server.stop()


def test_bench_serve_against_the_running_server(server, setup, tmp_path):
    from eval.bench.serve import compare_ttft, run_serve_bench, write_report

    _, config = setup
    summary = run_serve_bench(str(config), clients=[1, 3], requests=3, pool_size=4, docs_per_request=2,
                              max_tokens=3, doc_chars=200, mode="blend", ratio=0.3, url=server.url, compare=False,
                              log=lambda _: None)
    assert [lv["clients"] for lv in summary["levels"]] == [1, 3]
    for level in summary["levels"]:
        assert level["ok"] == 3 and level["lost"] == 0 and level["hit_rate"] == 1.0
        assert level["max_num_seqs"] == 8 and level["preemptions"] == 0  # the running server's setting
        assert isinstance(level["decode_rows_in_prefill_steps"], int) and level["decode_rows_in_prefill_steps"] >= 0
        assert level["prefill_chunk_tokens"] == 256  # the server's setting, from its /health
        assert level["mean_batch_size"] >= 1.0
        assert level["prefill_busy_s"] > 0 and level["decode_busy_s"] > 0 and level["decode_ms_per_step"] > 0
        assert level["prefill_busy_s"] + level["decode_busy_s"] <= level["wall_s"]  # one scheduler thread
        assert 0 < level["ttft_p50_s"] <= level["ttft_p99_s"] and level["requests_per_s"] > 0
        assert "itl_p50_s" in level and "itl_p99_s" in level  # None when no stream had two content chunks
        assert level["itl_p50_s"] is None or 0 <= level["itl_p50_s"] <= level["itl_p99_s"]
    write_report(summary, tmp_path)
    assert json.loads((tmp_path / "serve.json").read_text())["levels"] and (tmp_path / "serve.png").stat().st_size
    verdict = compare_ttft(1.0, [0.9, 1.0, 2.0])
    assert verdict["target_s"] == round(1.05 * 1.0 + 0.02, 4) and verdict["within_target"]
    assert verdict["pair_ratio"] is None
    assert not compare_ttft(1.2, [1.0])["within_target"]
    paired = compare_ttft(1.0, [1.0, 2.0, 4.0], [(1.1, 1.0), (2.0, 2.0), (6.0, 4.0)])
    assert paired["pair_ratio"] == {"median": 1.1, "min": 1.0, "max": 1.5}
    # the machine's hygiene: load average watched, CPU probe at both ends; no comparison, no spreads
    assert summary["load_average_start"] is not None and summary["cpu_cores"] >= 1
    assert summary["probe_gflops_start"] > 0 and summary["probe_gflops_end"] > 0
    assert summary["widest_spread"] == 0.0 and summary["widest_spread_of"] is None
    assert isinstance(summary["contended"], bool) and isinstance(summary["unsteady"], bool)


def test_bench_serve_starts_its_own_server_from_the_default_config(setup, tmp_path, monkeypatch):
    """No --config: the server it starts and the in-process comparison use $KVBLEND_CONFIG."""
    from eval.bench.serve import run_serve_bench

    _, config = setup
    monkeypatch.setenv("KVBLEND_CONFIG", str(config))
    summary = run_serve_bench(None, clients=[1], requests=2, pool_size=2, docs_per_request=1, max_tokens=2,
                              doc_chars=120, mode="blend", ratio=0.3, url=None, compare=True, log=lambda _: None)
    level = summary["levels"][0]
    assert level["ok"] == 2 and level["lost"] == 0 and summary["config"] is None
    # at 1 client each HTTP request is paired with the same request in-process: their ratio is the spread
    pair = summary["in_process"]["pair_ratio"]
    assert summary["in_process"]["in_process_samples"] == 2 and 0 < pair["min"] <= pair["median"] <= pair["max"]
    assert summary["widest_spread_of"] == "HTTP / in-process TTFT of one request (1 client)"
    assert summary["widest_spread"] == round((pair["max"] - pair["min"]) / pair["median"], 3)


def test_bench_serve_runs_the_same_requests_under_each_max_num_seqs(setup, tmp_path, monkeypatch):
    import tempfile

    from eval.bench.serve import run_serve_bench, write_report

    _, base = setup
    # prefills unbounded by the decode steps' time: with 6-token answers of the tiny model a bounded
    # prefill ends after the sequence before it has finished, and nothing would decode together
    config = tmp_path / "unbounded.yaml"
    config.write_text(base.read_text().replace("engine:\n", "engine:\n  scheduler:\n    step_stretch: null\n", 1))
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # where the servers' logs go
    summary = run_serve_bench(str(config), clients=[3], requests=3, pool_size=3, docs_per_request=2, max_tokens=6,
                              doc_chars=150, mode="blend", ratio=0.3, compare=False, max_num_seqs=[1, 3],
                              log=lambda _: None)
    one, three = summary["levels"]
    assert (one["max_num_seqs"], three["max_num_seqs"]) == (1, 3) and summary["max_num_seqs"] == [1, 3]
    assert one["ok"] == three["ok"] == 3 and one["lost"] == three["lost"] == 0
    assert one["mean_batch_size"] == 1.0 and three["mean_batch_size"] > 1.0  # one server per setting
    assert summary["speedups"][0]["max_num_seqs"] == 3 and summary["speedups"][0]["versus"] == 1
    write_report(summary, tmp_path)
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert not list(temp.glob("kvblend-bench-serve-*"))  # each server's log directory went with it


@pytest.mark.redis
def test_a_required_tier_that_goes_away_is_503_with_the_fix(setup, redis_server, redis_url):
    root, config = setup
    required = root / "required.yaml"
    required.write_text(config.read_text().replace(
        "    - {kind: cpu, budget: 64MiB}",
        f"    - {{kind: cpu, budget: 64MiB}}\n    - {{kind: redis, url: '{redis_url}', required: true, "
        "backoff_initial_s: 30}"))
    server = Server(required, root, "--no-warmup")
    try:
        assert httpx.post(server.url + "/v1/documents", json={"documents": [{"text": "Before the outage."}]},
                          timeout=120).status_code == 200
        redis_server.stop()
        for stream in (False, True):
            body = chat_body("Where?", docs=[{"text": f"Written during the outage ({stream})."}], max_tokens=2, stream=stream)
            reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
            assert reply.status_code == 503, reply.text  # a stream fails before its first token: no SSE yet
            error = reply.json()["error"]
            assert error["type"] == "store_unavailable" and redis_url.split("@")[-1].split("/")[2] in error["message"]
        ingest = httpx.post(server.url + "/v1/documents", json={"documents": [{"text": "Also during it."}]}, timeout=120)
        assert ingest.status_code == 503 and ingest.json()["error"]["type"] == "store_unavailable"
    finally:
        redis_server.start()
        server.stop()


def raw_status(url: str, method: str, path: str) -> int:
    """The status of `method path` sent byte for byte (an HTTP client would normalise '.' and '..')."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode("ascii"))
        head = sock.recv(64).decode("ascii", "replace")
    return int(head.split()[1])


def test_document_ids_round_trip_through_the_url_path_or_are_refused_at_ingest(server):
    """Ids that a URL path cannot carry back ('.', '..', a '/', a control character, over 256
    characters) are refused at ingest with 400 naming the rule; a delete of an id never seen is
    404 whatever its path; an id with URL-special characters is deleted through its encoding."""
    from urllib.parse import quote

    for bad in [".", "..", "a/b", "line\nbreak", "x" * 257]:
        reply = httpx.post(server.url + "/v1/documents", json={"documents": [{"id": bad, "text": "Some text."}]},
                           timeout=120)
        assert reply.status_code == 400, (bad, reply.text)
        assert "a document id is 1 to 256 characters, not all whitespace, without '/'" in reply.json()["error"]["message"]
    for path in ["/v1/documents/.", "/v1/documents/..", "/v1/documents/%2e%2e", "/v1/documents/%2E",
                 "/v1/documents/a%0Ab", "/v1/documents/a%2Fb", "/v1/documents/", "/v1/documents/never-seen"]:
        assert raw_status(server.url, "DELETE", path) == 404, path
    odd = "a b?#%&é:"
    stored = httpx.post(server.url + "/v1/documents", json={"documents": [{"id": odd, "text": "Odd ids work."}]},
                        timeout=120)
    assert stored.status_code == 200 and stored.json()["data"][0]["id"] == odd
    assert raw_status(server.url, "DELETE", "/v1/documents/" + quote(odd, safe="")) == 200
    assert raw_status(server.url, "DELETE", "/v1/documents/" + quote(odd, safe="")) == 404


def test_inter_token_latency_is_the_gaps_between_a_stream_s_chunks():
    from eval.bench.serve import Level, Sample

    level = Level(clients=2, samples=[Sample(True, ttft_s=0.5, e2e_s=1.0, tokens=3, gaps_s=[0.1, 0.3]),
                                      Sample(True, ttft_s=0.4, e2e_s=0.9, tokens=2, gaps_s=[0.2]),
                                      Sample(False, error="HTTP 503", gaps_s=[9.0])], wall_s=2.0)
    summary = level.summary()
    assert summary["itl_p50_s"] == 0.2 and summary["itl_p99_s"] == 0.298  # numpy percentiles, the failed one left out
    assert summary["decode_rows_in_prefill_steps"] is None  # no server counters read
    level.scheduler = {"decode_steps": 4.0, "batch_sum": 8.0, "decode_rows_in_prefill_steps": 21.0,
                       "decode_s": 1.0, "decode_only_s": 0.2}
    assert level.summary()["decode_rows_in_prefill_steps"] == 21
    # a decode step's time from the steps that carried only decode rows: the decode rows' share of mixed
    # steps (in decode_s) has no step of its own in the count
    assert level.summary()["decode_ms_per_step"] == 50.0 and level.summary()["decode_busy_s"] == 1.0
    assert Level(clients=1, samples=[Sample(True, ttft_s=0.1, e2e_s=0.1, tokens=1)], wall_s=1.0).summary()[
        "itl_p50_s"] is None


@pytest.mark.parametrize("delay", [0.0, 0.15])
def test_a_document_deleted_right_after_a_harvesting_request_stays_deleted(setup, tmp_path, delay):
    """Issue 49, item 1, through `kvblend serve`: a chat whose documents all miss harvests them
    (their writes queued, their standalone recompute waiting for the idle engine); DELETE of
    every id right after it removes them for good: seconds later no tier holds them, and a second
    DELETE is 404 because nothing of them is left, not while their data is back on disk."""
    root, _ = setup
    config = tmp_path / "harvest.yaml"
    config.write_text(f"""
model: {root / "model"}
device: cpu
engine:
  blend: {{chunk_tokens: 16, split: "off", miss_policy: harvest}}
  generation: {{max_new_tokens: 4}}
  sessions: {{sessions_dir: {tmp_path / "sessions"}}}
store:
  kv_dtype: float32
  tiers:
    - {{kind: disk, path: {tmp_path / "disk"}, budget: 64MiB, codec: none}}
""")
    docs = [d for d in DOCS if "id" in d]
    server = Server(config, tmp_path, "--no-warmup")
    try:
        reply = httpx.post(server.url + "/v1/chat/completions", json=chat_body(QUESTIONS[0], docs=docs), timeout=120)
        assert reply.status_code == 200 and reply.json()["kvblend"]["miss_plan"]["plan"] == "harvest"
        time.sleep(delay)
        for doc in docs:
            assert httpx.delete(f"{server.url}/v1/documents/{doc['id']}", timeout=60).status_code == 200
        time.sleep(2.5)  # the engine idle: its background recompute would have run
        for doc in docs:
            assert httpx.delete(f"{server.url}/v1/documents/{doc['id']}", timeout=60).status_code == 404
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]  # its queued writes flushed
    with BlendEngine.from_config(config) as engine:
        prompt = engine.build_prompt(QUESTIONS[0], [Document(d["text"], id=d["id"], title=d.get("title"))
                                                    for d in docs])
        keys = [key for seg in prompt.documents for key in engine.document_kv.keys(seg, prompt)]
        system = engine.document_kv.keys(prompt.prefix, prompt)
        assert keys and all(engine.store.contains(key) is None for key in keys), "a deleted document came back"
        assert all(engine.store.contains(key) is not None for key in system)  # what was not deleted stays


def test_sigterm_during_chunked_prefills_ends_every_request_and_exits_within_the_grace(setup, tmp_path):
    """Issue 49, item 3: a decoding stream C, then a full-mode stream A over documents and a blend
    stream B over documents never seen, prefills in chunks of 8 rows beside C's decode rows; SIGTERM
    right after. Every request gets a whole answer: its tokens then `[DONE]`, or an error (503, or
    an error event saying the server shut down, then `[DONE]`); the process exits 0 within the
    shutdown grace (and the bounded stop after it), and what was computed is stored: B's documents
    when B's prefill ended before the grace did (its first token came), else the log says that its
    missing documents' blocks were not stored (a slow machine: test_shutdown_writes.py waits for them)."""
    root, _ = setup
    config = disk_config(tmp_path, str(root / "model"))
    unseen = UNSEEN
    grace = 3.0
    server = Server(config, tmp_path, "--no-warmup", "--prefill-chunk-tokens", "8", "--shutdown-grace", str(grace),
                    "--request-timeout", "600")
    answers: dict[str, tuple[int, list[str]]] = {}

    def send(name: str, body: dict, started: threading.Event | None = None) -> None:
        try:
            with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/chat/completions",
                                                                json=body) as r:
                lines = []
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if started is not None:
                            started.set()
                answers[name] = (r.status_code, lines)
        except httpx.HTTPError as err:  # a connection closed without an answer
            answers[name] = (0, [repr(err)])

    try:
        decoding = threading.Event()
        threads = [threading.Thread(target=send, args=("C", chat_body("Go.", docs=[], max_tokens=LONG, stream=True),
                                                       decoding))]
        threads[0].start()
        assert decoding.wait(60)
        threads += [threading.Thread(target=send, args=("A", chat_body(QUESTIONS[0], max_tokens=LONG, stream=True,
                                                                       kvblend={"mode": "full"}))),
                    threading.Thread(target=send, args=("B", chat_body(QUESTIONS[1], docs=unseen, max_tokens=LONG,
                                                                       stream=True, kvblend={"mode": "blend"})))]
        for t in threads[1:]:
            t.start()
        deadline = time.monotonic() + 120  # A and B accepted (waiting for or running on the engine), however slow
        while sample(server.metrics(), "kvblend_queue_depth") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            code = server.proc.wait(grace + 25)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit {grace + 25:g} s after SIGTERM (shutdown grace {grace:g} s)")
        assert code == 0 and time.monotonic() - t0 < grace + 25, server.log.read_text()[-3000:]
        for t in threads:
            t.join(30)
        assert sorted(answers) == ["A", "B", "C"]
        for name, (status, lines) in answers.items():
            assert status in (200, 503), (name, status, lines[-3:])  # an answer, not a dropped connection
            if status == 200:
                assert lines[-1] == "data: [DONE]", (name, lines[-3:])
                last = json.loads(lines[-2][len("data: "):])
                assert "shut down" in last.get("error", {}).get("message", "") or last["choices"][0]["finish_reason"]
        assert "shut down" in json.loads(answers["C"][1][-2][len("data: "):])["error"]["message"]
    finally:
        server.stop()
    status, lines = answers["B"]
    prefilled = status == 200 and any('"content": "' in line and '"content": ""' not in line for line in lines)
    with BlendEngine.from_config(config) as engine:  # what was computed was written
        prompt = engine.build_prompt(QUESTIONS[1], [Document(d["text"], id=d["id"]) for d in unseen])
        keys = [key for seg in prompt.documents for key in engine.document_kv.keys(seg, prompt)]
        held = sum(engine.store.contains(key) is not None for key in keys)
    said = "blocks of its missing documents were not stored" in server.log.read_text()
    assert keys and (held == len(keys) or (not prefilled and said)), (held, len(keys), server.log.read_text())


def test_bench_serve_peer_is_a_second_server_given_prompts_as_text(server, setup, engine, tmp_path):
    """--peer: the same requests, as prompt texts (then as token ids), to another `kvblend serve`
    (raw completions): kvblend's rows (two modes) and the peer's side by side, the peer's answers
    compared with kvblend's full-prefill ones."""
    from blend.model.loading import load_tokenizer
    from blend.prompt.conversation import encode
    from blend.prompt.document import Document
    from eval.bench.peer import Peer, prompt_texts
    from eval.bench.sample import same_answer
    from eval.bench.serve import LEVELS_PLOT, bench_requests, document_pool, run_serve_bench, write_report

    root, config = setup
    twin = Server(config, root, "--completions-prompt", "raw", "--no-warmup")
    bench = dict(requests=3, pool_size=3, docs_per_request=2, max_tokens=4, doc_chars=150, ratio=0.3, url=server.url,
                 compare=False, log=lambda _: None)
    try:
        summary = run_serve_bench(str(config), clients=[1, 2], mode=["full", "blend"],
                                  peer=Peer(twin.url, "twin", {"launched_by": "test"}), **bench)
        served = sample(twin.metrics(), "kvblend_requests_total", endpoint="completions", mode="full", status="200")
        as_ids = run_serve_bench(str(config), clients=[2], mode="full", peer=Peer(twin.url, "twin", prompt="ids"),
                                 **bench)
    finally:
        assert twin.stop() == 0, twin.log.read_text()[-3000:]
    rows = summary["levels"]
    assert [(r["server"], r["mode"], r["clients"]) for r in rows] == [
        ("kvblend", "full", 1), ("kvblend", "full", 2), ("kvblend", "blend", 1), ("kvblend", "blend", 2),
        ("twin", None, 1), ("twin", None, 2)]
    assert served == 2 + 3 + 3  # its warm-up, then each level's requests, all as raw completions in full
    for row in rows:
        assert row["ok"] == 3 and row["lost"] == 0 and row["tokens_per_s"] > 0 and row["ttft_p50_s"] > 0, row
    for row in rows[:4]:
        assert row["answers_equal_alone"] == 3 and row["peer_settings"] is None and row["prompt_tokens_equal"] is None
    assert rows[0]["answers_equal_full"] == rows[1]["answers_equal_full"] == 3  # full is the reference
    for row in rows[4:]:
        assert row["answers_equal_alone"] is None and row["peer_settings"] == {"launched_by": "test"}
        assert row["max_num_seqs"] is None and row["hit_rate"] is None
    # the peer tokenized each text itself: its answers are kvblend's full prefill of that text, which
    # equal kvblend's own full answers where the ids came back the same (or the answer did not move)
    reqs = bench_requests(3, document_pool(3, 150), 2)
    prompts = prompt_texts(str(config), reqs)
    assert all(t.startswith("<|im_start|>system") and reqs[i].question in t for i, t in enumerate(prompts.texts))
    tokenizer = load_tokenizer(str(root / "model"))
    same_ids = sum(len(encode(tokenizer, t)) == n for t, n in zip(prompts.texts, prompts.tokens, strict=True))
    expected = 0
    for req, text in zip(reqs, prompts.texts, strict=True):
        full = engine.generate([{"role": "user", "content": req.question}],
                               [Document(d["text"], id=d["id"]) for d in req.documents], mode="full", max_new_tokens=4)
        expected += same_answer(engine.generate(text, mode="full", raw=True, max_new_tokens=4).text, full.text)
    for row in rows[4:]:
        assert row["prompt_tokens_equal"] == same_ids and row["answers_equal_full"] == expected
    # as kvblend's own ids: the same tokens, the same answers
    peer_row = as_ids["levels"][-1]
    assert (peer_row["server"], peer_row["answers_equal_full"], peer_row["prompt_tokens_equal"]) == ("twin", 3, 3)
    assert summary["peer"] == {"name": "twin", "url": twin.url, "prompt": "text"} and summary["modes"] == ["full", "blend"]
    write_report(summary, tmp_path)
    assert (tmp_path / LEVELS_PLOT).stat().st_size > 0 and (tmp_path / "serve.png").stat().st_size > 0


def test_answers_equal_counts_the_same_answers():
    from eval.bench.serve import Level, Sample

    level = Level(clients=2, samples=[Sample(True, tokens=1, index=0, text=" Maud Tillery"),
                                      Sample(True, tokens=1, index=1, text="Ostend"),
                                      Sample(True, tokens=1, index=2, text="1871"),
                                      Sample(False, error="HTTP 503", index=3, text="lost")], wall_s=1.0)
    reference = {0: "Maud Tillery", 1: "Ostend.", 2: "1871", 3: "lost"}
    row = level.summary(full=reference, alone={0: "Maud Tillery"})
    assert row["answers_equal_full"] == 2 and row["answers_equal_alone"] == 1  # the failed one is never equal
    assert level.summary()["answers_equal_full"] is None and row["server"] == "kvblend"


def test_raw_completions_take_the_whole_prompt_as_text(setup, engine):
    """A raw prompt is tokenized as it is: the text of a prompt kvblend built (no documents, so the
    ids come back the same) answers as that prompt; documents or a blend are refused."""
    from blend.prompt.builder import prompt_text

    messages = [{"role": "user", "content": "Who built the lighthouse?"}]
    text = prompt_text(engine.lm.tokenizer, engine.build_prompt(messages, []))
    built = engine.generate(messages, [], mode="full", max_new_tokens=4)
    raw = engine.generate(text, mode="full", raw=True, max_new_tokens=4)
    assert raw.token_ids == built.token_ids and raw.prompt_tokens == built.prompt_tokens
    assert engine.generate(text, mode="prefix", raw=True, max_new_tokens=4).token_ids == built.token_ids
    with pytest.raises(ValueError, match="no documents to blend"):
        engine.generate(text, raw=True, max_new_tokens=4)
    with pytest.raises(ValueError, match="pass no documents"):
        engine.generate(text, ["a document"], mode="full", raw=True)
    with pytest.raises(TypeError, match="one str"):
        engine.generate(messages, mode="full", raw=True)
