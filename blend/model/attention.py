"""Exact causal attention of query rows at explicit positions, and the choice of how to
compute it.

A query at position p sees exactly the keys at positions 0..p (slot i of a `KVCache`
holds position i). Queries come as sorted positions: every row (a full prefill), the last
rows (a continuation or the last layer), or a scattered subset (CacheBlend's recomputed
rows). q is (H, Tq, D); k and v are (Hkv, Tk, D); outputs are (Tq, H*D).

Strategies (`AttentionPlan.kind`):
  flash    flash-attn (optional extra) for half-precision queries that are the last rows
  causal   every row: one causal kernel call
  all      one query that sees every key: one unmasked call
  pad      most rows: the queries placed at their positions in a full-length block, one
           causal call over it, their rows kept (costs a full causal pass)
  groups   position-sorted query groups, each over the keys up to its last position with a
           boolean mask (on CUDA the query heads of a KV head may be folded into the rows)
  tail     the last rows (contiguous, ending at the last key): one causal call with the
           mask aligned to the bottom right (the CUDA flash kernel's own alignment)
  window   a sliding-window layer (a query at p sees keys p - W + 1 .. p only): the rows in
           position-sorted groups spanning fewer than W positions, each over the keys from
           its first row's window start to its last row, with a band mask (none where every
           key of the slice is visible, e.g. one decoded token); used once some row's window
           starts after key 0 (before that, the layer attends like a full one)
  merge    cost proportional to the visible (query, key) pairs: the keys from the first
           query's position on are cut into equal bands; one causal call covers every band
           (each query placed at its offset in its band, its band's keys only), and per band
           one unmasked call attends its queries over every key before the band. Both
           kernels return the log-sum-exp of their scores, so the two partial results of a
           row merge exactly: out = lerp(out_band, out_prefix, sigmoid(lse_prefix - lse_band)).

On a CPU the choice is a fixed rule (today's measured one, `rule_strategy`). On CUDA the
runner times the exact candidates (`candidates`) once per shape bucket (`shape_bucket`)
with CUDA events and keeps the fastest (`AttentionTuner`); a candidate that fails or
disagrees with the reference candidate is never chosen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from blend.model.native import native_decode_attention

try:  # optional extra `gpu`
    from flash_attn import flash_attn_func  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - CPU machines
    flash_attn_func = None

# Measured with CPU SDPA (3.1k keys, 9/3 heads): the masked kernel costs about as much per
# (query, key) pair as the causal one but visits the whole upper triangle; split into up to
# ATTN_GROUPS position-sorted groups with truncated keys it is ~35% faster, and beats a full
# causal pass up to ~70% of the rows.
PAD_TO_CAUSAL = 0.75  # query rows / keys above which the causal kernel on a full block wins (CPU rule)
ATTN_GROUPS = 8
ATTN_GROUP_MIN = 32  # queries per group at least (the rule's group count)
MERGE_BANDS = 8  # bands of `merge` when not given
TUNED_BANDS = (1, 4, 8, 16)  # band counts the tuner tries (1: a block of rows, e.g. the query)
FORCEABLE = ("groups", "pad", "merge")  # strategies that are exact for any sorted rows
TAIL = "tail"  # exact only for contiguous rows ending at the last key


@dataclass(frozen=True)
class AttentionPlan:
    """How one set of query rows is attended (built by `build_plan` or `Runner.plan_attention`).

    kind: see the module docstring, or `tune` (the candidates in `options`, timed on first
    use for shape `bucket`). parts: groups (group count) or merge (band count) as asked,
    0 for the default rule.
    """

    kind: str
    tq: int
    tk: int
    rows: torch.Tensor | None = None  # pad: (Tq,) query positions on the device
    groups: tuple[tuple[int, int, int, torch.Tensor], ...] = ()  # groups: (first, end row, keys, mask)
    fold: int = 1  # groups: query heads per KV head folded into the rows
    parts: int = 0
    band: tuple[int, int, int] = (0, 0, 0)  # merge: (first key, width, count) of the causal band block
    band_index: torch.Tensor | None = None  # merge: (2, Tq) each query's band and offset in it, on the device
    prefixes: tuple[tuple[int, int, int], ...] = ()  # merge: (first, end row, keys) per unmasked prefix call
    windows: tuple[tuple[int, int, int, int, torch.Tensor, bool], ...] = ()  # window: (first, end row,
    # first key, end key, band mask (Tg, keys), whether the mask hides any key of the slice)
    options: tuple[AttentionPlan, ...] = ()  # tune: the exact candidates, the reference first
    bucket: tuple[int, int] = (0, 0)  # tune: the shape bucket

    @property
    def strategy(self) -> str:
        """Name of the strategy, e.g. `merge/8`, `groups/1/fold4`, `pad` (what `build_plan` takes)."""
        name = self.kind + (f"/{self.parts}" if self.parts and self.kind in ("groups", "merge") else "")
        return name + (f"/fold{self.fold}" if self.kind == "groups" and self.fold > 1 else "")


def parse_strategy(name: str) -> tuple[str, int, int | None]:
    """`kind[/parts][/foldN]` -> (kind, parts (0: default), fold (None: not given))."""
    kind, *rest = name.split("/")
    parts, fold = 0, None
    try:
        for token in rest:
            if token.startswith("fold"):
                fold = int(token[4:])
            else:
                parts = int(token)
    except ValueError:
        kind = ""
    if kind not in (*FORCEABLE, TAIL) or parts < 0 or (fold is not None and fold < 1):
        raise ValueError(f"unknown attention strategy {name!r}; use one of {', '.join(FORCEABLE)}, "
                         f"optionally with /N (groups or bands) and, for groups, /foldN, or {TAIL} "
                         "(contiguous rows ending at the last key)")
    return kind, parts, fold


# ----------------------------------------------------------------------- plans
def shortcut_plan(pos: torch.Tensor, tk: int, use_flash: bool) -> AttentionPlan | None:
    """The plan for query sets that need no choice (every row, the last rows with
    flash-attn, one query that sees every key), else None. pos: (Tq,) sorted, on the host."""
    tq = pos.numel()
    first, last = int(pos[0]), int(pos[-1])
    contiguous = last - first + 1 == tq
    if use_flash and contiguous and last == tk - 1:
        return AttentionPlan("flash", tq, tk)
    if contiguous and first == 0 and last == tk - 1:
        return AttentionPlan("causal" if tq > 1 else "all", tq, tk)
    if tq == 1 and last >= tk - 1:
        return AttentionPlan("all", tq, tk)
    return None


def rule_strategy(tq: int, tk: int) -> str:
    """The fixed choice where nothing is measured (CPU): padded causal block for most rows,
    masked groups otherwise."""
    return "pad" if tq >= PAD_TO_CAUSAL * tk else "groups"


def build_plan(name: str, pos: torch.Tensor, tk: int, fold: int, device: torch.device) -> AttentionPlan:
    """The plan of strategy `name` for queries at host positions pos (Tq,) (sorted, unique,
    all < tk). `fold` applies to groups unless the name gives one. Copies the plan's index
    tensors and masks to `device`."""
    kind, parts, named_fold = parse_strategy(name)
    tq = pos.numel()
    if kind == "pad":
        return AttentionPlan("pad", tq, tk, rows=pos.to(device))
    if kind == "merge":
        return _merge_plan(pos, tk, parts, device)
    if kind == TAIL:
        if not is_tail(pos, tk):
            raise ValueError(f"attention strategy {TAIL} needs contiguous rows ending at key {tk - 1}; "
                             "use groups, pad or merge")
        return AttentionPlan(TAIL, tq, tk)
    fold = fold if named_fold is None else named_fold
    count = parts or max(1, min(ATTN_GROUPS, tq // ATTN_GROUP_MIN))
    bounds = torch.linspace(0, tq, min(count, tq) + 1).long().tolist()
    groups = []
    for a, b in zip(bounds, bounds[1:], strict=False):
        end = int(pos[b - 1]) + 1
        mask = torch.arange(end)[None, :] <= pos[a:b, None]  # (Tg, end) bool
        if fold > 1:
            mask = mask.repeat_interleave(fold, dim=0)  # (Tg * g, end): one row per folded query head
        groups.append((a, b, end, mask.to(device)))
    return AttentionPlan("groups", tq, tk, groups=tuple(groups), fold=fold, parts=parts)


def _merge_plan(pos: torch.Tensor, tk: int, parts: int, device: torch.device) -> AttentionPlan:
    """Bands of equal width ending at the last key, the first one holding the first query;
    leading and trailing bands without queries are dropped."""
    tq = pos.numel()
    span = tk - int(pos[0])
    count = max(1, min(parts or MERGE_BANDS, span))
    width = -(-span // count)
    while count > 1 and count * width > tk:  # the bands must start at a key >= 0
        count -= 1
        width = -(-span // count)
    base = tk - count * width  # <= first query position
    band = torch.div(pos - base, width, rounding_mode="floor")  # (Tq,) nondecreasing
    lo, hi = int(band[0]), int(band[-1])
    start, used = base + lo * width, hi - lo + 1
    offset = pos - start  # (Tq,) in [0, used * width)
    index = torch.stack([torch.div(offset, width, rounding_mode="floor"), offset % width])  # (2, Tq)
    cuts = torch.searchsorted(index[0].contiguous(), torch.arange(used + 1)).tolist()  # first row per band
    prefixes = tuple((a, b, start + j * width) for j, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))
                     if b > a and start + j * width > 0)
    return AttentionPlan("merge", tq, tk, parts=parts, band=(start, width, used), band_index=index.to(device),
                         prefixes=prefixes)


def window_plan(pos: torch.Tensor, tk: int, window: int, device: torch.device) -> AttentionPlan:
    """The `window` plan of queries at host positions pos (Tq,) (sorted, unique, all < tk) in a
    layer whose query at p sees the keys p - window + 1 .. p: groups of rows spanning fewer
    than `window` positions (so at most 2 * window - 1 keys each), each over keys
    [first row's window start, last row + 1) with a boolean band mask (applied only where it
    hides a key)."""
    tq = pos.numel()
    groups = []
    a = 0
    while a < tq:
        first = int(pos[a])
        b = int(torch.searchsorted(pos, first + window))  # rows at positions first .. first + window - 1
        lo, hi = max(0, first - window + 1), int(pos[b - 1]) + 1
        keys = torch.arange(lo, hi)  # (Tk',) key positions
        rows = pos[a:b, None]  # (Tg, 1)
        mask = (keys[None, :] <= rows) & (keys[None, :] > rows - window)  # (Tg, Tk')
        groups.append((a, b, lo, hi, mask.to(device), not bool(mask.all())))
        a = b
    return AttentionPlan("window", tq, tk, windows=tuple(groups), parts=window)


def needs_window(pos: torch.Tensor, window: int | None) -> bool:
    """Whether a sliding window of `window` hides a key from some query at sorted positions
    pos (a query at p < window sees every key 0..p, as in a full layer)."""
    return window is not None and int(pos[-1]) >= window


def is_tail(pos: torch.Tensor, tk: int) -> bool:
    """Whether sorted positions pos (Tq,) are the last rows: contiguous, ending at key tk-1."""
    return int(pos[-1]) == tk - 1 and int(pos[-1]) - int(pos[0]) + 1 == pos.numel()


def candidates(device: torch.device, dtype: torch.dtype, group: int, tail: bool = False) -> tuple[str, ...]:
    """Strategies the tuner times on `device`, the reference (today's default there) first.
    group: query heads per KV head; tail: the rows are the last ones (`is_tail`). Merge and
    tail on CUDA need the flash kernel (half precision); merge elsewhere the flash CPU kernel."""
    cuda = device.type == "cuda"
    folded = f"/fold{group}" if cuda and group > 1 else ""
    names = [f"groups{folded}", "groups", f"groups/1{folded}", "pad"]
    if not cuda or dtype in (torch.float16, torch.bfloat16):
        names += [f"merge/{n}" for n in TUNED_BANDS]
        names += [TAIL] if tail else []
    return tuple(dict.fromkeys(names))  # unique, in order


def shape_bucket(tq: int, tk: int) -> tuple[int, int]:
    """Half-octave buckets of the query and key counts: shapes whose best strategy is the same."""
    return round(2 * math.log2(max(tq, 1))), round(2 * math.log2(max(tk, 1)))


# ------------------------------------------------------------------- kernels
def run_plan(plan: AttentionPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of q (H, Tq, D) over k, v (Hkv, Tk, D) by `plan` (not `tune`). Returns (Tq, H*D)."""
    tq = q.shape[1]
    if plan.kind == "flash":
        # bottom-right aligned causal mask == exact when the queries are the last rows
        out = flash_attn_func(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                              softmax_scale=scale, causal=True)[0]  # (Tq, H, D)
        return out.reshape(tq, -1)
    if plan.kind == "pad":
        # Most rows: causal attention on a full-length block (the kernel skips the upper
        # triangle); the queries sit at their positions, their rows are kept.
        full = q.new_zeros((q.shape[0], plan.tk, q.shape[2]))
        full[:, plan.rows] = q
        out = F.scaled_dot_product_attention(full[None], k[None], v[None], is_causal=True, scale=scale,
                                             enable_gqa=True)[0]  # (H, Tk, D)
        return out[:, plan.rows].transpose(0, 1).reshape(tq, -1)
    if plan.kind == "groups":
        return _attend_groups(q, k, v, plan, scale)
    if plan.kind == "merge":
        return _attend_merge(q, k, v, plan, scale)
    if plan.kind == "window":
        outs = [F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, lo:hi], v[None, :, lo:hi],
                                               attn_mask=mask if hides else None, scale=scale, enable_gqa=True)[0]
                for a, b, lo, hi, mask, hides in plan.windows]  # (H, Tg, D) each
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(tq, -1)  # (Tq, H*D)
    if plan.kind == TAIL:
        if q.device.type == "cuda":  # the flash kernel aligns a causal mask to the bottom right: exact here
            out = torch.ops.aten._scaled_dot_product_flash_attention(q[None], k[None], v[None], 0.0, True, False,
                                                                     scale=scale)[0][0]  # (H, Tq, D)
        else:  # the CPU kernels align it to the top left: an explicit mask
            mask = torch.ones(tq, plan.tk, dtype=torch.bool, device=q.device).tril(plan.tk - tq)  # (Tq, Tk)
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                 enable_gqa=True)[0]  # (H, Tq, D)
        return out.transpose(0, 1).reshape(tq, -1)
    if plan.kind not in ("causal", "all"):
        raise ValueError(f"attention plan of kind {plan.kind!r} cannot run directly; use Runner.attend")
    out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=plan.kind == "causal",
                                         scale=scale, enable_gqa=True)[0]  # (H, Tq, D)
    return out.transpose(0, 1).reshape(tq, -1)


