"""Fixtures that run a real Corral server (a subprocess on a loopback port).

The server enters its own mount namespace, so it must be a separate process;
tests talk to it over real HTTP with the real SDK. Teardown kills every
sandbox the tests left and stops the server by PID, even when a test failed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import corral

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    """One `corral serve` subprocess with its own data dir and port."""

    data_dir: Path
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def config_file(self) -> Path:
        return self.data_dir / "client.json"

    @property
    def api_key(self) -> str:
        return json.loads(self.config_file.read_text())["api_key"]

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CORRAL_DATA_DIR=str(self.data_dir),
            CORRAL_PORT=str(self.port),
            CORRAL_CONFIG_FILE=str(self.config_file),
            CORRAL_TTL_CHECK_INTERVAL_S="0.2",
        )
        return env

    def start(self, timeout_s: float = 30.0) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "corral.cli.main", "serve"], env=self.env(), stdout=log, stderr=log, cwd=REPO
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError(f"server did not start: {self.log_path.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(sig)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def client(self) -> corral.Client:
        return corral.Client(self.url, self.api_key)

    def kill_all_sandboxes(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with self.client() as client:
            for info in client.list():
                try:
                    client.kill(info.id)
                except corral.CorralError:
                    pass


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    data_dir = tmp_path_factory.mktemp("corral-server")
    proc = ServerProcess(data_dir=data_dir, port=free_port(), log_path=data_dir / "server.log")
    proc.start()
    try:
        yield proc
    finally:
        try:
            proc.kill_all_sandboxes()
        finally:
            proc.stop()


@pytest.fixture
def fresh_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of the test's own, for restart and fault tests."""
    proc = ServerProcess(data_dir=tmp_path / "server", port=free_port(), log_path=tmp_path / "server.log")
    proc.data_dir.mkdir()
    proc.start()
    try:
        yield proc
    finally:
        if proc.process is not None and proc.process.poll() is not None:
            proc.start()  # bring it back so it can kill what it re-adopted
        try:
            proc.kill_all_sandboxes()
        finally:
            proc.stop()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[corral.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
async def aclient(server: ServerProcess):  # type: ignore[no-untyped-def]
    async with corral.AsyncClient(server.url, server.api_key) as c:
        yield c


@pytest.fixture
def sandbox(client: corral.Client) -> Iterator[corral.Sandbox]:
    with client.create("busybox", ttl_s=600) as sb:
        yield sb
