"""`kvblend serve-vllm` / `kvblend delete` without vLLM: the model directory vLLM gets, the model's
fingerprint, bad input (one line, exit 2). kvblend's own venv; fast."""

from __future__ import annotations

import subprocess
import sys

import pytest

from blend.cli.serve_vllm import vllm_model_dir
from blend.vllm.blocks import BlockNames, candidate_names, model_fingerprint
from tests.conftest import ROOT


def _model(path, weights: bytes = b"w") -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    (path / "blocks.safetensors").write_bytes(b"kvblend's quantized blocks")
    (path / "tokenizer.json").write_text("{}")
    (path / "kvblend.json").write_text("{}")


def test_vllm_gets_only_config_tokenizer_and_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    _model(tmp_path / "m")
    target = vllm_model_dir(str(tmp_path / "m"))
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert all(p.is_symlink() and p.resolve().parent == (tmp_path / "m").resolve() for p in target.iterdir())
    assert vllm_model_dir(str(tmp_path / "m")) == target  # made once
    (tmp_path / "m" / "generation_config.json").write_text("{}")
    assert "generation_config.json" in {p.name for p in vllm_model_dir(str(tmp_path / "m")).iterdir()}


def test_fingerprint_follows_config_and_weights(tmp_path):
    _model(tmp_path / "a", b"weights")
    _model(tmp_path / "b", b"weights")
    _model(tmp_path / "c", b"other weights")
    cache = tmp_path / "cache"
    fa = model_fingerprint(tmp_path / "a", cache)
    assert fa == model_fingerprint(tmp_path / "b", cache) == model_fingerprint(tmp_path / "a", cache)
    assert fa != model_fingerprint(tmp_path / "c", cache)
    (tmp_path / "b" / "config.json").write_text('{"model_type": "llama", "x": 1}')
    assert fa != model_fingerprint(tmp_path / "b", cache)
    with pytest.raises(ValueError, match="no config.json"):
        model_fingerprint(tmp_path / "missing")


def test_block_names_chain_and_expectation():
    names = BlockNames("fp", "float32", 4, "ns")
    tokens = list(range(10))
    keys = names.keys(tokens)
    assert len(keys) == 2 and len(set(keys)) == 2
    assert names.key(tokens, 1) == names.key(tokens[:8], 1)  # the chain up to the block's end only
    assert names.key([9] + tokens[1:], 1) != keys[1]
    exp = names.expected(tokens, 1, num_layers=2, kv_heads=1, head_dim=8)
    assert (exp.pos_start, exp.num_tokens, exp.kv_dtype) == (4, 4, "float32")
    with pytest.raises(ValueError, match="only 10 tokens"):
        names.key(tokens, 2)
    assert len(candidate_names("fp", "")) == 3 * 5


def _kvblend(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "blend.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    import os

    env = dict(os.environ, KVBLEND_VLLM_PYTHON=str(tmp_path / "no-python"))
    for args, says in [(("serve-vllm", "--port", "8123"), "make vllm"),
                       (("serve-vllm", "--port", "99999"), "port"),
                       (("serve-vllm", "--config", str(tmp_path / "none.yaml")), "none.yaml"),
                       (("delete",), "--text TEXT, --file FILE or --token-ids JSON"),
                       (("delete", "--token-ids", "[1, 2"), "JSON list of ints")]:
        done = _kvblend(*args, env=env)
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, (args, done.stderr)
