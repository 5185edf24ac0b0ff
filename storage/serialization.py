"""Entry headers and layers <-> bytes, and their verification.

Header bytes: MAGIC (8) | format version (u32 LE) | JSON length (u32 LE) | UTF-8 JSON.
Layer bytes:  raw K bytes then raw V bytes, C order, storage dtype, no framing; for an
              entry in a codec (the header's `codec`, absent for `none`) its K part then its
              V part (storage.codec).
Never pickle, never torch.load: decoding untrusted bytes can only fail with CorruptEntry.
A header is at most MAX_HEADER_BYTES and a layer at most MAX_LAYER_BYTES, so a tier can
bound every read before it fetches a value. How bytes travel (files, Redis keys) is each
tier's business.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import threading
import warnings
from typing import Any

import numpy as np
import torch

from storage import checksum as _checksum
from storage import codec as _codec
from storage.entry import FORMAT_VERSION, TORCH_DTYPES, CorruptEntry, EntryHeader, tensor_bytes

MAGIC = b"KVBLEND\x00"
_PRELUDE = struct.Struct("<8sII")  # magic, format version, JSON length
PRELUDE_SIZE = _PRELUDE.size  # 16
MAX_HEADER_BYTES = 64 << 10  # ~3000 layers of checksums; tiers never read more for a header
MAX_LAYER_BYTES = 1 << 30
_FIELDS = {f.name: f for f in dataclasses.fields(EntryHeader)}
_OPTIONAL = {"tag", "codec", "origin"}  # absent in unsigned / `none` / standalone entries (and in older ones)
ORIGINS = ("", "harvested")
_INTS = ("format_version", "num_layers", "kv_heads", "num_tokens", "head_dim", "pos_start", "layer_nbytes")
_STRS = ("fingerprint", "kv_dtype", "tokens_digest", "checksum", "tag", "origin")


def encode_header(header: EntryHeader) -> bytes:
    """Serialize a header to bytes (magic + version + length-prefixed JSON)."""
    body = dataclasses.asdict(header)
    body["layer_checksums"] = list(header.layer_checksums)
    if not header.tag:
        del body["tag"]
    if not header.origin:
        del body["origin"]  # a standalone entry's header is what it always was
    if header.codec.raw:
        del body["codec"]  # a `none` entry's header is byte for byte what it was before codecs
    else:
        body["codec"] = header.codec.to_json()
    data = json.dumps(body, separators=(",", ":"), sort_keys=True).encode()
    return _PRELUDE.pack(MAGIC, header.format_version, len(data)) + data


def header_size(prelude: bytes | bytearray | memoryview) -> int:
    """Total size of an encoded header from its first PRELUDE_SIZE bytes; CorruptEntry if not a header."""
    if len(prelude) < PRELUDE_SIZE:
        raise CorruptEntry(f"header truncated: {len(prelude)} bytes, need at least {PRELUDE_SIZE}")
    magic, version, length = _PRELUDE.unpack_from(prelude)
    if magic != MAGIC:
        raise CorruptEntry(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"unsupported format version {version} (this build reads {FORMAT_VERSION})")
    if PRELUDE_SIZE + length > MAX_HEADER_BYTES:
        raise CorruptEntry(f"header of {PRELUDE_SIZE + length} bytes exceeds {MAX_HEADER_BYTES}")
    return PRELUDE_SIZE + length


def decode_header(data: bytes | bytearray | memoryview) -> EntryHeader:
    """Parse and sanity-check header bytes (trailing bytes are ignored). Raises CorruptEntry."""
    total = header_size(data)
    if len(data) < total:
        raise CorruptEntry(f"header truncated: {len(data)} of {total} bytes")
    try:
        body: dict[str, Any] = json.loads(bytes(data[PRELUDE_SIZE:total]))
    # ValueError also covers json's refusal of integers over sys's digit limit; RecursionError: nested too deep
    except (ValueError, RecursionError) as e:
        raise CorruptEntry(f"header JSON unreadable: {type(e).__name__}: {str(e)[:100]}") from None
    if not isinstance(body, dict) or not set(_FIELDS) - _OPTIONAL <= set(body) <= set(_FIELDS):
        raise CorruptEntry(f"header fields {sorted(body) if isinstance(body, dict) else body!r} do not match")
    sums = body["layer_checksums"]
    if not isinstance(sums, list) or not all(_is_uint(c) for c in sums):
        raise CorruptEntry("header layer_checksums is not a list of non-negative integers")
    body["layer_checksums"] = tuple(sums)
    if "codec" in body:
        try:
            body["codec"] = _codec.from_json(body["codec"])
        except ValueError as e:
            raise CorruptEntry(f"header {e}") from None
    _check_types(body)
    header = EntryHeader(**body)
    _check_header(header)
    return header


def _is_uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _check_types(body: dict[str, Any]) -> None:
    for name in _INTS:
        if not _is_uint(body[name]):
            raise CorruptEntry(f"header {name} is {body[name]!r}, not a non-negative integer")
    for name in _STRS:
        if not isinstance(body.get(name, ""), str):
            raise CorruptEntry(f"header {name} is not a string")


def _check_header(h: EntryHeader) -> None:
    if h.kv_dtype not in TORCH_DTYPES:
        raise CorruptEntry(f"header kv_dtype {h.kv_dtype!r} unknown")
    if h.origin not in ORIGINS:
        raise CorruptEntry(f"header origin {h.origin!r} unknown")
    # a codec this build does not know is left to Expected (a mismatch: counted, never decoded)
    if h.layer_nbytes == 0 or (_codec.known(h.codec) and h.codec.supports(h.head_dim) and h.layer_nbytes
                               != h.codec.layer_nbytes(h.kv_heads, h.num_tokens, h.head_dim, h.kv_dtype)):
        raise CorruptEntry("header layer_nbytes does not match its shape, dtype and codec")
    if h.layer_nbytes > MAX_LAYER_BYTES:
        raise CorruptEntry(f"header layer_nbytes {h.layer_nbytes} exceeds {MAX_LAYER_BYTES}")
    if len(h.layer_checksums) != h.num_layers or h.num_layers == 0:
        raise CorruptEntry("header has the wrong number of layer checksums")


def layer_parts(k: torch.Tensor, v: torch.Tensor) -> tuple[memoryview, memoryview]:
    """Zero-copy byte views (K, V) of one layer (or its K and V parts); tensors must be contiguous CPU."""
    return tensor_bytes(k), tensor_bytes(v)


def layer_views(buf: torch.Tensor, header: EntryHeader) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's bytes in `buf` ((layer_nbytes,) uint8, any device): K and V, each
    (kv_heads, num_tokens, head_dim) in the storage dtype; for an encoded entry its K part and V part
    (flat uint8)."""
    kn, vn = header.part_nbytes
    if header.codec.raw:
        k, v = buf[: kn + vn].view(header.dtype).view(2, *header.shape).unbind(0)  # (H, T, D) each
        return k, v
    return buf[:kn], buf[kn : kn + vn]


