"""Bad input through the command line: every case exits 2 with exactly one line on stderr
naming the fault, no traceback, and nothing written (the working directory, $KVBLEND_HOME
and the files of the case are compared before and after). Run in-process through
blend.cli.main, and a few through a real `python -m blend.cli` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blend.cli import main

ROOT = Path(__file__).resolve().parents[1]
ENV = ("KVBLEND_CONFIG", "KVBLEND_MODEL", "KVBLEND_DEVICE", "KVBLEND_DTYPE", "KVBLEND_RECOMPUTE_RATIO",
       "KVBLEND_REDIS_URL", "KVBLEND_STORE_SECRET", "XDG_CACHE_HOME")
CPU_STORE = "store:\n  tiers:\n    - {kind: cpu, budget: 64MiB}\n"
DOWN_REDIS = ("store:\n  tiers:\n    - {kind: redis, url: 'redis://127.0.0.1:1/0', required: true, "
              "connect_timeout_s: 0.3}\n")


def cfg(text: str) -> dict[str, str | bytes]:
    return {"c.yaml": text}


def engine(extra: str = "", device: str = "cpu") -> dict[str, str | bytes]:
    """A config on the tiny model saved by the `model_dir` fixture, CPU tier only."""
    return cfg(f"model: '{{model}}'\ndevice: {device}\n{extra}{CPU_STORE}")


STATS = ["store", "stats", "--config", "{tmp}/c.yaml"]
INGEST = ["ingest", "--config", "{tmp}/c.yaml"]
# more tokens than the tiny model's 2,048 positions (about one a character) in few characters
NUMBERS = " ".join(str(i * 7919 % 100000) for i in range(700))
OVER_SIZE = "x " * 300_000  # 600 kB: over 2,048 positions x 256 bytes
ASK = ["ask", "--config", "{tmp}/c.yaml", "--question", "q"]
BAD_UTF8 = b"caf\xe9 \xff\xfe\n"

# (case id, argv, files of the case, environment)
CASES: list[tuple[str, list[str], dict[str, str | bytes], dict[str, str]]] = [
    # ---- the config file
    ("yaml-syntax", STATS, cfg("a: [\n"), {}),
    ("yaml-top-list", STATS, cfg("- 1\n- 2\n"), {}),
    ("yaml-int-key", STATS, cfg("1: 2\n"), {}),
    ("yaml-alias-bomb", STATS, cfg("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join(['*a' + (str(i - 1) if i > 1 else '')] * 9)}]\n" for i in range(1, 9))), {}),
    ("yaml-not-utf8", STATS, {"c.yaml": b"model: caf\xe9\n"}, {}),
    ("config-missing", ["store", "stats", "--config", "{tmp}/none.yaml"], {}, {}),
    ("config-is-dir", ["store", "stats", "--config", "{tmp}"], {}, {}),
    ("config-empty-path", ["store", "stats", "--config", ""], {}, {}),
    ("engine-list", STATS, cfg("engine: [1, 2]\n"), {}),
    ("store-int", STATS, cfg("store: 5\n"), {}),
    ("device-banana", STATS, cfg("device: banana\n"), {}),
    ("dtype-fp8", STATS, cfg("dtype: fp8\n"), {}),
    ("model-empty", STATS, cfg("model: ''\n"), {}),
    ("model-number", STATS, cfg("model: 5\n"), {}),
    ("unknown-top-key", STATS, cfg("modle: x\n"), {}),
    ("unknown-engine-key", STATS, cfg("engine:\n  chunk_tokenz: 3\n"), {}),
    ("idle-negative", STATS, cfg("engine:\n  sessions:\n    idle_seconds: -5\n"), {}),
    ("ratio-above-1", STATS, cfg("engine:\n  blend:\n    recompute_ratio: 1.5\n"), {}),
    ("ratio-nan", STATS, cfg("engine:\n  blend:\n    recompute_ratio: .nan\n"), {}),
    ("ratio-bool", STATS, cfg("engine:\n  blend:\n    recompute_ratio: true\n"), {}),
    ("ratio-string", STATS, cfg("engine:\n  blend:\n    recompute_ratio: 'high'\n"), {}),
    ("chunk-tokens-0", STATS, cfg("engine:\n  blend:\n    chunk_tokens: 0\n"), {}),
    ("chunk-tokens-float", STATS, cfg("engine:\n  blend:\n    chunk_tokens: 2.5\n"), {}),
    ("chunk-tokens-bool", STATS, cfg("engine:\n  blend:\n    chunk_tokens: false\n"), {}),
    ("check-layers-empty", STATS, cfg("engine:\n  blend:\n    selection:\n      check_layers: []\n"), {}),
    ("check-layers-order", STATS, cfg("engine:\n  blend:\n    selection:\n      check_layers: [3, 1]\n      filter_schedule: [1.0, 1.0]\n"), {}),
    ("check-layers-negative", STATS, cfg("engine:\n  blend:\n    selection:\n      check_layers: [-1]\n"), {}),
    ("filter-schedule-length", STATS, cfg("engine:\n  blend:\n    selection:\n      filter_schedule: [1.0, 0.5]\n"), {}),
    ("filter-schedule-end", STATS, cfg("engine:\n  blend:\n    selection:\n      filter_schedule: [0.5]\n"), {}),
    ("selection-unknown", STATS, cfg("engine:\n  blend:\n    selection: magic\n"), {}),
    ("deviation-unknown", STATS, cfg("engine:\n  deviation: q\n"), {}),
    ("chunk-context-unknown", STATS, cfg("engine:\n  blend:\n    chunk_context: all\n"), {}),
    ("max-new-tokens-0", STATS, cfg("engine:\n  generation:\n    max_new_tokens: 0\n"), {}),
    ("temperature-negative", STATS, cfg("engine:\n  generation:\n    temperature: -1\n"), {}),
    ("temperature-inf", STATS, cfg("engine:\n  generation:\n    temperature: .inf\n"), {}),
    ("top-p-0", STATS, cfg("engine:\n  generation:\n    top_p: 0\n"), {}),
    ("query-template", STATS, cfg("engine:\n  prompt:\n    query_template: '{foo}'\n"), {}),
    ("active-budget", STATS, cfg("engine:\n  sessions:\n    active_budget: lots\n"), {}),
    ("prefetch-depth-0", STATS, cfg("engine:\n  blend:\n    prefetch_depth: 0\n"), {}),
    ("engine-key-both-ways", STATS, cfg("engine:\n  max_num_seqs: 2\n  scheduler:\n    max_num_seqs: 4\n"), {}),
    ("sessions-dir-file", STATS, {"c.yaml": "engine:\n  sessions:\n    sessions_dir: f.txt\n", "f.txt": "x"}, {}),
    ("store-unknown-key", STATS, cfg("store:\n  kvdtype: float16\n"), {}),
    ("kv-dtype-int8", STATS, cfg("store:\n  kv_dtype: int8\n"), {}),
    ("namespace", STATS, cfg("store:\n  namespace: .hidden\n"), {}),
    ("write-queue-0", STATS, cfg("store:\n  write_queue: 0\n"), {}),
    ("promote-string", STATS, cfg("store:\n  promote: 'yes'\n"), {}),
    ("tiers-empty", STATS, cfg("store:\n  tiers: []\n"), {}),
    ("tiers-mapping", STATS, cfg("store:\n  tiers: {kind: cpu}\n"), {}),
    ("tier-kind-unknown", STATS, cfg("store:\n  tiers:\n    - {kind: s3}\n"), {}),
    ("tier-kind-missing", STATS, cfg("store:\n  tiers:\n    - {budget: 1GiB}\n"), {}),
    ("tier-unknown-key", STATS, cfg("store:\n  tiers:\n    - {kind: cpu, budgte: 1GiB}\n"), {}),
    ("budget-0", STATS, cfg("store:\n  tiers:\n    - {kind: cpu, budget: 0}\n"), {}),
    ("budget-negative", STATS, cfg("store:\n  tiers:\n    - {kind: cpu, budget: -5}\n"), {}),
    ("budget-words", STATS, cfg("store:\n  tiers:\n    - {kind: cpu, budget: 2 lots}\n"), {}),
    ("budget-bool", STATS, cfg("store:\n  tiers:\n    - {kind: cpu, budget: true}\n"), {}),
    ("tier-names-clash", STATS, cfg("store:\n  tiers:\n    - {kind: cpu}\n    - {kind: cpu}\n"), {}),
    ("tier-name-chars", STATS, cfg("store:\n  tiers:\n    - {kind: cpu, name: 'a b!'}\n"), {}),
    ("disk-path-missing", STATS, cfg("store:\n  tiers:\n    - {kind: disk}\n"), {}),
    ("disk-path-file", STATS, {"c.yaml": "store:\n  tiers:\n    - {kind: disk, path: f.txt}\n", "f.txt": "x"}, {}),
    ("disk-fsync", STATS, cfg("store:\n  tiers:\n    - {kind: disk, path: d, fsync: sometimes}\n"), {}),
    ("redis-url-scheme", STATS, cfg("store:\n  tiers:\n    - {kind: redis, url: 'http://h:6379'}\n"), {}),
    ("redis-ttl-negative", STATS, cfg("store:\n  tiers:\n    - {kind: redis, ttl_s: -1}\n"), {}),
    ("redis-backoff", STATS, cfg("store:\n  tiers:\n    - {kind: redis, backoff_initial_s: 60}\n"), {}),
    ("redis-pool-0", STATS, cfg("store:\n  tiers:\n    - {kind: redis, pool_size: 0}\n"), {}),
    ("cluster-urls-empty", STATS, cfg("store:\n  tiers:\n    - {kind: redis-cluster, urls: []}\n"), {}),
    ("secret-short", STATS, cfg("store:\n  secret: short\n"), {}),
    ("model-config-json-corrupt", ASK, {"c.yaml": "model: '{tmp}/m'\n" + CPU_STORE, "m/config.json": "{not json"}, {}),
    ("redis-required-down", STATS, cfg(DOWN_REDIS), {}),
    # ---- needs the model: fails at engine construction, before anything is written
    ("check-layers-beyond-model", ASK, engine("engine:\n  blend:\n    selection:\n      check_layers: [99]\n"), {}),
    ("budget-below-one-entry", ASK, cfg("model: '{model}'\ndevice: cpu\nstore:\n  tiers:\n    - {kind: cpu, budget: 1KiB}\n"),
     {}),
    ("device-cuda-on-cpu", ASK, engine(device="cuda"), {}),
    ("model-mla-alias", ASK, cfg("model: deepseek-v3\n" + CPU_STORE), {}),  # a shape without weights, and MLA
    ("model-mla-random", ASK, cfg("model: 'random:kimi-k2'\n" + CPU_STORE), {}),
    ("model-mla-local", ASK, {"c.yaml": "model: '{tmp}/m'\n" + CPU_STORE,
                              "m/config.json": '{"model_type": "kimi_k2", "kv_lora_rank": 512}'}, {}),
    ("plan-mla-and-mha", ["plan", "--tokens", "8", "--layers", "61", "--kv-lora-rank", "512", "--rope-head-dim", "64",
                          "--kv-heads", "8", "--link-gibps", "1", "--prefill-tokens-per-s", "1"], {}, {}),
    ("plan-mla-no-rate", ["plan", "--model", "deepseek-v3", "--tokens", "8", "--link-gibps", "1"], {}, {}),
    ("plan-tp-uneven", ["plan", "--tokens", "8", "--layers", "2", "--kv-heads", "8", "--head-dim", "8", "--tp", "3",
                        "--link-gibps", "1", "--prefill-tokens-per-s", "1"], {}, {}),
    # ---- the environment
    ("env-device", STATS, cfg(CPU_STORE), {"KVBLEND_DEVICE": "banana"}),
    ("env-dtype", STATS, cfg(CPU_STORE), {"KVBLEND_DTYPE": "fp8"}),
    ("env-ratio-word", STATS, cfg(CPU_STORE), {"KVBLEND_RECOMPUTE_RATIO": "lots"}),
    ("env-ratio-range", STATS, cfg(CPU_STORE), {"KVBLEND_RECOMPUTE_RATIO": "1.5"}),
    ("env-redis-url", STATS, cfg(CPU_STORE), {"KVBLEND_REDIS_URL": "http://x"}),
    ("env-secret-short", STATS, cfg(CPU_STORE), {"KVBLEND_STORE_SECRET": "short"}),
    ("env-config-missing", ["store", "stats"], {}, {"KVBLEND_CONFIG": "{tmp}/none.yaml"}),
    # ---- arguments
    ("no-command", [], {}, {}),
    ("unknown-command", ["frobnicate"], {}, {}),
    ("unknown-flag", ["--frobnicate", "store", "stats"], {}, {}),
    ("ask-no-question", ["ask"], {}, {}),
    ("ask-ratio-1.5", ASK + ["--ratio", "1.5"], cfg(CPU_STORE), {}),
    ("ask-ratio-nan", ASK + ["--ratio", "nan"], cfg(CPU_STORE), {}),
    ("ask-ratio-word", ASK + ["--ratio", "half"], cfg(CPU_STORE), {}),
    ("ask-mode", ASK + ["--mode", "fast"], cfg(CPU_STORE), {}),
    ("ask-max-new-tokens-0", ASK + ["--max-new-tokens", "0"], cfg(CPU_STORE), {}),
    ("ask-max-new-tokens-float", ASK + ["--max-new-tokens", "2.9"], cfg(CPU_STORE), {}),
    ("ask-doc-missing", ASK + ["--doc", "{tmp}/none.txt"], engine(), {}),
    ("ask-doc-dir", ASK + ["--doc", "{tmp}"], engine(), {}),
    ("ask-doc-not-utf8", ASK + ["--doc", "{tmp}/bad.txt"], {**engine(), "bad.txt": BAD_UTF8}, {}),
    ("ingest-missing", ["ingest", "--config", "{tmp}/c.yaml", "{tmp}/none.txt"], engine(), {}),
    ("ingest-not-utf8", ["ingest", "--config", "{tmp}/c.yaml", "{tmp}/bad.txt"], {**engine(), "bad.txt": BAD_UTF8}, {}),
    ("ingest-no-files", ["ingest"], {}, {}),
    ("ingest-longer-than-positions", INGEST + ["{tmp}/long.txt"], {**engine(), "long.txt": NUMBERS}, {}),
    ("ingest-larger-than-positions", INGEST + ["{tmp}/a.txt", "{tmp}/big.txt"],
     {**engine(), "a.txt": "a short one", "big.txt": OVER_SIZE}, {}),
    ("ingest-file-name-not-an-id", INGEST + ["{tmp}/line\nbreak.txt"], {**cfg(CPU_STORE), "line\nbreak.txt": "a"},
     {}),
    ("ask-doc-larger-than-positions", ASK + ["--doc", "{tmp}/big.txt"], {**engine(), "big.txt": OVER_SIZE}, {}),
    ("chat-session-path", ["chat", "--config", "{tmp}/c.yaml", "--session", "../x", "--message", "hi"], engine(), {}),
    ("chat-max-new-tokens", ["chat", "--session", "s", "--max-new-tokens", "-1"], {}, {}),
    ("demo-ratio", ["demo", "--ratio", "2"], {}, {}),
    ("store-no-action", ["store"], {}, {}),
    ("store-clear-no-tty", ["store", "clear", "--config", "{tmp}/c.yaml"],
     cfg("store:\n  tiers:\n    - {kind: disk, path: d}\n"), {}),
    ("demo-empty-question", ["demo", "--question", "  "], {}, {}),
    ("bench-serve-clients-0", ["bench", "serve", "--clients", "1,0"], {}, {}),
    ("bench-serve-url-not-a-url", ["bench", "serve", "--url", "notaurl", "--no-compare"], {}, {}),
    ("bench-serve-url-refused", ["bench", "serve", "--url", "http://127.0.0.1:1", "--clients", "1", "--requests", "1",
                                "--no-compare", "--json"], {}, {}),
    ("bench-serve-mode-list", ["bench", "serve", "--mode", "full,fast", "--no-compare"], {}, {}),
    ("bench-serve-peer-not-a-url", ["bench", "serve", "--peer", "llama", "--no-compare"], {}, {}),
    ("bench-serve-peer-refused", ["bench", "serve", "--peer", "http://127.0.0.1:1", "--clients", "1", "--requests", "1",
                                 "--no-compare", "--json"], {}, {}),
    ("bench-serve-peer-name-alone", ["bench", "serve", "--peer-name", "x", "--no-compare"], {}, {}),
    ("bench-serve-peer-setting", ["bench", "serve", "--peer", "http://127.0.0.1:1", "--peer-setting", "np",
                                  "--no-compare"], {}, {}),
    ("bench-serve-peer-name-kvblend", ["bench", "serve", "--peer", "http://127.0.0.1:1", "--peer-name", "kvblend",
                                       "--no-compare"], {}, {}),
    ("bench-load-size-negative", ["bench", "load", "--size-mb", "-5"], {}, {}),
    ("bench-load-size-beyond-memory", ["bench", "load", "--tier", "cpu", "--size-mb", "1e12"], {}, {}),
    ("bench-resume-disk-path-file", ["bench", "resume", "--tiers", "disk", "--disk-path", "{tmp}/f.txt"],
     {"f.txt": "a file"}, {}),
    ("bench-load-size-nan", ["bench", "load", "--size-mb", "nan"], {}, {}),
    ("bench-load-tier", ["bench", "load", "--tier", "s3"], {}, {}),
    ("bench-load-redis-url", ["bench", "load", "--tier", "cpu", "--tier", "redis", "--redis-url", "notaurl"], {}, {}),
    ("bench-load-cluster-no-urls", ["bench", "load", "--tier", "redis-cluster"], {}, {}),
    ("bench-load-layers-0", ["bench", "load", "--layers", "0"], {}, {}),
    ("bench-load-kv-dtype", ["bench", "load", "--kv-dtype", "int8"], {}, {}),
    ("bench-load-bad-config", ["bench", "load", "--config", "{tmp}/c.yaml"], cfg("store: 5\n"), {}),
    ("bench-ttft-ratios", ["bench", "ttft", "--ratios", "0.1,2"], {}, {}),
    ("bench-ttft-tiers", ["bench", "ttft", "--tiers", "cpu,s3"], {}, {}),
    ("bench-ttft-chunks", ["bench", "ttft", "--chunks", "0"], {}, {}),
    ("bench-ttft-out-is-file", ["bench", "ttft", "--out", "{tmp}/f.txt"], {"f.txt": "a file"}, {}),
    ("bench-ttft-chunks-beyond-positions", ["bench", "ttft", "--config", "{tmp}/c.yaml", "--chunks", "1000",
                                            "--chunk-tokens", "1000", "--tiers", "cpu"], engine(), {}),
    ("bench-serve-out-is-file", ["bench", "serve", "--out", "{tmp}/f.txt", "--no-compare"], {"f.txt": "a file"}, {}),
    ("bench-load-entry-beyond-memory", ["bench", "load", "--tier", "cpu", "--head-dim", "99999999", "--size-mb", "1"],
     {}, {}),
    ("bench-resume-history", ["bench", "resume", "--history-tokens", "0"], {}, {}),
    ("bench-resume-tiers", ["bench", "resume", "--tiers", "redis-cluster"], {}, {}),
    ("bench-resume-repeats", ["bench", "resume", "--repeats", "0"], {}, {}),
    ("eval-limit", ["eval", "--dataset", "{tmp}/d.json", "--limit", "0"], {}, {}),
    ("eval-modes", ["eval", "--dataset", "{tmp}/d.json", "--modes", "full,turbo"], {}, {}),
    ("eval-ratios", ["eval", "--dataset", "{tmp}/d.json", "--ratios", "0.1,1.5"], {}, {}),
    ("eval-dataset-missing", ["eval", "--config", "{tmp}/c.yaml", "--dataset", "{tmp}/none.json"], cfg(CPU_STORE), {}),
    ("eval-empty-csv", ["eval", "--config", "{tmp}/c.yaml", "--dataset", "{tmp}/e.csv"], {**cfg(CPU_STORE), "e.csv": ""}, {}),
    ("eval-header-only-csv", ["eval", "--config", "{tmp}/c.yaml", "--dataset", "{tmp}/h.csv"],
     {**cfg(CPU_STORE), "h.csv": "question,answers\n"}, {}),
    ("eval-every-example-skipped", ["eval", "--config", "{tmp}/c.yaml", "--dataset", "{tmp}/long.json", "--modes", "reuse",
                                    "--no-progress"],
     {**engine(), "long.json": json.dumps([{"id": "x", "question": "q?", "answers": ["a"],
                                            "ctxs": [{"title": "t", "text": "word " * 3000}]}])}, {}),
    ("eval-not-parquet", ["eval", "--config", "{tmp}/c.yaml", "--dataset", "{tmp}/x.parquet"],
     {**cfg(CPU_STORE), "x.parquet": "not parquet"}, {}),
    ("eval-out-empty", ["eval", "--dataset", "{tmp}/none.json", "--out", ""], {}, {}),
    ("eval-out-is-file", ["eval", "--dataset", "{tmp}/d.json", "--out", "{tmp}/d.json"], {"d.json": "[]"}, {}),
    ("eval-out-under-file", ["eval", "--dataset", "{tmp}/d.json", "--out", "{tmp}/d.json/sub"], {"d.json": "[]"}, {}),
    ("plan-tokens-0", ["plan", "--tokens", "0"], {}, {}),
    ("plan-no-stage", ["plan", "--tokens", "10", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"], {}, {}),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random model (4 layers) saved with the shipped tokenizer."""
    from tests.models import smollm2_tokenizer, tiny_model

    root = tmp_path_factory.mktemp("model")
    tiny_model("llama", tokenizer=smollm2_tokenizer()).model.save_pretrained(root)
    smollm2_tokenizer().save_pretrained(root)
    return root


