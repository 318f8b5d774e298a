"""One schema for SQLite and PostgreSQL: the state, catalogue and trajectory log on a real PostgreSQL."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text

import corral
from corral.embedded import EmbeddedServer
from corral.gateway.service import WARM_LABEL
from corral.state import db
from corral.state.db import PING_IDLE_S, POSTGRES_TCP_TIMEOUTS, StateStore, sandboxes
from corral.testing.records import sandbox_record
from corral.trajectory import Replay, Step, TrajectoryLog
from tests.unit.test_state_schema import expired_are_found_by_the_live_ttls
from tests.unit.test_trajectory_log import run_in_threads


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
    # The JSON columns' text (corral.state.json_text): non-ASCII as UTF-8, a NUL escaped, a lone surrogate by the
    # standard library's escape; each reads back as given.
    result = {"exit_code": 0, "stdout": "é✓ \x00 中", "stderr": "x" * 70_000}
    surrogate = {"cmd": "printf '\udc80'"}
    appended = log.append("sb-e0-00000000000000cc", "s1", "exec", surrogate, result)
    assert log.steps("sb-e0-00000000000000cc")[0].result == appended.result == result
    assert log.steps("sb-e0-00000000000000cc")[0].request == surrogate


def test_concurrent_begins_on_postgres_get_gap_free_seqs_and_one_step_per_id(postgres_url: str) -> None:
    """A begin is one INSERT ... SELECT in autocommit there: writers that take the same seq meet the primary key
    and retry, and of those that begin one new step id exactly one gets it (the others see it running or done)."""
    log = TrajectoryLog(StateStore(postgres_url).engine)
    sandbox_id = "sb-e0-00000000000000dd"

    def begin_and_finish(step_id: str) -> Step | Replay:
        outcome = log.begin(sandbox_id, step_id, "exec", {"cmd": "true"})
        return log.finish(outcome, {"exit_code": 0}) if isinstance(outcome, Step) else outcome

    distinct = run_in_threads(8, lambda i: begin_and_finish(f"distinct-{i}"))
    same = run_in_threads(8, lambda _: begin_and_finish("same"))
    assert all(isinstance(outcome, Step) for outcome in distinct), distinct
    assert sum(isinstance(outcome, Step) for outcome in same) == 1, same
    assert all(isinstance(outcome, Step | Replay | corral.Conflict) for outcome in same), same
    assert [step.seq for step in log.steps(sandbox_id)] == list(range(1, 10))
    assert isinstance(log.begin(sandbox_id, "same", "exec", {"cmd": "true"}), Replay)
    with pytest.raises(corral.Conflict, match="diverges"):
        log.begin(sandbox_id, "same", "exec", {"cmd": "false"})


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
    old_row = sandbox_record("sb-e0-pg-old-row", state="ended").row()
    del old_row["node_selector"]  # what a version before the column wrote
    with store.engine.begin() as conn:
        conn.execute(sandboxes.insert().values(**old_row))
    store.close()
    store = StateStore(postgres_url)
    try:
        old = store.get("sb-e0-pg-old-row")
        assert old is not None and old.node_selector == {}
        store.insert(dataclasses.replace(old, id="sb-e0-pg-new-row", node_selector={"zone": "a"}))
        assert store.get("sb-e0-pg-new-row").node_selector == {"zone": "a"}
    finally:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes WHERE id IN ('sb-e0-pg-old-row', 'sb-e0-pg-new-row')")
        store.close()


def test_batched_writes_store_what_single_writes_store_on_postgres(postgres_url: str) -> None:
    """insert_many (COPY on PostgreSQL) stores each column as insert does, to the JSON text (None as JSON null, an
    empty list and dict, a tab, a backslash, non-ASCII); mark_running_many marks only the sandboxes still creating."""
    store = StateStore(postgres_url)
    record = sandbox_record("sb-e0-pg-record", state="creating", cpu=0.25, memory_mb=256, cwd="/tmp/a b",
                            env={"A": "tab\there\nnew \\ é"}, layers=["sha256:0"], labels={"job": "pg-batch", "k": "v"},
                            created_at=1796042149.2624586, protected_paths=[], sensitive_paths=None)  # fmt: skip
    ids = ["sb-e0-pg-single", "sb-e0-pg-batch-0", "sb-e0-pg-batch-1"]
    columns = (
        'state, image, cpu, qos, memory_mb, "user", cwd, env::text, layers::text, labels::text, '
        "node_selector::text, created_at, expires_at, ttl_counts_paused, network::text, network IS NULL, "
        "protected_paths::text, sensitive_paths::text, disk_mb, status_message, job"
    )
    try:
        store.insert(dataclasses.replace(record, id=ids[0]))
        store.insert_many([dataclasses.replace(record, id=sandbox_id) for sandbox_id in ids[1:]])
        with store.engine.connect() as conn:
            rows = [tuple(conn.exec_driver_sql(f"SELECT {columns} FROM sandboxes WHERE id = %(id)s", {"id": i}).one())
                    for i in ids]  # fmt: skip
        assert rows[0] == rows[1] == rows[2]
        assert store.get(ids[1]).labels == {"job": "pg-batch", "k": "v"} and store.get(ids[1]).job == "pg-batch"
        store.end(ids[2], corral.SandboxState.ENDED, "killed")
        assert store.mark_running_many({ids[1]: "up", ids[2]: "up", "sb-e0-pg-absent": None}) == {ids[1]}
        assert (store.get(ids[1]).state, store.get(ids[1]).status_message) == ("running", "up")
        assert store.get(ids[2]).state == "ended"
    finally:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes WHERE id LIKE 'sb-e0-pg-%%'")
        store.close()


def test_reads_run_without_a_transaction_and_writes_within_one_on_postgres(postgres_url: str) -> None:
    """A read is one statement in autocommit (no BEGIN, no ROLLBACK on the pool's return: two round trips of its
    three); a write still commits as a whole, and a connection back in the pool is transactional again."""
    store = StateStore(postgres_url)
    seen: list[tuple[str, bool]] = []

    def note(conn: Any, _cursor: Any, statement: str, *_: Any) -> None:  # noqa: ANN401 - SQLAlchemy's event
        seen.append((statement.split()[0].upper(), conn.connection.driver_connection.autocommit))

    event.listen(store.engine, "before_cursor_execute", note)
    record = sandbox_record("sb-e0-pg-reads", state="creating", cpu=0.25, memory_mb=256, cwd="/", env={},
                            layers=[], labels={"job": "pg-reads"}, created_at=time.time())  # fmt: skip
    try:
        store.insert(record)
        assert store.get(record.id) is not None and record.id in store.active_ids("e0")
        assert store.mark_running_many({record.id: None}) == {record.id}
        assert [mode for verb, mode in seen if verb == "SELECT"] == [True, True]  # the two reads
        assert {mode for verb, mode in seen if verb in ("INSERT", "UPDATE")} == {False}  # the writes' transactions
        with store.engine.connect() as conn:  # the pool hands out its connections transactional again
            assert conn.connection.driver_connection.autocommit is False
    finally:
        event.remove(store.engine, "before_cursor_execute", note)
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes WHERE id = 'sb-e0-pg-reads'")
        store.close()


def test_heartbeats_of_several_edges_in_one_transaction_on_postgres(postgres_url: str) -> None:
    """heartbeat_many adds the nodes it has not seen, and brings a known node (a lost one too) up with its new
    load and time; nodes it does not name are left as they were."""
    store = StateStore(postgres_url)
    try:
        store.heartbeat("pg-beat-0", {"cpu": 1}, 10.0)
        store.heartbeat("pg-beat-quiet", {"cpu": 9}, 10.0)
        store.mark_node_lost("pg-beat-0", 11.0, "silent")
        store.mark_node_lost("pg-beat-quiet", 11.0, "silent")
        store.heartbeat_many({"pg-beat-0": {"cpu": 2}, "pg-beat-1": {"cpu": 3}}, 20.0)
        rows = {row["edge_id"]: row for row in store.nodes() if row["edge_id"].startswith("pg-beat-")}
        assert {e: (r["state"], r["last_seen"], r["load"]) for e, r in rows.items()} == {
            "pg-beat-0": ("up", 20.0, {"cpu": 2}),
            "pg-beat-1": ("up", 20.0, {"cpu": 3}),
            "pg-beat-quiet": ("lost", 10.0, {"cpu": 9}),
        }
    finally:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM nodes WHERE edge_id LIKE 'pg-beat-%%'")
        store.close()


def test_a_warm_record_is_claimed_once_by_concurrent_claims_on_postgres(postgres_url: str) -> None:
    """Two gateways claiming the same warm-pool sandbox at once (StateStore.claim_many, the claimable rows locked
    FOR UPDATE): one gets it, with its values; the other's claim finds it taken (PostgreSQL re-checks the row)."""
    store = StateStore(postgres_url)
    warm_id = "sb-e0-00000000000c1a11"
    store.insert(sandbox_record(warm_id, labels={WARM_LABEL: "0123456789abcdef"}, created_at=1.0))
    start = threading.Barrier(2)
    won: dict[str, set[str]] = {}

    def claim(job: str) -> None:
        start.wait()
        claims = {warm_id: {"labels": {"job": job}, "env": {"TASK": job}, "created_at": 2.0, "expires_at": 62.0}}
        won[job] = store.claim_many(claims, pool_label=WARM_LABEL)

    try:
        for _round in range(5):  # the two claims race differently each time; the outcome must not
            with store.engine.begin() as conn:
                conn.exec_driver_sql(
                    "UPDATE sandboxes SET labels = %(labels)s WHERE id = %(id)s",
                    {"labels": json.dumps({WARM_LABEL: "0123456789abcdef"}), "id": warm_id},
                )
            won.clear()
            threads = [threading.Thread(target=claim, args=(job,)) for job in ("pg-claim-a", "pg-claim-b")]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            winners = [job for job, ids in won.items() if ids == {warm_id}]
            assert len(winners) == 1 and len(won) == 2, won
            record = store.get(warm_id)
            assert record is not None
            assert (record.labels, record.env) == ({"job": winners[0]}, {"TASK": winners[0]})
    finally:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes WHERE id = %(id)s", {"id": warm_id})
        store.close()


