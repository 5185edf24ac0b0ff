"""Native CPU kernels: C sources shipped in blend/model/kernels/, each compiled once per
machine by the system's C compiler into a library of its own and loaded with ctypes.

- decode attention (kernels/decode_attention.c): a few query rows per KV head over every
  cached key, for a whole decode batch in one call (`native_decode_attention_batch`).
- blended attention (kernels/blend_attention.c): query rows at scattered, sorted positions
  over every key up to their own (a sliding layer's window), plus an additive bias per
  (KV head, key): CacheBlend's recomputed rows and its query pass (`native_blend_attention`).
- quantized products (kernels/quant_matmul.c): y = x W^T for a few rows straight from a
  GGUF's quantized blocks (`native_quant_matmul`; blend/model/quantized.py holds the blocks).

Why: torch's CPU kernels give decode attention over bfloat16 keys either a widened float32
copy of them or a fraction of memory speed, and give blended attention (a float mask per
KV head) its masked math path, which materialises every score: at 4,096 tokens of context
that was ~20 of the 45 ms of a SmolLM2 decode step, and 67% of a blend@0.15 pass, on this
project's 2-core machine. The kernels read K and V once, in their own width, scoring in
float32.

Build: `cc -O3 -march=native -fopenmp` into `kvblend_home()/kernels/`, one file per
source, compiler, CPU and OpenMP runtime (a hash in the name), written under a temporary
name and renamed, so concurrent builds are safe and a later run loads it in milliseconds.
Beside each library, `<name>.sha256` holds its digest and size, written by the build: a
library is loaded only if it is a regular file of this user whose bytes match it (an ELF
file), so a truncated, replaced or foreign file in the cache (a directory, a FIFO, half a
library) is set aside and built again, never `dlopen`ed; so is one that loads but lacks the
kernel's functions (another valid library with a matching record). A library this process
built is opened through a new link to it (`_open_new`): `dlopen` of a path already loaded
hands back the old handle, and the run that rebuilds must run the rebuild. Build
directories and load links a killed process left behind are removed by the next build.

All three kernels are batch-invariant: a row's output is the same bits whatever other
rows or sequences share the call and however many threads run it. The attention kernels
split their work by fixed sizes tied to key positions (decode: blocks of 256 keys; blended
attention: key blocks of 64 and ranges of 512 at their multiples) and merge in key order
on one thread (tests/test_kernel_invariance.py); the quantized products split by fixed
blocks of 16 output columns, and each row's accumulator sees its blocks in k order, alone
(tests/test_quant_kernel.py).

The libraries are linked against torch's own libgomp: their parallel regions then run on
the same per-thread pool as torch's ops (a second OpenMP runtime would add a second pool,
which on a 2-core machine makes every small op wait on wake-ups: storage/openmp.py).

`KVBLEND_DECODE_KERNEL` chooses for all three: `auto` (default: native where it builds,
torch else), `native` (a build failure is an error that says why), `torch` (never native;
under `weights: auto` the linear layers then read the dequantized weights, `weights:
quantized` is refused at load).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNEL_ENV = "KVBLEND_DECODE_KERNEL"
KERNEL_MODES = ("auto", "native", "torch")
KERNEL_DIR = Path(__file__).parent / "kernels"
COMPILE_FLAGS = ("-O3", "-march=native", "-fPIC", "-fopenmp")
BUILD_TIMEOUT_S = 120
STALE_BUILD_S = 4 * BUILD_TIMEOUT_S  # a build directory older than this was left by a killed build
MAX_LIBRARY_BYTES = 64 << 20
MAX_QUERY_ROWS = 16  # the decode kernel's MAX_G: query heads per KV head
MAX_HEAD_DIM = 256  # both attention kernels' largest head dimension
BLEND_MAX_GROUP = 64  # the blend kernel's MAX_M: query heads per KV head at most
KINDS = {torch.float32: 0, torch.bfloat16: 1}  # K/V dtypes the kernels read (their KIND_*)
ROTATION_SOURCES = KINDS | {torch.float16: 2}  # what `native_rotate_into` reads (the stored dtype too)
_LONG, _INT, _PTR = ctypes.c_long, ctypes.c_int, ctypes.c_void_p


@dataclass(frozen=True)
class KernelSpec:
    """One native kernel: its source, the function it exports and that function's C signature."""

    title: str  # in messages: "the decode kernel"
    source: Path
    functions: tuple[tuple[str, tuple[type, ...]], ...]  # exported name, argument types (each returns int)


