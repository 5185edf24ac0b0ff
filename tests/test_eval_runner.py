"""The eval runner, its results file, reports and the `kvblend eval` command, on a tiny
random model with the real SmolLM2 tokenizer (fast; the metrics' values are meaningless,
their relations to full prefill are not)."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
from pathlib import Path

import pytest
import torch

from blend.cli import main
from blend.config import EngineConfig
from blend.engine.engine import BlendEngine
from eval.loaders import Example, load_examples
from eval.report import summary_table, write_reports
from eval.results import FILENAME, ResultsLog, read_results
from eval.runner import METRICS, Entry, parse_ratios, plan_entries, run_eval
from tests.models import smollm2_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "eval" / "data" / "synthetic_small.json"
STORE = {"kv_dtype": "float32", "tiers": [{"kind": "cpu", "budget": "256MiB"}]}
ENTRIES = plan_entries(["full", "reuse", "prefix", "blend"], [0.15, 1.0])


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: the tiny model's matrices gain nothing from more, and on a busy
    machine spinning worker threads make these tests several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _tokenizer():
    """The SmolLM2 tokenizer alone from the converted model copy when there is one (faster
    than loading the whole model), else through the shared loader."""
    from transformers import AutoTokenizer

    from blend.model.loading import cache_home

    found = sorted((cache_home() / "models").glob("SmolLM2-135M-Instruct*/tokenizer.json"))
    return AutoTokenizer.from_pretrained(found[0].parent) if found else smollm2_tokenizer()


@functools.cache
def _lm():
    return tiny_model("llama", tokenizer=_tokenizer())


def _engine() -> BlendEngine:
    """A fresh engine (empty store) around the shared tiny model."""
    return BlendEngine(EngineConfig().with_overrides(store=STORE, chunk_tokens=64), model=_lm())


@functools.cache
def _examples() -> tuple[Example, ...]:
    return tuple(load_examples(DATA, limit=2))


def _run(out_dir=None, engine=None, examples=None, entries=ENTRIES, max_new_tokens=3):
    engine = engine or _engine()
    return run_eval(engine, list(_examples() if examples is None else examples), entries=entries, dataset="synthetic_small",
                    max_new_tokens=max_new_tokens, out_dir=out_dir, progress=False)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    return out, _run(out)


# ------------------------------------------------------------------- planning
def test_plan_entries_puts_full_first_and_names_blend_by_ratio():
    names = [e.name for e in plan_entries(["blend", "reuse"], [0.3, 0.05, 0.3])]
    assert names == ["full", "blend@0.3", "blend@0.05", "reuse"]
    assert [e.name for e in plan_entries("prefix,full", "0.15")] == ["full", "prefix"]
    assert plan_entries(["blend"], [1])[1] == Entry("blend@1.0", "blend", 1.0)


def test_selections_are_an_eval_dimension():
    entries = plan_entries(["blend", "reuse"], [0.15, 0.3], ["deviation", "hybrid"])
    assert [e.name for e in entries] == ["full", "blend@0.15:deviation", "blend@0.15:hybrid",
                                         "blend@0.3:deviation", "blend@0.3:hybrid", "reuse"]
    assert {e.selection for e in entries if e.mode == "blend"} == {"deviation", "hybrid"}
    with pytest.raises(ValueError, match="valid selections are: deviation, attention, hybrid"):
        plan_entries(["blend"], [0.15], ["fastest"])
    run = _run(None, entries=plan_entries(["blend"], [0.3], "deviation,attention"), max_new_tokens=2)
    rows = run.records[0]["entries"]
    assert rows["blend@0.3:deviation"]["selection"] == "deviation"
    assert rows["blend@0.3:attention"]["recomputed_tokens"] == rows["blend@0.3:deviation"]["recomputed_tokens"]


@pytest.mark.parametrize("modes, ratios, message", [
    (["full", "fast"], [0.1], "valid modes are: full, reuse, prefix, blend"),
    ([], [0.1], "no modes"),
    (["blend"], [1.5], "within [0, 1]"),
    (["blend"], [-0.1], "within [0, 1]"),
    (["blend"], ["abc"], "not a number"),
])
def test_plan_entries_rejects_bad_modes_and_ratios(modes, ratios, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        plan_entries(modes, ratios)


def test_parse_ratios_rejects_nan():
    with pytest.raises(ValueError, match="not a number"):
        parse_ratios("nan")


# ------------------------------------------------------------------- the runner
def test_summary_has_the_contract_fields(first_run):
    _, run = first_run
    doc = json.loads(json.dumps(run.to_json(), allow_nan=False))
    assert doc["dataset"] == "synthetic_small" and doc["n"] == 2
    assert list(doc["summary"]) == ["full", "reuse", "prefix", "blend@0.15", "blend@1.0"]
    for name, entry in doc["summary"].items():
        assert set(METRICS) <= set(entry), name
        assert entry["rouge_l"] is None  # QA set
        for key in ("f1", "em", "kl_to_full", "answer_kl", "top1_agree", "greedy_match", "answer_nll", "ttft_s"):
            assert isinstance(entry[key], float), (name, key)
        assert entry["n"] == 2


def test_full_is_its_own_reference_and_blend_at_one_matches_it(first_run):
    _, run = first_run
    s = run.summary
    assert s["full"]["kl_to_full"] == 0.0 and s["full"]["greedy_match"] == 1.0 and s["full"]["top1_agree"] == 1.0
    assert s["full"]["recomputed_fraction"] == 1.0 and s["reuse"]["recomputed_fraction"] == 0.0
    assert s["full"]["speedup"] == 1.0 and s["reuse"]["speedup"] > 0
    assert s["blend@1.0"]["kl_to_full"] < 1e-6, s["blend@1.0"]["kl_to_full"]
    assert s["blend@1.0"]["greedy_match"] == 1.0 and s["blend@1.0"]["recomputed_fraction"] == 1.0
    assert 0.1 < s["blend@0.15"]["recomputed_fraction"] < 0.2
    assert s["reuse"]["kl_to_full"] > s["blend@1.0"]["kl_to_full"]
    # along full prefill's whole answer: 0 for full, ~0 at ratio 1, more for reuse
    assert s["full"]["answer_kl"] == 0.0 and s["blend@1.0"]["answer_kl"] < 1e-5
    assert s["reuse"]["answer_kl"] > 10 * s["blend@1.0"]["answer_kl"] + 1e-6
    assert abs(s["blend@1.0"]["answer_nll"] - s["full"]["answer_nll"]) < 1e-4
    for record in run.records:  # documents were ingested first: every lookup hits
        assert record["entries"]["reuse"]["chunk_misses"] == 0 and record["entries"]["reuse"]["chunk_hits"] > 0


def _reference_engine(dtype: torch.dtype, digest: str) -> BlendEngine:
    """An engine around a copy of the tiny model in `dtype` (its own fingerprint)."""
    import copy

    from blend.model.loading import wrap_model

    lm = _lm()
    model = copy.deepcopy(lm.model).to(dtype)
    return BlendEngine(EngineConfig().with_overrides(store=STORE, chunk_tokens=64),
                       model=wrap_model(model, lm.tokenizer, "tiny-reference", weights_digest=digest))


def test_a_reference_engine_is_every_entry_s_reference(first_run):
    """The same computation under another fingerprint as the reference reproduces the run
    without one (full's KL 0, blend's KL unchanged); a bfloat16 copy as the reference moves
    full prefill's own KL off 0 (what the float32 model costs against it)."""
    _, plain = first_run
    entries = plan_entries(["full", "blend"], [0.15])
    same = run_eval(_engine(), list(_examples()), entries=entries, dataset="synthetic_small", max_new_tokens=3,
                    progress=False, reference=_reference_engine(torch.float32, "same-weights"))
    assert same.settings["reference"]["dtype"] == "float32"
    assert same.summary["full"]["kl_to_full"] < 1e-9 and same.summary["full"]["answer_kl"] < 1e-9
    assert same.summary["full"]["greedy_match"] == 1.0
    for name in ("kl_to_full", "answer_kl"):
        assert same.summary["blend@0.15"][name] == pytest.approx(plain.summary["blend@0.15"][name], abs=1e-6)
    bf16 = run_eval(_engine(), list(_examples()), entries=entries, dataset="synthetic_small", max_new_tokens=3,
                    progress=False, reference=_reference_engine(torch.bfloat16, "bf16-weights"))
    assert bf16.settings["reference"]["dtype"] == "bfloat16"
    assert bf16.summary["full"]["kl_to_full"] > 1e-6 and bf16.summary["full"]["answer_kl"] > 1e-6


