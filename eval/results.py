"""The resumable results file of an evaluation run: `results.jsonl` in the output directory.

Line 1 is a settings header, every further line one finished example (all its modes):

    {"record": "settings", "version": 1, "settings": {...}}
    {"record": "example", "id": "...", "task": "qa", "entries": {"full": {...}, "blend@0.15": {...}}}

An example is written only once all its modes are done, and each line is flushed, so a run
killed at any point loses at most the example in flight. Reopening the file with the same
settings returns the finished examples (a rerun skips them); different settings raise a
ValueError naming the differences, so results of different runs are never mixed.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

log = logging.getLogger(__name__)

FILENAME = "results.jsonl"
VERSION = 1
SUMMARY_JSON, SUMMARY_MD, QUALITY_PLOT, KL_PLOT = REPORT_FILES = (
    "summary.json", "summary.md", "quality_vs_ttft.png", "kl_vs_ttft.png")  # what eval.report writes


def write_file(path: str | Path, data: str | bytes) -> None:
    """Write a report file whole or not at all: into a fresh temp file next to it (created
    exclusively, no link followed), then renamed over `path`. A run killed mid-write leaves
    the previous file or none, never a half-written one."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_figure(fig: Any, path: str | Path, **savefig: Any) -> None:
    """`fig.savefig` through `write_file` (the format from the path's suffix)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix.lstrip(".") or "png", **savefig)
    write_file(path, buffer.getvalue())


def check_output_files(directory: str | Path) -> None:
    """ValueError naming the fix when a file eval writes in `directory` is a link or not a
    regular file (it would be written through, or fail only after the run)."""
    for name in (FILENAME, *REPORT_FILES):
        path = Path(directory) / name
        if path.is_symlink() or (path.exists() and not path.is_file()):
            kind = "a link" if path.is_symlink() else "not a regular file"
            raise ValueError(f"--out {directory}: {name} is {kind}; remove it or pick another --out")


def jsonable(value: Any) -> Any:
    """`value` with non-finite floats as None and tuples as lists (strict JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


class ResultsLog:
    """Append-only results file bound to one set of run settings.

    `done` maps example id -> its stored record. Use `open` to create or resume a file.
    """

    def __init__(self, path: Path, settings: Mapping[str, Any], done: dict[str, dict[str, Any]], fh: IO[str]):
        self.path = path
        self.settings = dict(settings)
        self.done = done
        self._fh = fh

    @classmethod
    def open(cls, out_dir: str | Path, settings: Mapping[str, Any]) -> ResultsLog:
        """Open `out_dir`/results.jsonl for appending, creating the directory and the header.

        Side effects: creates the directory; writes the header to a new file; cuts off a
        trailing partial line left by a killed run. Raises ValueError when the file was
        written with other settings.
        """
        directory = Path(out_dir)
        if directory.exists() and not directory.is_dir():
            raise ValueError(f"--out {directory} is a file; give a directory for the results")
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"--out {directory}: cannot create it ({err.strerror or err}); pick another --out") from None
        check_output_files(directory)
        path = directory / FILENAME
        wanted = jsonable(settings)
        done: dict[str, dict[str, Any]] = {}
        if path.is_file() and path.stat().st_size > 0:
            stored, done = _read(path)
            _check_same(path, stored, wanted)
            fh = path.open("a", encoding="utf-8")
        else:
            fh = path.open("w", encoding="utf-8")
            fh.write(json.dumps({"record": "settings", "version": VERSION, "settings": wanted}) + "\n")
            fh.flush()
        return cls(path, wanted, done, fh)

    def append(self, record: Mapping[str, Any]) -> None:
        """Write one finished example (a mapping with an "id") and flush it to the file."""
        line = dict(jsonable(record))
        line = {"record": "example", **line}
        self._fh.write(json.dumps(line) + "\n")
        self._fh.flush()
        self.done[str(line["id"])] = line

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> ResultsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_results(path: str | Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(settings, {id: example record}) of a results file; does not modify it."""
    return _read(Path(path), repair=False)


def _read(path: Path, repair: bool = True) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    complete = lines[:-1]  # everything up to the last newline
    tail = lines[-1]
    settings: dict[str, Any] | None = None
    done: dict[str, dict[str, Any]] = {}
    for number, line in enumerate(complete, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            why = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise ValueError(f"{path}:{number}: not valid JSON ({why}); delete the file to start over") from None
        kind = record.get("record") if isinstance(record, dict) else None
        if number == 1:
            if kind != "settings":
                raise ValueError(f"{path}: does not start with a kvblend eval settings line; pick another --out")
            if record.get("version") != VERSION:
                raise ValueError(f"{path}: results format version {record.get('version')} is not {VERSION}; "
                                 "pick another --out")
            settings = record.get("settings")
            if not isinstance(settings, dict):
                raise ValueError(f"{path}:1: the settings line holds no settings mapping; delete the file to start over")
        elif kind == "example":
            _check_example(record, path, number)
            done[str(record["id"])] = record
        else:
            raise ValueError(f"{path}:{number}: unknown record {kind!r}; delete the file to start over")
    if settings is None:
        raise ValueError(f"{path}: has no settings line; delete the file to start over")
    if tail.strip():  # only now that the file is known to be ours: never cut a file we did not write
        # a line without its newline: the run was killed while writing it
        log.warning("%s: dropping a partial last line left by an interrupted run", path)
        if repair:
            with path.open("r+b") as fh:
                fh.truncate(len(raw) - len(tail))
    return settings, done


# an entry's metrics, averaged by eval.runner.summarize; with the other fields it reads as numbers
METRICS = ("f1", "em", "rouge_l", "kl_to_full", "answer_kl", "top1_agree", "greedy_match", "answer_nll", "ttft_s",
           "recomputed_fraction")
NUMBER_FIELDS = (*METRICS, "chunk_hit_rate", "exposed_load_s", "selection_s", "load_s")


def _check_example(record: Mapping[str, Any], path: Path, number: int) -> None:
    """An example line as the runner writes it: an id, and per entry a mapping whose metric
    fields are numbers or null; ValueError naming the line otherwise."""
    def bad(what: str) -> ValueError:
        return ValueError(f"{path}:{number}: {what}; delete the file (or that line) to start over")

    if not isinstance(record.get("id"), str | int) or isinstance(record.get("id"), bool):
        raise bad("an example line without a string or integer id")
    entries = record.get("entries")
    if not isinstance(entries, dict) or not all(isinstance(row, dict) for row in entries.values()):
        raise bad("an example line without a mapping of entries")
    for name, row in entries.items():
        for field in NUMBER_FIELDS:
            value = row.get(field)
            if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)):
                raise bad(f"entry {name!r} has {field} {json.dumps(value)[:40]}, not a number")


def _check_same(path: Path, stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> None:
    diffs = [
        f"{key}: {json.dumps(stored.get(key))} in the file, {json.dumps(wanted.get(key))} now"
        for key in sorted(set(stored) | set(wanted))
        if stored.get(key) != wanted.get(key)
    ]
    if diffs:
        raise ValueError(
            f"{path} holds results of a run with different settings ({'; '.join(diffs)}). Rerun with the "
            "same settings to resume it, or pass another --out (or delete the file) to start a new run"
        )
