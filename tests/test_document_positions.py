"""`max_document_tokens` is capped to the model's positions, and a document that cannot fit a
model of 2,048 positions together with the prompt's fixed part is refused at ingest (no request
could use it) by the engine, `kvblend ingest` (exit 2) and the server (400) alike, before anything
is written. (Until issue 42 it was split into parts that fit and stored, then refused by every
request that named it.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from blend.cli import main
from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from tests.models import smollm2_tokenizer, tiny_model

LONG = " ".join(f"Entry {i}: the ledger of the Harrow mill records {i * 7 % 97} sacks of barley." for i in range(420))


def kv_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kv"))


def make_engine(tmp_path: Path, **overrides) -> BlendEngine:
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    assert lm.dims.max_positions == 2048
    cfg = EngineConfig().with_overrides(
        store={"kv_dtype": "float32", "tiers": [{"kind": "disk", "path": str(tmp_path / "disk"), "budget": "1GiB"}]},
        chunk_tokens=512, **overrides)
    return BlendEngine(cfg, model=lm)


def test_a_document_longer_than_the_positions_is_refused_at_ingest_writing_nothing(tmp_path):
    with make_engine(tmp_path) as engine:  # max_document_tokens 4096 > 2048 positions
        assert engine.prompts.max_document_tokens == 2048
        prompt = engine.build_prompt("q", [LONG])
        assert sum(len(s.token_ids) for s in prompt.documents) > 2048
        with pytest.raises(ValueError, match=r"documents\[0\]: .*cannot fit the model's 2048 positions"):
            engine.ingest([LONG])
        with pytest.raises(ValueError, match="positions"):  # nor can a question over it
            engine.generate("What did the ledger record?", [LONG], mode="blend")
        fits = LONG[: len(LONG) // 6]
        [doc] = engine.ingest([fits])
        assert doc.stored and len(doc.keys) >= 2  # one that fits is taken, in blocks
        assert len(kv_files(tmp_path)) == len(doc.keys) + 1  # and the system part's block: nothing of LONG
    with make_engine(tmp_path, max_document_tokens=300) as engine:  # a smaller setting stays in force
        assert max(len(s.token_ids) for s in engine.build_prompt("q", [LONG]).documents) == 300


def test_a_system_part_that_fills_the_positions_is_refused_before_writing(tmp_path):
    with make_engine(tmp_path, system_prompt="word " * 2100) as engine:
        with pytest.raises(ValueError, match="leaves none of the model's 2048 positions for documents"):
            engine.ingest(["A short document."])
    assert kv_files(tmp_path) == []


def test_cli_ingest_and_the_server_refuse_a_long_document_writing_nothing(tmp_path, capsys):
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    lm.model.save_pretrained(tmp_path / "model")
    smollm2_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "long.txt").write_text(LONG)
    for name in ("cli", "server"):
        (tmp_path / f"{name}.yaml").write_text(f"""
model: {tmp_path / "model"}
device: cpu
engine:
  blend:
    chunk_tokens: 512
  sessions:
    sessions_dir: {tmp_path / "sessions"}
store:
  kv_dtype: float32
  tiers:
    - {{kind: disk, path: {tmp_path / name}, budget: 1GiB}}
""")
    capsys.readouterr()  # the model's saving
    assert main(["ingest", "--config", str(tmp_path / "cli.yaml"), str(tmp_path / "long.txt")]) == 2
    out, err = capsys.readouterr()
    assert not out.strip() and err.count("\n") == 1, err
    assert "long.txt" in err and "cannot fit the model's 2048 positions" in err
    assert kv_files(tmp_path / "cli") == []

    from fastapi.testclient import TestClient

    from blend.server.app import ServerSettings, create_app

    with BlendEngine.from_config(tmp_path / "server.yaml") as engine:
        with TestClient(create_app(engine, ServerSettings("tiny", warmup=False))) as client:
            reply = client.post("/v1/documents", json={"documents": [{"text": LONG}]})
    assert reply.status_code == 400, reply.text
    assert "cannot fit the model's 2048 positions" in reply.json()["error"]["message"]
    assert kv_files(tmp_path / "server") == []
