"""vLLM blocks <-> kvblend entries (blend.vllm.layout) on hand-built tensors, both layouts, float32 and
bfloat16: kvblend's own venv, no vllm."""

from __future__ import annotations

import pytest
import torch

from blend.vllm.layout import block_views, cache_dims, layout_of, read_blocks, write_block
from storage.entry import Expected, KVEntry
from storage.keys import key_kind, prefix_block_key, vllm_block_key
from storage.serialization import layer_views

BLOCKS, HEADS, SIZE, DIM = 5, 3, 4, 8


def token_kv(block: int, head: int, token: int, dim: int, which: int) -> float:
    """A value that names where it belongs: K (which 0) or V (1) of (block, head, token, dim)."""
    return which * 10000 + block * 1000 + head * 100 + token * 10 + dim / 10


def reference(dtype: torch.dtype) -> torch.Tensor:
    """(2, blocks, heads, size, dim): K and V of every block, head, token, by construction."""
    out = torch.empty(2, BLOCKS, HEADS, SIZE, DIM, dtype=torch.float64)
    for w in range(2):
        for b in range(BLOCKS):
            for h in range(HEADS):
                for t in range(SIZE):
                    for d in range(DIM):
                        out[w, b, h, t, d] = token_kv(b, h, t, d, w)
    return out.to(dtype)


def cpu_cache(ref: torch.Tensor) -> torch.Tensor:
    """The CPU backend's tensor, built as its kernel reads it: each (block, head) slab is
    (2 * size, dim), keys in its first `size` rows, values in the next."""
    cache = torch.empty(BLOCKS, HEADS, SIZE, 2 * DIM, dtype=ref.dtype)
    flat = cache.view(BLOCKS, HEADS, 2 * SIZE * DIM)
    for b in range(BLOCKS):
        for h in range(HEADS):
            slab = flat[b, h].view(2 * SIZE, DIM)
            slab[:SIZE] = ref[0, b, h]
            slab[SIZE:] = ref[1, b, h]
    return cache


def flash_cache(ref: torch.Tensor) -> torch.Tensor:
    """The flash-attention layout (2, blocks, size, heads, dim), element by element."""
    cache = torch.empty(2, BLOCKS, SIZE, HEADS, DIM, dtype=ref.dtype)
    for w in range(2):
        for b in range(BLOCKS):
            for t in range(SIZE):
                for h in range(HEADS):
                    cache[w, b, t, h] = ref[w, b, h, t]
    return cache


BUILDERS = {"cpu": cpu_cache, "flash": flash_cache}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_block_read_is_each_tokens_k_and_v(layout: str, dtype: torch.dtype) -> None:
    ref = reference(dtype)
    cache = BUILDERS[layout](ref)
    assert cache_dims(cache, layout) == (BLOCKS, HEADS, SIZE, DIM)
    layers = read_blocks([cache, cache], 3, layout)
    for k, v in layers:
        assert k.shape == (HEADS, SIZE, DIM) and k.is_contiguous() and k.dtype == dtype
        assert torch.equal(k, ref[0, 3]) and torch.equal(v, ref[1, 3])
    cache.zero_()  # the read was a copy
    assert torch.equal(layers[0][0], ref[0, 3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["cpu", "flash"])
def test_entry_round_trip_writes_only_its_block(layout: str, dtype: torch.dtype) -> None:
    """A block -> an entry (its bytes as a tier returns them) -> another block of a zeroed cache:
    that block equals the source's, every other block untouched."""
    ref = reference(dtype)
    source = BUILDERS[layout](ref)
    name = str(dtype).removeprefix("torch.")
    tokens = list(range(100, 100 + SIZE))
    entry = KVEntry.from_tensors(read_blocks([source], 2, layout), fingerprint="f", token_ids=tokens,
                                 pos_start=2 * SIZE, kv_dtype=name)
    expected = Expected.of(tokens, fingerprint="f", num_layers=1, kv_heads=HEADS, head_dim=DIM, kv_dtype=name,
                           pos_start=2 * SIZE)
    assert expected.mismatch(entry.header) is None
    buf = torch.empty(entry.header.layer_nbytes, dtype=torch.uint8)
    kb, vb = layer_views(buf, entry.header)
    kb.copy_(entry.layers[0][0])
    vb.copy_(entry.layers[0][1])
    target = torch.full_like(source, -1)
    write_block(target, 4, layout, *layer_views(buf, entry.header))
    k, v = block_views(target, 4, layout)
    assert torch.equal(k, ref[0, 2]) and torch.equal(v, ref[1, 2])
    others = [b for b in range(BLOCKS) if b != 4]
    for b in others:
        ok, ov = block_views(target, b, layout)
        assert bool((ok == -1).all()) and bool((ov == -1).all())


def test_shapes_and_backends_are_checked() -> None:
    with pytest.raises(ValueError, match="CPU-layout"):
        cache_dims(torch.zeros(2, 3, 4), "cpu")
    with pytest.raises(ValueError, match="flash-layout"):
        cache_dims(torch.zeros(3, 2, 4, 1, 8), "flash")
    with pytest.raises(ValueError, match="one of cpu, flash"):
        cache_dims(torch.zeros(1), "paged")
    with pytest.raises(IndexError):
        block_views(cpu_cache(reference(torch.float32)), BLOCKS, "cpu")
    with pytest.raises(ValueError, match="the cache's block"):
        write_block(torch.zeros(BLOCKS, HEADS, SIZE, 2 * DIM), 0, "cpu", torch.zeros(HEADS, SIZE + 1, DIM),
                    torch.zeros(HEADS, SIZE + 1, DIM))
    assert layout_of("CPU_ATTN") == "cpu" and layout_of("FLASH_ATTN") == "flash"
    with pytest.raises(ValueError, match="not one kvblend converts"):
        layout_of("FLASHINFER")


def test_vllm_block_keys_are_their_own_kind() -> None:
    tokens = list(range(32))
    key = vllm_block_key("fp", tokens, "float32", "ns", block_size=16)
    assert key_kind(key) == "vllm" and key.startswith("ns-v")
    assert key != prefix_block_key("fp", tokens, "float32", "ns", start=16)
    assert key != vllm_block_key("fp", tokens, "float32", "ns", block_size=32)  # same end, other block
    assert key != vllm_block_key("fp", [1] + tokens[1:], "float32", "ns", block_size=16)  # the chain counts
    assert key != vllm_block_key("fp2", tokens, "float32", "ns", block_size=16)
    assert key != vllm_block_key("fp", tokens, "bfloat16", "ns", block_size=16)
    with pytest.raises(ValueError, match="whole blocks"):
        vllm_block_key("fp", tokens[:20], "float32", block_size=16)
