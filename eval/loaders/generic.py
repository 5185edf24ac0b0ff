"""kvblend's own flat layout: {"passages": [str, ...], "question", "answers", optional "id", "task"}.
Handy with `field_map` for any dataset that already has a list of passages per record."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eval.loaders.example import TASKS, Example, make_example, to_answers
from eval.loaders.shape import Shape, cell_text, missing, record_id, require, text_field

NAME = "kvblend passages"


def _matches(record: Mapping[str, Any]) -> bool:
    return "passages" in record and "question" in record


def _convert(record: Mapping[str, Any], default_id: str) -> Example | None:
    passages = require(record, "passages", NAME)
    if missing(passages):
        passages = []
    if isinstance(passages, str):
        passages = [passages]
    if not isinstance(passages, list | tuple):
        raise ValueError(f"a {NAME} record's 'passages' must be a list of texts (or one text), "
                         f"got {type(passages).__name__} {passages!r:.60}")
    task = record.get("task") or "qa"
    if task not in TASKS:
        raise ValueError(f"a {NAME} record's 'task' must be one of {', '.join(TASKS)}, got {task!r}")
    answers = record["answers"] if "answers" in record else record.get("answer")
    return make_example(
        record_id(record, default_id),
        [cell_text(p, f"a {NAME} record's 'passages' item") for p in passages],
        text_field(record, "question", NAME),
        to_answers(answers),
        task,
    )


SHAPE = Shape(name=NAME, fields=("passages", "question", "answers"), matches=_matches, convert=_convert)
