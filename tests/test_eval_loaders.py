"""Loaders: each record layout on a tiny file, layout detection errors, passages/limit handling,
and the Hugging Face path through `datasets.load_dataset` with the local json builder."""

from __future__ import annotations

import json
import logging

import pytest

from eval.loaders import Example, load_examples, pack, split_context, to_answers


def _write_json(path, data):
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


CACHEBLEND = [
    {
        "question": "Where was Ada born?",
        "answers": ["Pellton", "in Pellton"],
        "ctxs": [
            {"title": "Ada", "text": "Ada was born in Pellton."},
            {"title": "Bo", "text": "Bo was born in Rimby."},
            {"title": "Cy", "text": "Cy was born in Sorn."},
        ],
    },
    {"question": "Who founded Vex?", "answers": ["Ada"], "ctxs": [{"title": "Vex", "text": "Ada founded Vex."}]},
]


def test_cacheblend_json(tmp_path):
    examples = load_examples(str(_write_json(tmp_path / "mqa.json", CACHEBLEND)))
    assert len(examples) == 2
    first = examples[0]
    assert isinstance(first, Example)
    assert first.passages[0] == "Ada\nAda was born in Pellton."
    assert first.question == "Where was Ada born?"
    assert first.answers == ("Pellton", "in Pellton")
    assert first.task == "qa"
    assert first.id == "mqa-0"


def test_a_byte_order_mark_is_not_part_of_the_json(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(CACHEBLEND).encode())
    assert [e.question for e in load_examples(str(path))] == [e.question for e in load_examples(
        str(_write_json(tmp_path / "plain.json", CACHEBLEND)))]


def test_passages_and_limit(tmp_path):
    path = str(_write_json(tmp_path / "mqa.json", CACHEBLEND))
    examples = load_examples(path, passages=2, limit=1)
    assert len(examples) == 1
    assert examples[0].passages == ("Ada\nAda was born in Pellton.", "Bo\nBo was born in Rimby.")
    # Fewer passages than K: all are kept.
    assert len(load_examples(path, passages=6)[1].passages) == 1


@pytest.mark.parametrize("kwargs, message", [({"limit": 0}, "--limit must be >= 1"), ({"passages": 0}, "--passages must be >= 1")])
def test_limit_and_passages_must_be_positive(tmp_path, kwargs, message):
    path = str(_write_json(tmp_path / "mqa.json", CACHEBLEND))
    with pytest.raises(ValueError, match=message):
        load_examples(path, **kwargs)


def test_longbench_passage_markers(tmp_path):
    rows = [
        {
            "_id": "lb1",
            "input": "Which river?",
            "context": "Passage 1:\nRiver Ost\nThe Ost is long.\nPassage 2:\nRiver Wen\nThe Wen is short.",
            "answers": ["Ost"],
            "length": 12,
            "dataset": "2wikimqa",
        }
    ]
    (example,) = load_examples(str(_write_jsonl(tmp_path / "lb.jsonl", rows)))
    assert example.id == "lb1"
    assert example.passages == ("River Ost\nThe Ost is long.", "River Wen\nThe Wen is short.")
    assert example.question == "Which river?"
    assert example.answers == ("Ost",)


def test_longbench_blank_lines_are_packed(tmp_path):
    paragraphs = [f"Paragraph {i} " + "word " * 100 for i in range(10)]  # ~610 chars each
    rows = [{"input": "q", "context": "\n\n".join(paragraphs), "answers": ["a"], "dataset": "multi_news"}]
    (example,) = load_examples(str(_write_jsonl(tmp_path / "lb.jsonl", rows)))
    assert example.task == "summarization"
    assert 3 <= len(example.passages) <= 5
    assert all(len(p) <= 2000 for p in example.passages)
    assert " ".join(example.passages).split() == " ".join(paragraphs).split()


def test_split_context_and_pack():
    assert split_context("one\n\ntwo", target_chars=100) == ["one\n\ntwo"]
    assert split_context("one\n\ntwo", target_chars=4) == ["one", "two"]
    long_word = "x" * 50
    assert all(len(p) <= 10 for p in pack([long_word], 10))
    assert "".join(pack([long_word], 10)) == long_word


def test_hotpotqa_both_context_forms(tmp_path):
    rows = [
        {
            "_id": "h1",
            "question": "Which is older?",
            "answer": "Ost Bridge",
            "context": [["Ost Bridge", ["Built in 1700.", " It is stone."]], ["Wen Bridge", ["Built in 1900."]]],
        },
        {
            "id": "h2",
            "question": "Which is newer?",
            "answer": "Wen Bridge",
            "context": {"title": ["Ost Bridge", "Wen Bridge"], "sentences": [["Built in 1700."], ["Built in 1900."]]},
        },
    ]
    first, second = load_examples(str(_write_json(tmp_path / "hotpot.json", rows)))
    assert first.passages == ("Ost Bridge\nBuilt in 1700. It is stone.", "Wen Bridge\nBuilt in 1900.")
    assert first.answers == ("Ost Bridge",)
    assert second.id == "h2"
    assert second.passages[1] == "Wen Bridge\nBuilt in 1900."


