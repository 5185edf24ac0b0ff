"""Metrics on hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from eval.metrics import (
    aggregate,
    exact_match,
    kl_divergence,
    matching_prefix,
    mean,
    normalize_answer,
    qa_f1,
    rouge_l,
    top1_agree,
)


def test_normalize_answer():
    assert normalize_answer("The  Eiffel-Tower, an icon!") == "eiffeltower icon"


def test_qa_f1():
    assert qa_f1("the Eiffel Tower", ["Eiffel tower"]) == 1.0
    # prediction "eiffel tower paris" vs gold "eiffel tower": P = 2/3, R = 1, F1 = 0.8
    assert qa_f1("Eiffel Tower, Paris", ["the Eiffel Tower"]) == pytest.approx(0.8)
    # best over gold answers: "paris" vs ["lyon", "paris france"] -> P = 1, R = 1/2, F1 = 2/3
    assert qa_f1("Paris", ["Lyon", "Paris, France"]) == pytest.approx(2 / 3)
    assert qa_f1("Berlin", ["Paris"]) == 0.0
    assert qa_f1("the", ["Paris"]) == 0.0
    assert qa_f1("anything", []) is None


def test_exact_match():
    assert exact_match("The Eiffel Tower.", ["eiffel tower"]) == 1.0
    assert exact_match("Eiffel Tower Paris", ["eiffel tower"]) == 0.0
    assert exact_match("x", []) is None


def test_rouge_l():
    # LCS of "the cat sat on the mat" / "the cat is on the mat" = 5 tokens of 6 each -> F = 5/6
    assert rouge_l("the cat sat on the mat", ["the cat is on the mat"]) == pytest.approx(5 / 6)
    assert rouge_l("a b c", ["x y", "a b c"]) == pytest.approx(1.0)
    assert rouge_l("x", []) is None


def test_kl_divergence():
    p = torch.log(torch.tensor([0.5, 0.5]))
    q = torch.log(torch.tensor([0.25, 0.75]))
    assert kl_divergence(p, p) == 0.0
    expected = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-6)
    # Logits work too (renormalised): shifting every logit changes nothing.
    assert kl_divergence(p + 3.0, q - 1.0) == pytest.approx(expected, rel=1e-6)
    # P(v) = 0 terms vanish; Q(v) = 0 where P(v) > 0 is infinite.
    zero = torch.tensor([0.0, -math.inf])
    assert kl_divergence(zero, q) == pytest.approx(-math.log(0.25))
    assert kl_divergence(q, zero) == math.inf


def test_kl_divergence_large_vocab_half_precision():
    torch.manual_seed(0)
    logits = torch.randn(49152) * 5
    log_p = torch.log_softmax(logits, -1)
    value = kl_divergence(log_p.half(), log_p)  # rounding only: tiny, never negative
    assert 0.0 <= value < 1e-3


def test_distribution_shape_errors():
    with pytest.raises(ValueError, match="1-D"):
        kl_divergence(torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="same vocabulary"):
        top1_agree(torch.zeros(3), torch.zeros(4))


def test_top1_agree():
    assert top1_agree(torch.tensor([0.1, 2.0, 0.3]), torch.tensor([-1.0, 0.0, -5.0]))
    assert not top1_agree(torch.tensor([3.0, 2.0]), torch.tensor([2.0, 3.0]))


def test_mean_and_aggregate():
    assert mean([1.0, None, 0.0, True]) == pytest.approx(2 / 3)
    assert mean([None, None]) is None
    rows = [{"f1": 1.0, "kl": 0.2, "agree": True}, {"f1": None, "kl": 0.4, "agree": False}]
    assert aggregate(rows) == pytest.approx({"f1": 1.0, "kl": 0.3, "agree": 0.5})


def test_matching_prefix_counts_the_shared_leading_tokens():
    assert matching_prefix([5, 6, 7], [5, 6, 7]) == 3
    assert matching_prefix([5, 6, 7], [5, 9, 7]) == 1
    assert matching_prefix([5, 6, 7], [4, 6, 7]) == 0
    assert matching_prefix([5, 6, 7], [5, 6]) == 2  # one answer stopped earlier
    assert matching_prefix([], [1]) == 0