def test_a_reference_that_computes_the_same_is_refused():
    engine = _engine()
    with pytest.raises(ValueError, match="leave the reference out"):
        run_eval(engine, list(_examples()), entries=ENTRIES, dataset="x", progress=False, reference=_engine())


def test_rerun_skips_finished_examples_and_extends_with_a_higher_limit(first_run, monkeypatch):
    out, run = first_run
    engine = _engine()
    calls = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **k: calls.append(k.get("mode")) or real(*a, **k))
    again = _run(out, engine=engine)
    assert calls == []  # nothing recomputed, not even the warm-up
    assert again.records == run.records and again.summary == run.summary
    more = _run(out, engine=engine, examples=load_examples(DATA, limit=3))
    assert len(more.records) == 3
    assert calls.count("full") == 2  # the warm-up and the one new example
    settings, done = read_results(out / FILENAME)
    assert len(done) == 3 and settings["max_new_tokens"] == 3
    assert len((out / FILENAME).read_text().splitlines()) == 4  # header + 3 examples


def test_rerun_with_other_settings_is_refused(first_run):
    out, _ = first_run
    with pytest.raises(ValueError, match=r"different settings \(entries: .*max_new_tokens: 3 in the file, 5 now"):
        _run(out, entries=plan_entries(["blend"], [0.5]), max_new_tokens=5)


