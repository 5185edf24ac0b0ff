"""The optimized decode step (issue 32): greedy output and per-step logits against the
old decode path (`Runner.prefill` of one token at `start=cache.length`) and transformers'
own generate in float32, the folded stale-key bias against a per-head reference, the
fused projections against the model's modules, RoPE rows from the table, `dtype: auto`
per CPU flags and device, and `kvblend bench decode`."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from blend.cli import main
from blend.config import EngineConfig
from blend.model.attention import cpu_decode_attention, decode_attention
from blend.model.loading import CPU_BF16_FLAGS, auto_dtype, cpu_flags, load_model, resolve_dtype
from blend.model.projections import (
    PACKED,
    Linear,
    build_projections,
    projection_layout,
    projections_for,
)
from blend.model.runner import Runner, apply_rope, rms_norm, rotate
from tests.models import smollm2, tiny_model

STEPS = 64


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: tiny matrices gain nothing from more, and spinning workers slow a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield threads  # (a test that wants them back sets them)
    torch.set_num_threads(threads)


def _greedy_both_ways(runner: Runner, ids: torch.Tensor, steps: int, bias_rows: torch.Tensor | None = None
                      ) -> tuple[list[int], list[int], float]:
    """Greedy decode of `steps` tokens after `ids` through `decode_step` and through the old
    path (a one-token `prefill` at cache.length), each fed its own tokens; optionally with
    a stale-key bias on `bias_rows` of layer 1. Returns both token lists and the largest
    logit difference over the steps where the two had been fed the same tokens."""
    n = len(ids)
    fast, slow = runner.new_cache(n + steps), runner.new_cache(n + steps)
    first = runner.prefill(ids, fast)[0]
    runner.prefill(ids, slow)
    if bias_rows is not None:
        bias = torch.linspace(-1.5, 1.0, runner.kv_heads)
        fast.set_bias(1, bias_rows, bias)
        slow.set_bias(1, bias_rows, bias)
    a, b = [int(first.argmax())], [int(first.argmax())]
    worst = 0.0
    for _ in range(steps - 1):
        la = runner.decode_step([a[-1]], [fast])[0]
        lb = runner.prefill(torch.tensor([b[-1]]), slow, start=slow.length)[0]
        if a == b:
            worst = max(worst, float((la - lb).abs().max()))
        a.append(int(la.argmax()))
        b.append(int(lb.argmax()))
    return a, b, worst


# ------------------------------------------------------ decode == the reference
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_decode_step_equals_the_old_path_and_generate_for_64_tokens(arch):
    lm = tiny_model(arch, vocab_size=512, attention_bias=(arch == "qwen2"))
    runner = Runner(lm)
    assert runner.projections is None  # float32: the model's own modules (faster than copies here)
    for seed, n in ((1, 9), (2, 150)):
        ids = torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))
        fast, slow, worst = _greedy_both_ways(runner, ids, STEPS)
        assert fast == slow
        assert worst < 1e-4, f"{arch}: largest logit difference {worst:.2e}"
        with torch.inference_mode():
            ref = lm.model.generate(ids[None], max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False,
                                    pad_token_id=0)[0, n:].tolist()
        assert fast == ref


def test_decode_step_with_a_stale_key_bias_equals_the_old_path():
    lm = tiny_model("llama", vocab_size=512)
    runner = Runner(lm)
    ids = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(4))
    fast, slow, worst = _greedy_both_ways(runner, ids, 24, bias_rows=torch.arange(3, 70, 4))
    assert fast == slow and worst < 1e-4
    _, _, unbiased = _greedy_both_ways(runner, ids, 2)
    assert unbiased < 1e-4


@pytest.mark.skipif(projection_layout(torch.device("cpu"), torch.bfloat16) != "packed",
                    reason="this CPU or torch build has no oneDNN bfloat16 kernels")
def test_bfloat16_decode_step_follows_the_old_path_within_its_rounding():
    """bfloat16 through the packed products and float32-scored attention: each step's logits
    near the one-token prefill's (SDPA, the modules' F.linear), both fed the same tokens."""
    lm = tiny_model("llama", vocab_size=512)
    lm.model.to(torch.bfloat16)
    runner = Runner(lm)
    assert runner.projections is not None and runner.projections.layout == "packed"
    ids = torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(8))  # > PACKED_MAX_ROWS: F.linear
    fast, slow = runner.new_cache(320), runner.new_cache(320)
    token = int(runner.prefill(ids, fast)[0].argmax())
    runner.prefill(ids, slow)
    for _ in range(8):
        a = runner.decode_step([token], [fast])[0]
        b = runner.prefill(torch.tensor([token]), slow, start=slow.length)[0]
        assert a.dtype == torch.float32
        assert (a - b).abs().max() < 0.02 * (1 + b.abs().max())  # ~0.005 seen; a wrong rotation: ~0.3
        token = int(b.argmax())


@pytest.mark.slow
def test_smollm2_decode_equals_the_old_path_for_64_tokens(_one_thread):
    torch.set_num_threads(_one_thread)  # a real model: its products gain from every core
    lm = smollm2()
    runner = Runner(lm)
    for prompt, steps in (("The capital of France is Paris. The capital of Italy is", STEPS),
                          ("Here is a short story about a lighthouse keeper named Maud:", 16)):
        ids = lm.tokenizer(prompt, return_tensors="pt").input_ids[0]
        fast, slow, worst = _greedy_both_ways(runner, ids, steps)
        assert fast == slow
        assert worst < 1e-4, f"largest logit difference {worst:.2e}"


# -------------------------------------------------------------- attention
def _per_head_reference(q, k, v, scale, bias):
    """Each query head alone over its KV head's keys, float64, explicit softmax with the bias."""
    heads, hkv = q.shape[0], k.shape[0]
    out = []
    for h in range(heads):
        kv = h // (heads // hkv)
        scores = (k[kv].double() @ q[h].double()) * scale + (bias[kv].double() if bias is not None else 0.0)  # (Tk,)
        out.append(torch.softmax(scores, 0) @ v[kv].double())  # (D,)
    return torch.cat(out)


