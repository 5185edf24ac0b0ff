"""CacheBlend-style JSON: a list of {"ctxs": [{"title", "text"}], "question", "answers"}, the layout
of the MuSiQue and 2WikiMQA subsets used in the CacheBlend paper (and of our synthetic set).
Each ctx becomes one passage: its title, a newline, its text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eval.loaders.example import Example, make_example, to_answers
from eval.loaders.shape import Shape, cell_text, record_id, require, text_field

NAME = "CacheBlend JSON"


def _matches(record: Mapping[str, Any]) -> bool:
    return "ctxs" in record and "question" in record


def passage_text(ctx: Any) -> str:
    """One ctx as passage text: "title\\ntext" (or just the text when there is no title)."""
    if isinstance(ctx, str):
        return ctx
    if not isinstance(ctx, Mapping):
        raise ValueError(f"a {NAME} ctx must be a mapping with 'title' and 'text', got {type(ctx).__name__}")
    title = cell_text(ctx.get("title"), f"a {NAME} ctx's 'title'").strip()
    text = cell_text(ctx.get("text"), f"a {NAME} ctx's 'text'").strip()
    return f"{title}\n{text}" if title and text else (text or title)


def _convert(record: Mapping[str, Any], default_id: str) -> Example | None:
    ctxs = require(record, "ctxs", NAME) or []
    if not isinstance(ctxs, list | tuple):
        raise ValueError(f"a {NAME} record's 'ctxs' must be a list of {{'title', 'text'}}, got {type(ctxs).__name__}")
    answers = record["answers"] if "answers" in record else record.get("answer")
    return make_example(
        record_id(record, default_id),
        [passage_text(c) for c in ctxs],
        text_field(record, "question", NAME),
        to_answers(answers),
    )


SHAPE = Shape(name=NAME, fields=("ctxs", "question", "answers"), matches=_matches, convert=_convert)
