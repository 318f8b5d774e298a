"""Fixtures that run a real Corral server (a subprocess on a loopback port).

The server enters its own mount namespace, so it must be a separate process;
tests talk to it over real HTTP with the real SDK. Teardown kills every
sandbox the tests left and stops the server by PID, even when a test failed.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.config import Settings
from corral.embedded import EmbeddedServer, linked_node_dir
from corral.sdk._config import default_config_path

REPO = Path(__file__).resolve().parent.parent


def bench_report(name: str, *args: str, timeout_s: float = 240) -> dict[str, Any]:
    """``corral bench NAME ARGS --json`` run as users run it (a process of its own, with its own server and
    runtime state), so that a benchmark and its baselines cannot rot; the report it printed."""
    run = subprocess.run(
        [sys.executable, "-m", "corral.cli.main", "bench", name, *args, "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    report: dict[str, Any] = json.loads(run.stdout)
    return report


SLOW_ENV = "CORRAL_TEST_SLOW"


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups from the items
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``slow`` repeat heavy work a default run already does once (the conformance checks on a full
    VM: test_vm.py boots one in every run): they run with CORRAL_TEST_SLOW=1 or when ``-m`` selects by marker."""
    _worker_groups(items)
    if os.environ.get(SLOW_ENV) == "1" or config.getoption("markexpr"):
        return
    skip = pytest.mark.skip(reason=f"slow: {SLOW_ENV}=1 runs it")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def _worker_groups(items: list[pytest.Item]) -> None:
    """For pytest-xdist's ``--dist loadgroup`` (make test runs two workers): a file's tests stay on one worker,
    so its module fixtures (servers) start once, and the Ray cluster package is one group (one cluster)."""
    for item in items:
        path = item.path.relative_to(REPO)
        group = "cluster" if path.parts[:2] == ("tests", "cluster") else str(path)
        item.add_marker(pytest.mark.xdist_group(group))


_SANDBOX_CGROUPS = ("*/corral*/sb-*", "corral*/sb-*")  # v1 hierarchies and hybrid v2; pure v2
_CGROUPS_AT_START = pytest.StashKey[set[str]]()


def _sandbox_cgroups() -> set[str]:
    root = Path("/sys/fs/cgroup")
    return {str(path) for pattern in _SANDBOX_CGROUPS for path in root.glob(pattern) if path.is_dir()}


_OUTER_RUN_ENV = "CORRAL_TEST_OUTER_RUN"  # set by the outermost run: a pytest a test starts checks nothing


@pytest.hookimpl(tryfirst=True)  # before xdist starts its workers, which inherit the environment
def pytest_sessionstart(session: pytest.Session) -> None:
    """Only the outermost run (xdist's controller, not its workers, nor a pytest that a test runs: their own
    sessions end while the outer run's other tests still have sandboxes) notes the cgroups there were before it."""
    if hasattr(session.config, "workerinput") or os.environ.get(_OUTER_RUN_ENV):
        return
    os.environ[_OUTER_RUN_ENV] = str(os.getpid())
    session.config.stash[_CGROUPS_AT_START] = _sandbox_cgroups()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After every worker has ended: no sandbox cgroup the run made is left (an ended sandbox's teardown removes
    what its runtime left, tests/backend_conformance.py's ``destroy``; test runs had left a few a day, empty)."""
    before = session.config.stash.get(_CGROUPS_AT_START, None)
    if before is None:
        return
    left = sorted(_sandbox_cgroups() - before)
    if left:
        print(f"\nthe tests left {len(left)} sandbox cgroup(s) on the host: {left[:12]}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _user_files() -> dict[str, tuple[int, int]]:
    """(mtime, size) of every file that is the user's, not the tests': the client config that a plain `corral
    serve` writes (under $HOME and under the account's home, which servers started without HOME use), the
    default data dir and the node dir."""
    settings = Settings()
    configs = {default_config_path(), Path(pwd.getpwuid(os.getuid()).pw_dir) / ".config" / "corral" / "client.json"}
    paths = [p for p in configs if p.exists()]
    for root in (settings.data_dir, settings.node_dir):
        for directory, _, names in os.walk(root):
            paths.extend(Path(directory) / name for name in names)
    found = {}
    for path in paths:
        try:
            info = path.lstat()
        except FileNotFoundError:
            continue
        found[str(path)] = (info.st_mtime_ns, info.st_size)
    return found


@pytest.fixture(scope="session", autouse=True)
def users_files_left_alone() -> Iterator[None]:
    """Test servers, benches and the demo keep to their own directories (issue 15: they must not overwrite the
    user's ~/.config/corral/client.json, nor files in the node dir or the default data dir)."""
    before = _user_files()
    yield
    after = _user_files()
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    assert not changed, f"the tests changed the user's files: {changed[:20]}"


@pytest.fixture(scope="session")
def test_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Server settings for tests: their own node dir, frequent TTL checks (tests wait for TTLs), and a short
    window for repeated kernel audit events (tests wait for the summary)."""
    node_dir = linked_node_dir(tmp_path_factory.mktemp("corral-node"))
    return {
        "CORRAL_TTL_CHECK_INTERVAL_S": "0.2",
        "CORRAL_NODE_DIR": str(node_dir),
        "CORRAL_AUDIT_REPEAT_WINDOW_S": "2",
    }


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(tmp_path_factory.mktemp("corral-server"), env=test_env) as proc:
        yield proc


@contextlib.contextmanager
def restartable_server(data_dir: Path, env: dict[str, str]) -> Iterator[EmbeddedServer]:
    """A started server that a test may stop and start again; it is running when shut down at the end."""
    proc = EmbeddedServer(data_dir, env=env)
    proc.start()
    try:
        yield proc
    finally:
        try:
            if not proc.running():
                proc.start()  # bring it back so it can kill what it re-adopted
        finally:  # even if it cannot come back: its containers are deleted by their runtime state
            proc.shutdown()


@pytest.fixture
def fresh_server(tmp_path: Path, test_env: dict[str, str]) -> Iterator[EmbeddedServer]:
    """A server of the test's own, for restart and fault tests."""
    with restartable_server(tmp_path / "server", test_env) as proc:
        yield proc


@pytest.fixture
def client(server: EmbeddedServer) -> Iterator[corral.Client]:
    with server.client() as c:
        yield c


@pytest.fixture
async def aclient(server: EmbeddedServer) -> AsyncIterator[corral.AsyncClient]:
    async with corral.AsyncClient(server.url, server.api_key) as c:
        yield c


@pytest.fixture
def sandbox(client: corral.Client) -> Iterator[corral.Sandbox]:
    with client.create("busybox", ttl_s=600) as sb:
        yield sb


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A throwaway PostgreSQL (unix socket only) started by scripts/postgres.sh, stopped at the end."""
    directory = Path(tempfile.mkdtemp(prefix="corral-pg-", dir="/var/tmp"))
    started = subprocess.run(
        ["bash", str(REPO / "scripts" / "postgres.sh"), "start", str(directory)], capture_output=True, text=True
    )
    assert started.returncode == 0, started.stderr
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run(["bash", str(REPO / "scripts" / "postgres.sh"), "stop", str(directory)], capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)
