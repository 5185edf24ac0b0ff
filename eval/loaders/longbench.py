"""LongBench-style JSONL: {"context", "input", "answers", optional "_id", "length", "dataset"}.
The single context string is split into passages ("Passage N:" markers, else blank lines packed
to ~500 tokens). Records of LongBench's summarization subsets get task="summarization"."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eval.loaders.example import Example, make_example, to_answers
from eval.loaders.passages import split_context
from eval.loaders.shape import Shape, record_id, require, text_field

NAME = "LongBench JSONL"
SUMMARIZATION_SUBSETS = frozenset({"gov_report", "qmsum", "multi_news", "vcsum", "samsum"})


def _matches(record: Mapping[str, Any]) -> bool:
    return isinstance(record.get("context"), str) and "input" in record


def _convert(record: Mapping[str, Any], default_id: str) -> Example | None:
    context = require(record, "context", NAME)
    dataset = str(record.get("dataset") or "")
    task = "summarization" if dataset.removesuffix("_e") in SUMMARIZATION_SUBSETS else "qa"
    return make_example(
        record_id(record, default_id),
        split_context(str(context or "")),
        text_field(record, "input", NAME),
        to_answers(record.get("answers")),
        task,
    )


SHAPE = Shape(name=NAME, fields=("context", "input", "answers"), matches=_matches, convert=_convert)
