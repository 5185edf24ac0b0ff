"""Native CPU kernels: C source shipped in blend/model/kernels/, compiled once per machine
by the system's C compiler and loaded with ctypes. One kernel today: decode attention
(kernels/decode_attention.c), a few query rows per KV head over every cached key.

Why: torch's CPU kernels give decode attention over bfloat16 keys either a widened float32
copy of them (`cpu_decode_attention`'s torch path) or a fraction of memory speed (SDPA with
a handful of query rows); at 4,096 tokens of context that was ~20 of the 45 ms of a
SmolLM2 decode step on this project's 2-core machine. The kernel reads K and V once, in
their own width, scoring in float32.

Build: `cc -O3 -march=native -fopenmp` into `kvblend_home()/kernels/`, one file per
source, compiler, CPU and OpenMP runtime (a hash in the name), written under a temporary
name and renamed, so concurrent builds are safe and a later run loads it in milliseconds.
The library is linked against torch's own libgomp: its parallel regions then run on the
same per-thread pool as torch's ops (a second OpenMP runtime would add a second pool, which
on a 2-core machine makes every small op wait on wake-ups: storage/openmp.py).

`KVBLEND_DECODE_KERNEL` chooses: `auto` (default: native where it builds, torch else),
`native` (a build failure is an error that says why), `torch` (never native).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNEL_ENV = "KVBLEND_DECODE_KERNEL"
KERNEL_MODES = ("auto", "native", "torch")
SOURCE = Path(__file__).parent / "kernels" / "decode_attention.c"
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp")
BUILD_TIMEOUT_S = 120
MAX_QUERY_ROWS = 16  # the kernel's MAX_G: query heads per KV head
MAX_HEAD_DIM = 256  # the kernel's MAX_D
KINDS = {torch.float32: 0, torch.bfloat16: 1}  # K/V dtypes the kernel reads (its KIND_*)


class NativeBuildError(RuntimeError):
    """The native kernel could not be built or loaded (the message says why)."""


def kernel_mode() -> str:
    """$KVBLEND_DECODE_KERNEL, checked (ValueError naming the choices); `auto` when unset."""
    mode = os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNEL_ENV}: expected one of {', '.join(KERNEL_MODES)}, got {mode!r}")
    return mode


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError("no C compiler: install gcc (or set CC), or set KVBLEND_DECODE_KERNEL=torch")
    return cc


def _torch_libgomp() -> str:
    from storage.openmp import libgomp_paths

    paths = libgomp_paths()  # torch's own copy first
    if not paths:
        raise NativeBuildError("torch here does not run on libgomp; the kernel would bring a second OpenMP "
                               "runtime (set KVBLEND_DECODE_KERNEL=torch to silence this)")
    return paths[0]


def _library_path(cc: str, libgomp: str) -> Path:
    """Where the build for this source, compiler, CPU and OpenMP runtime lives."""
    from blend.config import kvblend_home
    from blend.model.loading import cpu_flags

    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeBuildError(f"the C compiler {cc} does not run: {err}") from None
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), cc.encode(), version.encode(), " ".join(COMPILE_FLAGS).encode(),
                 libgomp.encode(), " ".join(sorted(cpu_flags())).encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return kvblend_home() / "kernels" / f"{SOURCE.stem}-{key.hexdigest()[:16]}.so"


def _build(cc: str, libgomp: str, target: Path) -> None:
    """Compile SOURCE into `target` (atomically: a temporary file renamed)."""
    try:
        _compile(cc, libgomp, target)
    except OSError as err:  # the cache directory: not writable, full
        raise NativeBuildError(f"building the decode kernel into {target.parent} failed: {err}") from None


def _compile(cc: str, libgomp: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / target.name
        # compiled with OpenMP, linked against torch's libgomp only (not the compiler's own)
        steps = ([cc, *COMPILE_FLAGS, "-c", str(SOURCE), "-o", str(obj)],
                 [cc, "-shared", str(obj), libgomp, f"-Wl,-rpath,{Path(libgomp).parent}", "-o", str(lib)])
        for cmd in steps:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as err:
                raise NativeBuildError(f"building the decode kernel failed: {err}") from None
            if done.returncode:
                first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
                raise NativeBuildError(f"building the decode kernel failed ({Path(cmd[0]).name} exit "
                                       f"{done.returncode}): {first}")
        os.replace(lib, target)


@cache
def _load() -> ctypes.CDLL:
    """The built library with its function's signature set (NativeBuildError when it can't be)."""
    from storage.openmp import libgomp_paths

    cc, libgomp = _compiler(), _torch_libgomp()
    target = _library_path(cc, libgomp)
    before = set(libgomp_paths())
    for attempt in range(2):
        if not target.exists():
            _build(cc, libgomp, target)
            log.info("built the native decode kernel: %s", target)
        try:
            lib = ctypes.CDLL(str(target))
            fn = lib.kvb_decode_attention_batch
            break
        except (OSError, AttributeError) as err:  # a damaged file in the cache: built again, once
            if attempt:
                raise NativeBuildError(f"loading {target} failed: {err}") from None
            target.unlink(missing_ok=True)
    if set(libgomp_paths()) - before:
        raise NativeBuildError(f"{target} brought a second OpenMP runtime; delete it and rebuild, or set "
                               "KVBLEND_DECODE_KERNEL=torch")
    fn.restype = ctypes.c_int
    fn.argtypes = [*[ctypes.c_int] * 5, ctypes.c_void_p]
    return lib


@cache
def decode_kernel() -> ctypes.CDLL | None:
    """The native decode attention library, or None where `kernel_mode()` says torch or
    (auto) the build fails; `native` raises NativeBuildError instead. Built on first use."""
    mode = kernel_mode()
    if mode == "torch":
        return None
    try:
        return _load()
    except NativeBuildError as err:
        if mode == "native":
            raise NativeBuildError(f"{err} ({KERNEL_ENV}=native asks for the native kernel: fix the build, "
                                   f"or set {KERNEL_ENV}=auto to fall back to torch's)") from None
        log.warning("decode attention runs on torch's kernels: %s", err)
        return None


def decode_kernel_name() -> str:
    """`native` or `torch`: which decode attention this process runs on a CPU."""
    return "native" if decode_kernel() is not None else "torch"


def native_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                            out: torch.Tensor) -> bool:
    """softmax(q k^T + bias) v into `out` by the native kernel; False (nothing written) where
    it does not apply: no kernel, not a CPU, a dtype or layout it does not read.

    q (Hkv, g, D) float32 scaled and contiguous; k, v (Hkv, Tk, D) float32 or bfloat16, the
    same dtype, rows contiguous (the cache's slices are); bias (Hkv, Tk) float32 or None;
    out (Hkv, g, D) in K/V's dtype, rows contiguous.
    """
    return native_decode_attention_batch([(q, k, v, bias, out)])


DecodeInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]


def native_decode_attention_batch(seqs: Sequence[DecodeInputs]) -> bool:
    """`native_decode_attention` of several sequences (q, k, v, bias, out) in one call: the
    threads share every sequence's (head, block of keys) work items, so short contexts
    still keep both cores busy and the call costs one crossing, not one per sequence. The
    sequences share the dtype and q's shape; each has its own keys. False (nothing written)
    where any of them is not something the kernel reads."""
    lib = decode_kernel()
    if lib is None or not seqs:
        return False
    q0, k0 = seqs[0][0], seqs[0][1]
    kind = KINDS.get(k0.dtype)
    if kind is None or q0.dim() != 3:
        return False
    hkv, g, d = q0.shape
    if g > MAX_QUERY_ROWS or d > MAX_HEAD_DIM:
        return False
    rows: list[int] = []
    for q, k, v, bias, out in seqs:
        t = k.shape[1]
        if (q.device.type != "cpu" or k.device.type != "cpu" or k.dtype != k0.dtype or v.dtype != k0.dtype
                or out.dtype != k0.dtype or q.dtype != torch.float32 or q.shape != q0.shape or not q.is_contiguous()
                or k.stride(2) != 1 or v.stride(2) != 1 or out.stride(2) != 1 or k.shape != v.shape
                or k.shape[0] != hkv or k.shape[2] != d or tuple(out.shape) != (hkv, g, d) or t < 1):
            return False
        if bias is not None and (bias.dtype != torch.float32 or bias.stride(1) != 1 or tuple(bias.shape) != (hkv, t)):
            return False
        rows += (q.data_ptr(), k.data_ptr(), v.data_ptr(), bias.data_ptr() if bias is not None else 0, out.data_ptr(),
                 t, k.stride(0), k.stride(1), v.stride(0), v.stride(1), bias.stride(0) if bias is not None else 0,
                 out.stride(0), out.stride(1))
    table = torch.tensor(rows, dtype=torch.int64)  # (n, 13): the kernel's kvb_seq records
    return lib.kvb_decode_attention_batch(kind, hkv, g, d, len(seqs), table.data_ptr()) == 0