def _attend_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                   scale: float) -> torch.Tensor:
    """Masked attention per query group, keys truncated to the group's last position.

    Folded (fold > 1), the query heads sharing a KV head become query rows, so the kernel
    sees plain multi-head attention: a mask together with `enable_gqa` can send SDPA to a
    slower backend.
    """
    tq, g = q.shape[1], plan.fold
    if g == 1:
        outs = [F.scaled_dot_product_attention(q[None, :, a:b], k[None, :, :end], v[None, :, :end],
                                               attn_mask=mask, scale=scale, enable_gqa=True)[0]
                for a, b, end, mask in plan.groups]  # (H, Tg, D) each
        return torch.cat(outs, dim=1).transpose(0, 1).reshape(tq, -1)  # (Tq, H*D)
    hkv, d = k.shape[0], k.shape[2]
    qf = q.transpose(0, 1).reshape(tq, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, tq * g, d)  # (Hkv, Tq*g, D)
    outs = [F.scaled_dot_product_attention(qf[None, :, a * g:b * g], k[None, :, :end], v[None, :, :end],
                                           attn_mask=mask, scale=scale)[0]
            for a, b, end, mask in plan.groups]  # (Hkv, Tg*g, D) each
    out = torch.cat(outs, dim=1).view(hkv, tq, g, d)  # (Hkv, Tq, g, D)
    return out.permute(1, 0, 2, 3).reshape(tq, -1)  # (Tq, H*D): head = kv head * g + member


