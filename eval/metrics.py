"""Metrics for blended generation.

Quality against gold answers (None when an example has no answers):
    qa_f1        token F1 after LongBench normalisation, best over the gold answers
    exact_match  1.0 when the normalised prediction equals a normalised gold answer
    rouge_l      Rouge-L F-measure (rouge_score), best over the references
Fidelity of blending versus full prefill, from next-token distributions:
    kl_divergence  KL(full || blended) over the vocabulary
    top1_agree     whether both distributions put the same token first
Aggregation: `mean` and `aggregate` average per metric, ignoring None.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import cache

import torch

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """LongBench / SQuAD normalisation: lowercase, drop punctuation, drop the articles a/an/the,
    collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _token_f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, answers: Sequence[str]) -> float | None:
    """Token-level F1 between the prediction and the best-matching gold answer, in [0, 1];
    None when there are no gold answers."""
    if not answers:
        return None
    return max(_token_f1(prediction, gold) for gold in answers)


def exact_match(prediction: str, answers: Sequence[str]) -> float | None:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0; None when
    there are no gold answers."""
    if not answers:
        return None
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(gold) for gold in answers))


@cache
def _rouge_scorer():
    from rouge_score import rouge_scorer  # deferred: loads nltk pieces

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l(prediction: str, answers: Sequence[str]) -> float | None:
    """Rouge-L F-measure between the prediction and the best reference (rouge_score's own
    tokenisation: lowercase alphanumeric tokens); None when there are no references."""
    if not answers:
        return None
    scorer = _rouge_scorer()
    return max(scorer.score(gold, prediction)["rougeL"].fmeasure for gold in answers)


def _check_distribution_pair(p: torch.Tensor, q: torch.Tensor, what: str) -> None:
    if p.dim() != 1 or q.dim() != 1:
        raise ValueError(
            f"{what}: expects two 1-D tensors over the vocabulary (V,), got shapes {tuple(p.shape)} and "
            f"{tuple(q.shape)}; take one position, e.g. logprobs[-1]"
        )
    if p.shape != q.shape:
        raise ValueError(f"{what}: the two distributions differ in size ({p.numel()} vs {q.numel()}); use the same vocabulary")
    if p.numel() == 0:
        raise ValueError(f"{what}: the distributions are empty")


def mean_kl(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> float:
    """Mean over positions of `kl_divergence` for (T, V) log-probabilities row by row (e.g.
    full prefill's distribution at each token of its answer and another mode's, teacher-
    forced along the same tokens). NaN for T = 0."""
    if p_logprobs.dim() != 2 or p_logprobs.shape != q_logprobs.shape:
        raise ValueError(f"mean_kl needs two (T, V) tensors of one shape, got {tuple(p_logprobs.shape)} and "
                         f"{tuple(q_logprobs.shape)}")
    rows = [kl_divergence(a, b) for a, b in zip(p_logprobs, q_logprobs, strict=True)]
    return sum(rows) / len(rows) if rows else math.nan


def kl_divergence(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> float:
    """KL(P || Q) = sum_v P(v) (log P(v) - log Q(v)) in nats, P = full prefill, Q = blended.

    Both inputs are 1-D (V,) log-probabilities; they are renormalised with log_softmax in
    float64, so raw logits work too. Tokens with P(v) = 0 contribute nothing; a token with
    P(v) > 0 and Q(v) = 0 makes the result inf. The result is never negative.
    """
    _check_distribution_pair(p_logprobs, q_logprobs, "kl_divergence")
    log_p = torch.log_softmax(p_logprobs.detach().to(torch.float64), dim=-1)  # (V,)
    log_q = torch.log_softmax(q_logprobs.detach().to(torch.float64), dim=-1)  # (V,)
    p = log_p.exp()
    support = p > 0
    if bool((support & torch.isneginf(log_q)).any()):
        return math.inf
    terms = torch.where(support, p * (log_p - log_q), torch.zeros_like(p))
    return max(float(terms.sum()), 0.0)


def top1_agree(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor) -> bool:
    """True when both 1-D (V,) distributions (logprobs or logits) rank the same token first."""
    _check_distribution_pair(p_logprobs, q_logprobs, "top1_agree")
    return int(p_logprobs.argmax()) == int(q_logprobs.argmax())


def matching_prefix(reference: Sequence[int], other: Sequence[int]) -> int:
    """How many leading generated tokens two greedy answers share (len(reference) when equal)."""
    for i, (a, b) in enumerate(zip(reference, other, strict=False)):
        if a != b:
            return i
    return min(len(reference), len(other))


def mean(values: Iterable[float | bool | None]) -> float | None:
    """Mean of the values that are not None (booleans count as 0/1); None if there are none."""
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def aggregate(rows: Iterable[Mapping[str, float | bool | None]]) -> dict[str, float | None]:
    """Per-key mean over result rows, ignoring None; keys keep their first-seen order."""
    columns: dict[str, list[float | bool | None]] = {}
    for row in rows:
        for key, value in row.items():
            columns.setdefault(key, []).append(value)
    return {key: mean(values) for key, values in columns.items()}
