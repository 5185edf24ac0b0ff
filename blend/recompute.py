"""CacheBlend's selective recompute: plan which rows each layer computes, then run the
layers over the loaded KV.

`plan_recompute` fixes, before any compute, the check layers and how many context rows
each keeps (`ceil(r x schedule x context)`, nested), and the first layer that needs
loaded KV. `run_layers` is the algorithm:

    for each layer:
        wait until the loader has placed this layer's cached K/V
        compute q/k/v for the active rows (all rows before the first check layer)
        at a check layer: rank the active context rows (selector.select), keep the top ones
        write the fresh K/V of the active rows into the cache at their positions
        attend the active rows over the merged K/V (exact causal mask by position)
        finish the layer (o_proj, MLP) for the active rows only
    logits of the last row

`reuse` is the same loop with no check layer (only the query rows are computed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from blend.pipeline import LayerLoader
from blend.prompt import Prompt
from blend.runner import KVCache, Runner
from blend.selector import CheckLayerKV, schedule_counts, select
from blend.stats import SelectionReport


@dataclass(frozen=True)
class RecomputePlan:
    """Which rows each layer computes for one prompt."""

    n: int  # prompt length
    ctx_rows: torch.Tensor  # (C,) positions of cached context rows
    query_rows: torch.Tensor  # (Q,) positions of the query rows (always computed)
    check_layers: tuple[int, ...]  # layers where rows are selected
    counts: tuple[int, ...]  # context rows kept at each check layer (non-increasing)
    load_from: int  # first layer whose cached K/V is read (num_layers: none)
    # load-or-compute split (blend.split): positions [0, fresh) are computed in every layer, never loaded
    fresh_rows: torch.Tensor = torch.zeros(0, dtype=torch.long)  # (F,)

    @property
    def first_active(self) -> torch.Tensor:
        """Rows computed at layer 0: all of them when a check layer comes, else the fresh rows and the query."""
        return torch.arange(self.n) if self.check_layers else torch.cat([self.fresh_rows, self.query_rows])


def plan_recompute(prompt: Prompt, ratio: float, check_layers: tuple[int, ...], schedule: tuple[float, ...],
                   num_layers: int, fresh: int = 0) -> RecomputePlan:
    """Plan blend at `ratio` (0: reuse). Check layers beyond the model are dropped; the
    last one kept then takes the final budget. `fresh` (a segment boundary) is the split's
    computed prefix: those rows are computed everywhere, the ratio applies to the rest."""
    cached = [s for s in prompt.segments if s.kind != "query" and s.start >= fresh]
    ctx_rows = torch.cat([torch.arange(s.start, s.end) for s in cached]) if cached else torch.zeros(0, dtype=torch.long)
    n_ctx = ctx_rows.numel()
    layers: list[int] = []
    counts: list[int] = []
    if ratio > 0 and n_ctx:
        layers = [c for c in check_layers if c < num_layers]
        counts = schedule_counts(ratio, schedule[: len(layers)], n_ctx)
        if layers and len(layers) < len(check_layers):
            counts[-1] = schedule_counts(ratio, (1.0,), n_ctx)[0]
    # cached K/V is needed from the first check layer that drops a context row on;
    # everything kept everywhere (e.g. ratio 1) is a full prefill: no loads
    partial = [c for c, kept in zip(layers, counts, strict=True) if kept < n_ctx]
    load_from = partial[0] if partial else (num_layers if layers else 0)
    return RecomputePlan(len(prompt), ctx_rows, torch.arange(prompt.query.start, len(prompt)), tuple(layers),
                         tuple(counts), load_from, torch.arange(fresh))


@torch.inference_mode()
def run_layers(runner: Runner, cache: KVCache, token_ids: torch.Tensor, plan: RecomputePlan, loader: LayerLoader,
               *, policy: str, deviation_kind: str) -> tuple[torch.Tensor, SelectionReport]:
    """Run every layer over `cache` (filled by `loader`) computing only the planned rows.

    Returns the last row's logits (vocab,) and what was selected.
    """
    n, dev = plan.n, runner.device
    is_ctx = torch.zeros(n, dtype=torch.bool)
    is_ctx[plan.ctx_rows] = True
    cos_all, sin_all = runner.rope(torch.arange(n))
    active = plan.first_active  # (T,) prompt rows computed at this layer, sorted
    h = runner.embed(token_ids[active])  # (T, hidden)
    selected: list[torch.Tensor] = []
    recomputed, selection_s = 0, 0.0
    # the active rows change only at check layers: their device copy, RoPE rows and attention
    # plan (runner.attend caches it for this `active` tensor) are made once per change
    rows = active.to(dev)
    cos, sin = cos_all[rows], sin_all[rows]
    for layer in range(runner.num_layers):
        loader.wait(layer)
        q, k, v = runner.qkv(layer, h, cos, sin)  # (H, T, D), (Hkv, T, D) x2
        changed = False
        if layer in plan.check_layers:
            t0 = time.perf_counter()
            cand = is_ctx[active].to(dev)
            cand_rows = rows[cand]  # active context rows: the candidates
            count = plan.counts[plan.check_layers.index(layer)]
            if count < cand_rows.numel():
                prior = (cache.k[layer][:, cand_rows], cache.v[layer][:, cand_rows])  # copies, before overwriting
                cache.write(layer, rows, k, v, n)
                q_rows = torch.searchsorted(active, plan.query_rows).to(dev)
                kv = CheckLayerKV(k[:, cand], v[:, cand], *prior, q[:, q_rows], cache.k[layer][:, :n], runner.scaling)
                chosen = select(policy, kv, cand_rows, count, deviation_kind).cpu()
            else:  # everything kept: no scores needed
                cache.write(layer, rows, k, v, n)
                chosen = cand_rows.cpu()
            selected.append(chosen)
            recomputed = int(chosen.numel())
            keep = torch.searchsorted(active, torch.cat([plan.fresh_rows, chosen, plan.query_rows]).unique(sorted=True))
            keep_dev = keep.to(dev)
            q, h, active, changed = q[:, keep_dev], h[keep_dev], active[keep], True
            selection_s += time.perf_counter() - t0
        else:
            cache.write(layer, rows, k, v, n)
        if layer == runner.num_layers - 1:  # only the last row's output is needed
            q, h, active, changed = q[:, -1:], h[-1:], active[-1:], True
        attn = runner.attend(q, active, cache.k[layer][:, :n], cache.v[layer][:, :n])  # host positions: no sync
        h = runner.finish(layer, h, attn)
        if changed:
            rows = active.to(dev)
            cos, sin = cos_all[rows], sin_all[rows]
    report = SelectionReport(plan.check_layers, tuple(int(c.numel()) for c in selected),
                             recomputed if plan.check_layers else 0, selection_s, tuple(selected))
    return runner.logits(h[-1:])[0], report