def test_rerun_after_an_example_changed_is_refused_not_mixed(first_run):
    out, _ = first_run
    first, *rest = _examples()
    edited = dataclasses.replace(first, question=first.question + " (edited)", answers=("another",))
    with pytest.raises(ValueError, match=rf"1 example\(s\) changed .*{first.id!r}.*use another --out"):
        _run(out, examples=[edited, *rest])
    assert read_results(out / FILENAME)[1][first.id]["digest"] == first.digest  # the file is left as it was


def test_missing_answers_summarization_and_too_long_prompts(caplog):
    base = _examples()[0]
    no_answers = Example("no-answers", base.passages, base.question, ())
    summary = Example("summary", base.passages[:2], "", (base.passages[0][:80],), task="summarization")
    too_long = Example("too-long", ("word " * 3000,), "What?", ("x",))
    entries = plan_entries(["reuse"], [0.15])
    with caplog.at_level(logging.WARNING, logger="eval.runner"):
        run = _run(examples=[no_answers, summary, too_long], entries=entries)
    assert run.skipped == ["too-long"] and "exceeds the model's" in caplog.text
    rows = {r["id"]: r["entries"]["reuse"] for r in run.records}
    assert rows["no-answers"]["f1"] is None and rows["no-answers"]["answer_nll"] is None
    assert rows["no-answers"]["kl_to_full"] > 0 and rows["no-answers"]["top1_agree"] in (0.0, 1.0)
    assert rows["summary"]["rouge_l"] is not None and rows["summary"]["f1"] is None
    assert math.isfinite(rows["summary"]["answer_nll"])
    assert run.summary["reuse"]["f1"] is None and run.summary["reuse"]["rouge_l"] is not None


