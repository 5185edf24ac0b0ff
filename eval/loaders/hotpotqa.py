"""HotpotQA-style records: {"context", "question", "answer"} where context is a list of
[title, [sentence, ...]] pairs (the original JSON) or {"title": [...], "sentences": [[...]]}
(the Hugging Face form). Each titled paragraph becomes one passage: title, newline, sentences."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from eval.loaders.example import Example, make_example, to_answers
from eval.loaders.shape import Shape, record_id, require, text_field

NAME = "HotpotQA"


def _matches(record: Mapping[str, Any]) -> bool:
    return isinstance(record.get("context"), list | dict) and "question" in record


def _paragraphs(context: Any) -> list[tuple[str, list[str]]]:
    """(title, sentences) pairs from either context form."""
    if isinstance(context, Mapping):
        titles = context.get("title")
        sentences = context.get("sentences")
        if titles is None or sentences is None or len(titles) != len(sentences):
            raise ValueError(
                f"a {NAME} dict context needs equally long 'title' and 'sentences' lists; got keys "
                f"{', '.join(sorted(map(str, context)))}"
            )
        return [(str(t), list(s)) for t, s in zip(titles, sentences, strict=True)]
    pairs = []
    for item in context:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise ValueError(f"a {NAME} list context holds [title, [sentences...]] pairs, got {item!r:.80}")
        title, sentences = item
        pairs.append((str(title), [sentences] if isinstance(sentences, str) else list(sentences)))
    return pairs


def _convert(record: Mapping[str, Any], default_id: str) -> Example | None:
    passages = []
    for title, sentences in _paragraphs(require(record, "context", NAME)):
        body = " ".join(s.strip() for s in map(str, sentences) if s.strip())
        passages.append(f"{title.strip()}\n{body}" if title.strip() and body else body or title)
    answers = record["answer"] if "answer" in record else record.get("answers")
    return make_example(
        record_id(record, default_id), passages, text_field(record, "question", NAME), to_answers(answers)
    )


SHAPE = Shape(name=NAME, fields=("context", "question", "answer"), matches=_matches, convert=_convert)
