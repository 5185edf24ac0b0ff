"""The synthetic QA generator: determinism, answers present in the passages, two-hop structure,
and the shipped files loading through the CacheBlend loader."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from eval.loaders import load_examples
from eval.synthetic import CHARS_PER_TOKEN, generate

DATA = Path(__file__).resolve().parent.parent / "eval" / "data"


def test_same_seed_same_output_and_file(tmp_path):
    a = generate(7, 8, 4, 60, tmp_path / "a.json")
    b = generate(7, 8, 4, 60)
    assert a == b
    assert json.loads((tmp_path / "a.json").read_text()) == a
    assert generate(8, 8, 4, 60) != a


def test_answers_occur_in_passages_and_two_hop_needs_both():
    examples = generate(3, 12, 6, 80)
    assert {e["hops"] for e in examples} == {1, 2}
    for e in examples:
        assert len(e["ctxs"]) == 6
        texts = [c["title"] + "\n" + c["text"] for c in e["ctxs"]]
        (answer,) = e["answers"]
        assert any(answer in t for t in texts), e["id"]
        if e["hops"] == 2:
            org = re.fullmatch(r"In \w+ \w+ was the founder of (.+) born\?", e["question"]).group(1)
            org_passage = next(t for t in texts if t.lower().startswith(org.lower().removeprefix("the ")))
            founder = org_passage.split(" by the ")[1].split(".")[0].split(" ", 1)[1]
            # The answer is in the founder's passage, not in the organisation's.
            assert answer not in org_passage
            assert any(t.startswith(founder) and answer in t for t in texts)


def test_passage_length_tracks_target():
    examples = generate(0, 4, 3, 200)
    lengths = [len(c["text"]) for e in examples for c in e["ctxs"]]
    target = 200 * CHARS_PER_TOKEN
    assert all(0.8 * target <= n <= 1.15 * target for n in lengths)


@pytest.mark.parametrize("kwargs", [{"n": 0}, {"passages": 1}, {"passage_tokens": 4}])
def test_bad_arguments(kwargs):
    args = {"seed": 0, "n": 2, "passages": 3, "passage_tokens": 50} | kwargs
    with pytest.raises(ValueError, match=">="):
        generate(**args)


@pytest.mark.parametrize("name, count, passages", [("synthetic_qa.json", 24, 6), ("synthetic_small.json", 6, 3)])
def test_shipped_files(name, count, passages):
    examples = load_examples(str(DATA / name))
    assert len(examples) == count
    assert all(len(e.passages) == passages for e in examples)
    assert all(any(e.answers[0] in p for p in e.passages) for e in examples)
