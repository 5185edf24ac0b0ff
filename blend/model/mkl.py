"""MKL's conditional numerical reproducibility, strict: float32 products whose rows do not depend
on the rows beside them.

torch computes float32 products on a CPU with MKL's sgemm, which picks its kernel by the shape. On
a Xeon with AVX-512 and AMX (measured 2026-12-06, 2 cores) the rows of a product of fewer than
~130 rows came out with other bits than the same rows inside a larger product: SmolLM2's down
projection (1536 -> 576) at every row count from 1 to 128, the tiny test models' (128 -> 64) at
1 to 5; on an AMD EPYC only the rows past the last multiple of 4 below 12 did (`runner.rows4`
pads those). A decode row's or a prefill piece's float32 numbers would then depend on what shares
its step. MKL's strict CNR mode (`MKL_CBWR=AUTO,STRICT`: the CPU's own code branch, strict)
computes every row the same way whatever the row count: none differ at any count tried (1-79,
96, 128, 200 against 1,100 rows), at a cost of 0.02-0.12 ms a product of one row and -26% to +44%
at 1,024 rows (SmolLM2's shapes, 2 threads).

MKL reads `MKL_CBWR` at its first call, so importing `blend.model` sets it (unless the
environment already names a mode); `strict()` says whether MKL runs that way, and a runner in
float32 logs one line where it does not (a process that ran float32 products before importing
kvblend, or an environment that chose another mode).
"""

from __future__ import annotations

import ctypes
import logging
import os
from functools import cache

log = logging.getLogger(__name__)

MODE = "AUTO,STRICT"
_ALL = -1  # MKL_CBWR_ALL: the branch and the strict flag together
_STRICT = 0x10000  # MKL_CBWR_STRICT


def request() -> None:
    """Ask MKL for strict CNR at its first call (the environment's own choice kept)."""
    os.environ.setdefault("MKL_CBWR", MODE)


@cache
def _get():
    import torch

    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        return lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):  # another build of torch (no MKL, or MKL not exported)
        return None


def strict() -> bool | None:
    """Whether MKL computes in strict CNR mode (None where torch exposes no MKL to ask)."""
    get = _get()
    if get is None:
        return None
    return bool(get(_ALL) & _STRICT)


@cache
def warn_unless_strict() -> None:
    """One log line where MKL runs without strict CNR (float32 rows then may depend on their batch)."""
    if strict() is False:
        log.warning("MKL runs without strict reproducibility (MKL_CBWR=%s): float32 products' rows may depend "
                    "on the rows beside them; start the process with MKL_CBWR=%s, or import kvblend before "
                    "any float32 product runs", os.environ.get("MKL_CBWR", "unset"), MODE)