@pytest.mark.parametrize("tk", [1, 37, 700])
def test_the_folded_bias_equals_the_per_head_reference(tk):
    gen = torch.Generator().manual_seed(tk)
    heads, hkv, d = 9, 3, 64
    q, k, v = (torch.randn(s, generator=gen) for s in ((heads, d), (hkv, tk, d), (hkv, tk, d)))
    bias = torch.randn(hkv, tk, generator=gen)
    scale = d ** -0.5
    for b in (bias, None):
        ref = _per_head_reference(q, k, v, scale, b)
        assert (decode_attention(q, k, v, scale, b).double() - ref).abs().max() < 1e-5
        out = torch.empty(heads * d)
        assert decode_attention(q, k, v, scale, b, out=out) is out and (out.double() - ref).abs().max() < 1e-5
    # the folded mask is what the SDPA path (CUDA) takes: the same numbers through it on the CPU
    sdpa = F.scaled_dot_product_attention(q.view(hkv, 3, d), k, v, attn_mask=bias[:, None, :], scale=scale)
    assert (sdpa.reshape(-1).double() - _per_head_reference(q, k, v, scale, bias)).abs().max() < 1e-5


def test_bfloat16_keys_are_scored_in_float32():
    """Rounding the scores to bfloat16 would cost ~10x this error: the product widens the keys."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=gen) * 2 for s in ((3, 3, 64), (3, 2048, 64), (3, 2048, 64)))
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = torch.softmax((qb.double() @ kb.double().transpose(1, 2)) / 8, -1) @ vb.double()
    out = cpu_decode_attention(qb.float() / 8, kb, vb)
    assert out.dtype == torch.bfloat16
    assert (out.double() - ref).abs().max() < 1e-2  # bfloat16 rounding of p and of the output only


# ------------------------------------------------------------ projections
PACKS = projection_layout(torch.device("cpu"), torch.bfloat16) == PACKED
needs_packing = pytest.mark.skipif(not PACKS, reason="this CPU or torch build has no oneDNN bfloat16 kernels")


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to bfloat16 output rounding."""
    return bool((a.float() - b.float()).abs().max() < 0.02 * (1 + b.float().abs().max()))


