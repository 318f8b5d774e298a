"""The gateway's event loop does not wait on the database (corral/state/thread.py).

A second connection holds the server's SQLite write lock, as a slow PostgreSQL transaction or a long fsync
would: a create then waits for its record, and everything that reads no record (exec, files) must go on.
"""

from __future__ import annotations

import sqlite3
import threading
import time

import corral
from corral.embedded import EmbeddedServer

LOCK_HELD_S = 3.0


def test_a_stalled_database_stalls_only_the_requests_that_need_it(fresh_server: EmbeddedServer) -> None:
    with fresh_server.client() as client, client.create("busybox", ttl_s=300) as sandbox:
        assert sandbox.exec("echo warm").stdout == "warm\n"
        lock = sqlite3.connect(fresh_server.data_dir / "corral.db", timeout=10, isolation_level=None)
        created: list[corral.Sandbox] = []
        create = threading.Thread(target=lambda: created.append(client.create("busybox", ttl_s=300)))
        try:
            lock.execute("BEGIN IMMEDIATE")  # the write lock: the server's inserts wait (busy_timeout 5 s)
            locked_at = time.monotonic()
            create.start()
            time.sleep(0.3)  # the create is waiting on its record now
            exec_s = []
            while time.monotonic() - locked_at < LOCK_HELD_S - 0.5:
                begun = time.monotonic()
                assert sandbox.exec("echo through").stdout == "through\n"
                sandbox.files.write("/note", b"written")
                exec_s.append(time.monotonic() - begun)
            assert created == [], "the create finished while its record could not be written"
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        create.join(timeout=30)
        assert len(created) == 1 and created[0].exec("echo later").stdout == "later\n"
        created[0].kill()
        assert len(exec_s) >= 5
        assert max(exec_s) < 1.0, f"execs waited on the database: {sorted(exec_s)[-3:]}"
