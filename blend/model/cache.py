"""The KV cache of one sequence: preallocated per-layer K/V where slot i holds position i,
and an optional per-key attention-logit bias (blend's stale-key correction).

A sliding-window layer needs only the last `window` positions to go on decoding; once the
prompt is in (`compact_`), such a layer becomes a ring of window + RING_SLACK slots where
position p lives in slot p % slots, so a long generation keeps its memory bounded. The
slack lets a chat turn rewind a few tokens (a re-rendered end of turn) and still find
every key its window needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

RING_SLACK = 64  # ring slots beyond the window: how far a cache may rewind and still hold every window


class KVCache:
    """Preallocated per-layer K/V for one sequence; slot i holds position i.

    k[layer], v[layer]: (kv_heads, capacity, head_dim). `length` is the number of
    positions filled (0..length-1); it is set by whoever fills the cache.

    `bias` (None, or per layer a (kv_heads, capacity) float32 tensor) is an additive
    attention-logit bias per key slot that every attention over this cache adds: blend
    sets it on slots whose K/V were loaded stale and not recomputed (blend.recompute,
    `stale_bias`), so that later queries (the query rows, then every decoded token)
    weigh those keys as the recomputed ones say they should. Slots computed afresh
    (`Runner.prefill`, `write`) are unbiased.
    """

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, capacity: int,
                 dtype: torch.dtype, device: torch.device, windows: Sequence[int | None] | None = None,
                 ring: bool = False):
        """`windows`: each layer's sliding window (None: full attention); with `ring`, the sliding
        layers are rings from the start (at most window + RING_SLACK slots), else they become
        rings at `compact_`."""
        self.windows = tuple(windows) if windows is not None else (None,) * num_layers
        # per layer: None (slot i = position i) or the ring's slot count (position p in slot p % slots)
        self.rings: list[int | None] = [None] * num_layers
        sizes = [capacity] * num_layers
        if ring:
            for i, w in enumerate(self.windows):
                if w is not None:
                    self.rings[i] = w + RING_SLACK
                    sizes[i] = min(capacity, w + RING_SLACK)
        # uninitialised: a slot is always written before a query at or after its position reads it
        self.k = [torch.empty((kv_heads, n, head_dim), dtype=dtype, device=device) for n in sizes]
        self.v = [torch.empty((kv_heads, n, head_dim), dtype=dtype, device=device) for n in sizes]
        self.length = 0
        self.bias: list[torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        """Positions the cache holds without growing (rings hold any number: they wrap)."""
        linear = [t.shape[1] for t, r in zip(self.k, self.rings, strict=True) if r is None]
        return min(linear) if linear else 1 << 62

    def is_ring(self, layer: int) -> bool:
        return self.rings[layer] is not None

    def ensure_capacity(self, capacity: int) -> None:
        """Grow the buffers (copying) so that `capacity` positions fit; a ring layer grows up to
        its slot count only (it has not wrapped while it is smaller: slot = position there)."""
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                limit = self.rings[i]
                size = t.shape[1]
                want = capacity if limit is None else min(capacity, limit)
                if want <= size:
                    continue
                new_cap = max(want, int(size * 1.5) + 16)
                new_cap = new_cap if limit is None else min(new_cap, limit)
                grown = t.new_empty((t.shape[0], new_cap, t.shape[2]))
                kept = min(self.length, size)
                grown[:, :kept] = t[:, :kept]
                store[i] = grown
        if self.bias is not None:
            for i, b in enumerate(self.bias):
                if b.shape[1] < self.k[i].shape[1]:
                    grown = b.new_zeros((b.shape[0], self.k[i].shape[1]))
                    grown[:, : b.shape[1]] = b
                    self.bias[i] = grown

    def growth_bytes(self, capacity: int) -> int:
        """Bytes `ensure_capacity(capacity)` would add at least: every linear layer's new
        slots, a ring's up to its slot count (a ring never grows past it)."""
        out = 0
        for store in (self.k, self.v):
            for t, limit in zip(store, self.rings, strict=True):
                want = capacity if limit is None else min(capacity, limit)
                out += max(0, want - t.shape[1]) * t.shape[0] * t.shape[2] * t.element_size()
        return out

    def slots(self, layer: int, start: int, end: int) -> slice | torch.Tensor:
        """Where positions start..end-1 of `layer` live: a slice, or (ring layers past their
        first lap) the slot indices on the cache's device."""
        size = self.k[layer].shape[1]
        if self.rings[layer] is None or end <= size:
            return slice(start, end)
        return torch.arange(start, end, device=self.k[layer].device) % size

    def window(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (Hkv, end - start, D) of positions start..end-1 of `layer`, in position order
        (a ring: gathered). ValueError when a ring no longer holds them all."""
        size = self.k[layer].shape[1]
        if self.rings[layer] is not None and end > size and start < self.length - size:
            raise ValueError(f"layer {layer}'s ring of {size} slots no longer holds position {start} "
                             f"(length {self.length})")
        where = self.slots(layer, start, end)
        return self.k[layer][:, where], self.v[layer][:, where]

    def window_bias(self, layer: int, start: int, end: int) -> torch.Tensor | None:
        """(Hkv, end - start) logit bias of positions start..end-1 of `layer`, or None without one."""
        if self.bias is None:
            return None
        where = self.slots(layer, start, end)
        return self.bias[layer][:, where.to(self.bias[layer].device) if isinstance(where, torch.Tensor) else where]

    def put(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (Hkv, T, D) at positions start..start+T-1 of `layer` (a ring keeps the
        last slots' worth of them); their bias is cleared."""
        t = k.shape[1]
        size = self.k[layer].shape[1]
        if self.rings[layer] is not None and t > size:  # only the last lap survives
            k, v, start = k[:, t - size:], v[:, t - size:], start + t - size
            t = size
        where = self.slots(layer, start, start + t)
        self.k[layer][:, where] = k
        self.v[layer][:, where] = v
        if self.bias is not None:
            self.bias[layer][:, where.to(self.bias[layer].device) if isinstance(where, torch.Tensor) else where] = 0.0

    def compact_(self) -> None:
        """Turn every sliding layer into a ring of window + RING_SLACK slots holding the last
        positions (so decoding no longer grows it); full layers and caches without windows
        are left as they are. Frees the sliding layers' other slots."""
        for i, w in enumerate(self.windows):
            if w is None or self.rings[i] is not None:
                continue
            slots = w + RING_SLACK
            self.rings[i] = slots
            if self.k[i].shape[1] <= slots:
                continue  # slot = position until it wraps; grows up to `slots`
            lo = max(0, self.length - slots)
            keep = torch.arange(lo, self.length, device=self.k[i].device)  # positions kept
            for store in (self.k, self.v):
                t = store[i]
                ring = t.new_empty((t.shape[0], slots, t.shape[2]))
                ring[:, keep % slots] = t[:, lo:self.length]
                store[i] = ring
            if self.bias is not None:
                b = self.bias[i]
                ring = b.new_zeros((b.shape[0], slots))
                ring[:, keep.to(b.device) % slots] = b[:, lo:self.length]
                self.bias[i] = ring

    def set_bias(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Bias the keys of slots `rows` (R,) of `layer` by `values` (kv_heads,) (a logit added
        to every query's score of those keys); other slots keep theirs (0 unless set).
        (Blend sets it on prompt caches, before any layer is a ring.)"""
        if self.bias is None:
            self.bias = [torch.zeros((t.shape[0], t.shape[1]), dtype=torch.float32, device=t.device) for t in self.k]
        self.bias[layer][:, rows] = values.to(self.bias[layer].device, torch.float32)[:, None]

    def clear_bias(self, start: int, end: int) -> None:
        """Unbias positions start..end-1 in every layer (their K/V are being computed afresh)."""
        if self.bias is not None:
            for i, b in enumerate(self.bias):
                if self.rings[i] is not None and end > b.shape[1]:
                    where = torch.arange(max(start, end - b.shape[1]), end, device=b.device) % b.shape[1]
                    b[:, where] = 0.0
                else:
                    b[:, start:end] = 0.0

    def layer_bias(self, layer: int, n: int) -> torch.Tensor | None:
        """(kv_heads, n) logit bias of slots 0..n-1 of `layer`, or None when the cache has none."""
        return None if self.bias is None else self.bias[layer][:, :n]

    def put_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k, v (Hkv, T, D) at positions `rows` (T,) (on the cache's device; not a ring's
        wrapped slots) of `layer`; their bias is cleared."""
        self.k[layer][:, rows] = k
        self.v[layer][:, rows] = v
        if self.bias is not None:
            self.bias[layer][:, rows.to(self.bias[layer].device)] = 0.0

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> None:
        """Write fresh k/v (Hkv, T, D) of prompt rows `rows` (T,) into the layer; n = prompt length
        (when every row is written the copy is one contiguous slice)."""
        if rows.numel() == n:
            self.k[layer][:, :n] = k
            self.v[layer][:, :n] = v
        else:
            self.k[layer][:, rows] = k
            self.v[layer][:, rows] = v
        if self.bias is not None:
            self.bias[layer][:, rows.to(self.bias[layer].device)] = 0.0

    def layer(self, layer: int, length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.length if length is None else length
        return self.k[layer][:, :n], self.v[layer][:, :n]

    def nbytes(self) -> int:
        """Bytes of K/V of the filled positions (a ring: its slots)."""
        return sum(t[:, : self.length].numel() * t.element_size() for t in self.k + self.v)

    def allocated_bytes(self) -> int:
        """Bytes of K/V the cache holds allocated (every slot, filled or not)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def restore_bias(self, per_layer: list[torch.Tensor]) -> None:
        """Set the bias of slots 0..n-1 of every layer from `per_layer` ((kv_heads, n) each, e.g. a
        parked copy); the other slots are unbiased."""
        self.bias = []
        for t, b in zip(self.k, per_layer, strict=True):
            full = torch.zeros((t.shape[0], t.shape[1]), dtype=torch.float32, device=t.device)
            full[:, : b.shape[1]] = b.to(t.device, torch.float32)
            self.bias.append(full)

