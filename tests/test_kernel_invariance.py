"""Batch invariance of the native CPU kernels (blend/model/native.py, kernels/*.c): a row's
output is the same bits whatever else is in the call and however many OpenMP threads run
it. The decode kernel: a sequence alone and beside 1, 3 and 7 others of other lengths. The
blend kernel: a row alone and inside larger row sets over the same keys (the query pass's
column sums: the same bits on 1 and 2 threads). The stale-row shift: a row alone and with
others. float32 and bfloat16, SmolLM2's shapes (GQA 9/3, head_dim 64) and Gemma 3's (GQA
4/1, head_dim 256, a 512-key sliding window), on each of the three builds: AVX-512 (this
CPU's own), AVX2 + FMA (-march=haswell) and plain C (-march=x86-64)."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from blend.model import native
from blend.model.loading import cpu_flags
from blend.model.native import native_blend_attention, native_decode_attention_batch, native_shift_rows
from tests.models import home_sharing, torch_threads

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")

MARCHES = ["native", "native-vector", "haswell", "x86-64"]  # AVX-512 (+BF16, + AMX tiles where the CPU has them),
# the same build with the tiles off (where there are any), AVX2 + FMA, plain C
DTYPES = [torch.float32, torch.bfloat16]
LLAMA = dict(hkv=3, g=3, d=64, window=None)  # SmolLM2-135M
GEMMA = dict(hkv=1, g=4, d=256, window=512)  # Gemma 3 270M, a sliding layer


def _clear() -> None:
    native.decode_kernel.cache_clear()
    native.blend_kernel.cache_clear()
    native._load.cache_clear()


@pytest.fixture(scope="module")
def kernel_home(tmp_path_factory):
    return home_sharing(tmp_path_factory.mktemp("kvblend-home"))


@pytest.fixture(params=MARCHES)
def build(request, monkeypatch, kernel_home):
    """Both kernels built for one -march (each build its own library: the flags are in its name)."""
    march = request.param
    if not march.startswith("native") and (platform.machine() != "x86_64"
                                           or (march == "haswell" and not {"avx2", "fma"} <= cpu_flags())):
        pytest.skip("needs an x86-64 CPU (with AVX2 and FMA for haswell)")
    monkeypatch.setenv("KVBLEND_HOME", str(kernel_home))
    monkeypatch.delenv("KVBLEND_DECODE_KERNEL", raising=False)
    monkeypatch.setattr(native, "COMPILE_FLAGS", ("-O3", f"-march={march.removesuffix('-vector')}", "-fPIC", "-fopenmp"))
    _clear()
    assert native.decode_kernel() is not None and native.blend_kernel() is not None
    if march == "native-vector" and native.blend_kernel_path() != "amx":
        pytest.skip("this CPU has no AMX tiles: `native` is its vector build")
    try:
        if march == "native-vector":
            native.blend_kernel_path(False)
        yield march
    finally:
        if march == "native-vector":
            native.blend_kernel_path(True)
        _clear()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN payloads and signed zeros too)."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


# ------------------------------------------------------------------ decode
def _sequence(hkv, g, d, t, dtype, seed, with_bias):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv, g, d, generator=gen) * d ** -0.5 * 2
    k = (torch.randn(hkv, t + 8, d, generator=gen) * 2).to(dtype)[:, :t]
    v = torch.randn(hkv, t + 8, d, generator=gen).to(dtype)[:, :t]
    bias = torch.randn(hkv, t + 8, generator=gen)[:, :t] if with_bias else None
    return q, k, v, bias


def _decode(seqs, dtype) -> list[torch.Tensor]:
    calls = [(q, k, v, b, torch.full((q.shape[0], q.shape[1], q.shape[2]), float("nan"), dtype=dtype))
             for q, k, v, b in seqs]
    assert native_decode_attention_batch(calls)
    return [c[4] for c in calls]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["llama", "gemma3"], ids=str)
def test_a_decode_row_is_the_same_alone_and_in_any_batch_on_1_or_2torch_threads(build, dtype, shape):
    """One call per batch of 1, 2, 4 and 8 sequences (lengths across the 256-key blocks; a
    Gemma sliding layer's window of 512 and a global layer's longer context): each sequence's
    output equals its output alone on one thread, bitwise, on 1 and 2 threads."""
    s = LLAMA if shape == "llama" else GEMMA
    lengths = (1, 255, 256, 700, 3000, 37, 1500, 513) if shape == "llama" else (512, 1, 300, 2100, 512, 257, 40, 900)
    seqs = [_sequence(s["hkv"], s["g"], s["d"], t, dtype, seed=i, with_bias=i % 2 == 1)
            for i, t in enumerate(lengths)]
    with torch_threads(1):
        alone = [_decode([x], dtype)[0] for x in seqs]
    for threads in (1, 2):
        with torch_threads(threads):
            for size in (1, 2, 4, 8):
                for start in range(0, len(seqs), size):
                    order = [(start + j) % len(seqs) for j in range(size)][::-1]  # other orders, other neighbours
                    outs = _decode([seqs[i] for i in order], dtype)
                    for i, out in zip(order, outs, strict=True):
                        assert _same(out, alone[i]), (threads, size, i, lengths[i])


# ------------------------------------------------------------------ blend
def _blend_inputs(hkv, g, d, tk, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tk, hkv * g, d, generator=gen) * 1.5).to(dtype).transpose(0, 1)  # (H, Tk, D), row-strided
    k = (torch.randn(hkv, tk + 8, d, generator=gen) * 1.5).to(dtype)[:, :tk]
    v = torch.randn(hkv, tk + 8, d, generator=gen).to(dtype)[:, :tk]
    bias = torch.randn(hkv, tk + 8, generator=gen)[:, :tk]
    return q, k, v, bias


def _blend(q, pos, k, v, bias, window, sums: bool):
    heads, _, d = q.shape
    out = torch.full((pos.numel(), heads * d), float("nan"), dtype=q.dtype)
    colsum = torch.full((k.shape[0], k.shape[1]), float("nan")) if sums else None
    assert native_blend_attention(q[:, pos], pos, k, v, bias, d ** -0.5, window, out, colsum)
    return out, colsum


def _row_sets(tk: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Row sets of many sizes and spreads: the query's last rows, scattered rows (blend's
    recomputed ones), a few, one, a run at the start, every row."""
    scattered = torch.randperm(tk, generator=gen)[: tk // 6].sort().values
    return [torch.arange(tk - 40, tk), scattered, scattered[::7].contiguous(), scattered[-3:], torch.tensor([tk // 2]),
            torch.arange(0, 70), torch.arange(tk)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ["llama", "gemma3"], ids=str)
@pytest.mark.parametrize("sums", [False, True], ids=["out", "out+sums"])
def test_a_blend_row_is_the_same_alone_and_among_any_rows_on_1_or_2torch_threads(build, dtype, shape, sums):
    """Every row of every row set (and the union of them all) on 1 and 2 threads, with and
    without a bias: each row's output equals its output in the one call of every row on one
    thread, bitwise; with column sums, the sums of a row set are the same bits on 1 and 2
    threads."""
    s = LLAMA if shape == "llama" else GEMMA
    tk = 1400 if shape == "llama" else 1300  # several 512-key ranges; Gemma's window starts after key 0
    q, k, v, bias = _blend_inputs(s["hkv"], s["g"], s["d"], tk, dtype, seed=tk)
    gen = torch.Generator().manual_seed(5)
    for b in (bias, None):
        every = torch.arange(tk)
        with torch_threads(1):
            reference, _ = _blend(q, every, k, v, b, s["window"], sums)
        for pos in _row_sets(tk, gen):
            got = {}
            for threads in (1, 2):
                with torch_threads(threads):
                    got[threads] = _blend(q, pos, k, v, b, s["window"], sums)
                assert _same(got[threads][0], reference[pos]), (threads, pos.numel())
            if sums:
                assert _same(got[1][1], got[2][1]), pos.numel()


def test_a_row_set_that_crosses_range_and_block_edges_keeps_each_row_s_bits(build):
    """Rows just before and after the 64-key blocks and 512-key ranges, alone and together,
    a small window that starts mid-block: row by row the same bits."""
    q, k, v, bias = _blend_inputs(2, 3, 64, 1100, torch.float32, seed=3)
    edges = torch.tensor([0, 1, 62, 63, 64, 65, 511, 512, 513, 1023, 1024, 1025, 1099])
    for window in (None, 100, 600):
        with torch_threads(2):
            together, _ = _blend(q, edges, k, v, bias, window, sums=False)
        for i, p in enumerate(edges.tolist()):
            with torch_threads(1 + i % 2):
                alone, _ = _blend(q, torch.tensor([p]), k, v, bias, window, sums=False)
            assert _same(alone[0], together[i]), (window, p)


# ------------------------------------------------------------------ stale-row shift
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_shifted_row_is_the_same_alone_and_among_other_rows(build, dtype):
    hkv, t, d = 3, 700, 64
    gen = torch.Generator().manual_seed(8)
    k = torch.randn(hkv, t, d, generator=gen).to(dtype)
    v = torch.randn(hkv, t, d, generator=gen).to(dtype)
    dk, dv = torch.randn(hkv, d, generator=gen) * 0.1, torch.randn(hkv, d, generator=gen) * 0.1
    rows = torch.randperm(t, generator=gen)[:400].sort().values
    angles = rows[:, None].float() * torch.linspace(0.01, 1.0, d)[None]
    cos, sin = angles.cos(), angles.sin()
    together_k, together_v = k.clone(), v.clone()
    with torch_threads(2):
        assert native_shift_rows(together_k, together_v, rows, dk, dv, cos, sin)
    for i in (0, 1, 199, 399):
        alone_k, alone_v = k.clone(), v.clone()
        with torch_threads(1):
            assert native_shift_rows(alone_k, alone_v, rows[i:i + 1], dk, dv, cos[i:i + 1].contiguous(),
                                     sin[i:i + 1].contiguous())
        r = rows[i]
        assert _same(alone_k[:, r], together_k[:, r]) and _same(alone_v[:, r], together_v[:, r])
