"""OpenMP threads of the background threads (the store's writer, the layer loader).

torch's CPU build ships libgomp, which keeps one pool of worker threads per thread that
runs parallel work, alive as long as that thread. When the pools together hold more
threads than there are cores, libgomp stops letting idle workers spin between parallel
regions, in every pool: the scheduler's many small decode ops then wait on futex wake-ups.
Measured on this project's 2-core machine: a store writer encoding int8 / int4 entries
(torch ops) beside the scheduler made every blend request of a workload ~1.5x slower than
the same run with uncompressed tiers, and an engine built on the caller's thread made a
decode step 61 ms instead of 35.

`single_threaded()` makes the calling thread run its torch work on one OpenMP thread (no
pool of its own), without touching torch's process-wide thread count (which other threads
read when they first run parallel work). Where torch does not use libgomp it does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)


def libgomp_paths() -> list[str]:
    """The files of the libgomp copies loaded in this process, torch's own first (the one
    its ops run their parallel regions on); empty where none is loaded or /proc is absent."""
    import torch

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    home = str(Path(torch.__file__).parent)
    paths = {f.split()[-1] for f in maps.splitlines() if "libgomp" in f.rsplit("/", 1)[-1]}
    return sorted(paths, key=lambda p: (not p.startswith(home), p))


@cache
def _libgomp() -> ctypes.CDLL | None:
    """torch's own libgomp (the copy loaded from torch's directory; another loaded libgomp
    keeps its own settings), or None."""
    for path in libgomp_paths():
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def single_threaded() -> bool:
    """Run the calling thread's torch work on one OpenMP thread from here on (see the module
    docstring); True when it took effect. Call it at the start of a background thread."""
    import torch

    torch.get_num_threads()  # torch's per-thread set-up first: it would raise the count again later
    lib = _libgomp()
    if lib is None:
        return False
    try:
        lib.omp_set_num_threads(1)
    except AttributeError:
        return False
    log.debug("%s: torch runs on one OpenMP thread here", threading.current_thread().name)
    return True
