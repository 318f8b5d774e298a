"""The gateway's event loop does not wait on the database server (corral/state/thread.py).

A second connection holds a lock on the sandboxes table of the server's PostgreSQL, as a slow transaction or
a busy server would: a create then waits for its record, and everything that reads no record (exec, files)
must go on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

import corral
from corral.embedded import EmbeddedServer
from tests.conftest import restartable_server

LOCK_HELD_S = 3.0
DATABASE = "corral_state_thread"


@pytest.fixture
def postgres_server(
    postgres_url: str, tmp_path: Path, test_env: dict[str, str]
) -> Iterator[tuple[EmbeddedServer, str]]:
    """A server on a PostgreSQL database of its own; (server, a libpq URL of that database)."""
    url = postgres_url.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {DATABASE}")
        admin.execute(f"CREATE DATABASE {DATABASE}")
    own = postgres_url.replace("/corral?", f"/{DATABASE}?")
    with restartable_server(tmp_path / "server", {**test_env, "CORRAL_DATABASE_URL": own}) as server:
        yield server, own.replace("postgresql+psycopg://", "postgresql://")


def test_a_stalled_database_stalls_only_the_requests_that_need_it(postgres_server: tuple[EmbeddedServer, str]) -> None:
    server, url = postgres_server
    # A short client timeout: on a server whose loop waits on the lock, the execs fail instead of hanging.
    with (
        corral.Client(server.url, server.api_key, timeout_s=10) as client,
        client.create("busybox", ttl_s=300) as sandbox,
    ):
        assert sandbox.exec("echo warm").stdout == "warm\n"
        created: list[corral.Sandbox] = []
        create = threading.Thread(target=lambda: created.append(client.create("busybox", ttl_s=300)))
        exec_s = []
        with psycopg.connect(url) as lock:
            lock.execute("LOCK TABLE sandboxes IN EXCLUSIVE MODE")  # reads go on, writes wait until the rollback
            locked_at = time.monotonic()
            create.start()
            time.sleep(0.3)  # the create is waiting on its record now
            while time.monotonic() - locked_at < LOCK_HELD_S:
                begun = time.monotonic()
                assert sandbox.exec("echo through").stdout == "through\n"
                sandbox.files.write("/note", b"written")
                exec_s.append(time.monotonic() - begun)
            assert created == [], "the create finished while its record could not be written"
            lock.rollback()
        create.join(timeout=60)
        assert len(created) == 1 and created[0].exec("echo later").stdout == "later\n"
        created[0].kill()
        assert len(exec_s) >= 5
        assert max(exec_s) < 1.0, f"execs waited on the database: {sorted(exec_s)[-3:]}"
