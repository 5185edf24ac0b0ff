"""vLLM's paged KV blocks <-> kvblend entries, for the layouts a KV connector is handed.

A vLLM block of one layer holds `block_size` tokens of every KV head. An entry (storage.entry)
holds per layer K and V, each (kv_heads, num_tokens, head_dim): one vLLM block of every layer is
one entry, its tokens the block's, `pos_start` its first position. The layouts (the per-layer
tensor a connector's `register_kv_caches` receives):

- `cpu`: vLLM's CPU attention backend, (num_blocks, kv_heads, block_size, 2 * head_dim); the
  kernel reads each (block, head) slab as (2 * block_size, head_dim): the block's keys in its
  first block_size rows, its values in the next (so [b, h, n, :] is NOT token n's K and V).
- `flash`: the CUDA flash-attention layout, (2, num_blocks, block_size, kv_heads, head_dim)
  (K at [0], V at [1]); the logical view, whatever the physical stride order.

Imports torch only (never vllm), so kvblend's own venv tests it on hand-built tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LAYOUTS: tuple[str, ...] = ("cpu", "flash")


def check_layout(layout: str) -> str:
    """`layout` if known; ValueError listing the known ones."""
    if layout not in LAYOUTS:
        raise ValueError(f"KV layout {layout!r} is not one kvblend converts; use one of {', '.join(LAYOUTS)}")
    return layout


def layout_of(backend_name: str) -> str:
    """The layout of a vLLM attention backend by its name (`CPU_ATTN`, `FLASH_ATTN`, ...);
    ValueError for one whose layout is not converted here (the connector then refuses to start)."""
    name = backend_name.upper()
    if name.startswith("CPU"):
        return "cpu"
    if name.startswith("FLASH_ATTN"):
        return "flash"
    raise ValueError(f"vLLM attention backend {backend_name!r}: its KV layout is not one kvblend converts "
                     f"({', '.join(LAYOUTS)}); use the CPU or the flash-attention backend")


def cache_dims(cache: torch.Tensor, layout: str) -> tuple[int, int, int, int]:
    """(num_blocks, kv_heads, block_size, head_dim) of one layer's paged cache in `layout`."""
    check_layout(layout)
    if layout == "cpu":
        if cache.dim() != 4 or cache.shape[3] % 2:
            raise ValueError(f"a CPU-layout KV cache is (num_blocks, kv_heads, block_size, 2 * head_dim); got "
                             f"{tuple(cache.shape)}")
        blocks, heads, size, twice = cache.shape
        return blocks, heads, size, twice // 2
    if cache.dim() != 5 or cache.shape[0] != 2:
        raise ValueError(f"a flash-layout KV cache is (2, num_blocks, block_size, kv_heads, head_dim); got "
                         f"{tuple(cache.shape)}")
    _, blocks, size, heads, dim = cache.shape
    return blocks, heads, size, dim


def block_views(cache: torch.Tensor, block: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Views (no copy) of block `block`'s K and V in one layer's cache, each (kv_heads, block_size,
    head_dim): writing into them writes the cache."""
    blocks, heads, size, dim = cache_dims(cache, layout)
    if not 0 <= block < blocks:
        raise IndexError(f"block {block} outside the cache's {blocks} blocks")
    if layout == "cpu":
        slab = cache[block].view(heads, 2, size, dim)  # (H, 2, bs, D): the kernel's (2 * bs, D) slab
        return slab[:, 0], slab[:, 1]  # (H, bs, D) each
    return cache[0, block].transpose(0, 1), cache[1, block].transpose(0, 1)  # (bs, H, D) -> (H, bs, D)


def read_block(cache: torch.Tensor, block: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `block`'s K and V of one layer as new contiguous tensors, each (kv_heads, block_size,
    head_dim), in the cache's dtype (a copy: the cache may be reused afterwards)."""
    k, v = block_views(cache, block, layout)
    return k.contiguous().clone(), v.contiguous().clone()  # (H, bs, D) each


def write_block(cache: torch.Tensor, block: int, layout: str, k: torch.Tensor, v: torch.Tensor) -> None:
    """Copy K and V (each (kv_heads, block_size, head_dim)) into block `block` of one layer's
    cache (cast to its dtype). Side effect: the cache's block is overwritten."""
    dk, dv = block_views(cache, block, layout)
    if tuple(k.shape) != tuple(dk.shape) or tuple(v.shape) != tuple(dv.shape):
        raise ValueError(f"block KV shapes K {tuple(k.shape)} V {tuple(v.shape)}; the cache's block is "
                         f"{tuple(dk.shape)}")
    dk.copy_(k)
    dv.copy_(v)


def read_blocks(caches: Sequence[torch.Tensor], block: int, layout: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One block of every layer: `[(K, V)]` per layer, each (kv_heads, block_size, head_dim), copies
    (what `KVEntry.from_tensors` takes)."""
    return [read_block(cache, block, layout) for cache in caches]
