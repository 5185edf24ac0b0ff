"""KV codecs: how an entry's K and V are held in a tier (`store.tiers[i].codec`).

  none   K and V as they are, in the storage dtype (`store.kv_dtype`); what every tier held before codecs
  int8   8-bit codes: keys per channel in groups of 128 tokens (a float16 scale and minimum per group),
         values per token and head (a float16 scale, symmetric): ~1.9x smaller than float16
  int4   4-bit codes: keys per channel in groups of 128 tokens, quantized before RoPE (the rotation taken
         off at encode and put back by the loader at the prompt position), values per token in groups of 64
         channels; a float16 scale and minimum per group: 3.66x smaller than float16 for 512-token blocks,
         3.56x for the 100-300-token blocks of short passages

Keys are grouped along tokens within a block and quantized per channel, values per token along channels
(keys have outlier channels, values do not: the KIVI / CacheGen observation). Asymmetric groups store a
float16 scale s and minimum m and decode a code q as q * s + m; symmetric ones store s only and decode
(q - 2^(bits-1)) * s. The choices (bits, group sizes, keys before RoPE) were measured on the MuSiQue dev set
(docs/EVAL.md, "Compressed KV"); nothing here is tunable from a config: an entry's header records its codec
whole, and a reader uses an entry only when that record equals one this build knows (`known`), so a header
whose codec or its parameters were edited is a miss, never KV decoded by the wrong rule.

Layout of one encoded layer: the K part then the V part, each `codes | scales | minimums` (minimums only
for asymmetric groups). int8 codes are one byte each in (H, T, D) order; int4 codes are two to a byte over
the flat (H, T, D) order of the part: element e < N/2 in the low nibble of byte e, element N/2 + e in its high
nibble (two contiguous halves to unpack). Scales and minimums are float16, (H, ceil(T / key_group), D) for
keys and (H, T, D / value_group) for values.

Decoding (`decode_into`) runs where the bytes are: on the compute device after the copy (the loader),
writing into any float tensor (a slice of the request's cache); encoding (`encode_layer`) runs on the CPU
in the store's background writer. Importing this module imports torch only when a function runs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from storage.dtypes import dtype_bytes, torch_dtype

if TYPE_CHECKING:
    import torch

KEYS_ROTATED = "rotated"  # keys stored as computed: rotated at their positions (the header's pos_start on)
KEYS_PRE_ROPE = "pre-rope"  # the rotation taken off before quantizing: decoded keys are rotated at position 0
SCALE_DTYPE = "float16"


@dataclass(frozen=True)
class Codec:
    """How one entry's layers are encoded (recorded whole in its header).

    bits: bits per code (0: none, K and V raw in the storage dtype). key_group: tokens per key group
    (each channel of each head apart); value_group: channels per value group (each token of each head
    apart; a head_dim it does not divide is one group per head). *_zero: asymmetric groups (scale and
    minimum) instead of symmetric ones (scale only). keys: KEYS_ROTATED or KEYS_PRE_ROPE.
    """

    name: str = "none"
    bits: int = 0
    key_group: int = 0
    key_zero: bool = False
    value_group: int = 0
    value_zero: bool = False
    scale: str = SCALE_DTYPE
    keys: str = KEYS_ROTATED

    @property
    def raw(self) -> bool:
        """True for `none`: the layer is K and V in the storage dtype."""
        return self.bits == 0

    def to_json(self) -> dict[str, Any]:
        """The header's record of this codec."""
        return dataclasses.asdict(self)

    def value_group_for(self, head_dim: int) -> int:
        """Channels per value group for this head_dim."""
        return self.value_group if 0 < self.value_group <= head_dim and head_dim % self.value_group == 0 else head_dim

    def part_nbytes(self, kv_heads: int, num_tokens: int, head_dim: int, kv_dtype: str) -> tuple[int, int]:
        """Bytes of the K part and of the V part of one layer of (kv_heads, num_tokens, head_dim)."""
        n = kv_heads * num_tokens * head_dim
        if self.raw:
            return n * dtype_bytes(kv_dtype), n * dtype_bytes(kv_dtype)
        codes = codes_nbytes(n, self.bits)
        key_groups = kv_heads * math.ceil(num_tokens / self.key_group) * head_dim
        value_groups = kv_heads * num_tokens * (head_dim // self.value_group_for(head_dim))
        scale = dtype_bytes(self.scale)
        return (codes + key_groups * scale * (2 if self.key_zero else 1),
                codes + value_groups * scale * (2 if self.value_zero else 1))

    def layer_nbytes(self, kv_heads: int, num_tokens: int, head_dim: int, kv_dtype: str) -> int:
        """Bytes of one encoded layer (K part and V part)."""
        k, v = self.part_nbytes(kv_heads, num_tokens, head_dim, kv_dtype)
        return k + v

    def mla_layer_nbytes(self, num_tokens: int, latent_dim: int, rope_head_dim: int, kv_dtype: str) -> int:
        """Bytes one MLA layer of `num_tokens` (a latent of `latent_dim` and a RoPE key of
        `rope_head_dim` elements per token) would take in this codec's scale layout. Sizing only:
        `encode_layer` takes K and V per head, not an MLA cache. The RoPE key is counted as one key
        head of `rope_head_dim` channels (per channel in groups of tokens, like every key), the latent
        as one value head of `latent_dim` channels (per token: int8 one scale, int4 groups of 64
        channels; DeepSeek's own FP8 latent cache also scales per token)."""
        rope_key, _ = self.part_nbytes(1, num_tokens, rope_head_dim, kv_dtype)
        _, latent = self.part_nbytes(1, num_tokens, latent_dim, kv_dtype)
        return rope_key + latent

    def supports(self, head_dim: int) -> bool:
        """Whether layers of this head_dim can be encoded (int4 packs two codes a byte: an even head_dim)."""
        return self.raw or self.bits == 8 or head_dim % 2 == 0


def codes_nbytes(n: int, bits: int) -> int:
    """Bytes of n codes of `bits` bits, rounded up to even: the float16 scales after them stay aligned."""
    return (n * bits // 8 + 1) // 2 * 2


NONE = Codec()
CODECS: dict[str, Codec] = {
    "none": NONE,
    "int8": Codec("int8", bits=8, key_group=128, key_zero=True, value_group=0, value_zero=False),
    "int4": Codec("int4", bits=4, key_group=128, key_zero=True, value_group=64, value_zero=True, keys=KEYS_PRE_ROPE),
}
CODEC_NAMES: tuple[str, ...] = tuple(CODECS)


def codec_named(name: str, what: str = "codec") -> Codec:
    """The codec called `name`; ValueError listing the names otherwise."""
    if not isinstance(name, str) or name not in CODECS:
        raise ValueError(f"{what} {name!r} is not known; use one of {', '.join(CODEC_NAMES)}")
    return CODECS[name]


def known(codec: Codec) -> bool:
    """Whether `codec` is one this build encodes and decodes: a registered codec, its keys either
    pre-RoPE (when it quantizes them so) or as computed (entries written without the model's RoPE)."""
    base = CODECS.get(codec.name)
    return base is not None and (codec == base or codec == dataclasses.replace(base, keys=KEYS_ROTATED))


def from_json(body: Any) -> Codec:
    """A Codec from a header's record; ValueError when the record is not shaped like one (wrong or
    missing fields, wrong types). Whether it is a codec this build knows is `known`'s question."""
    fields = {f.name: f for f in dataclasses.fields(Codec)}
    if not isinstance(body, dict) or set(body) != set(fields):
        raise ValueError(f"codec record {body!r:.120} does not have the fields {sorted(fields)}")
    for name, value in body.items():
        want = bool if name.endswith("_zero") else int if name in ("bits", "key_group", "value_group") else str
        if type(value) is not want or (want is int and not 0 <= value <= 1 << 20):
            raise ValueError(f"codec record field {name} is {value!r:.40}, not a {want.__name__} in range")
    return Codec(**body)


def tag(codec: Codec) -> bytes:
    """Bytes that bind a layer's checksum to its codec (b"" for none, so raw entries are unchanged):
    a header whose codec was edited no longer matches its layers."""
    if codec.raw:
        return b""
    return ("|".join(f"{k}={v}" for k, v in sorted(codec.to_json().items()))).encode()


# ------------------------------------------------------------------------------------ encode
def _rotation(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (T, D/2) float32 of RoPE at `positions` (T,) for frequencies `inv_freq` (D/2,)
    (the rotate-half convention of llama, mistral and qwen; float32 angles, as the model's own)."""
    import torch

    freqs = positions.reshape(-1, 1).float() * inv_freq.reshape(1, -1).float().to(positions.device)  # (T, D/2)
    return torch.cos(freqs), torch.sin(freqs)


def rotate(k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys (H, T, D) float32 rotated by RoPE at `positions` (T,) (negative: the rotation taken off)."""
    import torch

    cos, sin = _rotation(positions, inv_freq)  # (T, D/2) each
    half = k.shape[-1] // 2
    x1, x2 = k[..., :half], k[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # (H, T, D)


def _round_up_f16(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to float16, never below x (a scale that covers its group's range)."""
    import torch

    h = x.to(torch.float16)
    low = h.float() < x
    if bool(low.any()):
        h = torch.where(low, torch.nextafter(h, torch.full_like(h, math.inf)), h)
    return h


def _quantize(x: torch.Tensor, bits: int, zero: bool, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes (uint8, x's shape), float16 scales and minimums (None when symmetric) of `x` (float32,
    groups along `dim`): asymmetric q = round((x - m) / s) in [0, 2^bits - 1]; symmetric
    q = round(x / s) + 2^(bits-1) in [1, 2^bits - 1]. Rounds half up (clamped, + 0.5, truncated)."""
    import torch

    top = (1 << bits) - 1
    if zero:
        lo, hi = torch.aminmax(x, dim=dim, keepdim=True)
        m = lo.to(torch.float16)
        m32 = m.float()
        s = _round_up_f16((hi - m32).clamp_min(0) / top)
        inv = torch.where(s == 0, 0.0, 1.0 / s.float())  # a constant group: every code 0, decoded as m
        q = torch.sub(x, m32).mul_(inv).clamp_(0, top).add_(0.5)
        return q.to(torch.uint8), s, m
    mid = 1 << (bits - 1)
    s = _round_up_f16(x.abs().amax(dim, keepdim=True) / (mid - 1))
    inv = torch.where(s == 0, 0.0, 1.0 / s.float())
    q = torch.mul(x, inv).add_(mid).clamp_(1, top).add_(0.5)
    return q.to(torch.uint8), s, None


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (any shape, uint8) as bytes in flat order: one a byte (8 bits), or two (4 bits: the
    flat first half in the low nibbles, the second half in the high ones)."""
    flat = codes.reshape(-1)
    if bits == 8:
        return flat
    half = flat.numel() // 2
    return flat[:half] | (flat[half:] << 4)


def _bytes(codes: torch.Tensor, *scales: torch.Tensor | None) -> torch.Tensor:
    """One part: the packed codes (padded to an even length), then the float16 scales and minimums."""
    import torch

    parts = [codes] + ([torch.zeros(1, dtype=torch.uint8)] if codes.numel() % 2 else [])
    parts += [t.contiguous().reshape(-1).view(torch.uint8) for t in scales if t is not None]
    return torch.cat(parts)


def encode_layer(codec: Codec, k: torch.Tensor, v: torch.Tensor, *, pos_start: int = 0,
                 inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V (each (H, T, D), any float dtype, CPU) as the K part and V part bytes
    ((k_nbytes,) and (v_nbytes,) uint8). With a KEYS_PRE_ROPE codec the keys (rotated at positions
    pos_start..) are first turned back to position 0 with `inv_freq` (required then). Pure: no side effects."""
    import torch

    if codec.raw or not codec.supports(k.shape[-1]):
        raise ValueError(f"encode_layer: codec {codec.name} cannot encode head_dim {k.shape[-1]}")
    h, t, d = k.shape
    x = k.float()
    if codec.keys == KEYS_PRE_ROPE:
        if inv_freq is None:
            raise ValueError("encode_layer: a pre-RoPE codec needs the model's RoPE frequencies (inv_freq)")
        x = rotate(x, -torch.arange(pos_start, pos_start + t), inv_freq)  # (H, T, D) at position 0
    g = codec.key_group
    groups = math.ceil(t / g)
    if groups * g != t:  # the last group is short: pad it with its last token (min and max unchanged)
        x = torch.cat((x, x[:, -1:].expand(h, groups * g - t, d)), dim=1)  # (H, groups * G, D)
    kq, ks, km = _quantize(x.view(h, groups, g, d), codec.bits, codec.key_zero, 2)  # (H, nG, G, D), (H, nG, 1, D)
    kq = kq.view(h, groups * g, d)[:, :t]  # (H, T, D)
    gv = codec.value_group_for(d)
    vq, vs, vm = _quantize(v.float().view(h, t, d // gv, gv), codec.bits, codec.value_zero, 3)  # (H, T, nV, gV)
    return _bytes(_pack(kq, codec.bits), ks, km), _bytes(_pack(vq, codec.bits), vs, vm)


# ------------------------------------------------------------------------------------ decode
def _unpack(part: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """The n codes (uint8, flat) at the start of a part, on its device."""
    import torch

    if bits == 8:
        return part[:n]
    packed = part[: n // 2]
    codes = torch.empty(n, dtype=torch.uint8, device=part.device)  # (N,)
    torch.bitwise_and(packed, 15, out=codes[: n // 2])
    torch.bitwise_right_shift(packed, 4, out=codes[n // 2 :])
    return codes


def _scales(part: torch.Tensor, at: int, count: int, zero: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """float16 scales and minimums (None when symmetric) of `count` groups from byte `at` of a part."""
    import torch

    s = part[at : at + 2 * count].view(torch.float16)
    at += 2 * count
    if not zero:
        return s, None, at
    return s, part[at : at + 2 * count].view(torch.float16), at + 2 * count


def _apply(out: torch.Tensor, s: torch.Tensor, m: torch.Tensor | None, bits: int) -> None:
    """out (holding codes) <- codes * s + m in place (symmetric: (codes - 2^(bits-1)) * s); s and m
    broadcast over out's groups."""
    dtype = out.dtype
    s = s.to(dtype)
    if m is None:
        out.sub_(1 << (bits - 1)).mul_(s)
    else:
        out.mul_(s).add_(m.to(dtype))


def finite(codec: Codec, kpart: torch.Tensor, vpart: torch.Tensor, shape: tuple[int, int, int],
           kv_dtype: str) -> bool:
    """Whether one stored layer decodes to finite values in `kv_dtype` (a layer that does not is as
    unusable as one whose checksum fails: NaN keys make every logit NaN). `none`: K and V (each
    `shape`, (H, T, D), in `kv_dtype`) hold no NaN or infinity (one min / max pass). Encoded: every
    scale and minimum is finite and the largest code times the largest scale plus the largest minimum
    fits the dtype; only the scales are read (~1/32 of an int8 layer). Pure: no side effects."""
    import torch

    if codec.raw:
        return all(_largest(t) < math.inf for t in (kpart, vpart))
    h, t, d = shape
    at = codes_nbytes(h * t * d, codec.bits)
    limit = torch.finfo(torch_dtype(kv_dtype)).max
    for part, zero in ((kpart, codec.key_zero), (vpart, codec.value_zero)):
        groups = part[at:].view(torch.float16)  # scales, then as many minimums when asymmetric
        if groups.numel() == 0:
            continue
        largest = groups.view(2 if zero else 1, -1).abs().amax(dim=1).tolist()  # per row; NaN comes through
        top = (1 << codec.bits) - 1 if zero else 1 << (codec.bits - 1)  # the largest |code| a scale multiplies
        if not largest[0] * top + (largest[1] if zero else 0.0) <= limit:  # NaN compares False
            return False
    return True


def _largest(x: torch.Tensor) -> float:
    """The largest magnitude in `x` (0.0 when empty); NaN or infinity when `x` holds one."""
    import torch

    if x.numel() == 0:
        return 0.0
    lo, hi = (float(y) for y in torch.aminmax(x.reshape(-1)))  # NaN comes out of both, an infinity out of one
    return math.nan if math.isnan(lo) else max(-lo, hi, 0.0)


def decode_into(codec: Codec, kpart: torch.Tensor, vpart: torch.Tensor, k_out: torch.Tensor,
                v_out: torch.Tensor) -> None:
    """Decode one layer's K part and V part (uint8, on the device of the outputs) into k_out and
    v_out, float tensors (H, T, D) (views, e.g. slices of a cache; any float dtype). Keys of a
    KEYS_PRE_ROPE codec come out rotated at position 0 (the caller rotates them to their positions).
    Writes only the outputs."""
    h, t, d = k_out.shape
    n = h * t * d
    if codec.raw:  # the parts are K and V themselves
        k_out.copy_(kpart.view(h, t, d))
        v_out.copy_(vpart.view(h, t, d))
        return
    g = codec.key_group
    groups = math.ceil(t / g)
    k_out.copy_(_unpack(kpart, n, codec.bits).view(h, t, d))
    s, m, _ = _scales(kpart, codes_nbytes(n, codec.bits), h * groups * d, codec.key_zero)
    s, m = s.view(h, groups, 1, d), (m.view(h, groups, 1, d) if m is not None else None)
    full = t // g
    if full:
        _apply(k_out[:, : full * g].view(h, full, g, d), s[:, :full], m[:, :full] if m is not None else None,
               codec.bits)
    if full < groups:
        _apply(k_out[:, full * g :], s[:, full], m[:, full] if m is not None else None, codec.bits)
    gv = codec.value_group_for(d)
    v_out.copy_(_unpack(vpart, n, codec.bits).view(h, t, d))
    s, m, _ = _scales(vpart, codes_nbytes(n, codec.bits), h * t * (d // gv), codec.value_zero)
    _apply(v_out.view(h, t, d // gv, gv), s.view(h, t, d // gv, 1),
           m.view(h, t, d // gv, 1) if m is not None else None, codec.bits)
