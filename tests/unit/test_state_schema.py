"""A database made by an older version opens: the nullable columns added since are added, empty."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sqlalchemy import create_engine, text

from corral.state.db import StateStore


def test_columns_added_since_are_added_to_an_old_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'corral.db'}"
    StateStore(url).engine.dispose()
    old = create_engine(url)
    with old.begin() as conn:  # what the sandboxes table looked like before these columns existed
        for column in ("sensitive_paths", "disk_mb", "protected_paths", "qos", "node_selector"):
            conn.execute(text(f"ALTER TABLE sandboxes DROP COLUMN {column}"))
        conn.execute(text("INSERT INTO sandboxes (id, edge_id, state, image, backend, runtime, cpu, memory_mb, "
                          "pids_max, user, cwd, env, layers, labels, created_at, ttl_counts_paused) VALUES "
                          "('sb-e0-old', 'e0', 'running', 'busybox', 'container', 'crun', 1, 512, 256, 'root', "
                          "'/', '{}', '[]', '{}', 0, 0)"))  # fmt: skip
    old.dispose()
    store = StateStore(url)
    record = store.get("sb-e0-old")
    assert record is not None
    assert record.sensitive_paths is None and record.disk_mb is None and record.protected_paths is None
    assert record.qos == "latency"  # a column with a default gets it on the old rows
    assert record.node_selector == {}
    store.insert(dataclasses.replace(record, id="sb-e0-new", sensitive_paths=["/work/hidden/"]))
    assert store.get("sb-e0-new").sensitive_paths == ["/work/hidden/"]


def test_job_column_is_added_filled_and_indexed_in_an_old_database(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'corral.db'}"
    StateStore(url).engine.dispose()
    old = create_engine(url)
    with old.begin() as conn:  # before the job column existed
        conn.execute(text("DROP INDEX ix_sandboxes_job"))
        conn.execute(text("ALTER TABLE sandboxes DROP COLUMN job"))
        conn.execute(text("INSERT INTO sandboxes (id, edge_id, state, image, backend, runtime, cpu, memory_mb, "
                          "pids_max, user, cwd, env, layers, labels, created_at, ttl_counts_paused) VALUES "
                          "('sb-e0-old', 'e0', 'running', 'busybox', 'container', 'crun', 1, 512, 256, 'root', "
                          "'/', '{}', '[]', '{\"job\": \"j1\", \"episode\": \"3\"}', 0, 0)"))  # fmt: skip
    old.dispose()
    store = StateStore(url)
    assert [r.id for r in store.list(labels={"job": "j1"})] == ["sb-e0-old"]
    assert [r.id for r in store.list(labels={"job": "j1", "episode": "3"})] == ["sb-e0-old"]
    assert store.list(labels={"job": "j1", "episode": "4"}) == []
    with store.engine.connect() as conn:
        plan = " ".join(
            str(row) for row in conn.execute(text("EXPLAIN QUERY PLAN SELECT id FROM sandboxes WHERE job = 'j1'"))
        )
    assert "ix_sandboxes_job" in plan
