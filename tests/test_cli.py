"""The kvblend CLI end to end on a tiny model saved to a local directory: requests, the
store commands, --json everywhere, confirmation, the default config outside the repository,
a parser that imports nothing heavy, quiet model loading, and a closed stdout."""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from blend.cli import main
from tests.models import home_sharing, smollm2_tokenizer, tiny_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer())
    lm.model.save_pretrained(root / "model")
    smollm2_tokenizer().save_pretrained(root / "model")
    (root / "a.txt").write_text("The Harrow bridge was finished in 1888 by a team of forty masons.")
    (root / "b.txt").write_text("Its central arch spans sixty metres over the river Dell.")
    (root / "c.yaml").write_text(f"""
model: {root / "model"}
device: cpu
engine:
  blend:
    chunk_tokens: 16
  generation:
    max_new_tokens: 4
  sessions:
    sessions_dir: {root / "sessions"}
store:
  kv_dtype: float32
  tiers:
    - {{kind: cpu, budget: 64MiB}}
    - {{kind: disk, path: {root / "disk"}, budget: 256MiB}}
""")
    return root


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_ingest_ask_and_store(config_file, capsys):
    cfg = str(config_file / "c.yaml")
    docs = [str(config_file / "a.txt"), str(config_file / "b.txt")]
    assert main(["ingest", "--config", cfg, *docs, "--json"]) == 0
    ingested = last_json(capsys)
    chunks = ingested["chunks"]
    assert [d["id"] for d in ingested["documents"]] == ["a.txt", "b.txt"]  # file names: ids hold no '/'
    assert len(chunks) >= 2
    answers = {}
    for mode in ("full", "reuse", "prefix", "blend"):
        args = ["ask", "--config", cfg, "--question", "When was the bridge finished?", "--mode", mode, "--json"]
        for d in docs:
            args += ["--doc", d]
        assert main(args + ["--ratio", "1.0"] if mode == "blend" else args) == 0
        out = last_json(capsys)
        assert set(out) == {"text", "ttft_s", "stats"} and out["stats"]["mode"] == mode
        answers[mode] = out
    assert answers["reuse"]["stats"]["documents"]["hits"] >= 2  # found on disk in a new process-like engine
    assert answers["blend"]["text"] == answers["full"]["text"]
    assert main(["store", "stats", "--config", cfg, "--json"]) == 0
    stats = last_json(capsys)
    assert "disk" in json.dumps(stats)
    assert main(["store", "ls", "--config", cfg]) == 0
    listing = capsys.readouterr().out
    assert chunks[0] in listing
    assert main(["store", "clear", "--config", cfg, "--yes"]) == 0


def test_ingest_that_no_tier_stored_is_an_error_after_the_json(config_file, capsys):
    blocker = config_file / "blocker"
    blocker.write_text("a file where the cache directory's parent should be")
    text = (config_file / "c.yaml").read_text()
    start = text.index("    - {kind: cpu")
    (config_file / "lost.yaml").write_text(text[:start] + f"    - {{kind: disk, path: {blocker / 'cache'}, budget: 1MiB}}\n")
    assert main(["ingest", "--config", str(config_file / "lost.yaml"), str(config_file / "a.txt"), "--json"]) == 2
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["documents"][0]["stored"] is False
    errors = [line for line in err.splitlines() if line.startswith("kvblend: error:")]
    assert len(errors) == 1 and "1 of 1 document(s) were not stored" in errors[0] and "path, permissions" in errors[0]


def test_bad_input_is_a_clear_error(config_file, capsys):
    cfg = str(config_file / "c.yaml")
    with pytest.raises(SystemExit, match="2"):
        main(["ask", "--config", cfg, "--question", "q", "--mode", "blend", "--ratio", "2"])
    assert "within [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["ask", "--config", cfg, "--question", "q", "--mode", "fast"])
    assert "invalid choice" in capsys.readouterr().err
    assert main(["ask", "--config", str(config_file / "missing.yaml"), "--question", "q"]) == 2
    assert "not found" in capsys.readouterr().err
    (config_file / "bad.yaml").write_text("model: x\nengine:\n  chunk_tokenz: 3\n")
    assert main(["ask", "--config", str(config_file / "bad.yaml"), "--question", "q"]) == 2
    err = capsys.readouterr().err
    assert "chunk_tokenz" in err and "chunk_tokens" in err  # names the valid keys


