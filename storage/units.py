"""Byte sizes: parsing "2GiB" / "16KiB" / 4096 from configs and flags, and formatting
sizes and rates for messages. The one home of both."""

from __future__ import annotations

import re

KIB, MIB, GIB, TIB = 1024, 1024**2, 1024**3, 1024**4

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
}


def parse_bytes(value: int | str, what: str = "size") -> int:
    """Parse a byte size: an int, or a string such as "4096", "16KiB", "1.5GiB", "10MB".

    Raises ValueError naming the accepted forms, prefixed with `what: ` unless `what` is empty.
    """
    where = f"{what}: " if what else ""
    if isinstance(value, bool):
        raise ValueError(f"{where}expected a byte size such as 4096, '16KiB' or '2GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{where}a byte size must be >= 0, got {value}")
        return value
    if isinstance(value, float) and value.is_integer():
        return parse_bytes(int(value), what)
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            number, unit = m.group(1), (m.group(2) or "").lower()
            if unit in _UNITS:
                return int(float(number) * _UNITS[unit])
    raise ValueError(
        f"{where}cannot parse {value!r} as a byte size; use an integer number of bytes "
        "or a number with a unit: B, KB, KiB, MB, MiB, GB, GiB, TB, TiB (e.g. '16KiB', '2GiB')"
    )


def format_bytes(n: float, sep: str = "") -> str:
    """A byte count for people: 12582912 -> '12MiB', 11.3 MiB -> '11.3MiB' (4 significant
    digits); `sep=" "` gives '12 MiB'."""
    for unit, size in (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.4g}{sep}{unit}"
    return f"{n:.4g}{sep}B"


def format_rate(bytes_per_s: float) -> str:
    """A transfer rate in MiB/s or GiB/s, e.g. '450 MiB/s'."""
    return f"{bytes_per_s / GIB:.4g} GiB/s" if bytes_per_s >= GIB else f"{bytes_per_s / MIB:.4g} MiB/s"