@needs_packing
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_projections_equal_the_model_s_modules(arch):
    lm = tiny_model(arch, vocab_size=512, attention_bias=(arch == "qwen2"))
    model = lm.model.to(torch.bfloat16)
    proj = build_projections(model)
    block = model.model.layers[1]
    with torch.inference_mode():
        for rows in (5, 300):  # packed; past PACKED_MAX_ROWS, F.linear on the model's weights
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows)).bfloat16()
            ref_qkv = torch.cat([block.self_attn.q_proj(x), block.self_attn.k_proj(x), block.self_attn.v_proj(x)], -1)
            assert _close(proj.layers[1].qkv(x), ref_qkv)
            assert [t.shape[1] for t in proj.layers[1].qkv.split(x)] == [64, 32, 32]
            assert _close(proj.layers[1].o(x), block.self_attn.o_proj(x))
            assert _close(proj.layers[1].mlp(x), block.mlp(x))
            assert _close(proj.lm_head(x), model.lm_head(x))


@needs_packing
def test_packed_products_equal_f_linear_with_biases():
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(96).bfloat16()
    for rows in (1, 8, 300):
        x = torch.randn(rows, 64).bfloat16()
        ref = F.linear(x.float(), w.float(), bias.float())
        out = Linear([w[:64], w[64:]], [bias[:64], None])(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
        assert _close(out[:, :64], ref[:, :64]) and _close(out[:, 64:], ref[:, 64:] - bias[64:].float())


@needs_packing
def test_projections_are_shared_and_rebuilt_when_the_weights_change():
    lm = tiny_model("llama", vocab_size=512)
    lm.model.to(torch.bfloat16)
    first = projections_for(lm.model)
    assert first is not None and Runner(lm).projections is first and projections_for(lm.model) is first
    with torch.no_grad():
        lm.model.model.layers[0].self_attn.q_proj.weight.mul_(2.0)
    again = projections_for(lm.model)
    assert again is not first
    x = torch.randn(2, 64).bfloat16()
    with torch.inference_mode():
        assert _close(again.layers[0].qkv(x)[:, :64], lm.model.model.layers[0].self_attn.q_proj(x))


def test_only_bfloat16_on_a_cpu_is_packed():
    assert projection_layout(torch.device("cpu"), torch.float32) is None
    assert projection_layout(torch.device("cpu"), torch.float16) is None
    assert projection_layout(torch.device("cuda"), torch.bfloat16) is None  # GPUs run the modules as they are


def test_rope_rows_and_rotate_equal_rope_and_apply_rope():
    runner = Runner(tiny_model("llama", vocab_size=512))
    positions = [0, 5, 511, 513, 1999]
    cos, sin_signed = runner.rope_rows(positions)
    ref_cos, ref_sin = runner.rope(torch.tensor(positions))
    assert torch.equal(cos, ref_cos) and torch.equal(sin_signed[:, 8:], ref_sin[:, 8:])
    assert torch.equal(sin_signed[:, :8], -ref_sin[:, :8])  # head_dim 16: the first half negated
    assert runner._rope_table is not None and runner._rope_table[0].shape[0] >= 2000
    x = torch.randn(5, 3, 16)  # (B, heads, D)
    assert torch.equal(rotate(x, cos[:, None], sin_signed[:, None]), apply_rope(x.transpose(0, 1), cos, ref_sin
                                                                                ).transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_module_s_result_bitwise(dtype):
    lm = tiny_model("qwen3", vocab_size=512)
    lm.model.to(dtype)
    x = torch.randn(7, 64).to(dtype) * 3
    with torch.inference_mode():
        for norm, rows in ((lm.model.model.layers[0].input_layernorm, x), (lm.model.model.norm, x),
                           (lm.model.model.layers[0].self_attn.q_norm, x.view(7, 4, 16))):
            assert torch.equal(rms_norm(norm, rows), norm(rows))


# ------------------------------------------------------------ dtype: auto
def test_auto_dtype_follows_the_cpu_flags_and_the_device(monkeypatch):
    cpu = torch.device("cpu")
    for flag in CPU_BF16_FLAGS:
        assert auto_dtype(cpu, flags={"avx2", flag}) == torch.bfloat16
    assert auto_dtype(cpu, flags={"avx2", "avx512f"}) == torch.float32
    assert auto_dtype(cpu, flags=set()) == torch.float32
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert auto_dtype(cpu, flags=set(CPU_BF16_FLAGS)) == torch.float32  # no oneDNN kernels to run it
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert auto_dtype(torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert auto_dtype(torch.device("cuda")) == torch.float32  # a GPU before Ampere
    assert auto_dtype(torch.device("mps")) == torch.float32


def test_cpu_flags_reads_the_first_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_an_explicit_dtype_always_wins_and_auto_resolves_at_load(monkeypatch):
    import blend.model.loading as loading

    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bfloat16") == torch.bfloat16
    monkeypatch.setattr(loading, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx512_bf16"}))
    assert resolve_dtype("auto") == torch.bfloat16
    assert load_model("random:tiny", device="cpu", dtype="auto").dtype == torch.bfloat16
    assert load_model("random:tiny", device="cpu", dtype="float32").dtype == torch.float32
    monkeypatch.setattr(loading, "cpu_flags", lambda path="/proc/cpuinfo": frozenset({"avx2"}))
    assert load_model("random:tiny", device="cpu", dtype="auto").dtype == torch.float32
    with pytest.raises(ValueError, match="use auto or one of float32, bfloat16, float16"):
        resolve_dtype("int8")
    assert EngineConfig().with_overrides(dtype="auto").dtype == "auto"
    with pytest.raises(ValueError, match="'auto', 'float32', 'bfloat16' or 'float16'"):
        EngineConfig().with_overrides(dtype="fp8")


# --------------------------------------------------------- bench decode
def test_bench_decode_json_rows(capsys):
    argv = ["bench", "decode", "--model", "random:tiny", "--dtype", "float32", "--context-tokens", "40,70",
            "--batch", "1,3", "--steps", "2", "--repeats", "2", "--warmup", "1", "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = doc["results"]
    assert [(r["context_tokens"], r["batch"]) for r in rows] == [(40, 1), (40, 3), (70, 1), (70, 3)]
    for r in rows:
        assert {"context_tokens", "batch", "ms_per_step", "tokens_per_s", "dtype"} <= set(r)
        assert r["dtype"] == "float32" and r["ms_per_step"] > 0
        assert math.isclose(r["tokens_per_s"], r["batch"] / r["ms_per_step"] * 1e3, rel_tol=0.01)
        assert r["ms_per_step_min"] <= r["ms_per_step"] <= r["ms_per_step_max"]
    assert rows[1]["batch_speedup"] == pytest.approx(rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"], rel=0.01)
    for key in ("load_average_start", "load_average_end", "load_average_peak", "contended", "cpu_cores",
                "probe_gflops_start", "unsteady"):
        assert key in doc
    assert doc["random_weights"] is True and doc["projections"] is None  # float32
    assert doc["decode_kernel"] in ("native", "torch")


@pytest.mark.parametrize("extra, message", [
    (["--context-tokens", "0"], "--context-tokens"),
    (["--batch", "2,x"], "--batch"),
    (["--context-tokens", "131000", "--steps", "500"], "positions"),
    (["--dtype", "int8"], "invalid choice"),
])
def test_bench_decode_rejects_bad_arguments(extra, message, capsys):
    argv = ["bench", "decode", "--model", "random:tiny", *extra]
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    assert code == 2
    assert message in capsys.readouterr().err
