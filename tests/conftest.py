"""Shared fixtures: real redis-server processes on free loopback ports (no mocks).

`redis_server` is one server for the session (stop()/start() for fault tests),
`redis_url` is its URL with the database flushed for each test, and
`redis_cluster_urls` are the three masters of a real Redis Cluster.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import blend.model  # noqa: E402,F401 - before any float32 product: MKL's strict mode (blend.model.mkl)


def _free_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 >= 65536:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair found")


def _redis_server_binary() -> str:
    path = shutil.which("redis-server")
    if path is None or shutil.which("redis-cli") is None:
        pytest.fail(
            "redis-server / redis-cli not found on PATH; run `make test` (it installs redis-server) "
            "or `apt-get install -y redis-server`"
        )
    return path


class RedisServer:
    """One redis-server process in its own directory; stop() and start() keep the port."""

    def __init__(self, workdir: Path, port: int, *extra: str) -> None:
        self.workdir, self.port, self.extra = workdir, port, extra
        self.binary = _redis_server_binary()
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        args = [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(self.workdir), "--protected-mode", "no", *self.extra,
        ]
        log = (self.workdir / "server.log").open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited; see {self.workdir / 'server.log'}")
            if self.cli("ping").strip() == "PONG":
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within 10 s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def cli(self, *args: str) -> str:
        out = subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), *args],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server for the session; tests may stop()/start() it."""
    server = RedisServer(tmp_path_factory.mktemp("redis"), _free_port())
    server.start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session server, running and with an empty database."""
    redis_server.start()
    redis_server.cli("flushall")
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster_urls(tmp_path_factory) -> list[str]:
    """Node URLs of a real 3-master Redis Cluster (no replicas) for the session."""
    base = tmp_path_factory.mktemp("redis-cluster")
    nodes = []
    try:
        for i in range(3):
            port = _free_port()
            node = RedisServer(
                base / f"node{i}", port, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
            )
            node.start()
            nodes.append(node)
        create = subprocess.run(
            ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60,
        )
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout}\n{create.stderr}")
        deadline = time.monotonic() + 20
        while not all("cluster_state:ok" in n.cli("cluster", "info") for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("Redis Cluster did not reach cluster_state:ok within 20 s")
            time.sleep(0.05)
        yield [n.url for n in nodes]
    finally:
        for node in nodes:
            node.stop()
