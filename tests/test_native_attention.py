"""The native decode attention kernel (blend/model/native.py, kernels/decode_attention.c):
its numbers against a float64 reference and the torch path, over the shapes its fast and
generic paths take; where it declines; the KVBLEND_DECODE_KERNEL switch; the build's
failures as misses with a reason; one OpenMP runtime in the process."""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blend.model import native
from blend.model.attention import cpu_decode_attention
from blend.model.loading import cpu_flags
from blend.model.native import (
    NativeBuildError,
    decode_kernel,
    kernel_mode,
    native_decode_attention,
    native_decode_attention_batch,
)
from storage.openmp import libgomp_paths
from tests.models import home_sharing

has_compiler = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler here")


@pytest.fixture(scope="module")
def kernel_home(tmp_path_factory):
    """One KVBLEND_HOME for the module's kernel: built once."""
    return home_sharing(tmp_path_factory.mktemp("kvblend-home"))


@pytest.fixture
def fresh_kernel(monkeypatch, kernel_home):
    """The switch and the build read afresh, built under the module's temporary KVBLEND_HOME."""
    monkeypatch.setenv("KVBLEND_HOME", str(kernel_home))
    _clear()
    yield
    _clear()


def _clear() -> None:
    """The kernels loaded afresh (another module's test may have loaded them from its own home)."""
    decode_kernel.cache_clear()
    native.blend_kernel.cache_clear()
    native._load.cache_clear()