def snapshot(root: Path) -> dict[str, int]:
    """Every path under `root` with its size (directories: -1), but the native kernels' build
    cache (`$KVBLEND_HOME/kernels`, built once per process by the first engine: not data)."""
    paths = {str(p.relative_to(root)): (-1 if p.is_dir() else p.stat().st_size) for p in root.rglob("*")}
    kernels = [k for k in paths if Path(k).name == "kernels"]
    for k in kernels:  # the kernels' directory, what is in it, and the home made for it
        paths = {p: v for p, v in paths.items() if not (p == k or p.startswith(k + "/"))}
        parent = str(Path(k).parent)
        if parent != "." and not any(p.startswith(parent + "/") for p in paths):
            paths.pop(parent, None)
    return paths


def prepare(tmp_path: Path, model: Path, files: dict[str, str | bytes], env: dict[str, str], monkeypatch) -> None:
    for var in ENV:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KVBLEND_HOME", str(tmp_path / "home"))
    for name, content in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content.replace("{model}", str(model)).replace("{tmp}", str(tmp_path)))
    for var, value in env.items():
        monkeypatch.setenv(var, value.replace("{tmp}", str(tmp_path)))
    monkeypatch.chdir(tmp_path)


def needs_model(files: dict[str, str | bytes]) -> bool:
    return any(isinstance(c, str) and "{model}" in c for c in files.values())


