"""`Shape`: one known record layout (CacheBlend JSON, LongBench, ...), how to recognise a record
of that layout and how to turn it into an `Example`. The dispatcher tries the shapes in order."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from eval.loaders.example import Example


@dataclass(frozen=True)
class Shape:
    """A record layout.

    `fields` names the fields a record must have (shown in errors); `matches` decides from one
    record whether the layout applies; `convert(record, default_id)` returns an `Example`, or None
    when the record has no passage text (the dispatcher skips and counts it).
    """

    name: str
    fields: tuple[str, ...]
    matches: Callable[[Mapping[str, Any]], bool]
    convert: Callable[[Mapping[str, Any], str], Example | None]


def require(record: Mapping[str, Any], field: str, shape: str) -> Any:
    """`record[field]`, or a ValueError naming the shape and the fields the record does have."""
    if field not in record:
        raise ValueError(
            f"a {shape} record needs the field {field!r}; this record has: {', '.join(sorted(map(str, record)))}"
        )
    return record[field]


def text_field(record: Mapping[str, Any], field: str, shape: str) -> str:
    """`record[field]` as text: a missing cell (None, NaN from CSV or Parquet) is "", a
    number its digits; anything else is a ValueError naming the field."""
    return cell_text(require(record, field, shape), f"a {shape} record's {field!r}")


def missing(value: Any) -> bool:
    """Whether `value` is a missing cell: None, or NaN (CSV / Parquet)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def cell_text(value: Any, what: str) -> str:
    """One cell as text: a missing cell is "", a number its digits, a str itself; a list,
    mapping or bool is a ValueError naming `what`."""
    if missing(value):
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValueError(f"{what} must be text, got {type(value).__name__} {value!r:.60}")
    return str(value)


def record_id(record: Mapping[str, Any], default_id: str) -> str:
    """The record's own id (`_id` or `id`) when it has one, else `default_id`."""
    for key in ("_id", "id"):
        value = record.get(key)
        if value is not None and str(value) != "":
            return str(value)
    return default_id
