"""kvblend engine: model loading, the layerwise runner, CacheBlend, chat sessions and the CLI.

`from blend import BlendEngine` is the Python API entry point; `Document`, `TextDelta` and
`GenerationResult` are what it takes and gives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blend.decode.result import GenerationResult, TextDelta
    from blend.engine.async_engine import AsyncBlendEngine
    from blend.engine.engine import BlendEngine
    from blend.prompt.document import Document

__all__ = ["AsyncBlendEngine", "BlendEngine", "Document", "GenerationResult", "TextDelta"]
_HOMES = {"BlendEngine": "blend.engine.engine", "AsyncBlendEngine": "blend.engine.async_engine", "GenerationResult": "blend.decode.result",
          "TextDelta": "blend.decode.result", "Document": "blend.prompt.document"}


def __getattr__(name: str) -> Any:  # lazy: `kvblend --help` does not import torch
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'blend' has no attribute {name!r}")
