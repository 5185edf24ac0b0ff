"""kvblend engine: model loading, the layerwise runner, CacheBlend, chat sessions and the CLI.

`from blend import BlendEngine` is the Python API entry point.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from blend.engine import BlendEngine, GenerationResult

__all__ = ["BlendEngine", "GenerationResult"]


def __getattr__(name: str) -> Any:  # lazy: `kvblend --help` does not import torch
    if name in __all__:
        from blend import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'blend' has no attribute {name!r}")