DECODE = KernelSpec("decode kernel", KERNEL_DIR / "decode_attention.c",
                    (("kvb_decode_attention_batch", (*[_INT] * 5, _PTR)),))
BLEND = KernelSpec("blend attention kernel", KERNEL_DIR / "blend_attention.c", (
    ("kvb_blend_attention", (_INT, _INT, _INT, _INT, _INT, _LONG, ctypes.c_float, _INT, _PTR,  # kind..pos
                             _PTR, _LONG, _LONG, _PTR, _LONG, _LONG, _PTR, _LONG, _LONG,  # q, k, v, strides
                             _PTR, _LONG, _PTR, _LONG, _PTR)),  # bias, out, column sums
    ("kvb_shift_rows", (_INT, _INT, _INT, _LONG, _PTR, _PTR, _LONG, _LONG, _PTR, _LONG, _LONG,  # ..k, v
                        _PTR, _PTR, _PTR, _PTR)),  # dk, dv, cos, sin
    ("kvb_blend_path", (_INT,)),  # -1 asks, 0 / 1 turns AMX tiles off / on
    ("kvb_rotate_into", (_INT, _INT, _INT, _INT, _LONG, _PTR, _LONG, _LONG, _PTR, _LONG, _LONG,  # ..src, dst
                         _PTR, _PTR, _LONG)),  # cos, sin, their row stride
    ("kvb_decode_codes", (_INT, _INT, _INT, _INT, _INT, _INT, _LONG, _INT, _PTR, _PTR, _PTR, _PTR)),
))
BLEND_PATHS = {0: "scalar", 1: "avx512_bf16", 2: "amx", 3: "avx2_fma"}  # what kvb_blend_path returns
QUANT = KernelSpec("quantized product kernel", KERNEL_DIR / "quant_matmul.c", (
    ("kvb_quant_matmul", (_INT, _LONG, _LONG, _PTR, _LONG, _PTR, _LONG, _PTR, _INT, _PTR)),  # kind..segments
    ("kvb_quant_path", ()),
    ("kvb_qpack_record", (_INT,)),
    ("kvb_qpack", (_INT, _LONG, _LONG, _PTR, _LONG, _PTR)),  # type, n, k, blocks, row bytes, packed
    ("kvb_qpack_matmul", (_INT, _LONG, _LONG, _PTR, _LONG, _PTR, _LONG, _PTR, _INT, _PTR)),  # as kvb_quant_matmul
    ("kvb_qpack_path", ()),
    ("kvb_qdecode_layer", (_INT, _LONG, _PTR, ctypes.c_float, ctypes.c_float, ctypes.c_float,  # kind..scaling
                           _PTR, _LONG, _PTR, _PTR, _LONG, _PTR, _PTR, _LONG)),  # h, rope, rows, out
    ("kvb_qdecode_layers", (_INT, _LONG, _LONG, _PTR, _PTR,  # kind, rows, layers: records, params
                            _PTR, _LONG, _PTR, _PTR, _LONG, _PTR, _PTR, _PTR, _LONG)),  # h, rope, rows, work, out
))
SOURCE = DECODE.source


class NativeBuildError(RuntimeError):
    """A native kernel could not be built or loaded (the message says why)."""


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


