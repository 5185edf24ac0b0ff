"""Tiny random-weight models built in code (milliseconds), and the shipped model loader
shared by tests. Not a test module itself."""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from blend.config import kvblend_home
from blend.model.loading import LoadedModel, load_model, wrap_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True)


# a tiny Gemma 3: sliding layers of 16 tokens (their RoPE base 10k) around a global one (base 1M),
# query_pre_attn_scalar unlike head_dim (so the scaling is the config's, not 1/sqrt(head_dim))
GEMMA3 = dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


MACHINE_HOME = kvblend_home()  # as the test run found it (fixtures may point KVBLEND_HOME elsewhere)


def home_sharing(path: Path, *names: str) -> Path:
    """`path` as a KVBLEND_HOME whose `names` (default: `models`) are links to this machine's home:
    the shipped models converted once per machine, not once per temporary home (20-40 s each), and
    with `kernels`, the native kernels built once (~10 s). Call before KVBLEND_HOME is set to it."""
    path.mkdir(parents=True, exist_ok=True)
    for name in names or ("models",):
        shared = MACHINE_HOME / name
        shared.mkdir(parents=True, exist_ok=True)
        if not (path / name).exists():
            (path / name).symlink_to(shared, target_is_directory=True)
    return path


def tiny_model(arch: str = "llama", *, vocab_size: int = 49152, seed: int = 0, tokenizer=None, **overrides) -> LoadedModel:
    """A random-weight model of a supported architecture, fp32, eval mode."""
    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "qwen3": (Qwen3Config, Qwen3ForCausalLM), "mistral": (MistralConfig, MistralForCausalLM),
               "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM)}
    config_cls, model_cls = classes[arch]
    kwargs = dict(TINY, vocab_size=vocab_size, **overrides)
    # a config may fill its rope_parameters in place (Gemma 3 adds one entry per layer type): each
    # model its own copy, so a later tiny llama does not save Gemma's keys (and warn when loaded)
    kwargs["rope_parameters"] = copy.deepcopy(kwargs["rope_parameters"])
    if arch == "mistral":
        kwargs.setdefault("sliding_window", None)
    if arch == "qwen3":
        kwargs.setdefault("head_dim", 16)
    if arch == "gemma3_text":
        for key, value in GEMMA3.items():
            kwargs.setdefault(key, value)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs))
    with torch.no_grad():  # larger-than-init weights so that positions and context matter
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(2.0)
    return wrap_model(model.float().eval(), tokenizer, f"tiny-{arch}")


@functools.cache
def smollm2() -> LoadedModel:
    """The shipped SmolLM2-135M-Instruct (converted copy cached under ~/.cache/kvblend)."""
    return load_model("smollm2-135m-instruct", device="cpu")


@functools.cache
def smollm2_tokenizer():
    return smollm2().tokenizer


@functools.cache
def gemma3() -> LoadedModel:
    """The shipped Gemma 3 270M (the gemma extra; converted copy cached under ~/.cache/kvblend)."""
    return load_model("gemma3-270m", device="cpu")


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to `n` inside the block, then back to what they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