def layer_to_bytes(k: torch.Tensor, v: torch.Tensor) -> bytes:
    """One layer as a single bytes object: raw K bytes then raw V bytes (one copy)."""
    kb, vb = layer_parts(k, v)
    return b"".join((kb, vb))


def verify_layer(data: Any, header: EntryHeader, layer: int) -> None:
    """Check length and checksum of one layer's bytes, and that they decode to finite values
    (storage.codec.finite: a layer of NaN behind a valid checksum, which anyone who can write to
    an unsigned store can plant, is as corrupt as a damaged one). Raises CorruptEntry; no side
    effects."""
    if not 0 <= layer < header.num_layers:
        raise IndexError(f"layer {layer} out of range: entry has {header.num_layers} layers")
    n = memoryview(data).nbytes
    if n != header.layer_nbytes:
        raise CorruptEntry(f"layer {layer}: {n} bytes, expected {header.layer_nbytes}")
    try:
        prefix = _codec.tag(header.codec)
        got = _checksum.checksum((prefix, data) if prefix else (data,), header.checksum)
    except ValueError as e:
        raise CorruptEntry(str(e)) from None
    if got != header.layer_checksums[layer]:
        raise CorruptEntry(f"layer {layer}: checksum mismatch ({header.checksum})")
    k, v = layer_views(_uint8_view(data), header)
    if not _codec.finite(header.codec, k, v, header.shape, header.kv_dtype):
        raise CorruptEntry(f"layer {layer}: decodes to values that are not finite (NaN or infinity)")


def _uint8_view(data: Any) -> torch.Tensor:
    """A flat uint8 tensor over any buffer, without a copy (read-only buffers are only read here)."""
    if isinstance(data, np.ndarray) and data.flags.writeable:
        return torch.from_numpy(data.reshape(-1).view(np.uint8))
    mv = memoryview(data).cast("B")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return _alias_readonly(mv) if mv.readonly else torch.frombuffer(mv, dtype=torch.uint8)


_frombuffer_lock = threading.Lock()
_frombuffer_quiet = False


def _alias_readonly(mv: memoryview) -> torch.Tensor:
    """uint8 tensor aliasing a read-only buffer, without torch's (warn-once) non-writable warning."""
    global _frombuffer_quiet
    if not _frombuffer_quiet:
        with _frombuffer_lock, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            flat = torch.frombuffer(mv, dtype=torch.uint8)
            _frombuffer_quiet = True  # torch warns once per process: the first call used it up
            return flat
    return torch.frombuffer(mv, dtype=torch.uint8)


def layer_from_bytes(
    data: Any, header: EntryHeader, layer: int, *, owned: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one layer and view it as (K, V), each (kv_heads, num_tokens, head_dim) (an encoded
    entry: as its (K part, V part), flat uint8; storage.entry.decode_layer decodes them).

    `data` is any buffer. A writable buffer (bytearray, uint8 tensor/numpy array) is used
    without copying and the tensors alias it. A read-only one (bytes) is copied into a
    fresh tensor, unless `owned=True`: the caller promises it holds the only reference
    (e.g. a value just received from a socket), so the tensors alias it - writing to them
    then changes an object nobody else can see. Copying a 384 KiB layer costs ~80 us here,
    mostly page faults, a quarter of a Redis GET. Raises CorruptEntry on a length or
    checksum mismatch.
    """
    if isinstance(data, torch.Tensor):
        flat = data.view(torch.uint8).reshape(-1)  # (layer_nbytes,)
        verify_layer(flat.numpy(), header, layer)
    else:
        verify_layer(data, header, layer)
        mv = memoryview(data)
        if not mv.readonly:
            flat = torch.frombuffer(mv, dtype=torch.uint8)  # (layer_nbytes,)
        elif owned:
            flat = _alias_readonly(mv)  # (layer_nbytes,)
        else:
            flat = torch.empty(mv.nbytes, dtype=torch.uint8)  # (layer_nbytes,)
            flat.numpy()[:] = np.frombuffer(mv, dtype=np.uint8)
    return layer_views(flat, header)