def _inputs(hkv: int, g: int, d: int, t: int, dtype: torch.dtype, seed: int, spare: int = 40):
    """q (hkv, g, d) float32 scaled; k, v (hkv, t, d) slices of a larger buffer (as the
    cache's are); bias (hkv, t) float32, a slice too."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(hkv, g, d, generator=gen) * d ** -0.5 * 2
    k = (torch.randn(hkv, t + spare, d, generator=gen) * 2).to(dtype)[:, :t]
    v = torch.randn(hkv, t + spare, d, generator=gen).to(dtype)[:, :t]
    bias = torch.randn(hkv, t + spare, generator=gen)[:, :t]
    return q, k, v, bias


def _exact(q, k, v, bias):
    """float64 softmax(q k^T + bias) v of the inputs as given (bfloat16 values exactly)."""
    scores = q.double() @ k.double().transpose(1, 2)  # (Hkv, g, Tk)
    if bias is not None:
        scores = scores + bias.double()[:, None, :]
    return torch.softmax(scores, -1) @ v.double()


@has_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hkv,g,d,t", [
    (3, 3, 64, 1), (3, 3, 64, 255), (3, 3, 64, 256), (3, 3, 64, 257), (3, 3, 64, 3000),  # SmolLM2; block edges
    (1, 4, 256, 700),  # Gemma 3 270M
    (8, 4, 128, 1100),  # Llama 3 8B
    (2, 5, 64, 300),  # a row count without its own unrolled shape
    (2, 16, 96, 513),  # the most rows; a head size off the 64-wide path
    (4, 1, 16, 40),  # tiny models' heads
])
def test_the_kernel_equals_the_float64_reference(fresh_kernel, dtype, hkv, g, d, t):
    assert decode_kernel() is not None
    q, k, v, bias = _inputs(hkv, g, d, t, dtype, seed=t + g)
    for b in (bias, None):
        out = torch.full((hkv, g, d), float("nan"), dtype=dtype)
        assert native_decode_attention(q, k, v, b, out)
        err = (out.double() - _exact(q, k, v, b)).abs().max().item()
        if dtype == torch.float32:
            assert err < 1e-5
        else:  # the output's own rounding to bfloat16 (2^-9 relative) and nothing else
            assert err < 2 ** -8 * (1 + _exact(q, k, v, b).abs().max().item())


@has_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_batch_of_sequences_of_different_lengths_in_one_call(fresh_kernel, dtype):
    """Each sequence its own keys (1 to 3,000 of them), some with a bias: one call gives each
    the float64 answer; a sequence the kernel does not read makes the call decline, writing
    nothing."""
    seqs = []
    for i, t in enumerate((1, 17, 300, 3000, 64)):
        q, k, v, bias = _inputs(3, 3, 64, t, dtype, seed=100 + i)
        seqs.append((q, k, v, bias if i % 2 else None, torch.full((3, 3, 64), float("nan"), dtype=dtype)))
    assert native_decode_attention_batch(seqs)
    for q, k, v, bias, out in seqs:
        exact = _exact(q, k, v, bias)
        bound = 1e-5 if dtype == torch.float32 else 2 ** -8 * (1 + exact.abs().max().item())
        assert (out.double() - exact).abs().max() < bound
    q, k, v, bias, _ = seqs[2]
    untouched = torch.full((3, 3, 64), 7.0, dtype=dtype)
    declined = [seqs[0][:4] + (torch.zeros(3, 3, 64, dtype=dtype),), (q, k.half(), v.half(), bias, untouched)]
    assert not native_decode_attention_batch(declined)
    assert (declined[0][4] == 0).all() and (untouched == 7).all()


@has_compiler
def test_the_kernel_is_at_least_as_close_as_the_torch_path(fresh_kernel, monkeypatch):
    """Over bfloat16 K/V the torch path rounds the probabilities to bfloat16; the kernel keeps
    them in float32: its error is never larger (both measured against float64)."""
    q, k, v, bias = _inputs(3, 3, 64, 2048, torch.bfloat16, seed=7)
    ours = cpu_decode_attention(q, k, v, bias)
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "torch")
    decode_kernel.cache_clear()
    theirs = cpu_decode_attention(q, k, v, bias)
    exact = _exact(q, k, v, bias)
    assert (ours.double() - exact).abs().max() <= (theirs.double() - exact).abs().max() + 1e-6
    assert (ours.double() - theirs.double()).abs().max() < 2e-2


@has_compiler
def test_scores_far_apart_and_a_large_bias_stay_finite(fresh_kernel):
    """Scores 200 apart (exponentials that underflow) and a -1e4 bias: finite, the right answer."""
    q, k, v, bias = _inputs(1, 2, 64, 600, torch.float32, seed=3)
    k = k.clone()
    k[:, 17] = q[0, 0] * 200 / q[0, 0].norm() ** 2  # one key 200 logits above the rest for row 0
    bias = bias.clone()
    bias[:, 100:] = -1e4
    out = torch.empty(1, 2, 64)
    assert native_decode_attention(q, k, v, bias, out)
    assert torch.isfinite(out).all()
    assert (out.double() - _exact(q, k, v, bias)).abs().max() < 1e-5


@has_compiler
def test_what_the_kernel_does_not_read_falls_back_to_torch(fresh_kernel):
    q, k, v, bias = _inputs(2, 3, 64, 50, torch.float16, seed=1)
    out = torch.empty(2, 3, 64, dtype=torch.float16)
    assert not native_decode_attention(q, k, v, bias, out)  # float16 K/V
    q17, k32, v32, _ = _inputs(2, 17, 64, 50, torch.float32, seed=1)
    assert not native_decode_attention(q17, k32, v32, None, torch.empty(2, 17, 64))  # 17 rows per KV head
    q3 = q17[:, :3].contiguous()
    assert native_decode_attention(q3, k32, v32, None, torch.empty(2, 3, 64))
    assert not native_decode_attention(q3, k32.transpose(1, 2).contiguous().transpose(1, 2), v32, None,
                                       torch.empty(2, 3, 64))  # keys not row-contiguous
    got = cpu_decode_attention(q, k, v, bias)  # the torch path: still right
    assert (got.double() - _exact(q, k, v, bias)).abs().max() < 1e-2


def test_the_switch_is_checked_and_torch_turns_the_kernel_off(fresh_kernel, monkeypatch):
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVBLEND_DECODE_KERNEL: expected one of auto, native, torch"):
        kernel_mode()
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "torch")
    assert decode_kernel() is None and native.decode_kernel_name() == "torch"
    q, k, v, bias = _inputs(3, 3, 64, 20, torch.float32, seed=2)
    assert not native_decode_attention(q, k, v, bias, torch.empty(3, 3, 64))


def test_a_failed_build_is_the_torch_path_on_auto_and_an_error_on_native(fresh_kernel, monkeypatch, tmp_path,
                                                                          caplog):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: no such thing' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with caplog.at_level("WARNING", logger="blend.model.native"):
        assert decode_kernel() is None
    assert "building the decode kernel failed (cc exit 3): cc: no such thing" in caplog.text
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "native")
    decode_kernel.cache_clear()
    native._load.cache_clear()
    with pytest.raises(NativeBuildError, match="exit 3"):
        decode_kernel()


@has_compiler
def test_the_kernel_shares_torch_s_openmp_runtime_and_is_built_once(fresh_kernel, monkeypatch, tmp_path):
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    before = libgomp_paths()
    assert decode_kernel() is not None
    assert libgomp_paths() == before  # no second runtime: one pool per thread for torch and the kernel
    built = list((tmp_path / "kernels").glob("decode_attention-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    native._load.cache_clear()
    decode_kernel.cache_clear()
    assert decode_kernel() is not None and built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@has_compiler
def test_a_damaged_build_in_the_cache_is_built_again(fresh_kernel, monkeypatch, tmp_path):
    """A file at the build's path that does not load (never loaded by this process: a
    library mapped here is never rewritten in place, a rebuild is a new file renamed)."""
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    target = native._library_path(native._compiler(), native._torch_libgomp())
    target.parent.mkdir(parents=True)
    target.write_bytes(b"not a shared library")
    assert decode_kernel() is not None
    assert target.read_bytes()[:4] == b"\x7fELF"


# one decode and one blend call through whichever kernels the process loads; prints their names
_PROBE = """
import torch
from blend.model import native
q, k = torch.randn(3, 3, 64), torch.randn(3, 100, 64)
ran = native.native_decode_attention(q, k, k, None, torch.empty(3, 3, 64))
ran &= native.native_blend_attention(torch.randn(9, 4, 64), torch.arange(96, 100), k, k, None, 0.125, None,
                                     torch.empty(4, 576))
