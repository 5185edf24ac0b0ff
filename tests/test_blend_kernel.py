"""The native blended-attention kernel (blend/model/native.py, kernels/blend_attention.c):
query rows at scattered, sorted positions over every key up to their own (a sliding layer's
window), plus a per-(KV head, key) bias. Its numbers against float64 and the torch path over
the shapes of the shipped models, key-block and range edges, its AVX2 and plain-C builds; the
shapes it declines; blend through the kernel against blend through torch; and a damaged
kernel cache (truncated, a directory, a FIFO, a killed build) rebuilt, never loaded."""

from __future__ import annotations

import os
import platform
import shutil

import pytest
import torch

from blend.model import native
from blend.model.attention import biased_attention, build_plan, causal_float_masks, window_plan
from blend.model.loading import cpu_flags
from blend.model.native import blend_kernel, decode_kernel, native_blend_attention
from blend.model.runner import Runner
from tests.models import home_sharing, tiny_model

has_compiler = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")
pytestmark = has_compiler


@pytest.fixture(scope="module")
def kernel_home(tmp_path_factory):
    return home_sharing(tmp_path_factory.mktemp("kvblend-home"))


def _clear() -> None:
    decode_kernel.cache_clear()
    blend_kernel.cache_clear()
    native._load.cache_clear()


@pytest.fixture
def fresh_kernel(monkeypatch, kernel_home):
    """The switch and the build read afresh, built under the module's temporary KVBLEND_HOME."""
    monkeypatch.setenv("KVBLEND_HOME", str(kernel_home))
    monkeypatch.delenv("KVBLEND_DECODE_KERNEL", raising=False)
    _clear()
    yield
    _clear()


