"""Prompt templates per task for evaluation: the built-in ones (blend.prompt.TEMPLATES, the
engine's own), optionally replaced from a YAML file (`kvblend eval --prompts FILE`).
Loading rejects unknown keys and placeholders other than {question}."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from blend.prompt.builder import QA, SUMMARIZATION, PromptTemplate
from storage.config import config_dataclass, from_mapping, load_yaml

__all__ = ["PromptTemplate", "Prompts", "load_prompts"]


@config_dataclass
class Prompts:
    """All task templates; a task missing from the YAML keeps its built-in default."""

    qa: PromptTemplate = Field(default_factory=lambda: QA)
    summarization: PromptTemplate = Field(default_factory=lambda: SUMMARIZATION)


def load_prompts(path: str | Path | None = None) -> dict[str, PromptTemplate]:
    """Templates by task name ("qa", "summarization"): the built-in ones (blend.prompt.TEMPLATES),
    with the tasks a YAML file at `path` gives replaced."""
    if path is None:
        prompts = Prompts()
    else:
        source = Path(path)
        if not source.is_file():
            raise FileNotFoundError(f"prompts file {str(source)!r} not found; pass an existing YAML file")
        prompts = from_mapping(Prompts, load_yaml(source), where=str(source))
    return {"qa": prompts.qa, "summarization": prompts.summarization}