def test_a_too_long_first_example_is_skipped_too_and_repeated_ids_never_collide(caplog):
    base = _examples()[0]
    too_long = Example("a", ("word " * 3000,), "What?", ("x",))
    second = Example("a", base.passages, "Q two?", ("x",))  # repeats id a: named a#3, as a#2 is taken
    third = Example("a#2", base.passages, "Q three?", ("y",))
    with caplog.at_level(logging.WARNING, logger="eval.runner"):
        run = _run(examples=[too_long, second, third], entries=plan_entries(["reuse"], [0.15]))
    assert run.skipped == ["a"]
    assert {r["id"]: r["question"] for r in run.records} == {"a#3": "Q two?", "a#2": "Q three?"}


def test_run_eval_refuses_bad_calls():
    with pytest.raises(ValueError, match="no examples"):
        _run(examples=[])
    with pytest.raises(ValueError, match="must start with full"):
        _run(entries=[Entry("reuse", "reuse")])


# ------------------------------------------------------------------ results file
def test_results_log_drops_a_partial_last_line(tmp_path, caplog):
    with ResultsLog.open(tmp_path, {"a": 1}) as log_file:
        log_file.append({"id": "e1", "entries": {}})
    with (tmp_path / FILENAME).open("a") as fh:
        fh.write('{"record": "example", "id": "e2", "entr')  # killed mid-write
    with caplog.at_level(logging.WARNING), ResultsLog.open(tmp_path, {"a": 1}) as log_file:
        assert set(log_file.done) == {"e1"}
        log_file.append({"id": "e2", "entries": {}, "x": float("nan")})
    assert "partial last line" in caplog.text
    settings, done = read_results(tmp_path / FILENAME)
    assert settings == {"a": 1} and set(done) == {"e1", "e2"} and done["e2"]["x"] is None


def test_results_log_rejects_a_foreign_file(tmp_path):
    (tmp_path / FILENAME).write_text('{"id": 1}\n')
    with pytest.raises(ValueError, match="settings line"):
        ResultsLog.open(tmp_path, {})


@pytest.mark.parametrize(("line", "why"), [
    ('{"record": "example", "entries": {}}', "without a string or integer id"),
    ('{"record": "example", "id": true, "entries": {}}', "without a string or integer id"),
    ('{"record": "example", "id": "e2"}', "without a mapping of entries"),
    ('{"record": "example", "id": "e2", "entries": {"full": 5}}', "without a mapping of entries"),
    ('{"record": "example", "id": "e2", "entries": {"full": {"f1": "x"}}}', "entry 'full' has f1 \"x\", not a number"),
])
def test_a_damaged_example_line_names_the_line_and_the_fix(tmp_path, line, why):
    with ResultsLog.open(tmp_path, {"a": 1}) as log_file:
        log_file.append({"id": "e1", "entries": {"full": {"f1": 0.5}}})
    with (tmp_path / FILENAME).open("a") as fh:
        fh.write(line + "\n")
    before = (tmp_path / FILENAME).read_bytes()
    with pytest.raises(ValueError, match=f"{FILENAME}:3: an? .*{why}|{FILENAME}:3: {why}"):
        ResultsLog.open(tmp_path, {"a": 1})
    assert (tmp_path / FILENAME).read_bytes() == before


def test_a_settings_line_without_settings_is_refused(tmp_path):
    (tmp_path / FILENAME).write_text('{"record": "settings", "version": 1, "settings": 5}\n')
    with pytest.raises(ValueError, match=":1: the settings line holds no settings mapping; delete the file"):
        ResultsLog.open(tmp_path, {})


def test_links_and_directories_where_eval_writes_are_refused_before_anything_runs(tmp_path):
    outside = tmp_path / "outside.jsonl"
    out = tmp_path / "out"
    out.mkdir()
    (out / FILENAME).symlink_to(outside)  # dangling: writing would create a file outside --out
    with pytest.raises(ValueError, match="results.jsonl is a link; remove it"):
        ResultsLog.open(out, {})
    assert not outside.exists()
    (out / FILENAME).unlink()
    (out / "summary.json").mkdir()  # found before the run, not after it
    with pytest.raises(ValueError, match="summary.json is not a regular file"):
        ResultsLog.open(out, {})
    assert not (out / FILENAME).exists()


