"""Summarization records, task="summarization" with an empty question (the prompt template holds
the instruction) and the reference summary as the single answer:
  SAMSum    {"dialogue", "summary"}: the dialogue is one passage, or ~500-token pieces when long;
  MultiNews {"document", "summary"}: one passage per news article ("|||||"-separated)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from eval.loaders.example import Example, make_example, to_answers
from eval.loaders.passages import DEFAULT_PASSAGE_CHARS, pack
from eval.loaders.shape import Shape, record_id, require, text_field

SAMSUM = "SAMSum"
MULTINEWS = "MultiNews"
# The original release separates articles with "|||||"; some copies use a story tag instead.
_ARTICLE_SEPARATOR = re.compile(r"\|\|\|\|\||story_separator_special_tag")


def _convert_samsum(record: Mapping[str, Any], default_id: str) -> Example | None:
    dialogue = text_field(record, "dialogue", SAMSUM)
    lines = dialogue.replace("\r\n", "\n").split("\n")
    passages = pack(lines, DEFAULT_PASSAGE_CHARS, joiner="\n")
    return make_example(
        record_id(record, default_id), passages, "", to_answers(require(record, "summary", SAMSUM)), "summarization"
    )


def _convert_multinews(record: Mapping[str, Any], default_id: str) -> Example | None:
    document = text_field(record, "document", MULTINEWS)
    articles = [a.strip() for a in _ARTICLE_SEPARATOR.split(document)]
    return make_example(
        record_id(record, default_id),
        articles,
        "",
        to_answers(require(record, "summary", MULTINEWS)),
        "summarization",
    )


SAMSUM_SHAPE = Shape(
    name=SAMSUM,
    fields=("dialogue", "summary"),
    matches=lambda r: "dialogue" in r and "summary" in r,
    convert=_convert_samsum,
)
MULTINEWS_SHAPE = Shape(
    name=MULTINEWS,
    fields=("document", "summary"),
    matches=lambda r: "document" in r and "summary" in r,
    convert=_convert_multinews,
)