def run_cli(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m blend.cli ARGS` in a fresh process running this checkout's code."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVBLEND_")}
    full_env |= {"PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, "-m", "blend.cli", *args], cwd=cwd, env=full_env, capture_output=True,
                          text=True, timeout=300, **kw)


def test_json_is_the_only_stdout_line_in_every_subcommand(config_file, capsys):
    cfg = str(config_file / "c.yaml")
    doc = str(config_file / "a.txt")
    commands = [
        ["ingest", "--config", cfg, doc],
        ["ask", "--config", cfg, "--question", "When?", "--doc", doc],
        ["chat", "--config", cfg, "--session", "j", "--message", "Hi"],
        ["store", "stats", "--config", cfg],
        ["store", "ls", "--config", cfg],
        ["plan", "--tokens", "512", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--read-mibps", "100",
         "--prefill-tokens-per-s", "1000"],
        ["bench", "load", "--size-mb", "0.02", "--layers", "2", "--rounds", "1"],
        ["store", "clear", "--config", cfg, "--yes"],
    ]
    for argv in commands:
        assert main([*argv, "--json"]) == 0, argv
        out = capsys.readouterr().out.splitlines()
        assert len(out) == 1 and isinstance(json.loads(out[0]), dict), (argv, out)


def test_store_ls_json_and_clear_confirmation(config_file, capsys, monkeypatch):
    cfg = str(config_file / "c.yaml")
    assert main(["ingest", "--config", cfg, str(config_file / "b.txt"), "--json"]) == 0
    keys = json.loads(capsys.readouterr().out)["chunks"]
    assert main(["store", "ls", "--config", cfg, "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)["entries"]
    assert {e["key"] for e in entries} >= set(keys) and {e["tier"] for e in entries} == {"disk"}  # a new process
    assert set(entries[0]) == {"key", "tier", "tokens", "bytes", "pos_start", "corrupt"}
    assert all(e["corrupt"] is None for e in entries)
    assert main(["store", "clear", "--config", cfg]) == 2  # stdin is not a terminal and no --yes
    assert "--yes" in capsys.readouterr().err
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert main(["store", "clear", "--config", cfg]) == 1
    assert main(["store", "ls", "--config", cfg, "--json"]) == 0 and json.loads(capsys.readouterr().out)["entries"]
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert main(["store", "clear", "--config", cfg]) == 0
    assert main(["store", "ls", "--config", cfg, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["entries"] == []


def test_store_ls_changes_nothing_it_lists(config_file, capsys):
    """A listing shows an unreadable entry instead of deleting it, and leaves every entry's
    recency (its file's mtime) as it was."""
    import os

    cfg = str(config_file / "c.yaml")
    assert main(["ingest", "--config", cfg, str(config_file / "a.txt"), str(config_file / "b.txt"), "--json"]) == 0
    capsys.readouterr()
    files = sorted((config_file / "disk").glob("*.kv"))
    assert len(files) >= 2
    damaged = files[0]
    damaged.write_bytes(b"not an entry" + damaged.read_bytes()[12:])
    for path in files:
        os.utime(path, (1_000_000, 1_000_000))
    assert main(["store", "ls", "--config", cfg, "--json"]) == 0
    entries = {e["key"]: e for e in json.loads(capsys.readouterr().out)["entries"]}
    assert "bad magic" in entries[damaged.stem]["corrupt"] and entries[damaged.stem]["tokens"] is None
    assert all(entries[p.stem]["corrupt"] is None for p in files[1:])
    assert all(p.exists() and p.stat().st_mtime == 1_000_000 for p in files)  # nothing deleted, nothing touched
    assert main(["store", "ls", "--config", cfg]) == 0
    assert f"{damaged.stem}" in capsys.readouterr().out


def test_store_clear_does_not_report_an_unreachable_redis_tier_as_cleared(config_file, capsys, monkeypatch):
    monkeypatch.setenv("KVBLEND_REDIS_URL", "redis://127.0.0.1:1")  # nothing listens on port 1
    cfg = str(config_file / "c.yaml")
    assert main(["store", "clear", "--config", cfg, "--yes", "--json"]) == 1
    captured = capsys.readouterr()
    result = json.loads(captured.out.splitlines()[-1])
    assert result["cleared"] == ["cpu", "disk"] and result["not_cleared"] == ["redis"]
    assert "tier redis could not be reached: its entries were not deleted" in captured.err


def test_json_stays_strict_and_present_at_the_edges(config_file, capsys, monkeypatch):
    # a rate that overflows: null, not the non-standard Infinity
    assert main(["plan", "--tokens", "3072", "--layers", "30", "--kv-heads", "3", "--head-dim", "64",
                 "--read-mibps", "1e308", "--prefill-tokens-per-s", "1e-308", "--json"]) == 0
    out = capsys.readouterr().out.splitlines()[-1]
    assert "Infinity" not in out and "NaN" not in out
    json.loads(out, parse_constant=lambda name: pytest.fail(f"non-standard JSON constant {name}"))
    # a chat on stdin that ends before any turn still ends with one JSON object
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    assert main(["chat", "--config", str(config_file / "c.yaml"), "--session", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"session": "none", "turns": 0}


def test_building_the_parser_imports_nothing_heavy():
    code = ("import sys; from blend.cli import build_parser; build_parser()\n"
            "print(sorted(m for m in ('torch', 'transformers', 'redis', 'pydantic', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_verbose_is_taken_before_or_after_any_subcommand():
    from blend.cli import build_parser

    parser = build_parser()
    for command in (["store", "stats"], ["bench", "ttft"], ["ask", "--question", "q"], ["serve"], ["demo"]):
        assert parser.parse_args(command).verbose is False
        assert parser.parse_args(["-v", *command]).verbose is True  # not reset by the subcommand's default
        assert parser.parse_args([*command, "-v"]).verbose is True
        assert parser.parse_args([*command, "--verbose"]).verbose is True


def test_store_stats_outside_the_repository(tmp_path):
    home = home_sharing(tmp_path / "home")  # (the model converted once per machine)
    proc = run_cli("store", "stats", "--json", cwd=tmp_path, env={"KVBLEND_HOME": str(home)})
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout.splitlines()[-1])
    assert list(stats) == ["cpu", "disk"] and stats["disk"]["path"] == str(home / "disk")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["home"]  # nothing in the working directory


def test_model_loading_is_quiet_unless_verbose(config_file, capsys):
    args = ["ask", "--config", str(config_file / "c.yaml"), "--question", "When?", "--mode", "full",
            "--max-new-tokens", "1"]
    assert main(args) == 0
    assert capsys.readouterr().err == ""
    assert main(["--verbose", *args]) == 0
    assert "Loading weights" in capsys.readouterr().err
    assert main(args) == 0
    assert capsys.readouterr().err == ""


def test_closed_stdout_is_not_a_traceback(config_file):
    for args in (["--help"], ["store", "ls", "--config", str(config_file / "c.yaml")]):
        proc = subprocess.Popen([sys.executable, "-m", "blend.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
        proc.stdout.close()  # like `| head` exiting before kvblend writes
        err = proc.stderr.read().decode()
        proc.wait(timeout=120)
        assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_missing_eval_extra_names_the_install_command(monkeypatch, capsys, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert main(["eval", "--dataset", str(tmp_path / "d.json")]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvblend: error: this command needs the optional package 'matplotlib': pip install 'kvblend[eval]'")

    def needs_rouge(args):
        raise ModuleNotFoundError("No module named 'rouge_score'", name="rouge_score")

    monkeypatch.setattr("blend.cli.demo.cmd_demo", needs_rouge)
    monkeypatch.setattr("blend.cli.demo.register", lambda sub: sub.add_parser("demo").set_defaults(func=needs_rouge))
    assert main(["demo"]) == 2
    assert "pip install 'kvblend[eval]'" in capsys.readouterr().err


_SLOW_COMMAND = """
import signal, sys, time
import blend.cli as cli

# as in a terminal: a test run in the background inherits SIGINT ignored (POSIX shells
# ignore it for background jobs), and kvblend leaves an ignored SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)

def slow(argv):
    try:
        print("started", flush=True)
        time.sleep(60)
    finally:
        time.sleep(float(sys.argv[1]))  # winding down (flushing writes, closing files)
    return 0

cli._run = slow
raise SystemExit(cli.main([]))
"""


@pytest.mark.parametrize("second", [False, True])
def test_interrupt_exits_130_with_one_line_and_a_second_one_at_once(second):
    import signal

    proc = subprocess.Popen([sys.executable, "-c", _SLOW_COMMAND, "30" if second else "0.2"], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGINT)
    if second:
        time.sleep(0.5)  # inside the 30 s wind-down
        proc.send_signal(signal.SIGINT)
    assert proc.wait(20) == 130
    err = proc.stderr.read()
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == ("kvblend: interrupted again; exiting now" if second else "kvblend: interrupted")


def test_demo_shows_both_answers_the_kls_and_where_they_part(tmp_path, capsys):
    """`kvblend demo` on a tiny random model: ratio 1 is full prefill (same answer, KL ~0, no
    parting); reuse (ratio 0) moves the answer's KL. (Reuse's greedy answer equals full's on this
    model, so where answers part is tested on a constructed case below.)"""
    lm = tiny_model("llama", tokenizer=smollm2_tokenizer(), max_position_embeddings=8192)
    lm.model.save_pretrained(tmp_path / "model")
    smollm2_tokenizer().save_pretrained(tmp_path / "model")
    (tmp_path / "d.yaml").write_text(f"""
model: {tmp_path / "model"}
device: cpu
engine:
  generation:
    max_new_tokens: 6
store:
  kv_dtype: float32
  tiers:
    - {{kind: cpu, budget: 256MiB}}
""")
    cfg = str(tmp_path / "d.yaml")
    assert main(["demo", "--config", cfg, "--ratio", "1", "--json"]) == 0
    captured = capsys.readouterr()
    same = json.loads(captured.out.strip().splitlines()[-1])
    assert same["answers_agree"] and same["parting"] is None
    assert same["first_token_kl_to_full"] < 1e-4 and same["answer_kl_to_full"] < 1e-4
    assert "where they part" not in captured.err and "the answers agree" in captured.err
    assert main(["demo", "--config", cfg, "--ratio", "0", "--json"]) == 0
    captured = capsys.readouterr()
    reuse = json.loads(captured.out.strip().splitlines()[-1])
    assert reuse["answer_kl_to_full"] > 1e-3  # random weights: the documents' context matters


def test_parting_shows_each_modes_top_tokens():
    from blend.cli.demo import Parting, top_tokens

    tok = smollm2_tokenizer()
    zero, seven = (tok(d, add_special_tokens=False).input_ids[0] for d in ("0", "7"))
    full = torch.full((len(tok),), -30.0)
    full[zero], full[seven] = 0.0, -0.3
    blend = full.clone()
    blend[seven] = 0.5
    parting = Parting(12, top_tokens(full.log_softmax(-1), tok, 2), top_tokens(blend.log_softmax(-1), tok, 2))
    assert [t for t, _ in parting.full_top] == ["0", "7"] and [t for t, _ in parting.blend_top] == ["7", "0"]
    assert parting.full_top[0][1] == pytest.approx(1 / (1 + math.exp(-0.3)), abs=1e-3)
    assert parting.line().startswith("where they part (token 13): full prefill '0' 0.57, '7' 0.43; blend on the "
                                     "same first 12 tokens '7' 0.62, '0' 0.38")
    assert json.loads(json.dumps(parting.to_dict()))["full_top"][0] == ["0", parting.full_top[0][1]]


def test_an_ingest_larger_than_the_budget_says_by_how_much(config_file, capsys):
    """Fault sweep: later documents of one ingest evict the earlier ones; the error names the tier, its
    budget and how much more the ingest wrote."""
    text = (config_file / "c.yaml").read_text()
    start = text.index("    - {kind: cpu")
    (config_file / "small.yaml").write_text(text[:start] + "    - {kind: cpu, budget: 40KiB}\n")
    docs = []
    for i in range(6):
        path = config_file / f"many{i}.txt"
        path.write_text(f"Document {i}: the {i}th mill on the river Dell was rebuilt in {1850 + i} after a fire.")
        docs.append(str(path))
    assert main(["ingest", "--config", str(config_file / "small.yaml"), *docs]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("kvblend: error:")]
    assert len(errors) == 1
    assert "larger than the budget of tier cpu (40KiB)" in errors[0] and "more" in errors[0]
    assert "later documents evicted the earlier ones" in errors[0]
