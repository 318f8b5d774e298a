"""The group commit of concurrent steps' trajectory writes (gateway/operations.py ``_StepWrites``), on a real
SQLite file (the writes on the event loop's thread) and a real PostgreSQL (on the database thread): one
transaction per turn of the event loop, each write's outcome to its own writer."""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg.pq import PipelineStatus
from sqlalchemy import event
from sqlalchemy.exc import DataError, OperationalError

from corral.gateway.operations import _StepWrites
from corral.sdk import Conflict
from corral.state.db import StateStore
from corral.state.thread import DatabaseThread
from corral.trajectory import Replay, Step, TrajectoryLog

REQUEST = {"cmd": "true", "env": {}, "cwd": None, "timeout_s": 60.0}
RESULT = {"exit_code": 0, "stdout": "", "stderr": "", "timed_out": False}


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StateStore]:
    url = f"sqlite:///{tmp_path / 'state.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    store = StateStore(url)
    yield store
    store.close()


@pytest.fixture
def db(store: StateStore) -> Iterator[DatabaseThread]:
    """As the gateway runs its database calls: inline on SQLite, on a thread of their own on PostgreSQL."""
    thread = DatabaseThread(inline=store.engine.dialect.name == "sqlite")
    yield thread
    thread.close()


def _sandbox(name: str) -> str:
    """A sandbox id of this test's own (the PostgreSQL is shared by the session's tests)."""
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _commits(store: StateStore) -> list[int]:
    commits: list[int] = []
    event.listen(store.engine, "commit", lambda _conn: commits.append(1))
    return commits


def _begin(log: TrajectoryLog, sandbox_id: str, step_id: str) -> functools.partial[Any]:
    return functools.partial(log.begin, sandbox_id, step_id, "exec", REQUEST)


async def test_the_writes_of_one_turn_are_one_transaction(store: StateStore, db: DatabaseThread) -> None:
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log, db)
    commits = _commits(store)
    sandboxes = [_sandbox(f"sb{k}") for k in range(4)]
    steps = await asyncio.gather(*(writes.write(_begin(log, sandboxes[i % 4], f"s{i}")) for i in range(16)))
    assert len(commits) == 1
    assert all(isinstance(step, Step) for step in steps)
    assert {step.sandbox_id: [s.seq for s in steps if s.sandbox_id == step.sandbox_id] for step in steps} == {
        sandbox_id: [1, 2, 3, 4] for sandbox_id in sandboxes
    }
    finished = await asyncio.gather(*(writes.write(functools.partial(log.finish, step, RESULT)) for step in steps))
    assert len(commits) == 2 and all(step.state == "done" for step in finished)
    assert await writes.write(_begin(log, sandboxes[0], "one")) and len(commits) == 3  # alone, at once


async def test_writes_asked_for_while_a_transaction_runs_join_the_next(store: StateStore, db: DatabaseThread) -> None:
    """On PostgreSQL the transaction runs on the database thread while the loop goes on: the writes asked for
    meanwhile, one a turn, wait for it and share the next one, in order. On SQLite each turn's writes are
    committed right after that turn."""
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log, db)
    commits = _commits(store)
    sandbox_id = _sandbox("sb")

    async def one_a_turn() -> list[Any]:
        later = []
        for k in range(8):
            await asyncio.sleep(0)
            later.append(asyncio.ensure_future(writes.write(_begin(log, sandbox_id, f"later{k}"))))
        return await asyncio.gather(*later)

    first, later = await asyncio.gather(
        asyncio.gather(*(writes.write(_begin(log, sandbox_id, f"first{k}")) for k in range(8))), one_a_turn()
    )
    assert [step.seq for step in [*first, *later]] == list(range(1, 17))
    assert [step.step_id for step in log.steps(sandbox_id)] == [*(f"first{k}" for k in range(8)),
                                                                *(f"later{k}" for k in range(8))]  # fmt: skip
    if store.engine.dialect.name == "sqlite":
        assert len(commits) == 9  # the first turn's eight, then one a turn
    else:
        assert len(commits) <= 3  # the first eight, then the rest together (a transaction takes ~2 ms, a turn µs)


async def test_a_writes_own_error_reaches_only_its_writer(store: StateStore, db: DatabaseThread) -> None:
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log, db)
    sandbox_id = _sandbox("sb")
    step = await writes.write(_begin(log, sandbox_id, "s"))
    assert isinstance(step, Step)
    finish = functools.partial(log.finish, step, RESULT)
    first, again, other = await asyncio.gather(
        writes.write(finish), writes.write(finish), writes.write(_begin(log, sandbox_id, "t")), return_exceptions=True
    )
    assert isinstance(first, Step) and first.state == "done"
    assert isinstance(again, Conflict) and "recorded once" in str(again)
    assert isinstance(other, Step) and other.seq == 2


