"""The sample documents and questions shipped with kvblend (eval/data/samples): the demo's
corpus and the benchmarks' text."""

from __future__ import annotations

import json
from pathlib import Path

SAMPLES = Path(__file__).resolve().parent / "data" / "samples"


def sample_documents() -> list[tuple[str, str]]:
    """(file name, text) of the shipped sample documents, in order."""
    files = sorted(SAMPLES.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no sample documents in {SAMPLES}; reinstall kvblend")
    return [(f.name, f.read_text(encoding="utf-8")) for f in files]


def sample_questions() -> list[dict]:
    """[{"question", "answers"}] about the sample documents."""
    return json.loads((SAMPLES / "questions.json").read_text(encoding="utf-8"))
