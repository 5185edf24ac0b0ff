"""RoPE variants (default, llama3, YaRN): re-rotating cached keys is exact, and the runner
matches transformers' own forward under each."""

from __future__ import annotations

import pytest
import torch

from blend.model.runner import Runner
from tests.models import tiny_model

THETA = 10000.0
ROPES = {
    "default": {"rope_type": "default", "rope_theta": THETA},
    # tiny head_dim 16: wavelengths 6..2e4, so some are kept, some smoothed, some divided
    "llama3": {"rope_type": "llama3", "rope_theta": THETA, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    # factor = max_position_embeddings (2048) / original: attention scaling 0.1 ln 4 + 1
    "yarn": {"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0, "original_max_position_embeddings": 512},
}
CASES = [(arch, rope) for arch in ("llama", "qwen2") for rope in ROPES]


def _tiny(arch: str, rope: str):
    return tiny_model(arch, vocab_size=512, rope_parameters=dict(ROPES[rope]))


def _keys(runner: Runner, h: torch.Tensor, positions: torch.Tensor, layer: int = 1) -> torch.Tensor:
    with torch.inference_mode():
        _, k, _ = runner.heads_qkv(layer, h, positions)
    return k  # (Hkv, T, D)


def test_variants_are_what_the_tests_assume():
    base = Runner(_tiny("llama", "default")).rotary
    llama3 = Runner(_tiny("llama", "llama3")).rotary
    yarn = Runner(_tiny("qwen2", "yarn")).rotary
    assert not torch.allclose(llama3.inv_freq, base.inv_freq) and llama3.attention_scaling == 1.0
    assert not torch.allclose(yarn.inv_freq, base.inv_freq)
    assert yarn.attention_scaling == pytest.approx(1.1386, abs=1e-4)  # re-rotation must not apply it again


@pytest.mark.parametrize("arch,rope", CASES)
def test_rerotation_equals_direct_rotation(arch, rope):
    runner = Runner(_tiny(arch, rope))
    n = 24
    h = runner.embed(torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(5)))
    start = torch.arange(n) + 100
    k0 = _keys(runner, h, start)
    per_token = torch.randint(-100, 400, (n,), generator=torch.Generator().manual_seed(6))
    for delta in (301, -90, 1, per_token):
        direct = _keys(runner, h, start + delta)
        moved = runner.rerotate(k0, delta)
        in_place = k0.clone()
        runner.rerotate_(in_place, delta)
        for got in (moved, in_place):
            diff = (got - direct).abs()
            assert diff.max() <= 1e-5, f"{arch}/{rope} delta {delta}: max {diff.max():.2e} mean {diff.mean():.2e}"
    assert runner.rerotate(k0, 0) is k0


def test_shift_is_memoised_and_round_trips():
    runner = Runner(_tiny("llama", "yarn"))
    k = torch.randn(2, 9, 16, generator=torch.Generator().manual_seed(1))
    moved = k.clone()
    runner.rerotate_(moved, 57)
    first = runner._shift(57, k.dtype)
    runner.rerotate_(moved, -57)
    assert runner._shift(57, k.dtype) is first  # one cos/sin per (delta, dtype), shared by every layer
    assert first[0].shape == (1, 16)
    assert (moved - k).abs().max() < 1e-6  # a pure rotation: norms kept, inverse is -delta


def _hf_logits(lm, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(ids[None]).logits[0].float()


@pytest.mark.parametrize("arch,rope", [("llama", "llama3"), ("llama", "yarn"), ("qwen2", "llama3"), ("qwen2", "yarn")])
def test_runner_matches_transformers_under_scaled_rope(arch, rope):
    lm = _tiny(arch, rope)
    runner = Runner(lm)
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(lm, ids)
    out = runner.prefill(ids, runner.new_cache(37), logit_rows=range(37))
    diff = (out - ref).abs()
    assert diff.max() < 1e-4, f"max {diff.max():.2e} mean {diff.mean():.2e}"
    cache = runner.new_cache(20)
    runner.prefill(ids[:20], cache)
    tail = runner.prefill(ids[20:], cache, start=20)  # explicit positions past the first call
    assert (tail[0] - ref[-1]).abs().max() < 1e-4
