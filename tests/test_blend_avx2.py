"""The blend kernel (kernels/blend_attention.c) built here with explicit instruction sets: AVX2 +
FMA (+ F16C), AVX-512 (F, BW, VL, BF16) and plain C, each compiled by this test into a library of
its own. Each build's output and column sums against float64 of its own inputs (1, 2, 3, 8 and 17
rows; head sizes on and off the vector paths' widths, key counts off the key blocks and across a
range cut; a bias or none, a window or none), and batch invariance: a row's output the same bits
alone and among other rows, on 1 and 2 threads, and the column sums the same bits on 1 and 2
threads. A build this CPU cannot run is still compiled; its runs are skipped, naming the flags."""

from __future__ import annotations

import ctypes
import platform
import shutil
import subprocess

import pytest
import torch

from blend.model import native
from blend.model.loading import cpu_flags
from tests.models import torch_threads

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")

# name: compiler flags, the CPU flags (/proc/cpuinfo) its code needs, what kvb_blend_path says
BUILDS = {
    "avx2": (("-mavx2", "-mfma", "-mf16c"), {"avx2", "fma", "f16c"}, "avx2_fma"),
    "avx512": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"),
               {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}, "avx512_bf16"),
    "plain": ((), set(), "scalar"),
}
ROWS = (1, 2, 3, 8, 17)
SHAPES = [  # hkv, g, d, tk, window
    (3, 3, 64, 1100, None),  # SmolLM2-135M's heads, keys across two range cuts
    (2, 5, 40, 333, None),  # an odd group, a head size of 2.5 AVX2 tiles
    (1, 4, 256, 700, 200),  # Gemma 3's head size, a sliding window
    (2, 3, 18, 97, None),  # a head size off every vector path
    (1, 2, 8, 1, None),  # one key
]


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    """Each build's library path (None: this machine's compiler cannot build it), built once."""
    cc, libgomp = native._compiler(), native._torch_libgomp()
    out = tmp_path_factory.mktemp("blend-builds")
    built = {}
    for name, (flags, _, _) in BUILDS.items():
        if flags and platform.machine() != "x86_64":
            built[name] = None
            continue
        obj, lib = out / f"{name}.o", out / f"{name}.so"
        steps = ([cc, "-O3", *flags, "-fPIC", "-fopenmp", "-c", str(native.BLEND.source), "-o", str(obj)],
                 [cc, "-shared", str(obj), libgomp, "-o", str(lib)])
        for cmd in steps:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=native.BUILD_TIMEOUT_S)
            assert done.returncode == 0, f"{' '.join(cmd)}: {done.stderr}"
        built[name] = lib
    return built


@pytest.fixture(params=list(BUILDS))
def build(request, libraries, monkeypatch):
    """One build loaded in place of the process's blend kernel (skipped where the CPU lacks its flags)."""
    name = request.param
    flags, needs, path = BUILDS[name]
    if libraries[name] is None:
        pytest.skip(f"{' '.join(flags)}: not an x86-64 machine")
    missing = sorted(needs - cpu_flags())
    if missing:
        pytest.skip(f"built with {' '.join(flags)}; this CPU lacks {', '.join(missing)}: not run")
    lib = ctypes.CDLL(str(libraries[name]))
    for fn, argtypes in native.BLEND.functions:
        getattr(lib, fn).restype = ctypes.c_int
        getattr(lib, fn).argtypes = list(argtypes)
    assert native.BLEND_PATHS[lib.kvb_blend_path(-1)] == path
    monkeypatch.setattr(native, "blend_kernel", lambda: lib)
    return name


def _inputs(hkv, g, d, tk, dtype, seed):
    """q (H, Tk, D) row-strided, as the runner's; k, v (Hkv, Tk, D) slices of a longer cache; a bias."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(tk, hkv * g, d, generator=gen) * 1.5).to(dtype).transpose(0, 1)
    k = (torch.randn(hkv, tk + 5, d, generator=gen) * 1.5).to(dtype)[:, :tk]
    v = torch.randn(hkv, tk + 5, d, generator=gen).to(dtype)[:, :tk]
    bias = torch.randn(hkv, tk + 5, generator=gen)[:, :tk]
    return q, k, v, bias


def _positions(count: int, tk: int, seed: int) -> torch.Tensor:
    """`count` sorted positions (at most tk), the last key's among them."""
    gen = torch.Generator().manual_seed(seed)
    count = min(count, tk)
    rest = torch.randperm(tk - 1, generator=gen)[:count - 1]
    return torch.cat([rest, torch.tensor([tk - 1])]).sort().values


