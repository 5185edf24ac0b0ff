"""The kvblend CLI end to end on a tiny model saved to a local directory."""

from __future__ import annotations

import json

import pytest

from blend.cli import main
from tests.models import smollm2_tokenizer, tiny_model


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    lm.model.save_pretrained(root / "model")
    smollm2_tokenizer().save_pretrained(root / "model")
    (root / "a.txt").write_text("The Harrow bridge was finished in 1888 by a team of forty masons.")
    (root / "b.txt").write_text("Its central arch spans sixty metres over the river Dell.")
    (root / "c.yaml").write_text(f"""
model: {root / "model"}
device: cpu
engine:
  chunk_tokens: 16
  max_new_tokens: 4
  sessions_dir: {root / "sessions"}
store:
  kv_dtype: float32
  tiers:
    - {{kind: cpu, budget: 64MiB}}
    - {{kind: disk, path: {root / "disk"}, budget: 256MiB}}
""")
    return root


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_ingest_ask_and_store(config_file, capsys):
    cfg = str(config_file / "c.yaml")
    docs = [str(config_file / "a.txt"), str(config_file / "b.txt")]
    assert main(["ingest", "--config", cfg, *docs, "--json"]) == 0
    chunks = last_json(capsys)["chunks"]
    assert len(chunks) >= 2
    answers = {}
    for mode in ("full", "reuse", "prefix", "blend"):
        args = ["ask", "--config", cfg, "--question", "When was the bridge finished?", "--mode", mode, "--json"]
        for d in docs:
            args += ["--doc", d]
        assert main(args + ["--ratio", "1.0"] if mode == "blend" else args) == 0
        out = last_json(capsys)
        assert set(out) == {"text", "ttft_s", "stats"} and out["stats"]["mode"] == mode
        answers[mode] = out
    assert answers["reuse"]["stats"]["documents"]["hits"] >= 2  # found on disk in a new process-like engine
    assert answers["blend"]["text"] == answers["full"]["text"]
    assert main(["store", "stats", "--config", cfg, "--json"]) == 0
    stats = last_json(capsys)
    assert "disk" in json.dumps(stats)
    assert main(["store", "ls", "--config", cfg]) == 0
    listing = capsys.readouterr().out
    assert chunks[0] in listing
    assert main(["store", "clear", "--config", cfg, "--yes"]) == 0


def test_bad_input_is_a_clear_error(config_file, capsys):
    cfg = str(config_file / "c.yaml")
    assert main(["ask", "--config", cfg, "--question", "q", "--mode", "blend", "--ratio", "2"]) == 2
    assert "within [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ask", "--config", cfg, "--question", "q", "--mode", "fast"])
    assert "invalid choice" in capsys.readouterr().err
    assert main(["ask", "--config", str(config_file / "missing.yaml"), "--question", "q"]) == 2
    assert "not found" in capsys.readouterr().err
    (config_file / "bad.yaml").write_text("model: x\nengine:\n  chunk_tokenz: 3\n")
    assert main(["ask", "--config", str(config_file / "bad.yaml"), "--question", "q"]) == 2
    err = capsys.readouterr().err
    assert "chunk_tokenz" in err and "chunk_tokens" in err  # names the valid keys
