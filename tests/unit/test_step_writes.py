"""The group commit of concurrent steps' trajectory writes on SQLite (gateway/operations.py ``_StepWrites``), on a
real SQLite file: one transaction per turn of the event loop, each write's outcome to its own writer."""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from corral.gateway.operations import _StepWrites
from corral.sdk import Conflict
from corral.state.db import StateStore
from corral.trajectory import Step, TrajectoryLog

REQUEST = {"cmd": "true", "env": {}, "cwd": None, "timeout_s": 60.0}
RESULT = {"exit_code": 0, "stdout": "", "stderr": "", "timed_out": False}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    yield store
    store.close()


def _commits(store: StateStore) -> list[int]:
    commits: list[int] = []
    event.listen(store.engine, "commit", lambda _conn: commits.append(1))
    return commits


def _begin(log: TrajectoryLog, sandbox_id: str, step_id: str) -> functools.partial[Any]:
    return functools.partial(log.begin, sandbox_id, step_id, "exec", REQUEST)


async def test_the_writes_of_one_turn_are_one_transaction(store: StateStore) -> None:
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log)
    commits = _commits(store)
    steps = await asyncio.gather(*(writes.write(_begin(log, f"sb{i % 4}", f"s{i}")) for i in range(16)))
    assert len(commits) == 1
    assert all(isinstance(step, Step) for step in steps)
    assert {step.sandbox_id: [s.seq for s in steps if s.sandbox_id == step.sandbox_id] for step in steps} == {
        f"sb{k}": [1, 2, 3, 4] for k in range(4)
    }
    finished = await asyncio.gather(*(writes.write(functools.partial(log.finish, step, RESULT)) for step in steps))
    assert len(commits) == 2 and all(step.state == "done" for step in finished)
    assert await writes.write(_begin(log, "sb0", "one")) and len(commits) == 3  # alone, at once


async def test_a_writes_own_error_reaches_only_its_writer(store: StateStore) -> None:
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log)
    step = await writes.write(_begin(log, "sb", "s"))
    assert isinstance(step, Step)
    finish = functools.partial(log.finish, step, RESULT)
    first, again, other = await asyncio.gather(
        writes.write(finish), writes.write(finish), writes.write(_begin(log, "sb", "t")), return_exceptions=True
    )
    assert isinstance(first, Step) and first.state == "done"
    assert isinstance(again, Conflict) and "recorded once" in str(again)
    assert isinstance(other, Step) and other.seq == 2


async def test_a_database_error_has_each_write_made_again_alone(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The shared transaction is rolled back; the others are written in transactions of their own and the error
    reaches only the write that raised it (a write nobody awaits has its failure logged)."""
    log = TrajectoryLog(store.engine)
    writes = _StepWrites(log)

    def broken() -> None:
        raise OperationalError("INSERT INTO trajectory_steps", {}, sqlite3.OperationalError("disk I/O error"))

    commits = _commits(store)
    writes.later(broken)
    before, failed, after = await asyncio.gather(
        writes.write(_begin(log, "sb", "x")), writes.write(broken), writes.write(_begin(log, "sb", "y")),
        return_exceptions=True,
    )  # fmt: skip
    assert isinstance(failed, OperationalError) and "disk I/O error" in str(failed)
    assert isinstance(before, Step) and isinstance(after, Step) and (before.seq, after.seq) == (1, 2)
    assert [step.step_id for step in log.steps("sb")] == ["x", "y"]
    assert len(commits) == 2  # each begin alone, after the shared transaction was rolled back
    assert any(record.levelno == logging.ERROR and "trajectory write failed" in record.message
               for record in caplog.records)  # fmt: skip