def causal_float_masks(plan: AttentionPlan, dtype: torch.dtype) -> list[torch.Tensor]:
    """The bool masks of a `groups` or `window` plan as additive float masks (0 visible,
    -inf not), (Tg, keys) each in `dtype`; [] for other plans."""
    if plan.kind == "window":
        return [torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
                for *_, mask, _hides in plan.windows]
    if plan.kind != "groups":
        return []
    return [torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            for _, _, _, mask in plan.groups]


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                     plan: AttentionPlan, masks: list[torch.Tensor]) -> torch.Tensor:
    """Exact causal attention plus an additive logit bias per KV head and key.

    q (H, Tq, D), k and v (Hkv, Tk, D), bias (Hkv, Tk) float: every query's score of key j
    under KV head h is q.k_j * scale + bias[h, j]. `plan` is `all` (one query that sees
    every key: one call, the bias broadcast over the heads of each group) or `groups` (not
    folded) with `masks` = causal_float_masks(plan): per group and KV head one call whose
    float mask is the causal mask plus that head's bias, so the mask is never materialised
    for all query heads. Returns (Tq, H*D).
    """
    heads, tq, d = q.shape
    hkv = k.shape[0]
    g = heads // hkv
    if plan.kind == "all":
        mask = bias.to(q.dtype).repeat_interleave(g, dim=0)[None, :, None, :]  # (1, H, 1, Tk)
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                             enable_gqa=True)[0]  # (H, Tq, D)
        return out.transpose(0, 1).reshape(tq, -1)
    spans = ([(a, e, lo, hi) for a, e, lo, hi, _, _ in plan.windows] if plan.kind == "window"
             else [(a, e, 0, end) for a, e, end, _ in plan.groups] if plan.kind == "groups" and plan.fold == 1 else None)
    if spans is None or len(masks) != len(spans):
        raise ValueError(f"biased attention runs an unfolded groups plan, a window plan or `all`, got {plan.strategy!r}")
    b = bias.to(q.dtype)
    outs = []
    for (a, e, lo, hi), causal in zip(spans, masks, strict=True):
        per_head = [F.scaled_dot_product_attention(q[None, h * g:(h + 1) * g, a:e], k[None, h:h + 1, lo:hi],
                                                   v[None, h:h + 1, lo:hi], attn_mask=causal + b[h, None, lo:hi],
                                                   scale=scale, enable_gqa=True)[0]  # (g, Tg, D)
                    for h in range(hkv)]
        outs.append(torch.cat(per_head, dim=0))  # (H, Tg, D)
    return torch.cat(outs, dim=1).transpose(0, 1).reshape(tq, -1)  # (Tq, H*D)


