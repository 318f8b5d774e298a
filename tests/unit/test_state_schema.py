"""A database made by an older version opens: the nullable columns added since are added, empty."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text

from corral.api.models import SandboxState
from corral.state import db, json_text
from corral.state.db import StateStore
from corral.testing.records import sandbox_record


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


def test_batched_writes_store_what_single_writes_store_on_sqlite(tmp_path: Path) -> None:
    """insert_many (one executemany of positional values on SQLite, JSON written by the store) stores each column
    as insert does (SQLAlchemy's binding), to the JSON text: None as JSON null, an empty list and dict, a tab, a
    backslash, non-ASCII, a network policy; and a burst's events (several rows) as a single event is stored."""
    store = StateStore(f"sqlite:///{tmp_path / 'corral.db'}")
    record = sandbox_record("sb-e0-lite-record", state="creating", cpu=0.25, memory_mb=256, cwd="/tmp/a b",
                            env={"A": "tab\there\nnew \\ é"}, layers=["sha256:0"], labels={"job": "lite", "k": "v"},
                            network={"allow": [{"host": "pypi.org", "ports": [443]}]}, created_at=1796042149.2624586,
                            expires_at=1796042249.5, ttl_counts_paused=True, protected_paths=[],
                            sensitive_paths=None)  # fmt: skip
    ids = ["sb-e0-lite-single", "sb-e0-lite-batch-0", "sb-e0-lite-batch-1"]
    try:
        store.insert(dataclasses.replace(record, id=ids[0]))
        store.insert_many([dataclasses.replace(record, id=sandbox_id) for sandbox_id in ids[1:]])
        with store.engine.connect() as conn:
            rows = [conn.execute(text("SELECT * FROM sandboxes WHERE id = :id"), {"id": i}).one()._asdict()
                    for i in ids]  # fmt: skip
            for row in rows:
                row.pop("id")
            assert rows[0] == rows[1] == rows[2]
            assert rows[0]["sensitive_paths"] == "null" and rows[0]["protected_paths"] == "[]"
            assert rows[0]["env"] == json_text.dumps({"A": "tab\there\nnew \\ é"}) == '{"A":"tab\\there\\nnew \\\\ é"}'
            assert store.get(ids[1]) == dataclasses.replace(store.get(ids[0]), id=ids[1])
            assert store.mark_running_many({ids[0]: None}) == {ids[0]}  # one event
            assert store.mark_running_many({ids[1]: None, ids[2]: None}) == {ids[1], ids[2]}  # a batch of two
            written = [conn.execute(text("SELECT kind, edge_id, job, detail FROM events WHERE sandbox_id = :id"),
                                    {"id": i}).one()._asdict() for i in ids]  # fmt: skip
        assert written[0] == written[1] == written[2] == {"kind": "sandbox.running", "edge_id": "e0", "job": "lite",
                                                          "detail": "{}"}  # fmt: skip
    finally:
        store.close()


@pytest.mark.parametrize("write", ["end_many", "mark_running_many", "claim_many"])
def test_writes_to_many_ids_find_each_by_its_key_not_by_the_state_index(tmp_path: Path, write: str) -> None:
    """SQLite's plan for the UPDATE of a list of ids in a state: each id by the primary key. With the state tested
    as a plain column, its planner takes the state index once the list is long (300 ids here) and reads every
    record in that state: an end of 200 sandboxes cost 213 against 27 µs an id with 100,000 live."""
    store = StateStore(f"sqlite:///{tmp_path / 'corral.db'}")
    updates: list[tuple[str, Any]] = []

    def keep(_conn: Any, _cursor: Any, statement: str, parameters: Any, _context: Any, _many: bool) -> None:  # noqa: ANN401
        if statement.startswith("UPDATE") or (statement.startswith("SELECT") and "labels" in statement):
            updates.append((statement, parameters))  # claim_many's: the claimable ones among the ids

    try:
        event.listen(store.engine, "before_cursor_execute", keep)
        ids = [f"sb-e0-{index:016x}" for index in range(300)]
        if write == "end_many":
            store.end_many(dict.fromkeys(ids, (SandboxState.ENDED, "killed", None)))
        elif write == "claim_many":
            store.claim_many(dict.fromkeys(ids, {"labels": {}}), pool_label="corral.warm")
        else:
            store.mark_running_many(dict.fromkeys(ids))
        event.remove(store.engine, "before_cursor_execute", keep)
        assert len(updates) == 1
        with store.engine.connect() as conn:
            statement, parameters = updates[0]
            plan = " ".join(row[3] for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters))
        assert "sqlite_autoindex_sandboxes_1 (id=?)" in plan and "ix_sandboxes_state" not in plan, plan
    finally:
        store.close()


def expired_are_found_by_the_live_ttls(store: StateStore, prefix: str) -> None:
    """``expired`` names the sandboxes past their TTL and not ended (a paused one if its paused time counts), and
    none else: not ended ones past theirs, not those with no TTL or one still ahead."""
    cases = {  # suffix -> (fields, expected among the expired)
        "running-past": ({"expires_at": 100.0}, True),
        "creating-past": ({"expires_at": 100.0, "state": "creating"}, True),
        "paused-counting": ({"expires_at": 100.0, "state": "paused", "ttl_counts_paused": True}, True),
        "paused-not-counting": ({"expires_at": 100.0, "state": "paused", "ttl_counts_paused": False}, False),
        "running-ahead": ({"expires_at": 300.0}, False),
        "running-no-ttl": ({"expires_at": None}, False),
        "ended-past": ({"expires_at": 100.0, "state": "ended", "ended_at": 150.0, "end_reason": "killed"}, False),
        "lost-past": ({"expires_at": 100.0, "state": "lost", "ended_at": 150.0, "end_reason": "lost"}, False),
    }
    store.insert_many([sandbox_record(f"{prefix}{suffix}", **fields) for suffix, (fields, _) in cases.items()])
    expired = {sandbox_id for sandbox_id in store.expired(200.0) if sandbox_id.startswith(prefix)}
    assert expired == {f"{prefix}{suffix}" for suffix, (_, wanted) in cases.items() if wanted}


def test_the_ttl_check_reads_the_live_ttls_alone(tmp_path: Path) -> None:
    """The TTL check (every second, on the gateway's loop) goes through the partial index of the sandboxes not ended
    (``INDEXED BY``: SQLite's planner, without statistics, read the state index, every live record: 16.6 ms a check
    with 100,000 live); a database made before the index gets it when it opens."""
    url = f"sqlite:///{tmp_path / 'corral.db'}"
    StateStore(url).engine.dispose()
    old = create_engine(url)
    with old.begin() as conn:
        conn.execute(text("DROP INDEX ix_sandboxes_live_expiry"))
    old.dispose()
    store = StateStore(url)
    try:
        expired_are_found_by_the_live_ttls(store, "sb-e0-ttl-")
        with store.engine.connect() as conn:
            query = f"EXPLAIN QUERY PLAN {db._EXPIRED[False]}"  # the check's own statement
            plan = " ".join(row[3] for row in conn.exec_driver_sql(query, {"now": 200.0}))
        assert plan.startswith("SEARCH sandboxes USING INDEX ix_sandboxes_live_expiry (expires_at<?)"), plan
    finally:
        store.close()