def test_connections_carry_the_tcp_timeouts_to_libpq(postgres_url: str) -> None:
    """Each pooled connection is opened with POSTGRES_TCP_TIMEOUTS (a database over TCP that goes silent fails
    the connection in seconds, not the kernel's ~15 minutes: the cluster's network-cut test relies on them)."""
    store = StateStore(postgres_url)
    try:
        with store.engine.connect() as conn:
            dsn = conn.connection.dbapi_connection.info.dsn  # type: ignore[union-attr]
            idle_limit = conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
        tcp = {key: value for key, value in POSTGRES_TCP_TIMEOUTS.items() if key != "options"}
        assert {f"{key}={value}" for key, value in tcp.items()} <= set(dsn.split()), dsn
        assert idle_limit == "30s"  # a client cut off mid-transaction does not hold its locks for ever
    finally:
        store.close()


def test_a_pooled_connection_is_pinged_only_after_sitting_idle_and_a_dead_one_is_replaced(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Back to back, a connection goes straight back to work (no round trip of a ping before each statement);
    after PING_IDLE_S in the pool it is pinged first, and one whose server side ended meanwhile (as after a
    restart) is replaced instead of failing the read."""
    store = StateStore(postgres_url)
    pings: list[int] = []
    ping = store.engine.dialect.do_ping

    def counted_ping(dbapi_connection: Any) -> bool:  # noqa: ANN401 - the DBAPI's connection
        pings.append(id(dbapi_connection))
        return ping(dbapi_connection)  # the real ping, counted (a dead connection's raises)

    monkeypatch.setattr(store.engine.dialect, "do_ping", counted_ping)
    try:
        for _ in range(20):
            assert store.get("sb-e0-none") is None
        assert pings == []
        with store.engine.connect() as conn:
            backend = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar()
        other = create_engine(postgres_url)
        with other.connect() as conn:  # the server ends that connection's session
            assert conn.exec_driver_sql(f"SELECT pg_terminate_backend({int(backend)})").scalar() is True
        other.dispose()
        time.sleep(PING_IDLE_S + 0.2)
        assert store.get("sb-e0-none") is None  # not an error: the dead connection was found and replaced
        assert len(pings) == 1  # the idle one, pinged once: the new one needs none
        with store.engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT pg_backend_pid()").scalar() != backend
    finally:
        store.close()


def test_the_ttl_check_reads_the_live_ttls_alone_on_postgres(postgres_url: str) -> None:
    """On PostgreSQL too the TTL check names what it should, and can be answered from the partial index of the
    sandboxes not ended (its terms imply the index's: the planner takes it once a scan is ruled out)."""
    store = StateStore(postgres_url)
    try:
        expired_are_found_by_the_live_ttls(store, f"sb-e0-pgttl-{time.monotonic_ns()}-")
        with store.engine.connect() as conn:
            conn.exec_driver_sql("SET enable_seqscan = off")
            query = text(f"EXPLAIN {db._EXPIRED[True]}")  # the check's own statement
            plan = "\n".join(row[0] for row in conn.execute(query, {"now": 200.0}))
        assert "ix_sandboxes_live_expiry" in plan, plan
    finally:
        store.close()
