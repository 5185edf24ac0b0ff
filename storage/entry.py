"""One cached KV entry: a header describing it and per-layer (K, V) tensors.

K and V of every layer are shaped (kv_heads, num_tokens, head_dim) in the storage dtype.
Keys were rotated at positions pos_start .. pos_start + num_tokens - 1. An entry encoded
by a codec (storage.codec: int8, int4) holds per layer its K part and V part instead, flat
uint8 tensors, and its header records the codec; `decode_layer` turns them back into K and V.

`Expected` is what a reader knows before it reads: the model's KV dims, the storage
dtype, the tokens and their positions. A stored header is used only if it matches all of
it, so no tensor is ever built from a header the reader did not expect.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from storage import checksum as _checksum
from storage.codec import KEYS_PRE_ROPE, KEYS_ROTATED, NONE, Codec, decode_into, encode_layer, known, tag
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


def layer_checksum(codec: Codec, k: torch.Tensor, v: torch.Tensor, algorithm: str = _checksum.DEFAULT_ALGORITHM) -> int:
    """Checksum of one stored layer: its K then V bytes (contiguous CPU tensors), bound to its codec
    (`storage.codec.tag`: nothing for `none`, so raw entries keep the checksums they always had)."""
    prefix = tag(codec)
    parts = (prefix, tensor_bytes(k), tensor_bytes(v)) if prefix else (tensor_bytes(k), tensor_bytes(v))
    return _checksum.checksum(parts, algorithm)


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
    codec: Codec = NONE  # how the layers are encoded (storage.codec); kv_dtype is what they decode to
    # how the K/V were computed: "" for the tokens alone (after their context), "harvested" when cut out
    # of a request's own prefill (after other documents: blend.planning.misses)
    origin: str = ""

    @property
    def dtype(self) -> torch.dtype:
        return dtype_of(self.kv_dtype)

    @property
    def part_nbytes(self) -> tuple[int, int]:
        """Bytes of one layer's K part and V part (K and V themselves for `none`)."""
        return self.codec.part_nbytes(self.kv_heads, self.num_tokens, self.head_dim, self.kv_dtype)

    @property
    def keys_pre_rope(self) -> bool:
        """Whether the keys decode without their rotation (every token at position 0): the reader
        rotates each by its whole prompt position, not by the shift from pos_start."""
        return self.codec.keys == KEYS_PRE_ROPE

    @property
    def keys_rotated_at(self) -> int:
        """The position of the first token's key as the layers decode: pos_start, or 0 for keys stored
        before RoPE."""
        return 0 if self.keys_pre_rope else self.pos_start

    @property
    def raw_nbytes(self) -> int:
        """Bytes of all layers decoded, in the storage dtype (what `none` would store)."""
        return self.num_layers * kv_bytes_per_token(1, self.kv_heads, self.head_dim, self.kv_dtype) * self.num_tokens

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

    def mismatch(self, header: EntryHeader) -> str | None:
        """None if `header` matches every expectation, else the first difference (for logs). Any
        codec this build knows is accepted (storage.codec.known: its parameters exactly as
        registered), with the layer size that codec gives this shape."""
        for name in ("fingerprint", "tokens_digest", "kv_dtype", "num_layers", "kv_heads", "head_dim",
                     "num_tokens", "pos_start"):
            got, want = getattr(header, name), getattr(self, name)
            if got != want:
                return f"{name} {got!r}, expected {want!r}"
        if not known(header.codec) or not header.codec.supports(self.head_dim):
            return f"codec {header.codec.to_json()} is not one this build decodes"
        want = header.codec.layer_nbytes(self.kv_heads, self.num_tokens, self.head_dim, self.kv_dtype)
        if header.layer_nbytes != want:
            return f"layer_nbytes {header.layer_nbytes}, expected {want} for codec {header.codec.name}"
        if len(header.layer_checksums) != self.num_layers:
            return f"{len(header.layer_checksums)} layer checksums, expected {self.num_layers}"
        if header.checksum not in _checksum.ALGORITHMS:
            return f"checksum algorithm {header.checksum!r} unknown here"
        return None


