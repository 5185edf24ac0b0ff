"""The stale-K/V corrections: the candidate rows a recompute leaves stale get the mean
K/V offset the recomputed rows measure (`stale_shift`) and a logit bias on their keys
(`stale_bias`), both measured in the request itself (docs/EVAL.md)."""

from __future__ import annotations

import torch

from blend.model.cache import KVCache
from blend.model.native import native_shift_rows
from blend.model.runner import Runner, apply_rope
from blend.recompute.plan import _EMPTY
from blend.recompute.selector import stale_key_bias

# fewer recomputed rows than this at a layer: no K/V shift there (too few to take a mean over)
MIN_SHIFT_ROWS = 16



def _at_positions(offset: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One un-rotated vector per KV head, offset (Hkv, 1, D), rotated to each of T positions
    given by their cos, sin (T, D): (Hkv, T, D)."""
    return apply_rope(offset.expand(-1, cos.shape[0], -1).contiguous(), cos, sin)



def shift_applies(setting: str, policy: str) -> bool:
    """Whether config `stale_shift` (auto | on | off) shifts the stale K/V under selection `policy`.

    auto leaves out `deviation`: it recomputes the rows whose K/V deviate most, so their mean
    offset overstates the stale rows' (measured worse on MuSiQue dev; docs/EVAL.md)."""
    return setting == "on" or (setting == "auto" and policy != "deviation")



class StaleKeys:
    """The candidate rows whose cached K/V the recompute leaves stale, and their correction.

    At each layer, before the layer's fresh K/V are written, the recomputed candidate rows
    show in this very request how their loaded K/V differ from what a full prefill gives:
    - with `shift` (config `stale_shift`), the mean of fresh minus loaded over those rows,
      per KV head (keys un-rotated first, so the offset is position-free), is added to the
      stale rows' K/V in the cache (keys rotated back to each row's position);
    - with `enabled` (config `stale_bias`), how much more the query rows attend to the
      recomputed rows' loaded keys (shifted, with `shift`) than to their fresh ones
      (selector.stale_key_bias, per KV head) is set, negated, on the stale rows' keys
      (`KVCache.set_bias`): every later attention over the cache adds it.
    Both apply to the recompute and then to each decoded token. No recomputed row (reuse) or
    no stale row (ratio 1): nothing is changed.
    """

    def __init__(self, cand_rows: torch.Tensor, n: int, device: torch.device, enabled: bool, shift: bool = False):
        self.is_cand = torch.zeros(n, dtype=torch.bool)
        self.is_cand[cand_rows] = True
        self.device, self.enabled, self.shift = device, enabled, shift
        self.rows = _EMPTY  # (S,) stale rows, host
        self.rows_dev = _EMPTY.to(device)
        self._rotation: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # per RoPE kind: cos, sin (S, D) of the stale rows
        self._means: list[torch.Tensor | None] = []  # per layer: the mean bias over heads (None: none set)

    def update(self, active: torch.Tensor) -> None:
        """The stale rows are the candidates not in `active` (sorted host positions)."""
        stale = self.is_cand.clone()
        stale[active] = False
        self.rows = stale.nonzero().flatten()
        self.rows_dev = self.rows.to(self.device)
        self._rotation = {}

    def correct(self, runner: Runner, cache: KVCache, layer: int, query_q: torch.Tensor, fresh_k: torch.Tensor,
                fresh_v: torch.Tensor, recomputed: torch.Tensor) -> None:
        """query_q (H, Q, D) the query rows' fresh queries; fresh_k, fresh_v (Hkv, S, D) the fresh
        K/V of the recomputed candidate rows `recomputed` (S,) (device positions) at `layer`."""
        if not (self.enabled or self.shift) or self.rows.numel() == 0 or recomputed.numel() == 0:
            self._means.append(None)
            return
        loaded = cache.k[layer][:, recomputed]  # (Hkv, S, D) as placed by the loader: read before the write
        if self.shift and recomputed.numel() >= MIN_SHIFT_ROWS:
            loaded = self._shift(runner, cache, layer, fresh_k, fresh_v, loaded, recomputed)
        if not self.enabled:
            self._means.append(None)
            return
        bias = stale_key_bias(query_q, fresh_k, loaded, runner.scaling)  # (Hkv,)
        cache.set_bias(layer, self.rows_dev, -bias)
        self._means.append(bias.mean())  # kept on the device: no sync per layer

    def _shift(self, runner: Runner, cache: KVCache, layer: int, fresh_k: torch.Tensor, fresh_v: torch.Tensor,
               loaded_k: torch.Tensor, recomputed: torch.Tensor) -> torch.Tensor:
        """Add the recomputed rows' mean K/V offset to the stale rows of `layer`; returns the
        recomputed rows' loaded keys with the same offset (Hkv, S, D), for the bias."""
        cos, sin = runner.rotation(recomputed, layer)  # (S, D) float32: R(p) of each recomputed row (this layer's RoPE)
        # R(p) k_fresh - R(p) k_loaded, turned back by R(-p): cos(-x) = cos x, sin(-x) = -sin x
        dk = apply_rope(fresh_k.float() - loaded_k.float(), cos, -sin).mean(dim=1, keepdim=True)  # (Hkv, 1, D)
        dv = (fresh_v.float() - cache.v[layer][:, recomputed].float()).mean(dim=1, keepdim=True)  # (Hkv, 1, D)
        kind = runner.layer_rope[layer]
        if kind not in self._rotation:
            self._rotation[kind] = runner.rotation(self.rows, layer)
        st_cos, st_sin = self._rotation[kind]  # (T, D) of the T stale rows
        keys, values, st = cache.k[layer], cache.v[layer], self.rows_dev
        # on a CPU one native pass over the stale rows (their K/V rounded once); elsewhere gathers and scatters
        if not (runner.native_blend and native_shift_rows(keys, values, self.rows, dk[:, 0].contiguous(),
                                                           dv[:, 0].contiguous(), st_cos, st_sin)):
            keys[:, st] += _at_positions(dk, st_cos, st_sin).to(keys.dtype)
            values[:, st] += dv.to(values.dtype)
        return loaded_k + _at_positions(dk, cos, sin).to(loaded_k.dtype)

    def skip(self) -> None:
        """A layer with nothing to correct."""
        self._means.append(None)

    def per_layer(self) -> tuple[float, ...]:
        """The mean over heads of the offset taken off the stale keys at each layer so far."""
        return tuple(0.0 if m is None else float(m) for m in self._means)

