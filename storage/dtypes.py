"""The one table of tensor dtypes kvblend knows (compute and storage), and KV sizes.

Names are torch's: float32, bfloat16, float16. Looking up any other name is a
ValueError that lists the valid ones. Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BYTES)


def check_dtype(name: str, what: str = "dtype") -> str:
    """`name` if it is a known dtype; ValueError listing the valid names otherwise."""
    if not isinstance(name, str) or name not in DTYPE_BYTES:
        raise ValueError(f"{what} {name!r} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    return name


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name."""
    return DTYPE_BYTES[check_dtype(name)]


def torch_dtype(name: str) -> Any:
    """The torch.dtype of a dtype name (imports torch)."""
    import torch

    return getattr(torch, check_dtype(name))


def dtype_name(dtype: Any) -> str:
    """The name of a torch.dtype in this table ("float16" for torch.float16)."""
    return check_dtype(str(dtype).removeprefix("torch."))


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: str | int) -> int:
    """K and V of every layer for one token: 2 * layers * kv_heads * head_dim * bytes.

    `dtype` is a dtype name or a number of bytes per element."""
    size = dtype if isinstance(dtype, int) and not isinstance(dtype, bool) else dtype_bytes(dtype)
    return 2 * layers * kv_heads * head_dim * size


def mla_bytes_per_token(layers: int, latent_dim: int, rope_head_dim: int, dtype: str | int) -> int:
    """An MLA cache (DeepSeek-V2/V3) for one token: per layer one latent of `latent_dim` (kv_lora_rank)
    elements and one RoPE key of `rope_head_dim` elements, shared by every head: layers * (R + D) * bytes."""
    size = dtype if isinstance(dtype, int) and not isinstance(dtype, bool) else dtype_bytes(dtype)
    return layers * (latent_dim + rope_head_dim) * size