_FLEX: dict[str, Callable] = {}  # per device type: flex_attention, compiled on CUDA (eager elsewhere: tests)


def flex_function(device: torch.device) -> Callable | None:
    """PyTorch's FlexAttention for `device` (compiled with dynamic shapes on CUDA, where it fuses
    the score and mask functions into one kernel; eager elsewhere), or None where this torch has none."""
    kind = device.type
    if kind not in _FLEX:
        try:
            from torch.nn.attention.flex_attention import flex_attention
        except ImportError:  # pragma: no cover - older torch
            return None
        _FLEX[kind] = torch.compile(flex_attention, dynamic=True) if kind == "cuda" else flex_attention
    return _FLEX[kind]


def flex_block_mask(q_pos: torch.Tensor, tk: int, window: int | None, device: torch.device) -> Any:
    """The block mask of query rows at positions q_pos (Tq,) over tk keys: a row at p sees keys
    p - window + 1 .. p (0 .. p without a window); blocks no row sees are skipped by the kernel."""
    from torch.nn.attention.flex_attention import create_block_mask

    pos = q_pos.to(device)

    def visible(b, h, qi, ki):
        seen = pos[qi] >= ki
        return seen & (pos[qi] - ki < window) if window is not None else seen

    return create_block_mask(visible, None, None, int(q_pos.numel()), tk, device=device)


