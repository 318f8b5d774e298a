"""One schema for SQLite and PostgreSQL: the state, catalogue and trajectory log on a real PostgreSQL."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import corral
from corral.embedded import EmbeddedServer
from corral.state.db import StateStore
from corral.trajectory import Replay, Step, TrajectoryLog


def test_trajectory_log_on_postgres(postgres_url: str) -> None:
    log = TrajectoryLog(StateStore(postgres_url).engine)
    step = log.begin("sb-e0-00000000000000aa", "s1", "exec", {"cmd": "true"})
    assert isinstance(step, Step) and step.seq >= 1
    log.finish(step, {"exit_code": 0, "stdout": "", "stderr": ""})
    again = log.begin("sb-e0-00000000000000aa", "s1", "exec", {"cmd": "true"})
    assert isinstance(again, Replay)

    seqs: list[int] = []

    def append(index: int) -> None:  # concurrent writers: seq stays gap-free (retry on the primary key)
        seqs.append(log.append("sb-e0-00000000000000bb", f"auto-{index}", "exec", {"i": index}, {}).seq)

    threads = [threading.Thread(target=append, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(seqs) == list(range(1, 9))


def test_server_on_postgres_survives_a_restart(postgres_url: str, tmp_path: Path, test_env: dict[str, str]) -> None:
    env = {**test_env, "CORRAL_DATABASE_URL": postgres_url}
    server = EmbeddedServer(tmp_path / "server", env=env)
    server.start()
    try:
        with server.client() as client:
            sandbox = client.create("busybox", labels={"db": "postgres"}, ttl_s=600)
            assert sandbox.exec("echo 1 >> /n", step_id="s1").exit_code == 0
            built = client.images.build("pg-tools", "commands", on=["busybox"], commands=["echo t > /tool"])
            assert len(built.layers) == 2
        server.stop()
        server.start()
        with server.client() as client:
            assert [s.id for s in client.list(labels={"db": "postgres"})] == [sandbox.id]
            handle = client.connect(sandbox)
            assert handle.exec("echo 1 >> /n", step_id="s1").replayed
            assert handle.exec("wc -l < /n").stdout == "1\n"
            assert "pg-tools:latest" in {image.name for image in client.images.list()}
            sandbox_info = handle.pause().sandbox
            assert sandbox_info.state == corral.SandboxState.PAUSED
            time.sleep(0.1)
            assert handle.exec("true").exit_code == 0
    finally:
        server.shutdown()


def test_node_selector_column_is_added_to_an_old_database_on_postgres(postgres_url: str) -> None:
    """JSON, NOT NULL DEFAULT '{}': rows written before the column existed read an empty selector."""
    store = StateStore(postgres_url)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE sandboxes DROP COLUMN node_selector")
    store.insert({"id": "sb-e0-pg-old-row", "edge_id": "e0", "state": "ended", "image": "busybox",
                  "backend": "container", "runtime": "crun", "cpu": 1.0, "memory_mb": 512, "pids_max": 256,
                  "user": "root", "cwd": "/", "env": {}, "layers": [], "labels": {}, "created_at": 0.0})  # fmt: skip
    store.close()
    store = StateStore(postgres_url)
    try:
        assert store.get("sb-e0-pg-old-row")["node_selector"] == {}
        store.insert({**store.get("sb-e0-pg-old-row"), "id": "sb-e0-pg-new-row", "node_selector": {"zone": "a"}})
        assert store.get("sb-e0-pg-new-row")["node_selector"] == {"zone": "a"}
    finally:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes WHERE id IN ('sb-e0-pg-old-row', 'sb-e0-pg-new-row')")
        store.close()
