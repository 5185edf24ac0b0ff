"""Reading the records of a local evaluation file: JSON (a list, or a mapping of split name to
list), JSON Lines, and — through the `datasets` library — Parquet and CSV. Returns plain dicts;
which layout the records have is decided by the dispatcher."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

_DATASETS_BUILDERS = {".parquet": "parquet", ".csv": "csv"}
# CSV cells are text as written ("NA" is an answer, not a missing value; an empty cell is
# ""), and a row with more fields than the header is an error, not shifted into an index
_READER_OPTIONS = {".csv": {"keep_default_na": False, "index_col": False}}


def read_records(path: str | Path, split: str | None = None) -> list[dict[str, Any]]:
    """All records of the file at `path` as dicts. Does not modify the file.

    `split` picks one list out of a JSON mapping such as {"train": [...], "test": [...]}; a
    split that the file does not have, or any split for a file without splits (a plain list,
    JSON Lines, CSV, Parquet), is a ValueError.
    """
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix in _DATASETS_BUILDERS:
        if split is not None:
            raise ValueError(_no_splits(p, split))
        import datasets  # deferred: importing datasets costs about a second

        try:
            table = datasets.load_dataset(_DATASETS_BUILDERS[suffix], data_files=str(p), split="train",
                                          **_READER_OPTIONS.get(suffix, {}))
        except Exception as err:  # datasets wraps the reader's error (e.g. pandas' EmptyDataError) in its own
            cause = err.__cause__ or err
            reason = " ".join(str(cause).split()) or type(cause).__name__
            raise ValueError(f"{p}: cannot be read as {p.suffix.lower()[1:]} ({reason}); give a file with a header "
                             "row and one example per row") from None
        return table.to_list()
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark is not part of the JSON
    except UnicodeDecodeError:
        raise ValueError(f"{p}: not UTF-8 text; give a JSON list or JSON Lines file of examples, or a .parquet "
                         "/ .csv file") from None
    stripped = text.lstrip()
    if not stripped:
        raise ValueError(f"{p}: the file is empty; give a JSON list or JSON Lines file of examples")
    if p.suffix.lower() == ".jsonl" or not stripped.startswith(("[", "{")):
        return _jsonl_without_split(text, p, split)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if stripped.startswith("{"):  # a file whose first record is an object may be JSON Lines named .json
            return _jsonl_without_split(text, p, split)
        raise ValueError(f"{p}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}); the file starts a JSON list: "
                         "complete or repair it (a truncated copy?), or give JSON Lines, one object per line") from None
    except RecursionError:
        raise ValueError(f"{p}: JSON nested too deeply to read; give a list of flat example records") from None
    return _records_of(data, p, split)


def _no_splits(p: Path, split: str) -> str:
    return f"{p}: --split {split!r}: this file has no splits (it is one list of examples); leave --split out"


def _jsonl_without_split(text: str, p: Path, split: str | None) -> list[dict[str, Any]]:
    if split is not None:
        raise ValueError(_no_splits(p, split))
    return _jsonl(text, p)


def _jsonl(text: str, p: Path) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{p}:{number}: not valid JSON ({exc.msg}); JSON Lines needs one object per line") from None
        except RecursionError:
            raise ValueError(f"{p}:{number}: JSON nested too deeply to read; give one flat object per line") from None
        if not isinstance(record, dict):
            raise ValueError(f"{p}:{number}: expected a JSON object per line, got {type(record).__name__}")
        records.append(record)
    return records


def _records_of(data: Any, p: Path, split: str | None) -> list[dict[str, Any]]:
    if isinstance(data, list) and split is not None:
        raise ValueError(_no_splits(p, split))
    if isinstance(data, dict):
        lists = {k: v for k, v in data.items() if isinstance(v, list)}
        splits = bool(lists) and len(lists) == len(data)  # a mapping of split name -> examples
        if split is not None and split in lists:
            data = lists[split]
        elif split is not None and splits:
            raise ValueError(f"{p}: has no split {split!r}; its splits are {', '.join(lists)} (--split)")
        elif split is None and splits and len(lists) == 1:
            data = next(iter(lists.values()))
        elif splits:
            raise ValueError(
                f"{p}: holds several splits ({', '.join(lists)}); choose one with split=... (--split)"
            )
        elif split is not None:
            raise ValueError(_no_splits(p, split))
        else:
            data = [data]  # a single example
    if not isinstance(data, list):
        raise ValueError(f"{p}: expected a JSON list of example objects, got {type(data).__name__}")
    bad = next((i for i, r in enumerate(data) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"{p}: record {bad} is a {type(data[bad]).__name__}; every record must be a JSON object")
    return data