def flex_biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                          scale: float, block_mask: Any) -> torch.Tensor:
    """Attention of q (H, Tq, D) over k, v (Hkv, Tk, D) through FlexAttention: `block_mask` from
    `flex_block_mask` (positions, window), the bias (Hkv, Tk) float added to every score of key j
    under its KV head (a score modification, never a materialised mask). Returns (Tq, H*D)."""
    fn = flex_function(q.device)
    if fn is None:
        raise RuntimeError("this torch has no FlexAttention")
    heads, tq, d = q.shape
    g = heads // k.shape[0]
    score_mod = None
    if bias is not None:
        b = bias.to(torch.float32)

        def score_mod(score, batch, h, qi, ki):
            return score + b[h // g, ki].to(score.dtype)

    out = fn(q[None], k[None], v[None], score_mod=score_mod, block_mask=block_mask, scale=scale,
             enable_gqa=g > 1)[0]  # (H, Tq, D)
    return out.transpose(0, 1).reshape(tq, heads * d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """One new token's attention over every key of its sequence.

    q (H, D) the token's queries; k, v (Hkv, Tk, D) every key up to and including its own;
    bias (Hkv, Tk) float or None: an additive logit per KV head and key (`KVCache.bias`).
    The H / Hkv query heads of a KV head are folded into the query rows of that head, so
    K and V are read once per KV head (no GQA expansion) and the bias is added to all of
    them at once. Writes into `out` (H*D,) when given (contiguous); returns (H*D,).

    On a CPU two matrix products and a softmax (`cpu_decode_attention`); elsewhere one
    SDPA call with the bias as a (Hkv, 1, Tk) mask.
    """
    heads, d = q.shape
    hkv = k.shape[0]
    qf = q.view(hkv, heads // hkv, d)  # (Hkv, g, D): query heads of a KV head as rows
    if q.device.type == "cpu":
        if out is None:
            return cpu_decode_attention(qf.float() * scale, k, v, bias).view(heads * d)
        cpu_decode_attention(qf.float() * scale, k, v, bias, out.view(hkv, heads // hkv, d))
        return out
    mask = None if bias is None else bias.to(q.dtype)[:, None, :]  # (Hkv, 1, Tk)
    result = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale).reshape(heads * d)  # (H*D,)
    if out is not None:
        out.copy_(result)
        return out
    return result


def cpu_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T + bias) v for float32 queries already scaled, q (Hkv, g, D), over k, v
    (Hkv, Tk, D), bias (Hkv, Tk) or None; into `out` (Hkv, g, D) when given. Returns
    (Hkv, g, D) in v's dtype.

    CPU SDPA with a few query rows reads K/V at 8-10 GB/s in float32 and ~3 GB/s in
    bfloat16; two batched products run at memory speed in float32 (about 2x SDPA's speed at
    4k keys). Scores and softmax are float32 always: half-precision keys are widened for
    the product (rounding scores to bfloat16 costs ~10x the attention error; this keeps
    SDPA's), the probabilities are rounded to V's dtype for the second product (as SDPA's
    CPU kernel does).

    Where the native kernel applies (blend.model.native: float32 or bfloat16 K/V, built
    for this machine), it computes the same in one pass over K and V, the probabilities
    kept in float32; at 4k keys in bfloat16 it is ~2x faster than these products.
    """
    if out is None:
        out = torch.empty(q.shape, dtype=v.dtype, device=v.device)
    if native_decode_attention(q, k, v, bias, out):
        return out
    keys = k.transpose(1, 2)  # (Hkv, D, Tk)
    if k.dtype != torch.float32:
        keys = keys.float()
    if bias is not None:
        scores = torch.baddbmm(bias[:, None, :].expand(-1, q.shape[1], -1), q, keys)  # (Hkv, g, Tk)
    else:
        scores = torch.bmm(q, keys)  # (Hkv, g, Tk)
    probs = torch.softmax(scores, dim=-1)
    if v.dtype != torch.float32:
        probs = probs.to(v.dtype)
    return torch.bmm(probs, v, out=out)  # (Hkv, g, D)


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unmasked (or square causal) attention that also returns the log-sum-exp of each
    row's scaled scores. q (B, H, Tq, D); k, v (B, Hkv, Tk, D) with H a multiple of Hkv
    (grouped-query attention is native to both kernels). Returns out (B, H, Tq, D) and lse
    (B, H, Tq) float32. CUDA: the flash kernel (fp16/bf16); elsewhere the flash CPU kernel."""
    if q.device.type == "cuda":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse


def merge_into(out: torch.Tensor, lse: torch.Tensor, other: torch.Tensor, other_lse: torch.Tensor) -> None:
    """Combine two softmax attentions of the same queries over disjoint key sets, exactly.

    out, other: (T, H, D) each part's normalised output; lse, other_lse: (T, H) the
    log-sum-exp of each part's scores. Overwrites `out` with the attention over both key
    sets: other's share of the softmax mass is exp(other_lse) / (exp(lse) + exp(other_lse))
    = sigmoid(other_lse - lse). Computed in float32.
    """
    share = torch.sigmoid(other_lse.float() - lse.float()).unsqueeze(-1)  # (T, H, 1)
    out.copy_(torch.lerp(out.float(), other.float(), share))


def _attend_merge(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: AttentionPlan,
                  scale: float) -> torch.Tensor:
    """Band-causal call + unmasked prefix calls, merged by log-sum-exp (see the module docstring)."""
    h, tq, d = q.shape
    start, width, count = plan.band
    band, offset = plan.band_index[0], plan.band_index[1]  # (Tq,) each
    block = q.new_zeros((count, width, h, d))  # every band's query slots; the empty ones stay zero
    block[band, offset] = q.transpose(0, 1)  # (Tq, H, D) scattered to their slots
    keys = k[:, start:start + count * width].unflatten(1, (count, width)).transpose(0, 1)  # (bands, Hkv, W, D)
    values = v[:, start:start + count * width].unflatten(1, (count, width)).transpose(0, 1)
    band_out, band_lse = attention_lse(block.transpose(1, 2), keys, values, causal=True,
                                       scale=scale)  # (bands, H, W, D), (bands, H, W)
    out = band_out[band, :, offset]  # (Tq, H, D)
    if plan.prefixes:
        outs, lses = [], []
        for a, b, n in plan.prefixes:  # rows a..b-1 see every key before their band
            o, lse = attention_lse(q[None, :, a:b], k[None, :, :n], v[None, :, :n], causal=False, scale=scale)
            outs.append(o[0])  # (H, Tg, D)
            lses.append(lse[0])  # (H, Tg)
        first = plan.prefixes[0][0]  # rows first..Tq-1 have a prefix (only a band at key 0 has none)
        prefix_out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # (H, Tq', D)
        prefix_lse = torch.cat(lses, dim=1) if len(lses) > 1 else lses[0]  # (H, Tq')
        merge_into(out[first:], band_lse[band[first:], :, offset[first:]],
                   prefix_out.transpose(0, 1), prefix_lse.transpose(0, 1))
    return out.reshape(tq, h * d)


# --------------------------------------------------------------------- tuning
Timer = Callable[[str, Callable[[], torch.Tensor]], float]


def cuda_event_timer(name: str, fn: Callable[[], torch.Tensor]) -> float:
    """Seconds of one call of fn on the current CUDA stream, from an idle device (so the
    host's launch time counts where it exceeds the kernels'). Synchronizes the device."""
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def wall_timer(name: str, fn: Callable[[], torch.Tensor]) -> float:
    """Seconds of one call of fn by the host clock (CPU tensors: the call is synchronous)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@dataclass(frozen=True)
class Tuning:
    """What the tuner measured for one shape bucket: per exact candidate the best of its
    repeats and its first (cold) call, in seconds; why the others were left out."""

    bucket: tuple[int, int]
    winner: str
    seconds: dict[str, float] = field(default_factory=dict)
    cold_seconds: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: milliseconds rounded to microseconds."""
        return {"bucket": list(self.bucket), "winner": self.winner,
                "ms": {k: round(t * 1e3, 3) for k, t in self.seconds.items()},
                "cold_ms": {k: round(t * 1e3, 3) for k, t in self.cold_seconds.items()}, "rejected": self.rejected}


def exact_tolerance(dtype: torch.dtype) -> float:
    """Largest max-abs difference, relative to 1 + max |reference|, between two exact
    strategies' outputs (different kernels round differently)."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


class AttentionTuner:
    """Picks the fastest exact attention strategy per shape bucket by measuring once.

    `choose` runs every candidate once (timed as its cold call, and checked against the
    first candidate's output), then times the survivors `repeats` times interleaved with `timer`
    and keeps the fastest's name for the bucket. Only exact strategies are ever offered;
    one that raises or disagrees with the reference is recorded in `tunings` and skipped.
    """

    def __init__(self, timer: Timer = cuda_event_timer, repeats: int = 3):
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        self.timer = timer
        self.repeats = repeats
        self.tunings: dict[tuple[int, int], Tuning] = {}

    def winner(self, bucket: tuple[int, int]) -> str | None:
        """The chosen strategy for `bucket`, or None before it has been measured."""
        tuning = self.tunings.get(bucket)
        return tuning.winner if tuning else None

    def choose(self, bucket: tuple[int, int], runs: dict[str, Callable[[], torch.Tensor]]
               ) -> tuple[str, torch.Tensor]:
        """Measure the candidates (name -> one call, the reference first) for `bucket`.

        Returns the winner's name and the output of its first call. Records the result in
        `tunings` (with each candidate's first, cold call: kernel selection and plan building
        happen there). Raises the reference's error when no candidate runs at all.
        """
        outputs: dict[str, torch.Tensor] = {}
        cold: dict[str, float] = {}
        rejected: dict[str, str] = {}
        first_error: RuntimeError | None = None
        reference, limit = None, 0.0
        for name, fn in runs.items():
            try:
                cold[name] = self.timer(name, lambda fn=fn, name=name: outputs.setdefault(name, fn()))
            except RuntimeError as err:  # a kernel that does not take this shape, dtype or device
                text = str(err).splitlines()[0] if str(err) else ""
                rejected[name] = f"{type(err).__name__}: {text}"[:200]
                first_error = first_error or err
                continue
            out = outputs[name]
            if reference is None:
                reference = out
                limit = exact_tolerance(out.dtype) * (1.0 + float(out.float().abs().max()))
                continue
            diff = float((out.float() - reference.float()).abs().max())
            if not diff <= limit:  # also rejects NaN
                rejected[name] = f"inexact: max abs diff {diff:.3g} > {limit:.3g}"
                del outputs[name], cold[name]
        if not outputs:
            raise first_error or ValueError("no attention candidates to choose from")
        seconds = dict.fromkeys(outputs, math.inf)
        for _ in range(self.repeats):
            for name in outputs:
                seconds[name] = min(seconds[name], self.timer(name, runs[name]))
        winner = min(seconds, key=seconds.__getitem__)
        self.tunings[bucket] = Tuning(bucket, winner, seconds, cold, rejected)
        return winner, outputs[winner]


def attention_with_sums(q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: int | None = None, bias: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact causal attention by position in float32 math, and each key's probability summed over
    the query rows and the query heads of its KV head (the query pass's scores where the native
    kernel does not run).

    q (H, Tq, D) at positions q_pos (Tq,) (host, sorted); k, v (Hkv, Tk, D) of positions 0..Tk-1;
    `window`: a row at p sees keys p - window + 1 .. p only; `bias` (Hkv, Tk): added to every
    score of each key. Returns (Tq, H*D) in q's dtype and (Hkv, Tk) float32."""
    heads, tq, d = q.shape
    hkv, tk = k.shape[0], k.shape[1]
    group = heads // hkv
    qg = (q.float() * scale).reshape(hkv, group * tq, d)  # the g heads of a KV head stacked, head-major
    scores = qg @ k.float().transpose(1, 2)  # (Hkv, g*Tq, Tk)
    if bias is not None:
        scores = scores + bias.float()[:, None, :]
    rows = q_pos.to(q.device, torch.long).repeat(group)  # (g*Tq,) each row's position
    keys = torch.arange(tk, device=q.device)
    hidden = keys[None, :] > rows[:, None]  # (g*Tq, Tk)
    if window is not None:
        hidden |= keys[None, :] <= rows[:, None] - window
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)  # (Hkv, g*Tq, Tk)
    out = (probs @ v.float()).reshape(heads, tq, d).transpose(0, 1).reshape(tq, heads * d)
    return out.to(q.dtype), probs.sum(dim=1)
