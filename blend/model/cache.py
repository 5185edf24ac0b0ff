"""The KV cache of one sequence: preallocated per-layer K/V where slot i holds position i,
and an optional per-key attention-logit bias (blend's stale-key correction)."""

from __future__ import annotations

import torch


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
                 dtype: torch.dtype, device: torch.device):
        shape = (kv_heads, capacity, head_dim)
        # uninitialised: a slot is always written before a query at or after its position reads it
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        self.bias: list[torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    def ensure_capacity(self, capacity: int) -> None:
        """Grow the buffers (copying) so that `capacity` positions fit."""
        if capacity <= self.capacity:
            return
        new_cap = max(capacity, int(self.capacity * 1.5) + 16)
        for store in (self.k, self.v):
            for i, t in enumerate(store):
                grown = t.new_empty((t.shape[0], new_cap, t.shape[2]))
                grown[:, : self.length] = t[:, : self.length]
                store[i] = grown
        if self.bias is not None:
            for i, b in enumerate(self.bias):
                grown = b.new_zeros((b.shape[0], new_cap))
                grown[:, : b.shape[1]] = b
                self.bias[i] = grown

    def set_bias(self, layer: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Bias the keys of slots `rows` (R,) of `layer` by `values` (kv_heads,) (a logit added
        to every query's score of those keys); other slots keep theirs (0 unless set)."""
        if self.bias is None:
            self.bias = [torch.zeros((t.shape[0], t.shape[1]), dtype=torch.float32, device=t.device) for t in self.k]
        self.bias[layer][:, rows] = values.to(self.bias[layer].device, torch.float32)[:, None]

    def clear_bias(self, start: int, end: int) -> None:
        """Unbias slots start..end-1 in every layer (their K/V are being computed afresh)."""
        if self.bias is not None:
            for b in self.bias:
                b[:, start:end] = 0.0

    def layer_bias(self, layer: int, n: int) -> torch.Tensor | None:
        """(kv_heads, n) logit bias of slots 0..n-1 of `layer`, or None when the cache has none."""
        return None if self.bias is None else self.bias[layer][:, :n]

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
        """Bytes of K/V of the filled positions."""
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

