"""What every `kvblend` subcommand shares: the JSON last line, the --config argument,
argument types that fail with a one-line message, reading document files.

Nothing here imports torch: building the parser must stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blend.config import DEFAULT_CONFIG


def emit_json(obj: Any) -> None:
    """Print `obj` as one JSON line (the last line of stdout of a --json command)."""
    sys.stdout.write(json.dumps(obj, default=_jsonable) + "\n")
    sys.stdout.flush()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)


def config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"YAML config (default: {DEFAULT_CONFIG})")


def json_arg(p: argparse.ArgumentParser, text: str = "print one JSON object as the last line of stdout") -> None:
    p.add_argument("--json", action="store_true", help=text)


def arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser raising ValueError (its message becomes the error)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = parse.__name__
    return convert


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1, got {value}")
    return value


def csv_list(text: str, what: str) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{what} is empty; give a comma-separated list")
    return items


def read_documents(paths: list[str]) -> list[str]:
    docs = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"document {p!r} not found; pass existing text files")
        docs.append(path.read_text(encoding="utf-8"))
    return docs
