"""Token selection for CacheBlend's selective recompute: the whole policy, behind `select`.

At a check layer every candidate token's K/V is computed fresh; the tokens whose fresh
K/V deviate most from the cached K/V (squared L2 over heads and head_dim: the paper's
"high-KV-deviation" tokens) are the ones recomputed in the following layers. With
gradual filtering, each check layer keeps a shrinking share of the previous selection,
ending at the recompute ratio.

Config `selection`: `deviation` is the paper's rule; `attention` ranks tokens by how much
the query attends to them at the check layer; `hybrid` multiplies the normalised
deviation and attention scores: a token is recomputed when its cached KV is wrong AND
the query looks at it.

`query` needs no check layer: the query rows alone are run through every layer over
the loaded (re-rotated) KV - a reuse pass - and each context token is scored by the
query's attention to it, averaged over heads and query rows, normalised per layer and
averaged over the layers after the first (`QueryAttention`). The top tokens are then
recomputed from layer 0 (blend.recompute). Comparison on MuSiQue: docs/EVAL.md.

Forced rows (e.g. the first tokens of each document, `sink_tokens`) are always kept and
count inside the budget.

`stale_key_bias` is not a selection: once rows are chosen, it measures per layer how
much more the query attends to the recomputed rows' stale keys than to their fresh ones;
blend.recompute subtracts that from the scores of the keys left stale.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from blend.modes import CHECK_LAYER_SELECTIONS, DEVIATIONS, QUERY_SELECTIONS, SELECTIONS  # noqa: F401 - the registry


def deviation(fresh_k: torch.Tensor, fresh_v: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor,
              kind: str = "v") -> torch.Tensor:
    """Per-token squared L2 deviation; inputs (Hkv, T, D), output (T,) float32."""
    def sq(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.float() - b.float()).pow(2).sum(dim=(0, 2))  # (T,)

    if kind == "v":
        return sq(fresh_v, cached_v)
    if kind == "k":
        return sq(fresh_k, cached_k)
    if kind == "kv":
        return sq(fresh_k, cached_k) + sq(fresh_v, cached_v)
    raise ValueError(f"unknown deviation {kind!r}; use v, k or kv")


def outside_window(q_start: int, tq: int, n: int, window: int | None, groups: int,
                   device: torch.device) -> torch.Tensor | None:
    """(g*Q, N) bool: which keys 0..N-1 lie before the sliding window of each query row at
    positions q_start..q_start+Q-1 (rows head-major as in `query_probs`); None when no
    window hides any key."""
    if window is None or q_start + tq - 1 < window:
        return None
    rows = torch.arange(q_start, q_start + tq, device=device).repeat(groups)  # (g*Q,)
    return torch.arange(n, device=device)[None, :] <= rows[:, None] - window  # (g*Q, N)


def query_attention(q: torch.Tensor, k: torch.Tensor, scale: float, window: int | None = None) -> torch.Tensor:
    """How much the query attends to each key: softmax(q k^T) averaged over heads and query rows.

    q (H, Tq, D) of the query rows (the last Tq positions; each sees every key, or in a
    sliding layer of `window` only the keys of its window), k (Hkv, N, D). Returns (N,) float32.
    """
    heads, tq, d = q.shape
    groups = heads // k.shape[0]
    qg = q.float().reshape(k.shape[0], groups * tq, d)  # heads of one kv group stacked
    logits = qg @ k.float().transpose(1, 2) * scale  # (Hkv, g*Tq, N)
    hidden = outside_window(k.shape[1] - tq, tq, k.shape[1], window, groups, q.device)
    if hidden is not None:
        logits.masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(logits, dim=-1)  # (Hkv, g*Tq, N)
    return probs.mean(dim=(0, 1))


def schedule_counts(ratio: float, schedule: tuple[float, ...], n_context: int) -> list[int]:
    """Tokens kept at each check layer: ceil(min(1, ratio * s) * n_context), non-increasing.

    The last entry is ceil(ratio * n_context): the recompute budget.
    """
    counts = [math.ceil(min(1.0, ratio * s) * n_context - 1e-9) for s in schedule]
    for i in range(1, len(counts)):
        counts[i] = min(counts[i], counts[i - 1])
    return counts


def select_top(scores: torch.Tensor, rows: torch.Tensor, k: int, forced: torch.Tensor | None = None
               ) -> torch.Tensor:
    """The k rows with the largest scores, returned sorted by position. scores, rows: (T,).

    `forced` (T,) bool: rows taken before any other (the first k of them by position when
    there are more than k)."""
    if k >= rows.numel():
        return rows.clone()
    if k <= 0:
        return rows[:0].clone()
    scores = scores.float()
    if forced is not None and bool(forced.any()):
        # forced rows first, earlier positions first among them; then the rest by score
        rank = torch.arange(rows.numel(), 0, -1, device=scores.device, dtype=torch.float32)
        top = scores.max().abs() + 1.0
        scores = torch.where(forced.to(scores.device), top + rank, scores)
    idx = torch.topk(scores, k, sorted=False).indices
    return rows[idx].sort().values


@dataclass(frozen=True)
class CheckLayerKV:
    """What a check layer knows about its candidate rows (context rows still active).

    fresh_k/fresh_v and cached_k/cached_v are (Hkv, C, D) for the C candidates; query_q
    (H, Tq, D) are the query rows' fresh queries; keys (Hkv, N, D) are the layer's keys
    for all N prompt positions after the fresh rows were written.
    """

    fresh_k: torch.Tensor
    fresh_v: torch.Tensor
    cached_k: torch.Tensor
    cached_v: torch.Tensor
    query_q: torch.Tensor
    keys: torch.Tensor
    scaling: float
    window: int | None = None  # the layer's sliding window (None: full attention)


def normalised(scores: torch.Tensor) -> torch.Tensor:
    """Scores scaled to mean 1, so two criteria weigh alike in a product."""
    return scores / scores.mean().clamp_min(1e-12)


def _deviation_scores(kv: CheckLayerKV, cand_rows: torch.Tensor, kind: str) -> torch.Tensor:
    return deviation(kv.fresh_k, kv.fresh_v, kv.cached_k, kv.cached_v, kind)


def _attention_scores(kv: CheckLayerKV, cand_rows: torch.Tensor, kind: str) -> torch.Tensor:
    return query_attention(kv.query_q, kv.keys, kv.scaling, kv.window)[cand_rows]


def _hybrid_scores(kv: CheckLayerKV, cand_rows: torch.Tensor, kind: str) -> torch.Tensor:
    return normalised(_deviation_scores(kv, cand_rows, kind)) * normalised(_attention_scores(kv, cand_rows, kind))


POLICIES: dict[str, Callable[[CheckLayerKV, torch.Tensor, str], torch.Tensor]] = {
    "deviation": _deviation_scores,  # the CacheBlend paper's rule
    "attention": _attention_scores,
    "hybrid": _hybrid_scores,
}
QUERY_POLICIES = QUERY_SELECTIONS  # selected before layer 0 from a query pass over the loaded KV
assert tuple(POLICIES) == CHECK_LAYER_SELECTIONS  # blend.modes names them for the config (no torch there)


def check_policy(policy: str) -> str:
    if policy not in SELECTIONS:
        raise ValueError(f"unknown selection {policy!r}; valid selections are: {', '.join(SELECTIONS)}")
    return policy


def uses_check_layers(policy: str) -> bool:
    """Whether `policy` selects at check layers (after a full pass of the early layers)."""
    return check_policy(policy) in POLICIES


def select(policy: str, kv: CheckLayerKV, cand_rows: torch.Tensor, count: int, deviation_kind: str = "v",
           forced: torch.Tensor | None = None) -> torch.Tensor:
    """The `count` candidate rows (prompt positions, (C,)) that `policy` ranks highest, sorted;
    `forced` (C,) bool marks rows kept first.

    The one entry point of the check-layer policies: policy name -> scores -> rows.
    """
    if count >= cand_rows.numel():
        return cand_rows.clone()
    if not uses_check_layers(policy):
        raise ValueError(f"selection {policy!r} does not select at check layers")
    scores = POLICIES[policy](kv, cand_rows, deviation_kind)
    return select_top(scores, cand_rows, count, forced)


def query_probs(q: torch.Tensor, k: torch.Tensor, scale: float, q_start: int,
                window: int | None = None) -> torch.Tensor:
    """Attention probabilities of the query rows over every key, float32.

    q (H, Q, D) at positions q_start..q_start+Q-1 (the last rows of the prompt), k
    (Hkv, N, D) for positions 0..N-1 (N = q_start + Q). Returns (Hkv, g*Q, N): the g
    query heads sharing kv head j are rows j*g*Q .. (j+1)*g*Q-1, head-major. In a
    sliding layer (`window`) a row at p has probability 0 on the keys before p - window + 1.
    """
    heads, tq, d = q.shape
    kv_heads = k.shape[0]
    if k.shape[1] != q_start + tq:
        raise ValueError(f"query_probs needs the keys of positions 0..{q_start + tq - 1} (the query rows are the "
                         f"last ones), got {k.shape[1]}")
    groups = heads // kv_heads
    qg = (q.float() * scale).reshape(kv_heads, groups * tq, d)  # scaled here: Q rows, not N columns
    logits = qg @ k.float().transpose(1, 2)  # (Hkv, g*Q, N)
    # every query row sees all of the context; only the query's own columns need the causal mask
    later = torch.ones(tq, tq, dtype=torch.bool, device=q.device).triu_(1).repeat(groups, 1)  # (g*Q, Q)
    logits[:, :, q_start:q_start + tq].masked_fill_(later, float("-inf"))
    hidden = outside_window(q_start, tq, k.shape[1], window, groups, q.device)
    if hidden is not None:
        logits.masked_fill_(hidden, float("-inf"))
    return torch.softmax(logits, dim=-1)


def stale_key_bias(query_q: torch.Tensor, fresh_k: torch.Tensor, stale_k: torch.Tensor, scale: float) -> torch.Tensor:
    """How much more the query attends to keys loaded stale than to the same keys computed
    fresh, per KV head: the logit offset to subtract from the scores of the keys left stale.

    query_q (H, Q, D): fresh queries of the query rows; fresh_k, stale_k (Hkv, S, D): the
    recomputed rows' keys as computed in this request and as loaded (before the write).
    Per query row and head, logsumexp of the scores over the S rows with the stale keys
    minus with the fresh ones (the log of the attention mass the stale keys draw in
    excess), averaged over the rows and the query heads of each KV head. Returns (Hkv,)
    float32 (zeros when S is 0). Stale keys of documents computed without the documents
    before them draw too much of the query's attention at most layers (measured on
    MuSiQue: docs/EVAL.md); the recomputed rows show by how much, in this very request.
    """
    kv_heads, s, d = fresh_k.shape
    if s == 0 or query_q.shape[1] == 0:
        return torch.zeros(kv_heads, dtype=torch.float32, device=fresh_k.device)
    heads, tq, _ = query_q.shape
    qg = query_q.float().reshape(kv_heads, (heads // kv_heads) * tq, d)  # (Hkv, g*Q, D)
    keys = torch.cat((fresh_k, stale_k), dim=1).float()  # (Hkv, 2S, D): both sets' scores in one product
    scores = torch.bmm(qg, keys.transpose(1, 2)).mul_(scale)  # (Hkv, g*Q, 2S)
    lse = torch.logsumexp(scores.view(kv_heads, -1, 2, s), dim=-1)  # (Hkv, g*Q, 2): fresh, stale
    return (lse[..., 1] - lse[..., 0]).mean(dim=-1)


class QueryAttention:
    """The query's attention to each context token, fused across layers.

    Per layer: attention probabilities averaged over heads and query rows, restricted to
    the context columns and normalised to sum 1; the fused score is their mean over the
    layers from `first_layer` on (layer 0 attends mostly by position). With
    `value_weighted`, each head's probability is multiplied by the norm of its value
    vector (what the token contributes to the output, not just how much it is looked at).
    """

    def __init__(self, n_context: int, *, first_layer: int = 1, value_weighted: bool = False):
        self.n_context, self.first_layer, self.value_weighted = n_context, first_layer, value_weighted
        self.total: torch.Tensor | None = None
        self.layers = 0

    def add(self, layer: int, probs: torch.Tensor, v: torch.Tensor) -> None:
        """probs (Hkv, g*Q, N) from `query_probs`; v (Hkv, N, D) the layer's values."""
        if layer >= self.first_layer:
            self.add_sums(layer, probs[:, :, : self.n_context].sum(dim=1), v)  # (Hkv, C)

    def add_sums(self, layer: int, sums: torch.Tensor, v: torch.Tensor) -> None:
        """`add` from each key's probabilities already summed over the query rows and the query
        heads of its KV head: sums (Hkv, N or more) float32 (the native kernel's column sums).
        The mean over heads and rows, normalised to sum 1, is the same as their sum normalised."""
        if layer < self.first_layer:
            return
        a = sums[:, : self.n_context]  # (Hkv, C)
        if self.value_weighted:
            a = a * v[:, : self.n_context].float().norm(dim=-1)
        score = a.sum(dim=0)  # (C,)
        score = score / score.sum().clamp_min(1e-12)
        self.total = score if self.total is None else self.total + score
        self.layers += 1

    def scores(self) -> torch.Tensor:
        """(C,) fused scores of context positions 0..C-1 (uniform when no layer was added)."""
        if self.total is None:
            return torch.full((self.n_context,), 1.0 / max(1, self.n_context))
        return self.total / self.layers
