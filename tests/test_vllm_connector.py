"""kvblend's KV connector inside a real vLLM (CPU build, `.venv-vllm`: `make vllm`) on loopback.

Two servers share one real Redis from the start (replica A and replica B, `kvblend serve-vllm`,
`--enforce-eager`, blocks of 32, prefill chunks of 256 tokens); B has a tiny KV space (33 blocks: 32 usable)
so that its requests get preempted. A third start, A again after a SIGTERM, is the restart. Each
test asserts the external prefix-cache hits vLLM reports in /metrics
(`vllm:external_prefix_cache_hits`) and the token ids of the answers (greedy, float32).
Skipped only where .venv-vllm could not be built.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, RedisServer, _free_port

pytestmark = [pytest.mark.vllm, pytest.mark.redis]

BLOCK = 32
CHUNK = 256
MODEL_ID = "smollm2-135m-instruct"
START_TIMEOUT_S = 600  # ~70 s alone; two at once on a shared 2-core machine take longer
KVBLEND = [str(ROOT / ".venv" / "bin" / "python"), "-m", "blend.cli"] if (ROOT / ".venv" / "bin" / "python").exists() \
    else [sys.executable, "-m", "blend.cli"]


def _vllm_or_skip() -> None:
    from blend.cli.serve_vllm import vllm_python

    try:
        python = vllm_python()
    except ValueError as err:
        pytest.skip(f".venv-vllm could not be built or is missing: {err}")
    probe = subprocess.run([str(python), "-c", "import vllm, blend.vllm.connector"], capture_output=True, text=True,
                           timeout=300)
    if probe.returncode != 0:
        pytest.skip(f".venv-vllm does not import vllm and the connector: {probe.stderr.strip().splitlines()[-1:]}")


def prompt(tag: str, sentences: int = 45) -> str:
    """A distinct prompt of ~15 tokens per sentence."""
    colours = ["red", "blue", "green", "gold", "grey"]
    return f"Inventory {tag}. " + " ".join(
        f"Shelf {i} of {tag}: the {colours[i % 5]} box holds {i * 7 + len(tag)} marbles." for i in range(sentences))


class Server:
    """One `kvblend serve-vllm` process (and vLLM's process group under it) on a loopback port."""

    def __init__(self, name: str, config: Path, workdir: Path, *vllm_args: str, env: dict[str, str] | None = None):
        self.name, self.config, self.port = name, config, _free_port()
        self.log = workdir / f"{name}.log"
        self.vllm_args, self.extra_env = vllm_args, env or {}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0-1", **self.extra_env)
        args = [*KVBLEND, "serve-vllm", "--config", str(self.config), "--port", str(self.port), "--grace", "30", "--",
                "--enforce-eager", "--max-model-len", "2048", "--block-size", str(BLOCK),
                "--max-num-batched-tokens", str(CHUNK), *self.vllm_args]
        self.proc = subprocess.Popen(args, stdout=self.log.open("ab"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vLLM {self.name} exited ({self.proc.returncode}) while starting: "
                                     f"{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(2)
        raise AssertionError(f"vLLM {self.name} not up after {START_TIMEOUT_S} s: {self.log.read_text()[-3000:]}")

    def complete(self, text: str, max_tokens: int = 16) -> list[int]:
        body = {"model": MODEL_ID, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True, "ignore_eos": True}
        reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert len(choice["token_ids"]) == max_tokens
        return choice["token_ids"]

    def metric(self, name: str) -> float:
        """The sum of a counter's samples in vLLM's /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$", line)
            if m:
                total += float(m.group(1))
        return total

    def external_hits(self) -> float:
        return self.metric("vllm:external_prefix_cache_hits_total")

    def stop(self) -> float:
        """SIGTERM; seconds until `kvblend serve-vllm` exited (it waits for vLLM's group)."""
        if self.proc is None or self.proc.poll() is not None:
            return 0.0
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"kvblend serve-vllm {self.name} still running 60 s after SIGTERM") from None
        return time.monotonic() - t0

    def group_pids(self) -> list[int]:
        """The processes of vLLM's group: serve-vllm starts vLLM in a session of its own, whose
        process group id is that child's pid."""
        if self.proc is None:
            return []
        table = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(stat.parent.name)] = (int(fields[1]), int(fields[2]))  # ppid, pgrp
        leaders = {pid for pid, (ppid, _) in table.items() if ppid == self.proc.pid}
        return [pid for pid, (_, pgrp) in table.items() if pgrp in leaders]


def _config(path: Path, redis_url: str, namespace: str) -> Path:
    path.write_text(f"""model: {MODEL_ID}
dtype: float32
engine:
  blend:
    load_stall_s: 5
store:
  namespace: {namespace}
  tiers:
    - kind: redis
      url: {redis_url}
""")
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    _vllm_or_skip()
    work = tmp_path_factory.mktemp("vllm")
    redis = RedisServer(work / "redis", _free_port(), "--enable-debug-command", "yes")  # DEBUG SLEEP: a hung store
    redis.start()
    config = _config(work / "kvblend.yaml", redis.url, "vt")
    a = Server("a", config, work)
    b = Server("b", config, work, "--num-gpu-blocks-override", "33", "--max-model-len", "1024")
    servers = [a, b]
    try:
        a.start()
        b.start()
        a.wait_ready()
        b.wait_ready()
        yield {"a": a, "b": b, "redis": redis, "config": config, "work": work, "servers": servers}
    finally:
        for s in servers:
            try:
                s.stop()
            except AssertionError:
                pass
        redis.stop()


def _names(config: Path):
    """The block names the servers use (float32 KV, blocks of 32, the config's namespace)."""
    from blend.cli.serve_vllm import vllm_model_dir
    from blend.config import kvblend_home, load_config
    from blend.vllm.blocks import BlockNames, model_fingerprint

    store = load_config(config).store
    directory = vllm_model_dir(MODEL_ID)
    return BlockNames(model_fingerprint(directory, kvblend_home()), "float32", BLOCK, store.key_namespace), directory


def _tokens(directory: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(str(directory))(text)["input_ids"])


def _redis(setup):
    import redis

    return redis.Redis.from_url(setup["redis"].url)


def _layer_key(client, key: str, layer: int) -> bytes:
    found = list(client.scan_iter(match=f"*{{{key}}}:l{layer}"))
    assert len(found) == 1, f"entry {key} layer {layer} not in Redis: {found}"
    return found[0]


def test_every_socket_on_loopback(setup):
    pids = {str(p) for s in setup["servers"] for p in s.group_pids()}
    assert pids, "no vLLM processes found"
    listening = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    ours = [line for line in listening if any(f"pid={p}," in line for p in pids)]
    assert ours, "vLLM listens on no TCP socket?"
    for line in ours:
        local = line.split()[3]
        assert local.startswith(("127.0.0.1:", "[::1]:")), f"a vLLM socket off loopback: {line}"


def test_chunked_prompt_every_block_saved_and_hit_by_a_second_replica(setup):
    """A prompt over two prefill chunks: every full block stored by A (chunk by chunk), all of
    them loaded by B (a second replica over the same Redis), the same tokens."""
    a, b = setup["a"], setup["b"]
    text = prompt("chunked", 48)
    names, directory = _names(setup["config"])
    tokens = _tokens(directory, text)
    assert len(tokens) > 2 * CHUNK + BLOCK
    answer = a.complete(text)
    time.sleep(1.0)  # the write-behind queue
    from storage.config import RedisTierConfig
    from storage.redis_tier import RedisTier

    tier = RedisTier(RedisTierConfig(url=setup["redis"].url), namespace=names.namespace)
    try:
        stored = [tier.contains(k) for k in names.keys(tokens)]
    finally:
        tier.close()
    assert all(stored), f"{stored.count(False)} of {len(stored)} full blocks not stored"
    before = b.external_hits()
    assert b.complete(text) == answer
    usable = (len(tokens) - 1) // BLOCK
    assert b.external_hits() - before == usable * BLOCK


def test_corrupt_and_forged_entries_are_recomputed_with_the_same_answer(setup):
    a, b = setup["a"], setup["b"]
    names, directory = _names(setup["config"])
    client = _redis(setup)
    corrupt, forged = prompt("corrupt", 30), prompt("forged", 30)
    answers = {t: a.complete(t) for t in (corrupt, forged)}
    time.sleep(1.0)
    # a flipped run of bytes in layer 5 of block 2 (its checksum fails on read)
    keys = names.keys(_tokens(directory, corrupt))
    client.setrange(_layer_key(client, keys[2], 5), 64, b"\xa5" * 64)
    # block 1 of `forged` replaced by block 3's entry: valid checksums, other tokens and positions
    fkeys = names.keys(_tokens(directory, forged))
    for suffix in ["h", *(f"l{i}" for i in range(30))]:
        src = list(client.scan_iter(match=f"*{{{fkeys[3]}}}:{suffix}"))[0]
        dst = src.decode().replace(fkeys[3], fkeys[1])
        client.set(dst, client.get(src))
    errors = b.metric("kvblend:connector_load_errors_total")
    loaded = b.metric("kvblend:connector_tokens_loaded_total")
    assert b.complete(corrupt) == answers[corrupt]
    assert b.complete(forged) == answers[forged]
    assert b.metric("kvblend:connector_load_errors_total") > errors
    # what loaded: blocks 0-1 of `corrupt`, block 0 of `forged`; the rest recomputed
    assert b.metric("kvblend:connector_tokens_loaded_total") - loaded == 3 * BLOCK


def test_delete_then_miss(setup):
    a, b = setup["a"], setup["b"]
    text = prompt("deleted", 30)
    answer = a.complete(text)
    time.sleep(1.0)
    done = subprocess.run([*KVBLEND, "delete", "--config", str(setup["config"]), "--text", text,
                           "--block-size", str(BLOCK), "--kv-dtype", "float32"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    names, directory = _names(setup["config"])
    assert json.loads(done.stdout.strip().splitlines()[-1])["deleted"] == len(_tokens(directory, text)) // BLOCK
    before = b.external_hits()
    assert b.complete(text) == answer
    assert b.external_hits() == before


def test_preemption_under_a_tiny_kv_space(setup):
    """B's 32 blocks of 32 hold three of these ~300-token prompts (10 blocks each), not three that
    have decoded 48 tokens (11 blocks each): vLLM preempts; a preempted request's prompt blocks
    come back from the store when it resumes; every answer is the one A gives each request alone."""
    a, b = setup["a"], setup["b"]
    texts = [prompt(f"preempt{i}", 16) for i in range(3)]
    preempted = b.metric("vllm:num_preemptions_total")
    results: dict[int, list[int]] = {}

    def run(i: int) -> None:
        results[i] = b.complete(texts[i], max_tokens=48)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert sorted(results) == [0, 1, 2]
    assert b.metric("vllm:num_preemptions_total") > preempted, "no preemption: the test proves nothing"
    for i, text in enumerate(texts):
        assert results[i] == a.complete(text, max_tokens=48), f"request {i}"


def test_hit_after_a_restart(setup):
    """A stopped by SIGTERM (vLLM and every process it started gone within the grace), started
    again on the same store: a prompt it answered before is loaded, the same tokens."""
    a = setup["a"]
    text = prompt("restart", 30)
    answer = a.complete(text)
    pids = a.group_pids()
    took = a.stop()
    assert took < 35 and a.proc.returncode == 0, f"stopped in {took:.1f} s, exit {a.proc.returncode}"
    alive = [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not alive, f"vLLM processes left after SIGTERM: {alive}"
    a.start()
    a.wait_ready()
    names, directory = _names(setup["config"])
    assert a.external_hits() == 0
    assert a.complete(text) == answer
    assert a.external_hits() == (len(_tokens(directory, text)) - 1) // BLOCK * BLOCK


def test_store_killed_or_hung_is_a_recompute(setup):
    """Redis stopped, then Redis hanging 30 s (DEBUG SLEEP): the answers are those computed with a
    working store, and no request waits on the store much past the stall (5 s) on top of its
    own compute time."""
    a, b, redis = setup["a"], setup["b"], setup["redis"]
    texts = [prompt("killed", 30), prompt("hung", 30)]
    answers = [a.complete(t) for t in texts]
    t0 = time.monotonic()
    b.complete(prompt("reference", 30))  # a miss: B's compute time for such a prompt, store up
    alone = time.monotonic() - t0
    redis.stop()
    try:
        t0 = time.monotonic()
        assert b.complete(texts[0]) == answers[0]
        killed = time.monotonic() - t0
    finally:
        redis.start()
    sleeper = subprocess.Popen(["redis-cli", "-p", str(redis.port), "debug", "sleep", "30"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        time.sleep(0.5)
        assert sleeper.poll() is None, f"DEBUG SLEEP refused: {sleeper.communicate()[0]!r}"
        t0 = time.monotonic()
        assert b.complete(texts[1]) == answers[1]
        hung = time.monotonic() - t0
    finally:
        sleeper.wait(timeout=60)
    for took in (killed, hung):
        assert took < 2 * alone + 5 + 10, f"a request took {took:.1f} s with the store down (alone: {alone:.1f} s)"
