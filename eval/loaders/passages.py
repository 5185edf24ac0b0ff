"""Splitting one long context into passages of roughly a target size, for sources that ship a
single context string (LongBench, long SAMSum dialogues) instead of a list of documents."""

from __future__ import annotations

import re

# ~500 SmolLM2 tokens of English prose; the CacheBlend paper's chunks are about this size.
DEFAULT_PASSAGE_CHARS = 2000

_PASSAGE_MARKER = re.compile(r"(?m)^\s*Passage\s+\d+\s*:\s*\n")
_BLANK_LINES = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def split_context(context: str, target_chars: int = DEFAULT_PASSAGE_CHARS) -> list[str]:
    """Split a context into passages.

    LongBench multi-document contexts mark documents with "Passage N:" lines: each marked
    document becomes one passage. Otherwise the context is split on blank lines and the pieces
    are packed greedily into passages of about `target_chars` characters.
    """
    if target_chars < 1:
        raise ValueError(f"target_chars must be >= 1, got {target_chars}")
    if _PASSAGE_MARKER.search(context):
        pieces = _PASSAGE_MARKER.split(context)
        return [p.strip() for p in pieces if p.strip()]
    return pack(_BLANK_LINES.split(context), target_chars)


def pack(pieces: list[str], target_chars: int = DEFAULT_PASSAGE_CHARS, joiner: str = "\n\n") -> list[str]:
    """Merge consecutive pieces into passages of at most about `target_chars` characters.

    A piece longer than twice the target is first cut at sentence ends (and, failing that,
    at whitespace), so no passage is far larger than the target. Empty pieces are dropped.
    """
    units: list[str] = []
    for piece in (p.strip() for p in pieces):
        if not piece:
            continue
        if len(piece) > 2 * target_chars:
            units.extend(_cut(piece, target_chars))
        else:
            units.append(piece)
    out: list[str] = []
    current = ""
    for unit in units:
        if current and len(current) + len(joiner) + len(unit) > target_chars:
            out.append(current)
            current = unit
        else:
            current = f"{current}{joiner}{unit}" if current else unit
    if current:
        out.append(current)
    return out


def _cut(text: str, target_chars: int) -> list[str]:
    """Cut an over-long piece at sentence ends, then at whitespace, into ~target-size parts."""
    parts: list[str] = []
    for sentence in _SENTENCE_END.split(text):
        if len(sentence) <= target_chars:
            parts.append(sentence)
            continue
        words = [w[i : i + target_chars] for w in sentence.split() for i in range(0, len(w), target_chars)]
        line = ""
        for word in words:
            if line and len(line) + 1 + len(word) > target_chars:
                parts.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        if line:
            parts.append(line)
    return pack(parts, target_chars, joiner=" ")