@dataclass
class KVEntry:
    """A header plus `layers[i] = (K, V)`, each (kv_heads, num_tokens, head_dim), contiguous CPU; for
    an encoded entry (header.codec not `none`) `layers[i] = (K part, V part)`, flat uint8.

    `rope`: per layer, the RoPE frequencies (head_dim / 2,) its keys were rotated with, when the model
    that computed them is known (a codec then quantizes keys before RoPE; models such as Gemma 3 rotate
    some layers with other frequencies); never stored."""

    header: EntryHeader
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    rope: tuple[torch.Tensor, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.header.nbytes

    def encode(self, codec: Codec) -> KVEntry:
        """This entry in `codec`: itself when it is already encoded (in any codec: an encoded
        entry is never encoded again) or `codec` is `none` or cannot hold its shape; else a new
        entry (CPU work, ~the layers' size; the checksums recomputed in the header's algorithm).
        Keys go before RoPE only where the codec asks and `rope` is known."""
        if not self.header.codec.raw or codec.raw or not codec.supports(self.header.head_dim):
            return self
        if codec.keys == KEYS_PRE_ROPE and self.rope is None:
            codec = dataclasses.replace(codec, keys=KEYS_ROTATED)
        h = self.header
        rope = self.rope or (None,) * len(self.layers)
        layers = [encode_layer(codec, k, v, pos_start=h.pos_start, inv_freq=f)
                  for (k, v), f in zip(self.layers, rope, strict=True)]
        sums = tuple(layer_checksum(codec, kp, vp, h.checksum) for kp, vp in layers)
        header = dataclasses.replace(h, codec=codec, layer_checksums=sums, tag="",
                                     layer_nbytes=codec.layer_nbytes(h.kv_heads, h.num_tokens, h.head_dim, h.kv_dtype))
        return KVEntry(header, layers, self.rope)

    def decoded(self) -> KVEntry:
        """This entry with K and V (a `none` entry: itself); the keys as the codec decodes them
        (`header.keys_rotated_at`)."""
        if self.header.codec.raw:
            return self
        layers = [decode_layer(self.header, kp, vp) for kp, vp in self.layers]
        return KVEntry(self.header, layers, self.rope)

    @classmethod
    def from_tensors(
        cls,
        layers: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        fingerprint: str,
        token_ids: Sequence[int],
        pos_start: int,
        kv_dtype: str,
        rope: torch.Tensor | Sequence[torch.Tensor] | None = None,
        origin: str = "",
    ) -> KVEntry:
        """Build an entry from per-layer (K, V) tensors shaped (kv_heads, num_tokens, head_dim).

        Tensors are copied to contiguous CPU tensors in `kv_dtype` (always a copy, so the
        entry owns its storage and the caller may reuse its buffers); per-layer checksums
        are computed. `rope`: the model's RoPE frequencies, one tensor for every layer or one per
        layer (see KVEntry). Raises
        ValueError on inconsistent shapes.
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
            sums.append(layer_checksum(NONE, k, v))
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
            origin=origin,
        )
        if rope is not None:
            per_layer = [rope] * len(out) if isinstance(rope, torch.Tensor) else list(rope)
            if len(per_layer) != len(out):
                raise ValueError(f"KVEntry.from_tensors: {len(per_layer)} RoPE frequency tensors for {len(out)} layers")
            rope = tuple(f.detach().to(device="cpu", dtype=torch.float32) for f in per_layer)
        return cls(header=header, layers=out, rope=rope)


def decode_layer(header: EntryHeader, kpart: torch.Tensor, vpart: torch.Tensor,
                 dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (each (kv_heads, num_tokens, head_dim), `dtype` or the storage dtype, on the parts'
    device) of one layer of an entry in any codec; a `none` layer is returned as it is. New tensors."""
    if header.codec.raw:
        return kpart, vpart
    out = dtype or header.dtype
    k = torch.empty(header.shape, dtype=out, device=kpart.device)  # (H, T, D)
    v = torch.empty(header.shape, dtype=out, device=kpart.device)  # (H, T, D)
    decode_into(header.codec, kpart, vpart, k, v)
    return k, v
