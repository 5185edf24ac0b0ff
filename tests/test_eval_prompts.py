"""Prompt templates: the shipped YAML, rejection of unknown keys and placeholders."""

from __future__ import annotations

import pytest

from eval.prompts import QA, SUMMARIZATION, PromptTemplate, load_prompts


def test_shipped_yaml_matches_builtin_defaults():
    prompts = load_prompts()
    assert prompts == {"qa": QA, "summarization": SUMMARIZATION}
    assert "Question: When?" in prompts["qa"].render_query("When?")
    assert "five words" in prompts["qa"].system


def test_partial_file_keeps_defaults(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text('qa:\n  system: Be brief.\n  query: "Q: {question}\\nA:"\n')
    prompts = load_prompts(path)
    assert prompts["qa"].render_query("Why?") == "Q: Why?\nA:"
    assert prompts["summarization"] == SUMMARIZATION


@pytest.mark.parametrize(
    "text, message",
    [
        ("qa:\n  system: s\n  query: q\n  footer: f\n", "unknown key.*footer.*valid keys are: query, system"),
        ("translation:\n  system: s\n  query: q\n", "unknown key.*translation.*qa, summarization"),
        ("qa:\n  system: s\n", "missing required key.*query"),
    ],
)
def test_rejects_unknown_and_missing_keys(tmp_path, text, message):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_prompts(path)


def test_rejects_unknown_placeholder():
    with pytest.raises(ValueError, match=r"unknown placeholder.*\{context\}.*valid placeholders: \{question\}"):
        PromptTemplate(system="s", query="{context} {question}")
    with pytest.raises(ValueError, match="placeholder"):
        PromptTemplate(system="{question}", query="q")
    assert PromptTemplate(system="use {{braces}}", query="q").render_system() == "use {braces}"


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="prompts file"):
        load_prompts(tmp_path / "none.yaml")
