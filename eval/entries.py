"""The columns of an evaluation: which modes, recompute ratios and token selections run,
in which order, under which names. Parsing only: importing this module loads no torch."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from blend.config import MODES, check_ratio


@dataclass(frozen=True)
class Entry:
    """One column of the evaluation: a mode, and for blend its recompute ratio and token
    selection (None: the engine's configured one)."""

    name: str
    mode: str
    ratio: float | None = None
    selection: str | None = None


def entry_name(mode: str, ratio: float | None = None, selection: str | None = None) -> str:
    """"full", "reuse", "prefix", or "blend@<ratio>" with the ratio as Python prints it (0.15, 1.0),
    followed by ":<selection>" when the entry names its selection."""
    if mode != "blend":
        return mode
    return f"blend@{float(ratio)}" + (f":{selection}" if selection else "")


def _parse_names(text: str | Sequence[str], valid: Sequence[str], what: str) -> tuple[str, ...]:
    """Distinct names from "a,b" (or a list), in order; ValueError listing the valid ones."""
    items = [m.strip() for m in (text.split(",") if isinstance(text, str) else text)]
    items = [m for m in items if m]
    if not items:
        raise ValueError(f"no {what}s given; choose from: {', '.join(valid)}")
    unknown = [m for m in items if m not in valid]
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(map(repr, unknown))}; valid {what}s are: {', '.join(valid)}")
    return tuple(dict.fromkeys(items))


def parse_modes(text: str | Sequence[str]) -> tuple[str, ...]:
    """Modes from "full,reuse,blend" (or a list); ValueError listing the valid modes."""
    return _parse_names(text, MODES, "mode")


def parse_ratios(text: str | Iterable[float]) -> tuple[float, ...]:
    """Recompute ratios from "0.05,0.15" (or numbers), each within [0, 1]; ValueError otherwise."""
    items = [r.strip() for r in text.split(",")] if isinstance(text, str) else list(text)
    ratios = []
    for item in items:
        if item == "":
            continue
        try:
            value = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"recompute ratio {item!r} is not a number; give fractions such as 0.05,0.15,0.3") from None
        if math.isnan(value):
            raise ValueError("recompute ratio nan is not a number; give fractions such as 0.05,0.15,0.3")
        ratios.append(check_ratio(value))
    if not ratios:
        raise ValueError("no recompute ratios given; give fractions such as 0.05,0.15,0.3")
    return tuple(dict.fromkeys(ratios))


def parse_selections(text: str | Sequence[str]) -> tuple[str, ...]:
    """Selection policies from "deviation,hybrid" (or a list); ValueError listing the valid ones."""
    from blend.modes import SELECTIONS  # the policy names (no torch)

    return _parse_names(text, SELECTIONS, "selection")


def plan_entries(modes: Sequence[str], ratios: Sequence[float],
                 selections: Sequence[str] | None = None) -> tuple[Entry, ...]:
    """The entries of a run in execution order: full first (always run, as the reference),
    then the other modes in the order given, blend once per ratio and selection (with no
    selections given, blend uses the engine's configured one and its name omits it)."""
    modes = parse_modes(modes)
    ratios = parse_ratios(ratios)
    chosen: tuple[str | None, ...] = parse_selections(selections) if selections else (None,)
    entries = [Entry("full", "full")]
    for mode in modes:
        if mode == "blend":
            entries.extend(Entry(entry_name("blend", r, s), "blend", r, s) for r in ratios for s in chosen)
        elif mode != "full":
            entries.append(Entry(mode, mode))
    return tuple(entries)
