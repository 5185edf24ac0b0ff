"""Prompt templates for evaluation and serving: per task, a fixed system instruction placed
before the passages and a query placed after them (configs/prompts.yaml). Loading rejects
unknown keys and placeholders other than {question}."""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path

from storage.config import from_mapping, load_yaml

DEFAULT_PATH = Path(__file__).resolve().parent.parent / "configs" / "prompts.yaml"
PLACEHOLDERS = frozenset({"question"})


@dataclass(frozen=True)
class PromptTemplate:
    """One task's prompt: `system` precedes the passages, `query` follows them."""

    system: str
    query: str

    def __post_init__(self) -> None:
        for name in ("system", "query"):
            text = getattr(self, name)
            try:
                used = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
            except ValueError as exc:
                raise ValueError(f"prompt {name}: {exc}; write a literal brace as {{{{ or }}}}") from None
            allowed = PLACEHOLDERS if name == "query" else frozenset()
            unknown = sorted(used - allowed)
            if unknown:
                valid = ", ".join("{" + p + "}" for p in sorted(allowed)) or "none"
                raise ValueError(
                    f"prompt {name}: unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; "
                    f"valid placeholders: {valid} (write a literal brace as {{{{ or }}}})"
                )

    def render_query(self, question: str = "") -> str:
        """The query with {question} filled in."""
        return self.query.format(question=question)

    def render_system(self) -> str:
        """The system instruction with doubled braces unescaped."""
        return self.system.format()


QA = PromptTemplate(
    system=(
        "You are given several passages and then a question about them. Answer using only the passages. "
        "Reply with the answer alone, in at most five words, and do not repeat the question."
    ),
    query="Question: {question}\nShort answer (five words at most):",
)
SUMMARIZATION = PromptTemplate(
    system=(
        "You are given one or more documents. Write a short, faithful summary of them in a few sentences, "
        "without adding facts that the documents do not state."
    ),
    query="Summary of the documents above:",
)


@dataclass(frozen=True)
class Prompts:
    """All task templates; a task missing from the YAML keeps its built-in default."""

    qa: PromptTemplate = field(default_factory=lambda: QA)
    summarization: PromptTemplate = field(default_factory=lambda: SUMMARIZATION)


def load_prompts(path: str | Path | None = None) -> dict[str, PromptTemplate]:
    """Templates by task name ("qa", "summarization") from `path` (default: configs/prompts.yaml,
    or the built-in defaults when that file is not present, as in an installed package)."""
    if path is None and not DEFAULT_PATH.is_file():
        prompts = Prompts()
    else:
        source = Path(path) if path is not None else DEFAULT_PATH
        if not source.is_file():
            raise FileNotFoundError(f"prompts file {str(source)!r} not found; pass a path such as configs/prompts.yaml")
        prompts = from_mapping(Prompts, load_yaml(source), where=str(source))
    return {"qa": prompts.qa, "summarization": prompts.summarization}