@pytest.mark.parametrize("content", [b"line one of my notes\nimportant unterminated data", b"\x00\x01binary tail",
                                     b'{"record": "settings", "version": 1, "settings": {}}\nnot json\npartial'])
def test_a_file_that_is_not_ours_is_refused_and_left_byte_for_byte(tmp_path, content):
    (tmp_path / FILENAME).write_bytes(content)
    with pytest.raises(ValueError):
        ResultsLog.open(tmp_path, {})
    assert (tmp_path / FILENAME).read_bytes() == content


# --------------------------------------------------------------------- reports
def test_reports_are_written(first_run, tmp_path):
    _, run = first_run
    paths = write_reports(run, tmp_path)
    assert set(paths) == {"summary.json", "summary.md", "quality_vs_ttft.png", "kl_vs_ttft.png"}
    for name in ("quality_vs_ttft.png", "kl_vs_ttft.png"):
        assert paths[name].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[name].stat().st_size > 5000
    assert json.loads(paths["summary.json"].read_text())["summary"]["full"]["kl_to_full"] == 0.0
    table = paths["summary.md"].read_text()
    assert "| blend@0.15 |" in table and "removes" in table
    assert summary_table(run.summary).count("\n|") == len(run.summary) + 1


# ------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> Path:
    """A config whose model is the tiny model saved as a Hugging Face directory."""
    root = tmp_path_factory.mktemp("tiny-model")
    _lm().model.save_pretrained(root / "model")
    _tokenizer().save_pretrained(root / "model")
    config = root / "config.yaml"
    config.write_text(
        f"model: {root / 'model'}\ndevice: cpu\ndtype: float32\nengine:\n  blend:\n    chunk_tokens: 64\n"
        "store:\n  kv_dtype: float32\n  tiers:\n    - kind: cpu\n      budget: 64MiB\n"
    )
    return config


def _eval_one(config, out, capsys, *extra: str) -> dict:
    """`kvblend eval --json` over the first example's 3 passages, 2 new tokens; its JSON line."""
    argv = ["eval", "--config", str(config), "--dataset", str(DATA), "--limit", "1", "--passages", "3",
            "--max-new-tokens", "2", "--json", "--out", str(out), "--no-progress", *extra]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_cli_eval_prints_the_summary_json_last(tiny_config, tmp_path, capsys):
    out = tmp_path / "out"
    doc = _eval_one(tiny_config, out, capsys, "--modes", "full,blend", "--ratios", "1.0")
    assert doc["n"] == 1 and list(doc["summary"]) == ["full", "blend@1.0"]
    assert doc["summary"]["blend@1.0"]["kl_to_full"] < 1e-6
    assert {p.name for p in out.iterdir()} >= {"results.jsonl", "summary.json", "summary.md", "kl_vs_ttft.png"}
    settings, _ = read_results(out / FILENAME)
    assert settings["passages"] == 3 and settings["prompts"]["qa"]["query"].startswith("Question: {question}")


@pytest.mark.parametrize("extra, message", [
    (["--modes", "full,turbo"], "valid modes are: full, reuse, prefix, blend"),
    (["--ratios", "0.1,1.5"], "within [0, 1]"),
    (["--limit", "0"], "--limit: must be >= 1"),
    (["--field-map", "question"], "is not ours=theirs"),
])
def test_cli_eval_rejects_bad_arguments(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--dataset", str(DATA), *extra])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_eval_with_a_reference_dtype(tiny_config, tmp_path, capsys):
    out = tmp_path / "out"
    doc = _eval_one(tiny_config, out, capsys, "--modes", "full", "--reference-dtype", "bfloat16")
    assert doc["summary"]["full"]["kl_to_full"] > 1e-6  # float32 full prefill against the bfloat16 one
    settings, _ = read_results(out / FILENAME)
    assert settings["dtype"] == "float32" and settings["reference"]["dtype"] == "bfloat16"


def test_cli_eval_refuses_a_reference_dtype_equal_to_the_config_s(tiny_config, capsys):
    argv = ["eval", "--config", str(tiny_config), "--dataset", str(DATA), "--reference-dtype", "float32"]
    assert main(argv) == 2
    assert "--reference-dtype float32 is the config's own compute dtype" in capsys.readouterr().err


def test_cli_eval_reports_an_unknown_dataset_layout(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"prompt": "x", "completion": "y"}]))
    assert main(["eval", "--config", str(ROOT / "configs" / "default.yaml"), "--dataset", str(bad)]) == 2
    assert "cannot tell the layout" in capsys.readouterr().err


