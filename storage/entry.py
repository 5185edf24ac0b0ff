"""One cached KV entry: a header describing it and per-layer (K, V) tensors.

K and V of every layer are shaped (kv_heads, num_tokens, head_dim) in the storage dtype.
Keys were rotated at positions pos_start .. pos_start + num_tokens - 1.

`Expected` is what a reader knows before it reads: the model's KV dims, the storage
dtype, the tokens and their positions. A stored header is used only if it matches all of
it, so no tensor is ever built from a header the reader did not expect.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storage import checksum as _checksum
from storage.dtypes import DTYPE_NAMES, check_dtype, kv_bytes_per_token, torch_dtype
from storage.keys import tokens_digest as _tokens_digest

FORMAT_VERSION: int = 1
TORCH_DTYPES: dict[str, torch.dtype] = {name: torch_dtype(name) for name in DTYPE_NAMES}


class CorruptEntry(Exception):
    """A stored entry failed verification (bad magic, truncated, checksum mismatch, ...)."""


def dtype_of(kv_dtype: str) -> torch.dtype:
    """Torch dtype for a storage dtype name; ValueError lists the valid names."""
    return torch_dtype(check_dtype(kv_dtype, "kv_dtype"))


def entry_nbytes(num_layers: int, kv_heads: int, num_tokens: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes of KV in one entry (all layers, K and V) - what tier budgets are measured in."""
    return kv_bytes_per_token(num_layers, kv_heads, head_dim, kv_dtype) * num_tokens


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """Zero-copy flat byte view of a contiguous CPU tensor (works for bfloat16 too)."""
    return memoryview(t.view(torch.uint8).reshape(-1).numpy())


@dataclass(frozen=True)
class EntryHeader:
    """Everything needed to locate, decode and verify an entry's layers."""

    format_version: int
    fingerprint: str
    kv_dtype: str
    num_layers: int
    kv_heads: int
    num_tokens: int
    head_dim: int
    pos_start: int
    tokens_digest: str
    layer_checksums: tuple[int, ...]
    layer_nbytes: int  # bytes of one layer = K + V
    checksum: str = _checksum.DEFAULT_ALGORITHM
    tag: str = ""  # HMAC-SHA256 (hex) by a store with a secret, see storage.signature; "" unsigned

    @property
    def dtype(self) -> torch.dtype:
        return dtype_of(self.kv_dtype)

    @property
    def shape(self) -> tuple[int, int, int]:
        """Shape of one K or V tensor: (kv_heads, num_tokens, head_dim)."""
        return (self.kv_heads, self.num_tokens, self.head_dim)

    @property
    def nbytes(self) -> int:
        """Bytes of all layers (K and V)."""
        return self.num_layers * self.layer_nbytes


@dataclass(frozen=True)
class Expected:
    """What the reader of an entry knows: `mismatch(header)` is None only for a header
    that describes exactly this entry (model, tokens, positions, dims, dtype, sizes)."""

    fingerprint: str
    tokens_digest: str
    num_tokens: int
    num_layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    pos_start: int  # the position of the first token's key

    @classmethod
    def of(cls, token_ids: Sequence[int], *, fingerprint: str, num_layers: int, kv_heads: int, head_dim: int,
           kv_dtype: str, pos_start: int) -> Expected:
        """The expectation for the KV of `token_ids` with keys rotated from `pos_start`."""
        return cls(fingerprint, _tokens_digest(token_ids), len(token_ids), int(num_layers), int(kv_heads),
                   int(head_dim), check_dtype(kv_dtype, "kv_dtype"), int(pos_start))

    @classmethod
    def matching(cls, header: EntryHeader) -> Expected:
        """The expectation a given header meets (tools and tests that hold the header already)."""
        return cls(header.fingerprint, header.tokens_digest, header.num_tokens, header.num_layers, header.kv_heads,
                   header.head_dim, header.kv_dtype, header.pos_start)

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one stored layer (K and V)."""
        return kv_bytes_per_token(1, self.kv_heads, self.head_dim, self.kv_dtype) * self.num_tokens

    def mismatch(self, header: EntryHeader) -> str | None:
        """None if `header` matches every expectation, else the first difference (for logs)."""
        for name in ("fingerprint", "tokens_digest", "kv_dtype", "num_layers", "kv_heads", "head_dim",
                     "num_tokens", "pos_start", "layer_nbytes"):
            got, want = getattr(header, name), getattr(self, name)
            if got != want:
                return f"{name} {got!r}, expected {want!r}"
        if len(header.layer_checksums) != self.num_layers:
            return f"{len(header.layer_checksums)} layer checksums, expected {self.num_layers}"
        if header.checksum not in _checksum.ALGORITHMS:
            return f"checksum algorithm {header.checksum!r} unknown here"
        return None


@dataclass
class KVEntry:
    """A header plus `layers[i] = (K, V)`, each (kv_heads, num_tokens, head_dim), contiguous CPU."""

    header: EntryHeader
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return self.header.nbytes

    @classmethod
    def from_tensors(
        cls,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        fingerprint: str,
        token_ids: Sequence[int],
        pos_start: int,
        kv_dtype: str,
    ) -> KVEntry:
        """Build an entry from per-layer (K, V) tensors shaped (kv_heads, num_tokens, head_dim).

        Tensors are copied to contiguous CPU tensors in `kv_dtype` (always a copy, so the
        entry owns its storage and the caller may reuse its buffers); per-layer checksums
        are computed. Raises ValueError on inconsistent shapes.
        """
        dtype = dtype_of(kv_dtype)
        if not layers:
            raise ValueError("KVEntry.from_tensors: got no layers; pass one (K, V) pair per layer")
        num_tokens = len(token_ids)
        shape = tuple(layers[0][0].shape)
        if len(shape) != 3 or shape[1] != num_tokens:
            raise ValueError(
                f"KVEntry.from_tensors: K of layer 0 has shape {shape}; expected (kv_heads, num_tokens={num_tokens}, "
                "head_dim) - drop the batch dimension with k[0] first"
            )
        if pos_start < 0:
            raise ValueError(f"KVEntry.from_tensors: pos_start must be >= 0, got {pos_start}")
        out: list[tuple[torch.Tensor, torch.Tensor]] = []
        sums: list[int] = []
        for i, (k, v) in enumerate(layers):
            if tuple(k.shape) != shape or tuple(v.shape) != shape:
                raise ValueError(
                    f"KVEntry.from_tensors: layer {i} has K {tuple(k.shape)} and V {tuple(v.shape)}; "
                    f"every K and V must be {shape}"
                )
            k = k.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()  # (H, T, D)
            v = v.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()  # (H, T, D)
            out.append((k, v))
            sums.append(_checksum.checksum((tensor_bytes(k), tensor_bytes(v))))
        kv_heads, _, head_dim = shape
        header = EntryHeader(
            format_version=FORMAT_VERSION,
            fingerprint=fingerprint,
            kv_dtype=kv_dtype,
            num_layers=len(out),
            kv_heads=kv_heads,
            num_tokens=num_tokens,
            head_dim=head_dim,
            pos_start=pos_start,
            tokens_digest=_tokens_digest(token_ids),
            layer_checksums=tuple(sums),
            layer_nbytes=2 * out[0][0].numel() * out[0][0].element_size(),
        )
        return cls(header=header, layers=out)