def _inputs(hkv, g, d, tk, dtype, seed, spare=24):
    """q (H, Tq-ready, D) with head and row strides of the runner's (T, H, D) layout; k, v (Hkv, Tk, D)
    slices of a larger buffer (as the cache's are); bias (Hkv, Tk) float32, a slice too."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tk, hkv * g, d, generator=gen) * 1.5).to(dtype).transpose(0, 1)  # (H, Tk, D), row-strided
    k = (torch.randn(hkv, tk + spare, d, generator=gen) * 1.5).to(dtype)[:, :tk]
    v = torch.randn(hkv, tk + spare, d, generator=gen).to(dtype)[:, :tk]
    bias = torch.randn(hkv, tk + spare, generator=gen)[:, :tk]
    return q, k, v, bias


def _exact(q, pos, k, v, bias, scale, window):
    """float64 attention of q (H, Tq, D) at positions pos over k, v, the bias added, the causal
    (and window) mask by position: (Tq, H*D)."""
    heads, tq, d = q.shape
    g = heads // k.shape[0]
    kk, vv = k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    s = q.double() @ kk.transpose(1, 2) * scale  # (H, Tq, Tk)
    if bias is not None:
        s = s + bias.double().repeat_interleave(g, 0)[:, None, :]
    j = torch.arange(k.shape[1])
    seen = j[None, :] <= pos[:, None]
    if window:
        seen &= j[None, :] > pos[:, None] - window
    s = s.masked_fill(~seen[None], float("-inf"))
    return (torch.softmax(s, -1) @ vv).transpose(0, 1).reshape(tq, heads * d)


def _rows(kind: str, tk: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "start":
        return torch.arange(min(20, tk))
    if kind == "middle":
        return torch.arange(tk // 3, tk // 3 + min(45, tk // 3))
    if kind == "end":
        return torch.arange(max(0, tk - 33), tk)
    if kind == "one":
        return torch.tensor([tk - 1])
    count = max(1, tk // 7)
    return torch.cat([torch.randperm(tk - 10, generator=gen)[:count].sort().values, torch.arange(tk - 10, tk)])


def _run(q, pos, k, v, bias, scale, window):
    out = torch.full((pos.numel(), q.shape[0] * q.shape[2]), float("nan"), dtype=q.dtype)
    assert native_blend_attention(q[:, pos], pos, k, v, bias, scale, window, out)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,g,d,tk,window", [
    (3, 3, 64, 700, None),  # SmolLM2
    (1, 4, 256, 1300, 512),  # Gemma 3 270M, a sliding layer
    (1, 4, 256, 300, None),  # Gemma 3 270M, a global layer
    (8, 4, 128, 600, None),  # Llama 3 8B
    (2, 5, 48, 200, None),  # a group size and head size without their own unrolled tile
    (2, 3, 18, 130, 30),  # a head size off every vector path, a small window
    (4, 1, 16, 65, None),  # tiny models' heads; one key past a key block
])
@pytest.mark.parametrize("rows", ["start", "middle", "end", "scattered", "one"])
def test_the_kernel_equals_the_float64_reference(fresh_kernel, dtype, hkv, g, d, tk, window, rows):
    q, k, v, bias = _inputs(hkv, g, d, tk, dtype, seed=tk + g + d)
    pos = _rows(rows, tk, seed=tk)
    scale = d ** -0.5
    for b in (bias, None):
        exact = _exact(q[:, pos], pos, k, v, b, scale, window)
        out = _run(q, pos, k, v, b, scale, window)
        # float32: the order of the sums; bfloat16: the output's own rounding (half an ulp)
        bound = 2e-5 if dtype == torch.float32 else 2 ** -8 * (1 + exact.abs().max().item())
        assert (out.double() - exact).abs().max() < bound


@pytest.mark.parametrize("tk", [63, 64, 65, 511, 512, 513, 1025])
def test_key_block_and_range_edges(fresh_kernel, tk):
    """Every row over keys that end on, before and after a key block (64) and a range cut (512)."""
    q, k, v, bias = _inputs(3, 3, 64, tk, torch.float32, seed=tk)
    for pos in (torch.arange(tk), torch.arange(tk - 3, tk), torch.tensor([0, tk // 2, tk - 1])):
        out = _run(q, pos, k, v, bias, 0.125, None)
        assert (out.double() - _exact(q[:, pos], pos, k, v, bias, 0.125, None)).abs().max() < 2e-5


def test_never_less_accurate_than_the_torch_path(fresh_kernel):
    """bfloat16 K/V, blend's shape (scattered rows and the query's last rows over every key, a
    bias): the kernel's error against float64 is at most the torch path's (masked groups)."""
    tk = 1500
    q, k, v, bias = _inputs(3, 3, 64, tk, torch.bfloat16, seed=5)
    pos = _rows("scattered", tk, seed=6)
    exact = _exact(q[:, pos], pos, k, v, bias, 0.125, None)
    ours = _run(q, pos, k, v, bias, 0.125, None)
    plan = build_plan("groups", pos, tk, 1, torch.device("cpu"))
    torch_out = biased_attention(q[:, pos], k, v, bias, 0.125, plan, causal_float_masks(plan, q.dtype))
    ours_err, torch_err = (ours.double() - exact).abs(), (torch_out.double() - exact).abs()
    assert ours_err.max() <= torch_err.max() and ours_err.mean() <= torch_err.mean()
    window = window_plan(pos, tk, 512, torch.device("cpu"))
    exact = _exact(q[:, pos], pos, k, v, bias, 0.125, 512)
    ours = _run(q, pos, k, v, bias, 0.125, 512)
    torch_out = biased_attention(q[:, pos], k, v, bias, 0.125, window, causal_float_masks(window, q.dtype))
    assert (ours.double() - exact).abs().mean() <= (torch_out.double() - exact).abs().mean()


def test_large_score_gaps_and_biases_stay_finite(fresh_kernel):
    q, k, v, bias = _inputs(2, 3, 64, 300, torch.float32, seed=3)
    q = q * 40  # scores hundreds apart: the running maximum moves between key blocks
    bias[:, 100:200] = -1e4
    pos = torch.arange(150, 300, 3)
    out = _run(q, pos, k, v, bias, 0.125, None)
    assert torch.isfinite(out).all()
    assert (out.double() - _exact(q[:, pos], pos, k, v, bias, 0.125, None)).abs().max() < 1e-4


def test_declined_shapes_write_nothing_and_the_runner_takes_torch(fresh_kernel):
    q, k, v, bias = _inputs(2, 3, 64, 100, torch.float32, seed=4)
    pos = torch.arange(50, 100)
    out = torch.full((50, 6 * 64), 7.0)
    half = q.half()
    assert not native_blend_attention(half[:, pos], pos, k.half(), v.half(), None, 0.125, None, out.half())
    assert not native_blend_attention(q[:, pos], pos, k, v.to(torch.bfloat16), None, 0.125, None, out)  # mixed
    assert not native_blend_attention(q[:, pos], pos, k.transpose(1, 2).contiguous().transpose(1, 2), v, None,
                                      0.125, None, out)  # keys not row-contiguous
    assert not native_blend_attention(q[:, pos], pos.int(), k, v, None, 0.125, None, out)  # positions not int64
    assert not native_blend_attention(q[:, pos], pos.flip(0), k, v, None, 0.125, None, out)  # not sorted
    assert not native_blend_attention(q[:, pos], pos + 60, k, v, None, 0.125, None, out)  # past the keys
    assert not native_blend_attention(q[:, pos], pos, k, v, bias[:, :50], 0.125, None, out)  # bias of other keys
    assert (out == 7.0).all()
    runner = Runner(tiny_model("llama"))
    assert runner.native_blend
    q16 = torch.randn(runner.num_heads, 100, runner.head_dim).half()
    k16 = torch.randn(runner.kv_heads, 100, runner.head_dim).half()
    with torch.inference_mode():
        got = runner.attend(q16[:, pos], pos, k16, k16)  # float16: declined, torch's strategies answer
    assert runner.strategies["native"] == 0
    assert (got.double() - _exact(q16[:, pos], pos, k16, k16, None, runner.scaling, None)).abs().max() < 5e-3


def test_the_switch_turns_the_kernel_off(fresh_kernel, monkeypatch):
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "torch")
    _clear()
    assert blend_kernel() is None and native.blend_kernel_name() == "torch"
    assert not Runner(tiny_model("llama")).native_blend
    q, k, v, _ = _inputs(2, 3, 64, 40, torch.float32, seed=2)
    assert not native_blend_attention(q[:, :4], torch.arange(4), k, v, None, 0.1, None, torch.empty(4, 384))


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_the_avx2_and_plain_builds_equal_the_float64_reference(fresh_kernel, monkeypatch, tmp_path, march):
    """The AVX2 path (CPUs without AVX-512) and the plain C one, built here for -march=haswell / x86-64."""
    if platform.machine() != "x86_64" or (march == "haswell" and not {"avx2", "fma"} <= cpu_flags()):
        pytest.skip("needs an x86-64 CPU (with AVX2 and FMA for haswell)")
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    monkeypatch.setattr(native, "COMPILE_FLAGS", ("-O3", f"-march={march}", "-fPIC", "-fopenmp"))
    assert blend_kernel() is not None
    for dtype in (torch.float32, torch.bfloat16):
        for i, (hkv, g, d, tk, window) in enumerate([(3, 3, 64, 600, None), (1, 4, 256, 900, 512),
                                                     (2, 5, 40, 150, None), (2, 3, 18, 90, 20)]):
            q, k, v, bias = _inputs(hkv, g, d, tk, dtype, seed=300 + i)
            pos = _rows("scattered", tk, seed=i)
            exact = _exact(q[:, pos], pos, k, v, bias, d ** -0.5, window)
            out = _run(q, pos, k, v, bias, d ** -0.5, window)
            bound = 2e-5 if dtype == torch.float32 else 2 ** -8 * (1 + exact.abs().max().item())
            assert (out.double() - exact).abs().max() < bound


def test_amx_tiles_and_vector_dot_products_both_equal_the_float64_reference(fresh_kernel):
    """On a CPU with AMX, bfloat16 rows take tile products (the probabilities rounded to bfloat16
    for P V); turned off, AVX-512 BF16 dot products. Both within the output's own rounding of
    float64, with and without column sums; float32 never takes the tiles."""
    assert blend_kernel() is not None
    if native.blend_kernel_path() != "amx":
        pytest.skip("this CPU has no AMX tiles (or Linux does not grant them)")
    try:
        for i, (hkv, g, d, tk, window) in enumerate([(3, 3, 64, 1100, None), (1, 4, 256, 900, 512),
                                                     (8, 4, 128, 300, None)]):
            q, k, v, bias = _inputs(hkv, g, d, tk, torch.bfloat16, seed=400 + i)
            outs = {}
            for amx in (True, False):
                assert native.blend_kernel_path(amx) == ("amx" if amx else "avx512_bf16")
                for rows in ("scattered", "one", "end"):
                    pos = _rows(rows, tk, seed=i)
                    exact = _exact(q[:, pos], pos, k, v, bias, d ** -0.5, window)
                    bound = 2 ** -8 * (1 + exact.abs().max().item())
                    out = _run(q, pos, k, v, bias, d ** -0.5, window)
                    assert (out.double() - exact).abs().max() < bound, (amx, d, rows)
                    sums = torch.full((hkv, tk), float("nan"))
                    summed = torch.full_like(out, float("nan"))
                    assert native_blend_attention(q[:, pos], pos, k, v, None, d ** -0.5, window, summed, sums)
                    exact = _exact(q[:, pos], pos, k, v, None, d ** -0.5, window)
                    assert (summed.double() - exact).abs().max() < 2 ** -8 * (1 + exact.abs().max().item())
                    outs[amx, rows] = sums
            for rows in ("scattered", "one", "end"):  # the sums are float32 probabilities either way
                assert (outs[True, rows] - outs[False, rows]).abs().max() < 1e-3
        q, k, v, bias = _inputs(3, 3, 64, 300, torch.float32, seed=7)
        pos = _rows("scattered", 300, seed=7)
        assert native.blend_kernel_path(True) == "amx"
        with_tiles = _run(q, pos, k, v, bias, 0.125, None)
        native.blend_kernel_path(False)
        assert torch.equal(with_tiles, _run(q, pos, k, v, bias, 0.125, None))  # float32: no tiles
    finally:
        native.blend_kernel_path(True)


# ------------------------------------------------------------- blend end to end
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_blend_through_the_kernel_equals_blend_through_torch(fresh_kernel, arch):
    """float32: every mode's first-token log-probs within 1e-4 and the same greedy tokens, the
    kernel on and off (a hybrid model's windows too)."""
    from tests.test_engine import DOCS, QUESTION, make_engine

    with make_engine(arch, stale_bias=True) as engine:
        assert engine.runner.native_blend
        engine.ingest(DOCS)
        runs = {}
        for native_on in (True, False):
            engine.runner.native_blend = native_on
            engine.runner.strategies.clear()
            runs[native_on] = [engine.generate(QUESTION, DOCS, mode=mode, recompute_ratio=r, max_new_tokens=6)
                               for mode, r in (("blend", 0.05), ("blend", 0.15), ("blend", 0.5), ("reuse", 0.0),
                                               ("prefix", 0.0))]
            used = engine.runner.strategies["native"]
            assert used > 0 if native_on else used == 0
    for ours, theirs in zip(runs[True], runs[False], strict=True):
        assert (ours.first_token_logprobs - theirs.first_token_logprobs).abs().max() < 1e-4
        assert ours.token_ids == theirs.token_ids


# ------------------------------------------------------------- a damaged cache
def _built() -> tuple[os.PathLike, os.PathLike]:
    """The blend kernel's library and its build record under the current KVBLEND_HOME."""
    lib = native._library_path(native._compiler(), native._torch_libgomp(), native.BLEND)
    return lib, native._digest_path(lib)


@pytest.mark.parametrize("damage", ["truncated", "directory", "fifo", "no-record", "forged-record"])
@pytest.mark.parametrize("mode", ["auto", "native"])
def test_a_damaged_library_is_set_aside_and_rebuilt_never_loaded(fresh_kernel, monkeypatch, tmp_path, damage, mode):
    assert blend_kernel() is not None  # built once in the module's home, copied here as a build leaves it
    built, built_record = _built()
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", mode)
    _clear()
    lib, record = _built()
    lib.parent.mkdir(parents=True)
    shutil.copy(built, lib)
    shutil.copy(built_record, record)
    assert blend_kernel() is not None and native.check_library(lib) is None
    good = lib.read_bytes()
    _clear()
    lib.unlink()
    if damage == "truncated":  # loading half a library would be a bus error
        lib.write_bytes(good[: len(good) // 2])
    elif damage == "directory":
        lib.mkdir()
    elif damage == "fifo":  # reading it would block
        os.mkfifo(lib)
    elif damage == "no-record":
        lib.write_bytes(good)
        record.unlink()
    else:  # a record that does not match the bytes
        lib.write_bytes(good[:-8] + b"\0" * 8)
    assert blend_kernel() is not None  # rebuilt, not loaded
    assert lib.is_file() and native.check_library(lib) is None
    q, k, v, bias = _inputs(2, 3, 64, 80, torch.float32, seed=9)
    pos = torch.arange(40, 80)
    assert (_run(q, pos, k, v, bias, 0.125, None).double()
            - _exact(q[:, pos], pos, k, v, bias, 0.125, None)).abs().max() < 2e-5


def test_a_killed_build_s_directory_and_load_link_are_removed_by_the_next_build(fresh_kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    kernels = tmp_path / "kernels"
    left = kernels / ".build-killed"
    left.mkdir(parents=True)
    (left / "kernel.o").write_bytes(b"half an object")
    old = native.time.time() - 2 * native.STALE_BUILD_S
    os.utime(left, (old, old))
    recent = kernels / ".build-running"  # another process's build in progress: left alone
    recent.mkdir()
    link = kernels / ".load-killed-blend_attention.so"  # a load link a killed process left
    link.write_bytes(b"\x7fELF")
    os.utime(link, (old, old))
    assert blend_kernel() is not None
    assert not left.exists() and recent.exists() and not link.exists()
    assert not [p for p in kernels.iterdir() if ".bad-" in p.name]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stale_shift_pass_equals_the_rotated_offset(fresh_kernel, dtype):
    """native_shift_rows: k[:, rows] += R(rows) dk, v[:, rows] += dv, the other rows untouched;
    float32 as torch's gathers and scatters compute it, bfloat16 rounded once (closer to float64)."""
    from blend.model.native import native_shift_rows
    from blend.recompute.stale import _at_positions

    runner = Runner(tiny_model("llama"))
    gen = torch.Generator().manual_seed(11)
    hkv, t, d = runner.kv_heads, 90, runner.head_dim
    k = torch.randn(hkv, t + 5, d, generator=gen).to(dtype)[:, :t]
    v = torch.randn(hkv, t + 5, d, generator=gen).to(dtype)[:, :t]
    rows = torch.tensor([3, 4, 17, 40, 41, 42, 88])
    dk, dv = torch.randn(hkv, d, generator=gen) * 0.1, torch.randn(hkv, d, generator=gen) * 0.1
    cos, sin = runner.rotation(rows)
    exact_k, exact_v = k.double().clone(), v.double().clone()
    exact_k[:, rows] += _at_positions(dk[:, None].double(), cos.double(), sin.double())
    exact_v[:, rows] += dv[:, None].double()
    ours_k, ours_v = k.clone(), v.clone()
    assert native_shift_rows(ours_k, ours_v, rows, dk, dv, cos, sin)
    theirs_k, theirs_v = k.clone(), v.clone()
    theirs_k[:, rows] += _at_positions(dk[:, None], cos, sin).to(dtype)
    theirs_v[:, rows] += dv[:, None].to(dtype)
    others = torch.ones(t, dtype=torch.bool)
    others[rows] = False
    assert torch.equal(ours_k[:, others], k[:, others]) and torch.equal(ours_v[:, others], v[:, others])
    if dtype == torch.float32:
        assert (ours_k - theirs_k).abs().max() < 1e-6 and torch.equal(ours_v, theirs_v)
    else:
        for ours, theirs, exact in ((ours_k, theirs_k, exact_k), (ours_v, theirs_v, exact_v)):
            assert (ours.double() - exact).abs().sum() <= (theirs.double() - exact).abs().sum()
            assert (ours.double() - exact).abs().max() <= 2 ** -8 * (1 + exact.abs().max())
    assert not native_shift_rows(k, v, torch.tensor([t]), dk, dv, *runner.rotation(torch.tensor([t])))  # past T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_column_sums_equal_the_query_pass_probabilities(fresh_kernel, dtype, window):
    """The query pass's shape (the last rows over every key): the kernel's column sums equal
    query_probs summed over the rows and heads of each KV head, and its output their product
    with the values."""
    from blend.recompute.selector import query_probs

    hkv, g, d, tk, nq = 3, 3, 64, 700, 90  # 90 rows x 3 heads: two row blocks per head
    q, k, v, _ = _inputs(hkv, g, d, tk, dtype, seed=21)
    pos = torch.arange(tk - nq, tk)
    out = torch.full((nq, hkv * g * d), float("nan"), dtype=dtype)
    sums = torch.full((hkv, tk), float("nan"))
    assert native_blend_attention(q[:, pos], pos, k, v, None, 0.125, window, out, sums)
    probs = query_probs(q[:, pos].double(), k.double(), 0.125, tk - nq, window)  # (Hkv, g*Q, Tk)
    assert (sums.double() - probs.sum(1)).abs().max() < 1e-5 * nq * g
    exact = _exact(q[:, pos], pos, k, v, None, 0.125, window)
    bound = 2e-5 if dtype == torch.float32 else 2 ** -8 * (1 + exact.abs().max().item())
    assert (out.double() - exact).abs().max() < bound


# --------------------------------------------------------------- CUDA: FlexAttention
@pytest.mark.parametrize("window", [None, 40])
def test_flex_attention_with_bias_and_positions_equals_the_float64_reference(window):
    """The CUDA path's function, run eagerly on the CPU: a per-(KV head, key) bias as a score
    modification, the rows' positions (and window) as a block mask."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    import warnings

    from blend.model.attention import flex_biased_attention, flex_block_mask

    q, k, v, bias = _inputs(3, 3, 16, 300, torch.float32, seed=31)
    pos = _rows("scattered", 300, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not fused
        mask = flex_block_mask(pos, 300, window, torch.device("cpu"))
        for b in (bias, None):
            out = flex_biased_attention(q[:, pos].contiguous(), k, v, b, 0.25, mask)
            assert (out.double() - _exact(q[:, pos], pos, k, v, b, 0.25, window)).abs().max() < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the CPU runs the native kernel)")
def test_cuda_biased_and_windowed_rows_go_through_flex_attention():
    from blend.model.loading import wrap_model

    runner = Runner(wrap_model(tiny_model("llama").model.to("cuda"), None))
    assert runner.device.type == "cuda" and runner.use_flex
    q, k, v, bias = (t.cuda() for t in _inputs(runner.kv_heads, runner.num_heads // runner.kv_heads,
                                                runner.head_dim, 400, torch.float32, seed=32))
    pos = _rows("scattered", 400, seed=4)
    with torch.inference_mode():
        out = runner.attend(q[:, pos.cuda()], pos, k, v, bias=bias)
    assert runner.strategies["flex"] == 1
    exact = _exact(q[:, pos.cuda()].cpu(), pos, k.cpu(), v.cpu(), bias.cpu(), runner.scaling, None)
    assert (out.double().cpu() - exact).abs().max() < 1e-4


# ------------------------------------------------------- the loader's placement
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float32])
def test_rotating_loaded_keys_natively_gives_the_torch_formula_s_bits(fresh_kernel, src_dtype, dst_dtype):
    """`native_rotate_into` (the loader's placement of keys moved to new positions): bitwise the
    torch formula of `Runner.rotate_into` (float32 products and sums, one rounding into the
    cache's dtype), by one rotation for every row and by a table row by row, into a strided slice
    of a cache; subnormal keys keep their bits, a NaN stays NaN."""
    from blend.model.native import native_rotate_into

    assert blend_kernel() is not None
    gen = torch.Generator().manual_seed(11)
    for d in (64, 256, 18):  # the vector path (a multiple of 32) and the scalar one
        src = (torch.randn(3, 70, d, generator=gen) * 4).to(src_dtype)
        src[0, 0, :3] = torch.tensor([1e-39 if src_dtype != torch.float16 else 3e-6, -3e-40, float("nan")])
        angles = torch.rand(70, d // 2, generator=gen) * 6
        for cos, sin in ((angles.cos(), angles.sin()), (angles[:1].cos(), angles[:1].sin())):
            got = torch.zeros(3, 100, d, dtype=dst_dtype)
            assert native_rotate_into(got[:, 20:90], src, cos, sin)
            x = src.float()
            half = d // 2
            want = torch.cat([x[..., :half] * cos - x[..., half:] * sin, x[..., half:] * cos + x[..., :half] * sin],
                             -1).to(dst_dtype)
            nan = want.isnan()
            assert torch.equal(got[:, 20:90].isnan(), nan)
            bits = torch.int16 if dst_dtype == torch.bfloat16 else torch.int32
            assert torch.equal(got[:, 20:90][~nan].view(bits), want[~nan].view(bits))
            assert not got[:, :20].any() and not got[:, 90:].any()


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("shape", [(3, 512, 64), (3, 300, 64), (1, 77, 256), (2, 129, 48)])
def test_decoding_a_stored_layer_natively_gives_the_codec_s_bits(fresh_kernel, name, shape):
    """`native_decode_codes` (the loader's decode of an int8 / int4 entry): bitwise
    `storage.codec.decode_into`, with whole and partial key groups, value groups of a head's
    channels, and a 4-bit layer whose nibble halves split mid-row."""
    from blend.model.native import native_decode_codes
    from storage.codec import CODECS, decode_into, encode_layer

    assert blend_kernel() is not None
    codec = CODECS[name]
    h, t, d = shape
    gen = torch.Generator().manual_seed(t)
    k, v = (torch.randn(h, t, d, generator=gen) * 3).half(), torch.randn(h, t, d, generator=gen).half()
    rope = {"inv_freq": torch.rand(d // 2, generator=gen), "pos_start": 7} if codec.keys == "pre-rope" else {}
    kpart, vpart = encode_layer(codec, k, v, **rope)
    want = torch.empty(h, t, d), torch.empty(h, t, d)
    decode_into(codec, kpart, vpart, *want)
    got = torch.full((h, t, d), float("nan")), torch.full((h, t, d), float("nan"))
    assert native_decode_codes(codec.bits, codec.key_group, codec.key_zero, codec.value_group_for(d),
                               codec.value_zero, kpart, vpart, *got)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    short = torch.full((h, t, d), float("nan"))
    assert not native_decode_codes(codec.bits, codec.key_group, codec.key_zero, codec.value_group_for(d),
                                   codec.value_zero, kpart[:-2], vpart, short, short.clone())  # a truncated part
    assert short.isnan().all()