def test_prefix_hits_of_an_earlier_run_are_flagged(caplog):
    engine, example, entries = _engine(), _examples()[:1], plan_entries(["prefix"], [0.15])
    first = _run(engine=engine, examples=example, entries=entries, max_new_tokens=1)
    assert first.records[0]["entries"]["prefix"]["repeated_prompt"] is False
    with caplog.at_level(logging.WARNING, logger="eval.runner"):
        second = _run(engine=engine, examples=example, entries=entries, max_new_tokens=1)
    assert second.records[0]["entries"]["prefix"]["repeated_prompt"] is True
    assert "repeated prompt" in caplog.text


def test_tradeoff_plot_draws_one_line_per_selection_at_equal_ratios(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from eval.report import plot_tradeoff

    figures = []
    savefig = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self) or savefig(self, *a, **k))
    summary = {"full": {"mode": "full", "ratio": 1.0, "f1": 0.3, "ttft_s": 9.0},
               "reuse": {"mode": "reuse", "ratio": 0.0, "f1": 0.1, "ttft_s": 0.4}}
    for policy, f1 in (("query", 0.28), ("deviation", 0.2)):
        for ratio in (0.05, 0.15):
            summary[f"blend@{ratio}:{policy}"] = {"mode": "blend", "ratio": ratio, "f1": f1 + ratio, "ttft_s": 2 + ratio}
    path = plot_tradeoff(summary, "f1", tmp_path / "q.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = {line.get_label(): list(line.get_xdata()) for line in figures[0].axes[0].get_lines()}
    assert lines == {"blend (recompute ratio), deviation": [2.05, 2.15], "blend (recompute ratio), query": [2.05, 2.15]}


class _Frozen(BlendEngine):
    """An engine whose attributes nobody may assign once it is built (eval passes options)."""

    def __setattr__(self, name: str, value: object) -> None:
        raise AssertionError(f"engine.{name} assigned during an evaluation")


def test_a_run_passes_its_template_and_split_per_request_and_changes_no_engine_attribute():
    from blend.planning.split import Splitter
    from blend.prompt.builder import PromptTemplate

    class FrozenSplit(Splitter):
        def __setattr__(self, name: str, value: object) -> None:
            assert name != "mode", "engine.splitter.mode assigned during an evaluation"
            super().__setattr__(name, value)

    engine = _engine()
    engine.__class__, engine.splitter.__class__ = _Frozen, FrozenSplit
    template = PromptTemplate(system="Answer from the passages, tersely.", query="Q: {question}\nA:")
    ex = _examples()[0]
    entries = plan_entries(["full", "blend"], [0.15])
    run = run_eval(engine, [ex], entries=entries, dataset="synthetic_small", max_new_tokens=2, progress=False,
                   prompts={"qa": template, "summarization": template})
    record = run.records[0]
    ours = engine.build_prompt(ex.question, list(ex.passages), template=template)
    assert record["prompt_tokens"] == len(ours) != len(engine.build_prompt(ex.question, list(ex.passages)))
    blend = record["entries"]["blend@0.15"]
    # the passages were ingested after the template's system part: the blend request found them all
    assert blend["chunk_misses"] == 0 and blend["chunk_hits"] > 0
    assert engine.splitter.mode == "auto" and engine.prompts.system_prompt != template.system
    # the same request outside the run: its own split off, the engine's untouched
    result = engine.generate(ex.question, list(ex.passages), recompute_ratio=0.15, max_new_tokens=1,
                             template=template, split="off")
    assert result.stats.split.reason == "off (the request's split)"