def test_the_table_is_large_enough():
    assert len(CASES) >= 60 and len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, files, env", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, files, env, tmp_path, monkeypatch, capsys, request):
    if "cuda" in request.node.callspec.id:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    model = request.getfixturevalue("model_dir") if needs_model(files) else tmp_path / "no-model"
    prepare(tmp_path, model, files, env, monkeypatch)
    before, home_before = snapshot(tmp_path), snapshot(model) if model.exists() else {}
    capsys.readouterr()  # what making the model fixture printed is not the command's
    try:
        code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    except SystemExit as exit_info:  # argparse usage errors
        code = exit_info.code
    out, err = capsys.readouterr()
    # a busy machine (e.g. this suite's own server tests) adds the benchmarks' contention
    # warning: a fact about the machine, not about the input
    lines = [line for line in err.splitlines() if not line.startswith("warning: load average")]
    assert code == 2, (out, err)
    assert not out.strip(), "work began before the input was checked"
    assert len(lines) == 1 and "error: " in lines[0], err
    assert "Traceback" not in err and len(lines[0]) < 500  # an unknown key lists the ~25 valid ones
    assert snapshot(tmp_path) == before, "the command wrote files"
    if model.exists():
        assert snapshot(model) == home_before


@pytest.mark.parametrize("case, key", [("check-layers-beyond-model", "engine.blend.selection.check_layers"),
                                       ("budget-below-one-entry", "store.tiers[0] (cpu): budget")])