def test_samsum_and_multinews(tmp_path):
    samsum = [{"id": "s1", "dialogue": "Ann: hi\nBen: hello", "summary": "Ann greets Ben."}]
    (dialogue,) = load_examples(str(_write_json(tmp_path / "samsum.json", samsum)))
    assert dialogue.task == "summarization"
    assert dialogue.passages == ("Ann: hi\nBen: hello",)
    assert dialogue.question == ""
    assert dialogue.answers == ("Ann greets Ben.",)

    long_dialogue = "\n".join(f"P{i}: " + "talk " * 60 for i in range(20))  # ~6 KB
    (split,) = load_examples(str(_write_json(tmp_path / "long.json", [{"dialogue": long_dialogue, "summary": "s"}])))
    assert len(split.passages) > 1

    news = [{"document": "Storm hits coast. ||||| Coast cleans up after storm. |||||  ", "summary": "A storm."}]
    (article,) = load_examples(str(_write_jsonl(tmp_path / "news.jsonl", news)))
    assert article.passages == ("Storm hits coast.", "Coast cleans up after storm.")
    assert article.task == "summarization"


def test_unknown_layout_names_fields(tmp_path):
    path = str(_write_json(tmp_path / "odd.json", [{"prompt": "x", "completion": "y"}]))
    with pytest.raises(ValueError) as info:
        load_examples(path)
    message = str(info.value)
    assert "completion, prompt" in message
    assert "CacheBlend JSON: ctxs, question, answers" in message
    assert "LongBench JSONL: context, input, answers" in message
    assert "field_map" in message


def test_field_map_renames_fields(tmp_path):
    rows = [{"docs": ["A is 1.", "B is 2."], "query": "What is A?", "gold": ["1"]}]
    path = str(_write_json(tmp_path / "custom.json", rows))
    (example,) = load_examples(path, field_map={"passages": "docs", "question": "query", "answers": "gold"})
    assert example.passages == ("A is 1.", "B is 2.")
    assert example.answers == ("1",)
    with pytest.raises(ValueError, match="lacks"):
        load_examples(path, field_map={"question": "nope"})


def test_examples_without_passages_or_question_are_skipped(tmp_path, caplog):
    rows = [
        {"question": "q0", "answers": [], "ctxs": []},
        {"question": "q1", "answers": [], "ctxs": [{"title": "", "text": "  "}]},
        {"question": "q2", "answers": [], "ctxs": [{"title": "T", "text": "body"}]},
        {"question": "  ", "answers": ["a"], "ctxs": [{"title": "T", "text": "body"}]},
        {"question": None, "answers": ["a"], "ctxs": [{"title": "T", "text": "body"}]},
    ]
    with caplog.at_level(logging.WARNING):
        examples = load_examples(str(_write_json(tmp_path / "gaps.json", rows)))
    assert [e.question for e in examples] == ["q2"]
    assert examples[0].answers == ()
    assert "skipped 4 example(s)" in caplog.text and "gaps-3" in caplog.text
    with pytest.raises(ValueError, match="record 0 .*'question' must be text, got list"):
        load_examples(str(_write_json(tmp_path / "odd.json", [{"question": ["q"], "answers": [], "ctxs": ["x"]}])))


@pytest.mark.parametrize("passages, message", [
    ([["a", "b"], "c"], "'passages' item must be text, got list"),
    (["a", {"text": "t"}], "'passages' item must be text, got dict"),
    (["a", True], "'passages' item must be text, got bool"),
    ({"a": 1}, "'passages' must be a list of texts .*got dict"),
    (5, "'passages' must be a list of texts .*got int"),
])
def test_passages_that_are_not_text_are_errors_not_their_repr(tmp_path, passages, message):
    rows = [{"passages": passages, "question": "q", "answers": ["x"]}]
    with pytest.raises(ValueError, match=f"record 0 .*{message}"):
        load_examples(str(_write_json(tmp_path / "odd.json", rows)))
    # a missing cell (null) is skipped text, never the passage "None"; a ctx's NaN title is no title
    (ok,) = load_examples(str(_write_json(tmp_path / "ok.json", [{"passages": ["a", None], "question": "q"}])))
    assert ok.passages == ("a",)
    rows = [{"question": "q", "ctxs": [{"title": float("nan"), "text": "body"}]}]
    assert load_examples(str(_write_json(tmp_path / "nan.json", rows)))[0].passages == ("body",)
    with pytest.raises(ValueError, match="ctx's 'text' must be text, got list"):
        load_examples(str(_write_json(tmp_path / "l.json", [{"question": "q", "ctxs": [{"text": ["a"]}]}])))


