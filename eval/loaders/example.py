"""The `Example` record that every loader returns: the passages whose KV caches are blended,
the question asked after them, and the gold answers used to score the generated text."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

Task = Literal["qa", "summarization"]
TASKS: tuple[str, ...] = ("qa", "summarization")


@dataclass(frozen=True)
class Example:
    """One evaluation item.

    `passages` are the documents in retrieval order (each becomes one reusable KV chunk);
    `answers` may be empty, in which case quality metrics are skipped for this item.
    For summarization `question` is usually empty and `answers` holds the reference summaries.
    """

    id: str
    passages: tuple[str, ...]
    question: str
    answers: tuple[str, ...]
    task: Task = "qa"

    @property
    def digest(self) -> str:
        """What the example asks, over what, expecting what: a resumed run compares it with
        the one recorded, so an example whose content changed is never taken as done."""
        body = json.dumps([self.task, self.question, list(self.answers), list(self.passages)], ensure_ascii=False)
        return hashlib.sha256(body.encode("utf-8")).hexdigest()[:32]

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"example {self.id!r}: task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if not isinstance(self.passages, tuple) or not all(isinstance(p, str) for p in self.passages):
            raise ValueError(f"example {self.id!r}: passages must be a tuple of strings; wrap a list in tuple(...)")
        if not self.passages:
            raise ValueError(f"example {self.id!r}: needs at least one passage; drop examples without passages")
        if not isinstance(self.answers, tuple) or not all(isinstance(a, str) for a in self.answers):
            raise ValueError(f"example {self.id!r}: answers must be a tuple of strings; wrap a list in tuple(...)")
        if not isinstance(self.question, str):
            raise ValueError(f"example {self.id!r}: question must be a string, got {type(self.question).__name__}")

    def first_passages(self, k: int) -> Example:
        """A copy keeping only the first `k` passages (k >= 1); does not modify `self`."""
        if k < 1:
            raise ValueError(f"--passages must be >= 1, got {k}")
        return replace(self, passages=self.passages[:k])


def to_answers(value: Any) -> tuple[str, ...]:
    """Gold answers as a tuple of non-empty strings: accepts a string, a list of strings, a
    SQuAD-style mapping {"text": [...]}, or None."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        if "text" not in value:
            raise ValueError(
                f"answers given as a mapping need a 'text' entry, got keys {', '.join(sorted(map(str, value)))}; "
                "map a list of answer strings with field_map={'answers': '<field>'}"
            )
        value = value["text"]
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Iterable):
        value = [value]
    answers = []
    for v in value:
        if v is None or (isinstance(v, float) and math.isnan(v)):  # a missing cell (CSV, Parquet)
            continue
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise ValueError(f"each answer must be a string or a number, got {type(v).__name__} {v!r:.60}; "
                             "flatten the answers into one list of strings")
        answers.append(str(v).strip())
    return tuple(a for a in answers if a)


def make_example(
    id: str, passages: Iterable[str], question: str, answers: tuple[str, ...], task: Task = "qa"
) -> Example | None:
    """Build an `Example`, or return None when no passage has any text, or a qa example has
    no question (the caller skips it)."""
    kept = tuple(p.strip() for p in passages if p and p.strip())
    question = (question or "").strip()
    if not kept or (task == "qa" and not question):
        return None
    return Example(id=str(id), passages=kept, question=question, answers=answers, task=task)