def test_settings_checked_against_the_model_name_the_file_too(case, key, tmp_path, monkeypatch, capsys, model_dir):
    _, argv, files, env = next(c for c in CASES if c[0] == case)
    prepare(tmp_path, model_dir, files, env, monkeypatch)
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert capsys.readouterr().err.startswith(f"kvblend: error: {tmp_path}/c.yaml: {key}")


SUBPROCESS_CASES = ["yaml-syntax", "engine-list", "ask-ratio-1.5", "bench-load-size-negative", "ask-doc-missing",
                    "ask-doc-not-utf8", "model-config-json-corrupt", "redis-required-down", "no-command",
                    "model-mla-alias", "plan-mla-no-rate"]


@pytest.mark.parametrize("case", SUBPROCESS_CASES)
def test_no_traceback_reaches_stderr_of_a_real_process(case, tmp_path, monkeypatch):
    _, argv, files, env = next(c for c in CASES if c[0] == case)
    prepare(tmp_path, tmp_path / "no-model", files, env, monkeypatch)
    before = snapshot(tmp_path)
    run_env = {k: v for k, v in os.environ.items() if k not in ENV} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "blend.cli", *[a.replace("{tmp}", str(tmp_path)) for a in argv]],
                          cwd=tmp_path, env=run_env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == "" and snapshot(tmp_path) == before