print(native.decode_kernel_name(), native.blend_kernel_name(), ran)
"""


@has_compiler
@pytest.mark.parametrize("mode", ["native", "auto"])
def test_a_forged_library_with_a_matching_record_is_rebuilt_and_the_rebuild_runs(fresh_kernel, tmp_path, mode):
    """Each cached kernel replaced by another valid shared library (the other kernel's: an ELF
    file without its functions) with a build record that matches it: the run that finds it
    sets it aside, rebuilds it and runs on the rebuild (a process that had loaded a library
    from a path gets that handle back for the path: the rebuild is opened under a new name),
    the next run loads the rebuild as it is."""
    assert decode_kernel() is not None and native.blend_kernel() is not None  # built once in the module's home
    for spec in (native.DECODE, native.BLEND):  # ... and copied as a build leaves them: the first run loads them
        built = native._library_path(native._compiler(), native._torch_libgomp(), spec)
        copy = tmp_path / "kernels" / built.name
        copy.parent.mkdir(exist_ok=True)
        shutil.copy(built, copy)
        shutil.copy(native._digest_path(built), native._digest_path(copy))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "KVBLEND_HOME": str(tmp_path), "KVBLEND_DECODE_KERNEL": mode, "PYTHONPATH": str(root)}

    def probe() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _PROBE], env=env, cwd=root, capture_output=True, text=True,
                              timeout=600)

    first = probe()
    assert first.returncode == 0 and first.stdout.split() == ["native", "native", "True"], first.stderr
    libs = {p.name.split("-")[0]: p for p in (tmp_path / "kernels").glob("*.so")}
    decode, blend = libs["decode_attention"], libs["blend_attention"]
    forged = {decode: blend.read_bytes(), blend: decode.read_bytes()}
    for lib, data in forged.items():
        lib.unlink()
        lib.write_bytes(data)
        native._digest_path(lib).write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")
        assert native.check_library(lib) is None  # the record checks: only loading it shows the forgery
    rebuilt = probe()
    assert rebuilt.returncode == 0 and rebuilt.stdout.split() == ["native", "native", "True"], rebuilt.stderr
    for lib, data in forged.items():
        assert native.check_library(lib) is None and lib.read_bytes() != data
    assert not [p for p in (tmp_path / "kernels").iterdir() if p.name.startswith(".load-")]
    again = probe()
    assert again.returncode == 0 and again.stdout.split() == ["native", "native", "True"], again.stderr
    assert "rebuilding" not in again.stderr


@has_compiler
def test_prebuild_compiles_the_missing_kernels_side_by_side_and_their_loads_find_them_built(
        fresh_kernel, monkeypatch, tmp_path, caplog):
    """An engine's first start compiles the kernels beside the model's load (`native.prebuild`,
    once per process): each is then loaded as built, not built again; under
    KVBLEND_DECODE_KERNEL=torch nothing is compiled."""
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "torch")
    native.prebuild.cache_clear()
    assert native.prebuild() == 0 and not (tmp_path / "kernels").exists()
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "auto")
    native.prebuild.cache_clear()
    try:
        assert native.prebuild() == 3
        assert native.prebuild() == 3  # once per process (cached)
        libs = sorted((tmp_path / "kernels").glob("*.so"))
        assert [p.name.split("-")[0] for p in libs] == ["blend_attention", "decode_attention", "quant_matmul"]
        assert all(native.check_library(p) is None for p in libs)
        with caplog.at_level("INFO", logger="blend.model.native"):
            assert decode_kernel() is not None and native.blend_kernel() is not None
            assert native.quant_kernel() is not None
        assert "built the native" not in caplog.text and "rebuilding" not in caplog.text
    finally:
        native.prebuild.cache_clear()
        native.blend_kernel.cache_clear()
        native.quant_kernel.cache_clear()


@has_compiler
def test_a_home_that_cannot_be_written_is_the_torch_path_with_a_reason(fresh_kernel, monkeypatch, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the home directory should be")
    monkeypatch.setenv("KVBLEND_HOME", str(blocked))
    with caplog.at_level("WARNING", logger="blend.model.native"):
        assert decode_kernel() is None
    assert "building the decode kernel into" in caplog.text and "failed" in caplog.text


@has_compiler
@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma"} <= cpu_flags(),
                    reason="needs an x86-64 CPU with AVX2 and FMA")
def test_the_avx2_build_equals_the_float64_reference(fresh_kernel, monkeypatch, tmp_path):
    """The AVX2 path (laptops without AVX-512), built for -march=haswell on this machine."""
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path))
    monkeypatch.setattr(native, "COMPILE_FLAGS", ("-O3", "-march=haswell", "-fPIC", "-fopenmp"))
    assert decode_kernel() is not None
    for dtype in (torch.float32, torch.bfloat16):
        seqs = []
        for i, (hkv, g, d, t) in enumerate([(3, 3, 64, 1), (3, 3, 64, 263), (3, 3, 64, 2000), (1, 4, 256, 700),
                                           (2, 5, 32, 100), (2, 3, 48, 90)]):
            q, k, v, bias = _inputs(hkv, g, d, t, dtype, seed=200 + i)
            out = torch.full((hkv, g, d), float("nan"), dtype=dtype)
            assert native_decode_attention_batch([(q, k, v, bias if i % 2 else None, out)])
            seqs.append((q, k, v, bias if i % 2 else None, out))
        for q, k, v, bias, out in seqs:
            exact = _exact(q, k, v, bias)
            bound = 1e-5 if dtype == torch.float32 else 2 ** -8 * (1 + exact.abs().max().item())
            assert (out.double() - exact).abs().max() < bound


def test_the_cli_says_in_one_line_when_native_was_asked_for_and_does_not_build(monkeypatch, capsys):
    """(The usual home, where the shipped tokenizer is converted already: another compiler is
    another build path, which fails before anything is written there.)"""
    from blend.cli import main

    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("KVBLEND_DECODE_KERNEL", "native")
    decode_kernel.cache_clear()
    native._load.cache_clear()
    try:
        code = main(["bench", "decode", "--model", "random:tiny", "--context-tokens", "40", "--batch", "1",
                     "--steps", "1", "--repeats", "1"])
    finally:
        decode_kernel.cache_clear()
        native._load.cache_clear()
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("kvblend:")]
    assert code == 2 and len(said) == 1 and "Traceback" not in err
    assert said[0].startswith("kvblend: error: building the decode kernel failed (false exit 1)")
    assert "set KVBLEND_DECODE_KERNEL=auto" in said[0]