def _library_path(cc: str, libgomp: str, spec: KernelSpec = DECODE) -> Path:
    """Where the build of `spec` for this source, compiler, CPU and OpenMP runtime lives."""
    from blend.config import kvblend_home
    from blend.model.cpu import cpu_flags

    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise NativeBuildError(f"the C compiler {cc} does not run: {err}") from None
    key = hashlib.sha256()
    headers = [h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h"))]  # kernel_math.h, shared by the sources
    for part in (spec.source.read_bytes(), *headers, cc.encode(), version.encode(), " ".join(COMPILE_FLAGS).encode(),
                 libgomp.encode(), " ".join(sorted(cpu_flags())).encode(), platform.machine().encode()):
        key.update(part)
        key.update(b"\0")
    return kvblend_home() / "kernels" / f"{spec.source.stem}-{key.hexdigest()[:16]}.so"


def _digest_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _read_regular(path: Path, limit: int) -> bytes:
    """The bytes of `path` if it is a regular file of this user of at most `limit` bytes
    (never following a link, never blocking on a FIFO); OSError or ValueError saying why not."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_uid != os.geteuid():
            raise ValueError("not written by this user")
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than {limit}")
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_library(target: Path) -> str | None:
    """Why the library at `target` must not be loaded, or None when it is the one a build
    wrote: a regular file of this user, an ELF file whose sha256 and size match its
    `.sha256` file. "missing" when nothing is there."""
    try:
        st = os.lstat(target)
    except (FileNotFoundError, NotADirectoryError):  # no library there (or no directory: the build says why)
        return "missing"
    except OSError as err:
        return f"unreadable ({err})"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    try:
        digest, size = _read_regular(_digest_path(target), 256).decode("ascii").split()
        data = _read_regular(target, MAX_LIBRARY_BYTES)
    except (OSError, ValueError, UnicodeDecodeError) as err:
        return f"its build record does not check ({err})"
    if len(data) != int(size) or hashlib.sha256(data).hexdigest() != digest:
        return f"{len(data)} bytes that do not match their build record ({size} bytes): damaged"
    if data[:4] != b"\x7fELF":
        return "not a shared library"
    return None


def _set_aside(target: Path) -> bool:
    """Move whatever is at `target` (and its digest) out of the way; False when it can't be."""
    for path in (target, _digest_path(target)):
        if os.path.lexists(path):
            try:
                os.rename(path, path.with_name(f"{path.name}.bad-{uuid.uuid4().hex[:8]}"))
            except OSError:
                pass
    return not os.path.lexists(target)


def _clear_leftovers(directory: Path) -> None:
    """Remove entries set aside as bad, and build directories and load links a killed
    process left behind."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    now = time.time()
    for path in entries:
        try:
            stale = path.name.startswith((".build-", ".load-")) and now - path.lstat().st_mtime > STALE_BUILD_S
            if ".bad-" in path.name or stale:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        except OSError:
            pass


def _build(cc: str, libgomp: str, target: Path, spec: KernelSpec = DECODE) -> None:
    """Compile `spec` into `target` (atomically: a temporary file renamed) with its digest beside it."""
    try:
        _compile(cc, libgomp, target, spec)
    except OSError as err:  # the cache directory: not a directory, not writable, full
        from blend.config import HOME_ENV

        raise NativeBuildError(f"building the {spec.title} into {target.parent} failed ({err.strerror or err}); "
                               f"set {HOME_ENV} to a writable directory") from None


def _compile(cc: str, libgomp: str, target: Path, spec: KernelSpec = DECODE) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    _clear_leftovers(target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        obj, lib = Path(tmp) / "kernel.o", Path(tmp) / target.name
        # compiled with OpenMP, linked against torch's libgomp only (not the compiler's own)
        steps = ([cc, *COMPILE_FLAGS, "-c", str(spec.source), "-o", str(obj)],
                 [cc, "-shared", str(obj), libgomp, f"-Wl,-rpath,{Path(libgomp).parent}", "-o", str(lib)])
        for cmd in steps:
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except (OSError, subprocess.SubprocessError) as err:
                raise NativeBuildError(f"building the {spec.title} failed: {err}") from None
            if done.returncode:
                first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
                raise NativeBuildError(f"building the {spec.title} failed ({Path(cmd[0]).name} exit "
                                       f"{done.returncode}): {first}")
        data = lib.read_bytes()
        record = Path(tmp) / "digest"
        record.write_text(f"{hashlib.sha256(data).hexdigest()} {len(data)}\n")
        os.replace(lib, target)
        os.replace(record, _digest_path(target))


def _fresh_name(target: Path) -> Path:
    return target.with_name(f"{target.stem}-{uuid.uuid4().hex[:8]}.so")


def _open_new(target: Path) -> ctypes.CDLL:
    """`dlopen` the library just built at `target` through a new name (a link to it, removed
    once open). A process that has loaded a library from a path gets that same handle back
    for the path (the loader matches loaded objects by name), even after the file there was
    set aside and rebuilt: a library that did not load, or an earlier build, would answer
    instead of the rebuild."""
    alias = target.with_name(f".load-{uuid.uuid4().hex[:8]}-{target.name}")
    try:
        try:
            os.link(target, alias)
        except OSError:  # a file system without hard links
            shutil.copyfile(target, alias)
        return ctypes.CDLL(str(alias))
    finally:
        alias.unlink(missing_ok=True)


@cache
def _load(spec: KernelSpec = DECODE) -> ctypes.CDLL:
    """The built library of `spec` with its function's signature set (NativeBuildError when
    it can't be). A library that does not check (`check_library`) is set aside and built
    again; one that checks but does not load (not the kernel: a valid library without its
    functions) is set aside and built again once. A library this call built is opened
    under a new name (`_open_new`), so that the process runs the rebuild."""
    from storage.openmp import libgomp_paths

    cc, libgomp = _compiler(), _torch_libgomp()
    target = _library_path(cc, libgomp, spec)
    before = set(libgomp_paths())
    for attempt in range(2):
        problem = check_library(target)
        built = problem is not None
        if built:
            if problem != "missing":
                log.warning("rebuilding the %s: %s is %s", spec.title, target, problem)
                if not _set_aside(target):  # it stays: build under a fresh name
                    target = _fresh_name(target)
            _build(cc, libgomp, target, spec)
            log.info("built the native %s: %s", spec.title, target)
            problem = check_library(target)
            if problem is not None:
                raise NativeBuildError(f"the {spec.title} just built at {target} is {problem}")
        try:
            lib = _open_new(target) if built else ctypes.CDLL(str(target))
            fns = [(getattr(lib, name), argtypes) for name, argtypes in spec.functions]
            break
        except (OSError, AttributeError) as err:
            if attempt:
                raise NativeBuildError(f"loading {target} failed: {err}") from None
            log.warning("rebuilding the %s: %s does not load (%s)", spec.title, target, err)
            if not _set_aside(target):
                target = _fresh_name(target)
    if set(libgomp_paths()) - before:
        raise NativeBuildError(f"{target} brought a second OpenMP runtime; delete it and rebuild, or set "
                               "KVBLEND_DECODE_KERNEL=torch")
    for fn, argtypes in fns:
        fn.restype = ctypes.c_int
        fn.argtypes = list(argtypes)
    return lib


def _kernel(spec: KernelSpec) -> ctypes.CDLL | None:
    mode = kernel_mode()
    if mode == "torch":
        return None
    try:
        return _load(spec)
    except NativeBuildError as err:
        if mode == "native":
            raise NativeBuildError(f"{err} ({KERNEL_ENV}=native asks for the native kernel: fix the build, "
                                   f"or set {KERNEL_ENV}=auto to fall back to torch's)") from None
        what = {DECODE: "decode attention", BLEND: "blended attention"}.get(spec, "the linear layers")
        log.warning("%s run%s on torch's kernels: %s", what, "" if spec is QUANT else "s", err)
        return None


@cache
def prebuild() -> int:
    """Compile the kernels this machine has no build of yet side by side, once per process: a
    compile is a subprocess, and the three took 6.9 s one after another on 2 cores (AMD EPYC).
    Their loads stay with their first use, which then finds them built. Raises nothing: a build
    that fails here fails again, with its message, where its kernel is loaded. Returns how many
    were built."""
    import threading

    try:
        if kernel_mode() == "torch":
            return 0
        cc, libgomp = _compiler(), _torch_libgomp()
        todo = [(spec, _library_path(cc, libgomp, spec)) for spec in (DECODE, BLEND, QUANT)]
        todo = [(spec, target) for spec, target in todo if check_library(target) == "missing"]
    except (NativeBuildError, ValueError, OSError):  # (a bad KVBLEND_DECODE_KERNEL: said where it is read)
        return 0
    built: list[KernelSpec] = []

    def build(spec: KernelSpec, target: Path) -> None:
        try:
            _build(cc, libgomp, target, spec)
            built.append(spec)
        except Exception:  # noqa: BLE001 - said where the kernel is loaded (this thread prints nothing)
            pass

    threads = [threading.Thread(target=build, args=job, name="kvblend-kernel-build") for job in todo[1:]]
    for thread in threads:
        thread.start()
    if todo:
        build(*todo[0])
    for thread in threads:
        thread.join()
    return len(built)


@cache
def decode_kernel() -> ctypes.CDLL | None:
    """The native decode attention library, or None where `kernel_mode()` says torch or
    (auto) the build fails; `native` raises NativeBuildError instead. Built on first use."""
    return _kernel(DECODE)


@cache
def blend_kernel() -> ctypes.CDLL | None:
    """The native blended attention library (as `decode_kernel`)."""
    return _kernel(BLEND)


@cache
def quant_kernel() -> ctypes.CDLL | None:
    """The native quantized-product library (as `decode_kernel`)."""
    return _kernel(QUANT)


QUANT_PATHS = ("plain C", "AVX2 + FMA", "AVX-512", "AVX-512 VNNI")


def quant_kernel_path() -> str | None:
    """Which code path the quantized-product build runs here (`QUANT_PATHS`), None without one."""
    lib = quant_kernel()
    return QUANT_PATHS[lib.kvb_quant_path()] if lib is not None else None


def native_quant_matmul(x: torch.Tensor, segments: Sequence[tuple[int, int, torch.Tensor]], out: torch.Tensor,
                        bias: torch.Tensor | None = None) -> bool:
    """out = x W^T + bias by the native kernel, W the `segments` stacked along the outputs,
    each (GGML type id, outputs n, blocks (n, row bytes) uint8, rows contiguous) read as the
    GGUF stores them; False (nothing written) where it does not apply: no kernel, not a CPU,
    a dtype, type or shape it does not take.

    x (T, k) float32 or bfloat16, rows contiguous; out (T, sum n) in x's dtype, rows
    contiguous; bias (sum n,) float32 or None. k a multiple of 64 (of 256 with a K-quant).
    Each output row depends on its own x row only, bitwise, whatever T and the threads.
    """
    lib = quant_kernel()
    kind = KINDS.get(x.dtype)
    if lib is None or kind is None or x.dim() != 2 or out.dim() != 2 or not segments:
        return False
    rows, k = x.shape
    n = sum(seg[1] for seg in segments)
    if (rows < 1 or x.device.type != "cpu" or out.device.type != "cpu" or out.dtype != x.dtype
            or x.stride(1) != 1 or out.stride(1) != 1 or tuple(out.shape) != (rows, n)):
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or tuple(bias.shape) != (n,)):
        return False
    table = []
    for gtype, width, blocks in segments:
        if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[0] != width or blocks.stride(1) != 1
                or blocks.device.type != "cpu"):
            return False
        table += (gtype, width, blocks.data_ptr(), blocks.stride(0))
    segs = torch.tensor(table, dtype=torch.int64)  # (nseg, 4): the kernel's kvb_segment records
    return lib.kvb_quant_matmul(kind, rows, k, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                bias.data_ptr() if bias is not None else None, len(segments), segs.data_ptr()) == 0


def native_qpack(gtype: int, blocks: torch.Tensor, k: int) -> torch.Tensor | None:
    """The packed form (kernels/quant_matmul.c, "the packed layout") of n weight rows of GGML
    type `gtype` given as their blocks (n, row bytes) uint8: a flat uint8 tensor, or None where
    the kernel is off or does not take that type or width."""
    lib = quant_kernel()
    if lib is None or blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.stride(1) != 1:
        return None
    record = lib.kvb_qpack_record(gtype)
    n = blocks.shape[0]
    if record <= 0 or k % 64 or n < 1:
        return None
    packed = torch.empty((n + 15) // 16 * (k // 32) * record, dtype=torch.uint8)
    if lib.kvb_qpack(gtype, n, k, blocks.data_ptr(), blocks.stride(0), packed.data_ptr()) != 0:
        return None
    return packed


QPACK_NATIVE = "AVX-512 VNNI"
QPACK_AVX2 = "AVX2 + FMA"
QPACK_PATHS = {0: "plain C", 1: QPACK_NATIVE, 2: QPACK_AVX2}  # what kvb_qpack_path returns


def qpack_path() -> str | None:
    """Which path the packed products run here (`QPACK_PATHS`), None without a kernel."""
    lib = quant_kernel()
    return None if lib is None else QPACK_PATHS[lib.kvb_qpack_path()]


def qpack_native() -> bool:
    """Whether the packed products run vectorized here (AVX-512 VNNI or AVX2), not in plain C."""
    return qpack_path() in (QPACK_NATIVE, QPACK_AVX2)


def float32_reads_blocks() -> bool:
    """Whether `weights: auto` reads a GGUF's blocks for the decode rows of a model in the float32 that
    `dtype: auto` picks here: where the packed products run on AVX2 (a CPU without AVX-512, so without
    bfloat16 products), whose dense float32 weights are ~6x the bytes of Q4_1 blocks; prefill rows keep
    the dense weights. Elsewhere (and for a float32 asked for by name) float32 stays the dense reference."""
    return qpack_path() == QPACK_AVX2


def native_qpack_matmul(x: torch.Tensor, segments: Sequence[tuple[int, int, torch.Tensor]], out: torch.Tensor,
                        bias: torch.Tensor | None = None) -> bool:
    """`native_quant_matmul` from packed segments (GGML type id, outputs n, `native_qpack`'s
    tensor); False (nothing written) where it does not apply."""
    lib = quant_kernel()
    kind = KINDS.get(x.dtype)
    if lib is None or kind is None or x.dim() != 2 or out.dim() != 2 or not segments:
        return False
    rows, k = x.shape
    n = sum(seg[1] for seg in segments)
    if (rows < 1 or x.device.type != "cpu" or out.device.type != "cpu" or out.dtype != x.dtype
            or x.stride(1) != 1 or out.stride(1) != 1 or tuple(out.shape) != (rows, n)):
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous() or tuple(bias.shape) != (n,)):
        return False
    table = []
    for gtype, width, packed in segments:
        record = lib.kvb_qpack_record(gtype)
        if (record <= 0 or packed.dtype != torch.uint8 or not packed.is_contiguous() or packed.device.type != "cpu"
                or packed.numel() != (width + 15) // 16 * (k // 32) * record):
            return False
        table += (gtype, width, packed.data_ptr(), 0)
    segs = torch.tensor(table, dtype=torch.int64)
    return lib.kvb_qpack_matmul(kind, rows, k, x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                bias.data_ptr() if bias is not None else None, len(segments), segs.data_ptr()) == 0


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
    threads share every sequence's (head, block of 256 keys from its key 0) work items, so
    short contexts still keep both cores busy and the call costs one crossing, not one per
    sequence; a sequence's blocks are merged in key order, so its output is the same bits
    whatever other sequences share the call and however many threads run it. The sequences
    share the dtype and q's shape; each has its own keys. False (nothing written) where any
    of them is not something the kernel reads."""
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


def blend_kernel_name() -> str:
    """`native` or `torch`: which blended attention this process runs on a CPU."""
    return "native" if blend_kernel() is not None else "torch"


def blend_kernel_path(amx: bool | None = None) -> str | None:
    """The blend kernel's bfloat16 dot products in this process: `amx` (tiles: the CPU has them and
    Linux grants them), `avx512_bf16`, `avx2_fma` (float32 keys, AVX2 + FMA: a CPU without AVX-512), or
    `scalar` (float32 keys); None without the kernel.
    `amx` False turns the tiles off for this process (True back on, where there are any)."""
    lib = blend_kernel()
    if lib is None:
        return None
    return BLEND_PATHS[lib.kvb_blend_path(-1 if amx is None else int(amx))]


def native_blend_attention(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           bias: torch.Tensor | None, scale: float, window: int | None, out: torch.Tensor,
                           colsum: torch.Tensor | None = None) -> bool:
    """Exact attention of query rows at sorted positions by the native kernel, into `out`;
    False (nothing written) where it does not apply: no kernel, not a CPU, a dtype or
    layout it does not read.

    q (H, Tq, D) at host positions q_pos (Tq,) int64, sorted, unique, all < Tk; k, v (Hkv,
    Tk, D) hold positions 0..Tk-1, all three float32 or all bfloat16, rows contiguous (any
    head and row strides); bias (Hkv, Tk) float32 or None: added to every score of key j
    under KV head h (after `scale`); window: a query at p sees keys p - window + 1 .. p
    (None: 0 .. p). out (Tq, H*D) in q's dtype, rows contiguous. colsum (Hkv, Tk) float32,
    contiguous, or None: filled with each key's attention probabilities summed over the query
    rows and the query heads of its KV head.

    Batch-invariant: a row's output depends on its own query, position and keys only (key
    blocks of 64 and ranges of 512 at their multiples, merged in key order), not on the other
    rows in the call or the thread count; colsum is the same bits on any number of threads.
    """
    lib = blend_kernel()
    if lib is None:
        return False
    kind = KINDS.get(q.dtype)
    if kind is None or q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or out.dim() != 2:
        return False
    heads, tq, d = q.shape
    hkv, tk = k.shape[0], k.shape[1]
    if (heads % hkv or heads // hkv > BLEND_MAX_GROUP or d > MAX_HEAD_DIM or d % 2 or tq < 1 or tk < 1
            or tuple(v.shape) != (hkv, tk, d) or k.shape[2] != d or tuple(out.shape) != (tq, heads * d)
            or k.dtype != q.dtype or v.dtype != q.dtype or out.dtype != q.dtype
            or any(t.device.type != "cpu" for t in (q, k, v, out))
            or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or out.stride(1) != 1
            or q_pos.dtype != torch.int64 or q_pos.device.type != "cpu" or q_pos.numel() != tq
            or not q_pos.is_contiguous() or (window is not None and window < 1)):
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.device.type != "cpu" or bias.stride(1) != 1
                             or tuple(bias.shape) != (hkv, tk)):
        return False
    if colsum is not None and (colsum.dtype != torch.float32 or colsum.device.type != "cpu"
                               or not colsum.is_contiguous() or tuple(colsum.shape) != (hkv, tk)):
        return False
    done = lib.kvb_blend_attention(
        kind, hkv, heads // hkv, d, tq, tk, scale, window or 0, q_pos.data_ptr(),
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
        v.data_ptr(), v.stride(0), v.stride(1),
        bias.data_ptr() if bias is not None else None, bias.stride(0) if bias is not None else 0,
        out.data_ptr(), out.stride(0), colsum.data_ptr() if colsum is not None else None)
    return done == 0


