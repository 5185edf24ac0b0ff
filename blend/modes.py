"""Request modes and the per-request knobs that every entry point (Python API, CLI, server,
eval) checks the same way: the mode name and the recompute ratio. Imports nothing heavy,
so the command-line parser can use it.
"""

from __future__ import annotations

import math
from typing import Any

MODES = ("full", "reuse", "prefix", "blend")
# blend's token-selection policies (blend.recompute.selector): a check-layer rule (the paper's), or query-driven
CHECK_LAYER_SELECTIONS = ("deviation", "attention", "hybrid")
QUERY_SELECTIONS = ("query",)
SELECTIONS = (*CHECK_LAYER_SELECTIONS, *QUERY_SELECTIONS)
DEVIATIONS = ("v", "k", "kv")  # which cached tensor's deviation ranks tokens
# the load-or-compute split (blend.planning.split): `engine.blend.split`, or one request's own
SPLIT_MODES = ("auto", "adaptive", "off")


def check_mode(mode: Any) -> str:
    """`mode` if it is one of MODES; ValueError listing them otherwise."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes are: {', '.join(MODES)}")
    return mode


def check_ratio(ratio: Any, what: str = "recompute ratio") -> float:
    """`ratio` as a float if it is a real number within [0, 1] (not a bool, not NaN);
    ValueError otherwise."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= float(ratio) <= 1.0:
        raise ValueError(f"{what} must be a number within [0, 1] such as 0.15, got {ratio!r}")
    return float(ratio)


def parse_ratio(text: str, what: str = "recompute ratio") -> float:
    """A ratio from text ("0.15"); ValueError as `check_ratio`."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what} must be a number within [0, 1] such as 0.15, got {text!r}") from None
    return check_ratio(value if math.isfinite(value) else text, what)