def _exact(q, pos, k, v, bias, scale, window):
    """float64 attention of q (H, Tq, D) at pos over k, v with the bias, causal (and window) by
    position: the output (Tq, H*D) and each key's probabilities summed per KV head (Hkv, Tk)."""
    heads, tq, d = q.shape
    hkv, tk = k.shape[:2]
    g = heads // hkv
    s = q.double() @ k.double().repeat_interleave(g, 0).transpose(1, 2) * scale  # (H, Tq, Tk)
    if bias is not None:
        s = s + bias.double().repeat_interleave(g, 0)[:, None, :]
    j = torch.arange(tk)
    seen = j[None, :] <= pos[:, None]
    if window:
        seen &= j[None, :] > pos[:, None] - window
    p = torch.softmax(s.masked_fill(~seen[None], float("-inf")), -1)
    out = (p @ v.double().repeat_interleave(g, 0)).transpose(0, 1).reshape(tq, heads * d)
    return out, p.reshape(hkv, g * tq, tk).sum(1)


def _run(q, pos, k, v, bias, scale, window, sums=False):
    out = torch.full((pos.numel(), q.shape[0] * q.shape[2]), float("nan"), dtype=q.dtype)
    colsum = torch.full((k.shape[0], k.shape[1]), float("nan")) if sums else None
    assert native.native_blend_attention(q[:, pos].contiguous(), pos, k, v, bias, scale, window, out, colsum)
    return out, colsum


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal."""
    bits = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,g,d,tk,window", SHAPES)
def test_each_build_equals_float64_of_its_inputs(build, dtype, hkv, g, d, tk, window):
    q, k, v, bias = _inputs(hkv, g, d, tk, dtype, seed=tk + d)
    scale = d ** -0.5
    for count in ROWS:
        pos = _positions(count, tk, seed=count)
        for b in (bias, None):
            exact, exact_sums = _exact(q[:, pos], pos, k, v, b, scale, window)
            out, sums = _run(q, pos, k, v, b, scale, window, sums=True)
            # float32: the order of the sums; bfloat16: the output's own rounding (half an ulp)
            bound = 2e-5 if dtype == torch.float32 else 2 ** -8 * (1 + exact.abs().max().item())
            assert (out.double() - exact).abs().max() < bound, (build, count, b is None)
            assert (sums.double() - exact_sums).abs().max() < 1e-5 * (1 + pos.numel() * g), (build, count)
            alone, _ = _run(q, pos, k, v, b, scale, window)  # without column sums: another work split
            assert (alone.double() - exact).abs().max() < bound, (build, count, b is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,g,d,tk,window", SHAPES[:4])
def test_a_row_is_the_same_bits_alone_and_among_others_on_1_or_2torch_threads(build, dtype, hkv, g, d, tk, window):
    """17 rows at once, and each row alone, beside its neighbours and in every other row:
    bitwise equal outputs on 1 and 2 threads; the column sums the same bits on 1 and 2 threads."""
    q, k, v, bias = _inputs(hkv, g, d, tk, dtype, seed=tk + g)
    pos = _positions(17, tk, seed=tk)
    scale = d ** -0.5
    with torch_threads(1):
        alone = [_run(q, pos[i:i + 1], k, v, bias, scale, window)[0] for i in range(pos.numel())]
        # with column sums the kernel walks a row's keys in one pass (no range cuts): its own reference
        alone_sums = [_run(q, pos[i:i + 1], k, v, bias, scale, window, sums=True)[0] for i in range(pos.numel())]
        _, sums1 = _run(q, pos, k, v, bias, scale, window, sums=True)
    for threads in (1, 2):
        with torch_threads(threads):
            sets = [torch.arange(pos.numel()), torch.arange(0, pos.numel(), 2), torch.arange(pos.numel() - 3, pos.numel())]
            for rows in sets:
                out, _ = _run(q, pos[rows], k, v, bias, scale, window)
                for at, i in enumerate(rows.tolist()):
                    assert _same(out[at:at + 1], alone[i]), (build, threads, i)
            out, sums = _run(q, pos, k, v, bias, scale, window, sums=True)
            assert _same(sums, sums1), (build, threads)
            for i in range(pos.numel()):
                assert _same(out[i:i + 1], alone_sums[i]), (build, threads, i, "with column sums")