def native_rotate_into(dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """dst (Hkv, T, D) = src (Hkv, T, D) rotated by the angles cos, sin ((T, D/2) float32, or (1, D/2)
    for every row), rotate-half layout, in float32 with each product and sum rounded as torch
    rounds them, then once into dst's dtype: the same bits as `Runner.rotate_into`'s torch
    formula, in one pass. src float32, bfloat16 or float16 (the stored dtype), dst float32 or
    bfloat16, rows contiguous. False (nothing written) where the kernel does not apply."""
    lib = blend_kernel()
    src_kind, dst_kind = ROTATION_SOURCES.get(src.dtype), KINDS.get(dst.dtype)
    if lib is None or src_kind is None or dst_kind is None or src.dim() != 3 or tuple(dst.shape) != tuple(src.shape):
        return False
    hkv, t, d = src.shape
    if (d % 2 or d > MAX_HEAD_DIM or src.device.type != "cpu" or dst.device.type != "cpu"
            or src.stride(2) != 1 or dst.stride(2) != 1
            or any(x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != d // 2
                   or x.stride(1) != 1 or x.shape[0] not in (1, t) for x in (cos, sin))
            or cos.shape[0] != sin.shape[0] or cos.stride(0) != sin.stride(0)):
        return False
    cs_row = cos.stride(0) if cos.shape[0] == t and t > 1 else 0
    return lib.kvb_rotate_into(src_kind, dst_kind, hkv, d, t, src.data_ptr(), src.stride(0), src.stride(1),
                               dst.data_ptr(), dst.stride(0), dst.stride(1), cos.data_ptr(), sin.data_ptr(),
                               cs_row) == 0


def native_decode_codes(bits: int, key_group: int, key_zero: bool, value_group: int, value_zero: bool,
                        kpart: torch.Tensor, vpart: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor) -> bool:
    """One stored layer in an integer codec (`storage.codec`: its bits, key groups of tokens, value
    groups of channels, asymmetric or not) decoded into k_out and v_out, float32 (H, T, D) contiguous:
    the same bits as `storage.codec.decode_into`, in one pass on the calling thread. kpart, vpart:
    the layer's K and V parts (uint8, contiguous). False (nothing written) where it does not apply,
    parts shorter than the codes and scales of (H, T, D) included (the torch decode then says why)."""
    lib = blend_kernel()
    if (lib is None or k_out.dtype != torch.float32 or v_out.dtype != torch.float32 or k_out.dim() != 3
            or tuple(v_out.shape) != tuple(k_out.shape) or not k_out.is_contiguous() or not v_out.is_contiguous()
            or any(x.dtype != torch.uint8 or not x.is_contiguous() or x.device.type != "cpu"
                   for x in (kpart, vpart)) or k_out.device.type != "cpu" or v_out.device.type != "cpu"
            or bits not in (4, 8) or key_group < 1 or value_group < 1):
        return False
    h, t, d = k_out.shape
    codes = (h * t * d * bits // 8 + 1) // 2 * 2  # storage.codec.codes_nbytes
    k_scales = 2 * h * -(-t // key_group) * d * (2 if key_zero else 1)
    v_scales = 2 * h * t * (d // value_group) * (2 if value_zero else 1)
    if kpart.numel() < codes + k_scales or vpart.numel() < codes + v_scales:
        return False
    return lib.kvb_decode_codes(bits, key_group, int(key_zero), value_group, int(value_zero), h, t, d,
                                kpart.data_ptr(), vpart.data_ptr(), k_out.data_ptr(), v_out.data_ptr()) == 0


def native_shift_rows(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """k[:, rows] += R(rows) dk and v[:, rows] += dv in place, rounded once (the stale rows'
    K/V offset): k, v (Hkv, T, D) float32 or bfloat16, rows contiguous; rows (R,) int64 host
    positions < T; dk, dv (Hkv, D) float32; cos, sin (R, D) float32, the rows' rotations.
    False (nothing changed) where the kernel does not apply."""
    lib = blend_kernel()
    kind = KINDS.get(k.dtype)
    if lib is None or kind is None or v.dtype != k.dtype or k.dim() != 3 or v.shape != k.shape:
        return False
    hkv, t, d = k.shape
    n = rows.numel()
    tensors = (k, v, rows, dk, dv, cos, sin)
    if (any(x.device.type != "cpu" for x in tensors) or k.stride(2) != 1 or v.stride(2) != 1 or d % 2
            or d > MAX_HEAD_DIM or rows.dtype != torch.int64 or not rows.is_contiguous()
            or any(x.dtype != torch.float32 or not x.is_contiguous() for x in (dk, dv, cos, sin))
            or tuple(dk.shape) != (hkv, d) or tuple(dv.shape) != (hkv, d)
            or tuple(cos.shape) != (n, d) or tuple(sin.shape) != (n, d)):
        return False
    if n and (int(rows.min()) < 0 or int(rows.max()) >= t):
        return False
    return lib.kvb_shift_rows(kind, hkv, d, n, rows.data_ptr(), k.data_ptr(), k.stride(0), k.stride(1),
                              v.data_ptr(), v.stride(0), v.stride(1), dk.data_ptr(), dv.data_ptr(),
                              cos.data_ptr(), sin.data_ptr()) == 0
