"""What this machine's CPU has: its feature flags as the kernel reports them (a leaf module:
the loader's dtype policy and the native kernels' build key both read it)."""

from __future__ import annotations

from pathlib import Path

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of CPUs that compute bfloat16 natively


def cpu_flags(path: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags the kernel reports for the first CPU (Linux); empty where the file
    is missing or unreadable (another OS)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()