def test_a_file_system_that_refuses_a_write_is_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """A full or read-only file system met mid-command (writing a report, a plot) is one line
    naming the file, exit 2, not a traceback."""
    import errno

    import blend.cli.plan

    def full(_args, parser=None):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out" / "kl_vs_ttft.png"))

    monkeypatch.setattr(blend.cli.plan, "run_plan", full)
    code = main(["plan", "--tokens", "10", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--read-mibps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("kvblend: error: [Errno 28] No space left on device:") and "kl_vs_ttft.png" in err


def test_a_command_started_with_stdout_closed_finishes_quietly(tmp_path):
    """`kvblend store ls --json >&-`: Python starts with no sys.stdout; what the command
    prints goes nowhere, and it exits 0 with nothing on stderr."""
    (tmp_path / "c.yaml").write_text(CPU_STORE)
    env = {k: v for k, v in os.environ.items() if k not in ENV} | {"PYTHONPATH": str(ROOT),
                                                                      "KVBLEND_HOME": str(tmp_path / "home")}
    proc = subprocess.run([sys.executable, "-m", "blend.cli", "store", "ls", "--config", str(tmp_path / "c.yaml"),
                           "--json"], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, timeout=300,
                          preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_a_huge_document_file_is_refused_on_its_size_before_it_is_read(tmp_path, monkeypatch, capsys, model_dir):
    """A 1 GiB file (sparse: nothing on disk) given to ingest or ask is refused from its size and the
    model's positions, with one line, before it is read (reading it whole took 23 s) or the model loads."""
    prepare(tmp_path, model_dir, engine(), {}, monkeypatch)
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    for argv in (["ingest", "--config", str(tmp_path / "c.yaml"), str(big)],
                 ["ask", "--config", str(tmp_path / "c.yaml"), "--question", "q", "--doc", str(big)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert not out and err.count("\n") == 1
        assert f"document '{big}' is 1GiB: more text than the model's 2048 positions can hold" in err, err


def test_a_kvblend_home_that_is_a_file_is_one_line_with_native_kernels(tmp_path, model_dir):
    """$KVBLEND_HOME a regular file and KVBLEND_DECODE_KERNEL=native: the kernels cannot be built
    there; the command says so in one line naming the setting (it printed a 'rebuilding ... is
    cannot be read' warning before it). A real process: the kernels are built once per process."""
    home = tmp_path / "home"
    home.write_text("not a directory\n")
    (tmp_path / "c.yaml").write_text(f"model: '{model_dir}'\ndevice: cpu\n{CPU_STORE}")
    (tmp_path / "d.txt").write_text("The lighthouse was built in 1871.")
    env = {k: v for k, v in os.environ.items() if k not in ENV} | {
        "PYTHONPATH": str(ROOT), "KVBLEND_HOME": str(home), "KVBLEND_DECODE_KERNEL": "native"}
    proc = subprocess.run([sys.executable, "-m", "blend.cli", "ask", "--config", str(tmp_path / "c.yaml"), "--doc",
                           str(tmp_path / "d.txt"), "--question", "When?", "--mode", "full", "--max-new-tokens", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("warning: load average")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvblend: error: ") and "KVBLEND_HOME" in lines[0], proc.stderr
    assert home.read_text() == "not a directory\n"
