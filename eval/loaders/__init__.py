"""Loaders for evaluation sets: every source becomes a list of `Example`.

`load_examples` reads a local file (JSON, JSONL, Parquet, CSV) or, for a name that is not an
existing path, a Hugging Face dataset; it detects the record layout from the fields present:

    CacheBlend JSON   ctxs, question, answers        (cacheblend.py; also eval/synthetic.py)
    kvblend passages  passages, question, answers    (generic.py)
    LongBench JSONL   context (string), input, answers (longbench.py)
    HotpotQA          context (list/dict), question, answer (hotpotqa.py)
    SAMSum            dialogue, summary              (summarization.py)
    MultiNews         document, summary              (summarization.py)

`field_map` renames source fields to these names first, e.g. {"question": "query"}.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from eval.loaders import cacheblend, generic, hotpotqa, longbench, summarization
from eval.loaders.example import TASKS, Example, Task, make_example, to_answers
from eval.loaders.files import read_records
from eval.loaders.hub import load_hub_records
from eval.loaders.passages import DEFAULT_PASSAGE_CHARS, pack, split_context
from eval.loaders.shape import Shape

__all__ = [
    "DEFAULT_PASSAGE_CHARS",
    "SHAPES",
    "TASKS",
    "Example",
    "Shape",
    "Task",
    "detect_shape",
    "examples_from_records",
    "load_examples",
    "load_hub_records",
    "make_example",
    "pack",
    "read_records",
    "split_context",
    "to_answers",
]

log = logging.getLogger(__name__)

# Order matters only where layouts share fields: the list/dict vs string `context` of HotpotQA
# and LongBench is told apart by type, so the order below is also the order shown in errors.
SHAPES: tuple[Shape, ...] = (
    cacheblend.SHAPE,
    generic.SHAPE,
    longbench.SHAPE,
    hotpotqa.SHAPE,
    summarization.SAMSUM_SHAPE,
    summarization.MULTINEWS_SHAPE,
)


def load_examples(
    path_or_name: str | Path,
    *,
    split: str | None = None,
    limit: int | None = None,
    passages: int | None = None,
    field_map: Mapping[str, str] | None = None,
    data_files: str | list[str] | dict[str, Any] | None = None,
) -> list[Example]:
    """Load evaluation examples from a local file or a Hugging Face dataset.

    path_or_name: an existing file, else a dataset name for `datasets.load_dataset`
        (optionally "name:config"; a builder such as "json" together with `data_files`).
    split: the split of a dataset, or of a JSON mapping {split: [records]}.
    limit: keep the first `limit` usable examples (>= 1).
    passages: keep the first K passages of each example (>= 1; the CacheBlend paper uses 6).
    field_map: {our field: source field}, applied to every record before layout detection.
    data_files: passed to `datasets.load_dataset` (dataset names only).

    Examples without any passage text, and qa examples without a question, are skipped
    with one logged warning giving their count.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if passages is not None and passages < 1:
        raise ValueError(f"--passages must be >= 1, got {passages}")
    path = Path(path_or_name)
    if path.is_dir():
        raise ValueError(f"{path} is a directory; pass one JSON, JSONL, Parquet or CSV file inside it")
    if path.is_file():
        if data_files is not None:
            raise ValueError("data_files applies to dataset names only; pass the file itself as path_or_name")
        records = read_records(path, split)
        source = str(path)
    else:
        if Path(path_or_name).suffix.lower() in {".json", ".jsonl", ".parquet", ".csv"}:
            raise FileNotFoundError(f"{path_or_name}: no such file; check the path (relative to {Path.cwd()})")
        records = load_hub_records(str(path_or_name), split=split, data_files=data_files)
        source = f"dataset {str(path_or_name)!r}"
    return examples_from_records(records, source=source, limit=limit, passages=passages, field_map=field_map)


def examples_from_records(
    records: Iterable[Mapping[str, Any]],
    *,
    source: str = "records",
    limit: int | None = None,
    passages: int | None = None,
    field_map: Mapping[str, str] | None = None,
) -> list[Example]:
    """Convert already-read records (all of one layout) into examples; see `load_examples`."""
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    if passages is not None and passages < 1:
        raise ValueError(f"--passages must be >= 1, got {passages}")
    stem = Path(source).stem if not source.startswith("dataset ") else "example"
    out: list[Example] = []
    skipped: list[str] = []
    shape: Shape | None = None
    for index, raw in enumerate(records):
        record = _rename(raw, field_map, source, index) if field_map else raw
        if shape is None:
            shape = detect_shape(record, source)
        default_id = f"{stem}-{index}"
        try:
            example = shape.convert(record, default_id)
        except ValueError as exc:
            raise ValueError(f"{source}, record {index} ({shape.name}): {exc}") from None
        if example is None:
            skipped.append(default_id)
            continue
        out.append(example.first_passages(passages) if passages is not None else example)
        if limit is not None and len(out) >= limit:
            break
    if skipped:
        log.warning(
            "%s: skipped %d example(s) without passage text or (qa) without a question (first: %s)",
            source, len(skipped), ", ".join(skipped[:5]),
        )
    if shape is None:
        raise ValueError(f"{source}: holds no records; give a file with at least one example")
    return out


def detect_shape(record: Mapping[str, Any], source: str = "records") -> Shape:
    """The first known layout that `record` matches, else a ValueError listing the fields found
    and the fields each layout expects."""
    for shape in SHAPES:
        if shape.matches(record):
            return shape
    expected = "; ".join(f"{s.name}: {', '.join(s.fields)}" for s in SHAPES)
    raise ValueError(
        f"{source}: cannot tell the layout of its records; found fields {', '.join(sorted(map(str, record)))}. "
        f"Known layouts expect — {expected}. Rename fields with field_map={{'question': '<your field>', ...}} "
        "(--field-map question=<your field>)"
    )


def _rename(record: Mapping[str, Any], field_map: Mapping[str, str], source: str, index: int) -> dict[str, Any]:
    """A copy of `record` with each source field of `field_map` renamed to our field."""
    missing = [src for src in field_map.values() if src not in record]
    if missing:
        raise ValueError(
            f"{source}, record {index}: field_map names field(s) {', '.join(map(repr, missing))} that the record "
            f"lacks; it has: {', '.join(sorted(map(str, record)))}"
        )
    sources = set(field_map.values())
    renamed = {k: v for k, v in record.items() if k not in sources}
    for ours, theirs in field_map.items():
        renamed[ours] = record[theirs]
    return renamed