async def test_a_database_error_has_each_write_made_again_alone(
    store: StateStore, db: DatabaseThread, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared transaction is rolled back; the others are written in transactions of their own and the error
    reaches only the write that raised it (a write nobody awaits has its failure logged)."""
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log, db)
    sandbox_id = _sandbox("sb")

    def broken() -> None:
        raise OperationalError("INSERT INTO trajectory_steps", {}, sqlite3.OperationalError("disk I/O error"))

    commits = _commits(store)
    writes.later(broken)
    before, failed, after = await asyncio.gather(
        writes.write(_begin(log, sandbox_id, "x")), writes.write(broken), writes.write(_begin(log, sandbox_id, "y")),
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(failed, OperationalError) and "disk I/O error" in str(failed)
    assert isinstance(before, Step) and isinstance(after, Step) and (before.seq, after.seq) == (1, 2)
    assert [step.step_id for step in log.steps(sandbox_id)] == ["x", "y"]
    # each begin alone, after the shared transaction was rolled back (a statement in autocommit on PostgreSQL)
    assert len(commits) == (2 if store.engine.dialect.name == "sqlite" else 0)
    assert any(record.levelno == logging.ERROR and "trajectory write failed" in record.message
               for record in caplog.records)  # fmt: skip


def _pipeline_modes(store: StateStore) -> list[str]:
    """The driver's pipeline status at each statement the engine runs ("none" on SQLite)."""
    modes: list[str] = []

    def note(conn: Any, *_: Any) -> None:  # noqa: ANN401 - SQLAlchemy's event
        pgconn = getattr(conn.connection.dbapi_connection, "pgconn", None)
        modes.append(PipelineStatus(pgconn.pipeline_status).name if pgconn is not None else "none")

    event.listen(store.engine, "before_cursor_execute", note)
    return modes


async def test_begins_and_results_in_two_halves_are_sent_in_one_pipeline_on_postgresql(
    store: StateStore, db: DatabaseThread
) -> None:
    """A step's begin and result come in two halves (the statement sent, then its answer read): on PostgreSQL a
    transaction's run of them goes in one pipeline, where each waited for its own answer; the outcomes are each
    writer's as before, a resent step a replay and a divergent one a conflict. On SQLite the same writes run as
    they come."""
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log, db)
    commits = _commits(store)
    modes = _pipeline_modes(store)
    sandboxes = [_sandbox(f"sb{k}") for k in range(4)]

    def begin(sandbox_id: str, step_id: str, request: dict[str, Any] = REQUEST) -> Any:  # noqa: ANN401
        call = functools.partial(log.begin, sandbox_id, step_id, "exec", request)
        return writes.write(call, functools.partial(log.begin_sent, sandbox_id, step_id, "exec", request))

    steps = await asyncio.gather(*(begin(sandboxes[i % 4], f"s{i}") for i in range(16)))
    assert all(isinstance(step, Step) for step in steps)
    assert {step.sandbox_id: [s.seq for s in steps if s.sandbox_id == step.sandbox_id] for step in steps} == {
        sandbox_id: [1, 2, 3, 4] for sandbox_id in sandboxes
    }
    finished = await asyncio.gather(*(writes.write(functools.partial(log.finish, step, RESULT, files=["/a"]),
                                                   functools.partial(log.finish_sent, step, RESULT, files=["/a"]))
                                      for step in steps))  # fmt: skip
    assert all(step.state == "done" and step.files == ["/a"] for step in finished) and len(commits) == 2
    replayed, diverged, new = await asyncio.gather(
        begin(sandboxes[0], "s0"), begin(sandboxes[0], "s4", {**REQUEST, "cmd": "false"}), begin(sandboxes[0], "n"),
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(replayed, Replay) and replayed.step.result == RESULT
    assert isinstance(diverged, Conflict) and isinstance(new, Step) and new.seq == 5
    if store.engine.dialect.name == "postgresql":
        assert modes.count("ON") >= 35  # 16 begins + 16 results + 3 begins, each sent with the pipeline on


async def test_a_database_error_in_a_pipeline_has_each_write_made_again_alone(
    store: StateStore, db: DatabaseThread
) -> None:
    """A statement the driver refuses while its pipeline is being sent (a NUL in a PostgreSQL text value) breaks the
    shared transaction: the other writes are made again in transactions of their own, the error goes to its own
    writer only."""
    if store.engine.dialect.name != "postgresql":
        pytest.skip("the pipeline is PostgreSQL's (SQLite stores a NUL)")
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log, db)
    sandbox_id = _sandbox("sb")

    def begin(step_id: str) -> Any:  # noqa: ANN401
        call = functools.partial(log.begin, sandbox_id, step_id, "exec", REQUEST)
        return writes.write(call, functools.partial(log.begin_sent, sandbox_id, step_id, "exec", REQUEST))

    before, failed, after = await asyncio.gather(begin("x"), begin("nul\0"), begin("y"), return_exceptions=True)
    assert isinstance(failed, DataError) and "NUL" in str(failed)
    assert isinstance(before, Step) and isinstance(after, Step) and (before.seq, after.seq) == (1, 2)
    assert [step.step_id for step in log.steps(sandbox_id)] == ["x", "y"]
