"""A SIGTERM loses no computed KV: a blend stream over documents never seen opens (its documents
computed, their writes queued), a full-mode stream and a decoding one beside it, a CPU-bound
process beside the server; SIGTERM right then. After the exit every key of the blend's documents
is in the store, on the tiny model and on SmolLM2."""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from blend.engine.engine import BlendEngine
from blend.prompt.document import Document
from tests.models import smollm2_tokenizer, tiny_model
from tests.test_server import LONG, QUESTIONS, UNSEEN, Server, chat_body, disk_config


def _burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        sum(i * i for i in range(10_000))


class Burner:
    """A CPU-bound process beside the server (the machine as busy as CI's may be)."""

    def __enter__(self) -> Burner:
        self.stop = multiprocessing.Event()
        self.proc = multiprocessing.Process(target=_burn, args=(self.stop,), daemon=True)
        self.proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


class Stream(threading.Thread):
    """One streamed chat request; `opened` is set at its first data line (its prefill done)."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.opened = threading.Event()
        self.status, self.lines = 0, []

    def run(self) -> None:
        try:
            with httpx.Client(timeout=300) as http, http.stream("POST", self.url + "/v1/chat/completions",
                                                                json=self.body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.opened.set()
        except httpx.HTTPError as err:  # a connection closed without an answer
            self.lines.append(repr(err))
        finally:
            self.opened.set()


def _stored_keys(config: Path) -> tuple[int, int]:
    """(keys of UNSEEN's blocks, how many of them the store holds), in a fresh engine."""
    with BlendEngine.from_config(config) as engine:
        prompt = engine.build_prompt(QUESTIONS[1], [Document(d["text"], id=d["id"]) for d in UNSEEN])
        keys = [key for seg in prompt.documents for key in engine.document_kv.keys(seg, prompt)]
        return len(keys), sum(engine.store.contains(key) is not None for key in keys)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer(), max_position_embeddings=32768)
    lm.model.save_pretrained(root)
    smollm2_tokenizer().save_pretrained(root)
    return root


@pytest.mark.parametrize("model", ["tiny", pytest.param("smollm2-135m-instruct", marks=pytest.mark.slow)])
def test_sigterm_after_a_blend_stream_opened_writes_its_documents(model, request, tmp_path):
    config = disk_config(tmp_path, str(request.getfixturevalue("tiny_dir")) if model == "tiny" else model)
    tokens = LONG if model == "tiny" else 6000  # minutes of decoding, within the model's positions
    with Burner():
        server = Server(config, tmp_path, "--no-warmup", "--prefill-chunk-tokens", "16", "--shutdown-grace", "2",
                        "--request-timeout", "600")
        try:
            t0 = time.monotonic()
            decoding = Stream(server.url, chat_body("Go.", docs=[], max_tokens=tokens, stream=True))
            decoding.start()
            assert decoding.opened.wait(600)
            # the wait for the blend's first token scaled by this machine's speed (the first stream's)
            bound = max(600.0, 60 * (time.monotonic() - t0))
            blend = Stream(server.url, chat_body(QUESTIONS[1], docs=UNSEEN, max_tokens=tokens, stream=True,
                                                 kvblend={"mode": "blend"}))
            blend.start()
            full = Stream(server.url, chat_body(QUESTIONS[0], max_tokens=tokens, stream=True, kvblend={"mode": "full"}))
            full.start()  # (after the blend: its prefill goes first, the full one's chunks beside its decode)
            assert blend.opened.wait(bound) and blend.status == 200, blend.lines[-3:]
            server.proc.send_signal(signal.SIGTERM)
            try:
                code = server.proc.wait(120)
            except subprocess.TimeoutExpired:
                pytest.fail("the server did not exit 120 s after SIGTERM (shutdown grace 2 s)")
            assert code == 0, server.log.read_text()[-3000:]
            for stream in (decoding, full, blend):
                stream.join(30)
                assert stream.lines and stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        finally:
            server.stop()
    log = server.log.read_text()
    total, held = _stored_keys(config)
    assert total and held == total, f"{held} of {total} keys stored after SIGTERM; server log:\n{log[-3000:]}"