def test_answer_forms():
    assert to_answers(None) == ()
    assert to_answers(" Paris ") == ("Paris",)
    assert to_answers(["a", "", None, 3]) == ("a", "3")
    assert to_answers({"text": ["x", "y"], "answer_start": [0, 5]}) == ("x", "y")
    with pytest.raises(ValueError, match="'text'"):
        to_answers({"label": 1})
    assert to_answers(["1903", float("nan"), 1903.5]) == ("1903", "1903.5")  # a missing cell is skipped
    with pytest.raises(ValueError, match="string or a number, got list"):
        to_answers([["1903"]])  # never the string "['1903']"
    with pytest.raises(ValueError, match="got bool"):
        to_answers([True])


def test_bad_record_names_index(tmp_path):
    rows = [CACHEBLEND[0], {"question": "q", "ctxs": "not a list"}]
    with pytest.raises(ValueError, match="record 1"):
        load_examples(str(_write_json(tmp_path / "bad.json", rows)))


def test_split_of_json_mapping(tmp_path):
    path = str(_write_json(tmp_path / "splits.json", {"train": CACHEBLEND[:1], "test": CACHEBLEND[1:]}))
    assert load_examples(path, split="test")[0].question == "Who founded Vex?"
    with pytest.raises(ValueError, match="split"):
        load_examples(path)


def test_a_split_the_file_lacks_is_named_and_a_file_without_splits_refuses_one(tmp_path):
    path = str(_write_json(tmp_path / "one.json", {"train": CACHEBLEND}))
    with pytest.raises(ValueError, match="has no split 'test'; its splits are train"):
        load_examples(path, split="test")
    for name, writer in (("list.json", _write_json), ("lines.jsonl", _write_jsonl)):
        with pytest.raises(ValueError, match="--split 'test': this file has no splits"):
            load_examples(str(writer(tmp_path / name, CACHEBLEND)), split="test")
    single = {"passages": ["The bridge opened in 1888."], "question": "When?", "answers": ["1888"]}
    (example,) = load_examples(str(_write_json(tmp_path / "single.json", single)))  # one example, not its list
    assert example.passages == ("The bridge opened in 1888.",)


def test_csv_cells_are_text_as_written_and_a_ragged_row_is_an_error(tmp_path):
    pytest.importorskip("datasets")
    good = tmp_path / "na.csv"
    good.write_text("passages,question,answers\nNamibia borders Angola.,Which country?,NA\nx,None,null\n")
    first, second = load_examples(str(good))
    assert first.answers == ("NA",) and (second.question, second.answers) == ("None", ("null",))
    ragged = tmp_path / "ragged.csv"
    ragged.write_text("passages,question,answers\na,q,x\nEXTRA,MORE,a,b,c\n")
    with pytest.raises(ValueError, match="ragged.csv: cannot be read as csv .*Expected 3 fields in line 3, saw 5"):
        load_examples(str(ragged))
    with pytest.raises(ValueError, match="this file has no splits"):
        load_examples(str(good), split="train")


def test_missing_local_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_examples(str(tmp_path / "nope.json"))


def test_hub_path_with_local_json_builder(tmp_path, monkeypatch):
    """The dataset-name path, offline: the `json` builder reads a local file through
    datasets.load_dataset exactly as a hub name would be read."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    rows = [
        {"context": "Passage 1:\nAlpha\nA.\nPassage 2:\nBeta\nB.", "query": "Which first?", "answers": ["Alpha"]},
        {"context": "Passage 1:\nGamma\nG.", "query": "Which?", "answers": ["Gamma"]},
    ]
    data = _write_jsonl(tmp_path / "rows.jsonl", rows)
    examples = load_examples(
        "json", split="train", data_files=str(data), field_map={"input": "query"}, limit=1
    )
    assert len(examples) == 1
    assert examples[0].passages == ("Alpha\nA.", "Beta\nB.")
    assert examples[0].question == "Which first?"
    # Without a split, the only split the builder makes ("train") is used.
    assert len(load_examples("json", data_files=str(data), field_map={"input": "query"})) == 2


def test_json_nested_too_deeply_is_one_line(tmp_path):
    deep = "[" * 20000 + "]" * 20000
    (tmp_path / "deep.json").write_text(deep)
    with pytest.raises(ValueError, match="deep.json: JSON nested too deeply"):
        load_examples(str(tmp_path / "deep.json"))
    (tmp_path / "deep.jsonl").write_text('{"question": "q", "ctxs": ["x"]}\n{"a": ' + deep + "}\n")
    with pytest.raises(ValueError, match="deep.jsonl:2: JSON nested too deeply"):
        load_examples(str(tmp_path / "deep.jsonl"))


def test_a_broken_json_list_is_named_as_one(tmp_path):
    """A truncated JSON list gets the place of the damage, not advice about JSON Lines."""
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(CACHEBLEND, indent=1)[:-40], encoding="utf-8")
    with pytest.raises(ValueError) as info:
        load_examples(str(path))
    message = str(info.value)
    assert message.startswith(f"{path}:") and "JSON list" in message and "\n" not in message
    lines = path.read_text().count("\n") + 1
    assert message.split(":")[1] == str(lines)  # the line where the text stops
