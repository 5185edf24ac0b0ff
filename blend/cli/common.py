"""What every `kvblend` subcommand shares: the --config and --json arguments, the JSON last
line, argument types that fail with a one-line message, reading document files.

Nothing here imports torch or pydantic: building the parser must stay fast.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from blend.modes import parse_ratio


def emit_json(obj: Any) -> None:
    """Print `obj` as one JSON line (the last line of stdout of a --json command): strict
    JSON, a non-finite number (an overflow, an undefined rate) is written as null."""
    sys.stdout.write(json.dumps(_finite(obj), default=_jsonable, allow_nan=False) + "\n")
    sys.stdout.flush()


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return _finite(value.to_dict())
    if hasattr(value, "tolist"):
        return _finite(value.tolist())
    if isinstance(value, set):
        return _finite(list(value))
    return str(value)


def human(args: argparse.Namespace) -> Callable[..., None]:
    """`print` for human-readable lines: to stdout, or to stderr under --json (whose stdout
    then holds only the JSON line)."""
    if getattr(args, "json", False):
        return lambda *a, **k: print(*a, **k, file=sys.stderr)
    return print


def config_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="FILE",
                   help="YAML config (default: $KVBLEND_CONFIG, else the built-in default: the shipped model, "
                        "CPU memory + a disk tier under $KVBLEND_HOME or ~/.cache/kvblend)")


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


def document_positions(path: str | None, config: Any) -> int | None:
    """The positions of `config`'s model, from its config file (no weights), for checks on document
    files before the model loads; a model that cannot be found fails here as its load would."""
    from blend.config import naming_config
    from blend.model.loading import model_positions

    with naming_config(path):
        return model_positions(config.model)


def open_engine(path: str | None, config: Any) -> Any:
    """A BlendEngine on `config`, loaded (and checked) from `path` beforehand, so that bad
    files fail before torch is imported; a setting found wrong only once the model or store
    is known names that file too (blend.config.naming_config)."""
    from blend.config import naming_config
    from blend.engine.engine import BlendEngine

    with naming_config(path):
        return BlendEngine(config)


def whole_number(text: str, minimum: int) -> int:
    """`text` as an int >= minimum; a one-line ValueError otherwise."""
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a whole number >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise ValueError(f"must be >= {minimum}, got {value}")
    return value


def positive_int(text: str) -> int:
    return whole_number(text, 1)


def non_negative_int(text: str) -> int:
    return whole_number(text, 0)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"expected a number > 0, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return value


def directory(text: str) -> str:
    """A directory to create if missing: not empty, and not an existing non-directory."""
    if not text.strip():
        raise ValueError("is empty; give a directory (created if missing)")
    if Path(text).expanduser().exists() and not Path(text).expanduser().is_dir():
        raise ValueError(f"{text!r} exists and is not a directory; give a directory (created if missing)")
    return str(Path(text).expanduser())


def csv_list(text: str, what: str) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise ValueError(f"{what} is empty; give a comma-separated list")
    return items


def positive_ints(text: str, what: str) -> list[int]:
    """A comma-separated list of whole numbers >= 1; errors name the flag `what`."""
    try:
        return [positive_int(v) for v in csv_list(text, what)]
    except ValueError as err:
        raise ValueError(f"{what}: {err}" if not str(err).startswith(what) else str(err)) from None


POSITIVE_INT = arg_type(positive_int)
NON_NEGATIVE_INT = arg_type(non_negative_int)
POSITIVE_FLOAT = arg_type(positive_float)
RATIO = arg_type(parse_ratio)


# no token covers this many bytes of text: a file larger than the model's positions times this
# cannot fit them (a cheap check on its size before it is read; the exact one counts its tokens)
MAX_BYTES_PER_POSITION = 256


def check_document_files(paths: list[str]) -> None:
    """FileNotFoundError naming the first path that is not an existing file (nothing is read)."""
    for p in paths:
        path = Path(p)
        if not path.is_file():
            problem = "is not a file" if path.exists() else "not found"
            raise FileNotFoundError(f"document {p!r} {problem}; pass existing text files")


def read_documents(paths: list[str], max_positions: int | None = None) -> list[str]:
    """The text of each file (UTF-8); ValueError/FileNotFoundError naming the file otherwise.
    With `max_positions` (the model's), a file over max_positions x MAX_BYTES_PER_POSITION bytes
    is refused on its size, before any file is read."""
    check_document_files(paths)
    for p in paths:
        path = Path(p)
        if max_positions is not None and (size := path.stat().st_size) > max_positions * MAX_BYTES_PER_POSITION:
            from storage.units import format_bytes

            raise ValueError(f"document {p!r} is {format_bytes(size)}: more text than the model's {max_positions} "
                             f"positions can hold (at most {format_bytes(max_positions * MAX_BYTES_PER_POSITION)} "
                             "at this size); split it into smaller documents")
    docs = []
    for p in paths:
        path = Path(p)
        try:
            docs.append(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(f"document {p!r} is not UTF-8 text (byte {err.start}); convert it to UTF-8") from None
        except OSError as err:
            raise ValueError(f"document {p!r} cannot be read ({err.strerror}); check its permissions") from None
    return docs


def confirm(question: str, yes: bool) -> bool:
    """True if `yes`, else ask on the terminal (True on y/yes). Without a terminal on stdin
    and without `yes`: ValueError (pass --yes)."""
    if yes:
        return True
    if not sys.stdin.isatty():
        raise ValueError(f"{question.rstrip('?')}: needs confirmation; pass --yes (stdin is not a terminal)")
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


EVAL_EXTRA = ("datasets", "rouge_score", "matplotlib")  # the packages of the `eval` extra (pyproject.toml)


def missing_extra_message(module: str) -> str:
    """The one-line fix for an optional package of the `eval` extra that is not installed."""
    return f"this command needs the optional package {module!r}: pip install 'kvblend[eval]'"


def require_eval_extra(*modules: str) -> None:
    """ValueError naming `pip install 'kvblend[eval]'` if one of `modules` is not installed
    (checked without importing it)."""
    import importlib.util

    for module in modules:
        if importlib.util.find_spec(module) is None:
            raise ValueError(missing_extra_message(module))


def check_out_dir(text: str | None, files: Sequence[str] = ()) -> None:
    """--out must name a directory, or a path whose nearest existing ancestor is a directory
    this user may write, and none of `files` (what the command writes there) may be a link
    or something other than a regular file. Checked before the model loads; nothing is
    created here."""
    if text is None:
        return
    if not text.strip():
        raise ValueError("--out is empty; name a directory for the results (created if missing)")
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {text!r} exists and is not a directory; name a directory (created if missing)")
    for name in files:
        target = path / name
        if target.is_symlink() or (target.exists() and not target.is_file()):
            kind = "a link" if target.is_symlink() else "not a regular file"
            raise ValueError(f"--out {text}: {name} is {kind}; remove it or pick another --out")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {text!r}: {str(parent)!r} is not a writable directory; pick another --out")
