"""A generation request's parameters, checked at the API edge before any work is done.

`GenerationRequest.create` is the one place the engine's public methods (and through
them the CLI, eval and the HTTP server) turn caller arguments into a validated, frozen
request with the config's defaults filled in. Bad input is a TypeError (wrong type) or
a ValueError (bad value) naming the parameter and what is allowed; nothing is coerced:
True is not 1, 2.9 is not 2, nan is not a temperature.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from blend.config import BlendConfig, check_mode
from blend.modes import SELECTIONS, SPLIT_MODES
from blend.prompt.builder import PromptTemplate
from blend.prompt.conversation import Message, check_messages
from blend.prompt.document import Document, check_documents, clean_text

MAX_STOP_STRINGS = 16


def check_count(value: object, name: str) -> int:
    """A positive int (not a bool, not a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number >= 1, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def check_real(value: object, name: str) -> float:
    """A finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_fraction(value: object, name: str = "recompute_ratio") -> float:
    """A real number within [0, 1]."""
    value = check_real(value, name)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {value}")
    return value


def check_temperature(value: object) -> float:
    value = check_real(value, "temperature")
    if value < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {value}")
    return value


def check_top_p(value: object) -> float:
    value = check_real(value, "top_p")
    if not 0.0 < value <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {value}")
    return value


def check_seed(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"seed must be a whole number or None, got {value!r}")
    if not 0 <= value < 2**63:
        raise ValueError(f"seed must be within [0, 2**63), got {value}")
    return int(value)


def check_stop(value: object) -> tuple[str, ...]:
    """Stop strings: None, one str, or a list of non-empty str (at most MAX_STOP_STRINGS
    distinct ones; repeats are dropped, order kept)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if isinstance(items, bytes | dict) or not isinstance(items, Sequence):
        raise TypeError(f"stop must be a str or a list of str, got {type(value).__name__}")
    out = []
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a str, got {type(s).__name__}")
        if not s:
            raise ValueError(f"stop[{i}] is empty; stop strings must have at least one character")
        out.append(clean_text(s))
    unique = tuple(dict.fromkeys(out))
    if len(unique) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} distinct stop strings are supported, got {len(unique)}")
    return unique


def check_ingest_options(sync: object, stop: object) -> None:
    """An ingest's `sync` (a bool) and `stop` (None or a callable returning a bool): TypeError naming the fix."""
    if not isinstance(sync, bool):
        raise TypeError(f"sync must be a bool, got {type(sync).__name__}")
    if stop is not None and not callable(stop):
        raise TypeError(f"stop must be a callable returning a bool, got {type(stop).__name__}")


def check_query(query: object) -> str | tuple[Message, ...]:
    """A non-empty question (str) or a conversation (list of messages)."""
    if isinstance(query, str):
        if not query.strip():
            raise ValueError("empty query: pass a non-empty question")
        return query
    if isinstance(query, bytes):
        raise TypeError("query must be a str (decode the bytes first) or a list of messages")
    return check_messages(query)


def _token_ids(value: object) -> bool:
    """A non-empty sequence of ints >= 0 (not bools): token ids (their vocabulary is checked at layout)."""
    return (isinstance(value, Sequence) and not isinstance(value, str | bytes) and len(value) > 0
            and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in value))


class ChatOptions(TypedDict, total=False):
    """A chat turn's keyword arguments (`BlendEngine.chat`; None: the config's default, mode:
    blend)."""

    mode: str | None
    recompute_ratio: float | None
    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: str | Sequence[str] | None


class RequestOptions(TypedDict, total=False):
    """`generate`'s per-request keyword arguments, checked by `GenerationRequest.create` (None:
    the config's default; mode: blend)."""

    mode: str
    recompute_ratio: float | None
    max_new_tokens: int | None
    temperature: float | None
    top_p: float | None
    seed: int | None
    stop: str | Sequence[str] | None  # strings that end the text (not included)
    selection: str | None  # blend's token-selection policy (blend.modes.SELECTIONS)
    template: PromptTemplate | None  # this request's system instruction and query template
    split: str | None  # this request's load-or-compute split (blend.modes.SPLIT_MODES), e.g. "off"
    raw: bool  # the query is the whole prompt, as text or token ids (no template, no documents; full, prefix)


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request: what to answer, over which documents, how to decode; and two
    options of this request alone (eval compares modes under its own templates, unsplit):
    `template` (the system instruction and query template; None: the configured
    `engine.prompt` template) and `split` (the load-or-compute split, one of
    SPLIT_MODES; None: the configured `engine.blend.split`). `raw`: the query is the
    whole prompt, as an OpenAI-style /v1/completions takes it: text tokenized as it is
    (special tokens' strings are control tokens, nothing added) or token ids; no documents,
    and only the exact modes (full, prefix): there is nothing to blend."""

    query: str | tuple[Message, ...] | tuple[int, ...]  # a raw prompt: text or token ids
    documents: tuple[Document | str, ...]
    mode: str
    recompute_ratio: float
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    selection: str | None
    template: PromptTemplate | None = None
    split: str | None = None
    raw: bool = False

    @classmethod
    def create(cls, config: BlendConfig, query: object, documents: object = (), *, mode: object = "blend",
               recompute_ratio: object = None, max_new_tokens: object = None, temperature: object = None,
               top_p: object = None, seed: object = None, stop: object = None,
               selection: object = None, template: object = None, split: object = None,
               raw: object = False) -> GenerationRequest:
        """Check every argument (None: the config's default) and build the request."""
        if not isinstance(mode, str):
            raise TypeError(f"mode must be a str, got {type(mode).__name__}")
        check_mode(mode)
        if selection is not None:
            if not isinstance(selection, str):
                raise TypeError(f"selection must be a str or None, got {type(selection).__name__}")
            if selection not in SELECTIONS:
                raise ValueError(f"unknown selection {selection!r}; valid selections are: {', '.join(SELECTIONS)}")
        if template is not None and not isinstance(template, PromptTemplate):
            raise TypeError(f"template must be a blend.prompt.builder.PromptTemplate or None, "
                            f"got {type(template).__name__}")
        if split is not None and not isinstance(split, str):
            raise TypeError(f"split must be a str or None, got {type(split).__name__}")
        if split is not None and split not in SPLIT_MODES:
            raise ValueError(f"unknown split {split!r}; valid splits are: {', '.join(SPLIT_MODES)} (None: engine.blend.split)")
        if not isinstance(raw, bool):
            raise TypeError(f"raw must be a bool, got {type(raw).__name__}")
        if raw and not isinstance(query, str) and not _token_ids(query):
            raise TypeError("a raw prompt is one str (the whole prompt as text) or a non-empty list of token ids")
        if raw and documents:
            raise ValueError("a raw prompt holds its documents as text already; pass no documents")
        if raw and mode not in ("full", "prefix"):
            raise ValueError(f"a raw prompt has no documents to blend: use mode full or prefix, not {mode!r}")
        return cls(
            query=tuple(query) if raw and not isinstance(query, str) else check_query(query),
            documents=check_documents(documents),
            mode=mode,
            recompute_ratio=check_fraction(config.blend.recompute_ratio if recompute_ratio is None else recompute_ratio),
            max_new_tokens=check_count(config.generation.max_new_tokens if max_new_tokens is None else max_new_tokens,
                                       "max_new_tokens"),
            temperature=check_temperature(config.generation.temperature if temperature is None else temperature),
            top_p=check_top_p(config.generation.top_p if top_p is None else top_p),
            seed=check_seed(seed),
            stop=check_stop(stop),
            selection=selection,
            template=template,
            split=split,
            raw=raw,
        )
