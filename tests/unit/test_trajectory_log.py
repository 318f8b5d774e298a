"""The trajectory log on a real SQLite file and a real PostgreSQL: append, replay, divergence, crash recovery,
concurrency."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, delete
from sqlalchemy.engine import Engine

from corral.sdk import Conflict, InvalidRequest, NotFound, error_from_response
from corral.state.db import StateStore
from corral.trajectory import (
    LOG_CAP_KEY,
    Replay,
    Step,
    TrajectoryLog,
    request_digest,
    trajectory_metadata,
    trajectory_steps,
)
from corral.trajectory import log as log_module

SANDBOX = "sb-1"


def exec_request(cmd: str, **extra: Any) -> dict[str, Any]:
    return {"cmd": cmd, "env": {}, "cwd": None, "timeout_s": 60.0, **extra}


def exec_result(stdout: str = "", stderr: str = "", exit_code: int = 0) -> dict[str, Any]:
    return {"exit_code": exit_code, "stdout": stdout, "stderr": stderr, "timed_out": False}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state.db"


@pytest.fixture(params=["create_engine", "state_store", "postgresql"])
def open_engine(request: pytest.FixtureRequest, db_path: Path) -> Iterator[Callable[[], Engine]]:
    """Opens engines over one database: a SQLite file through plain SQLAlchemy or the state store's engine (WAL,
    busy timeout), or the session's PostgreSQL through the state store's (its log emptied first)."""
    opened: list[Engine] = []
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres_url")
        engine = StateStore(url).engine
        trajectory_metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(delete(trajectory_steps))
        engine.dispose()
    else:
        url = f"sqlite:///{db_path}"

    def open_() -> Engine:
        engine = create_engine(url) if request.param == "create_engine" else StateStore(url).engine
        opened.append(engine)
        return engine

    yield open_
    for engine in opened:
        engine.dispose()


@pytest.fixture
def log(open_engine: Callable[[], Engine]) -> TrajectoryLog:
    return TrajectoryLog(open_engine())


def begin_step(log: TrajectoryLog, step_id: str, request: dict[str, Any], *, sandbox_id: str = SANDBOX) -> Step:
    step = log.begin(sandbox_id, step_id, "exec", request)
    assert isinstance(step, Step)
    return step


def run_in_threads(count: int, target: Callable[[int], Any]) -> list[Any]:
    """Run target(i) in count threads released together; returns results or raised exceptions."""
    barrier = threading.Barrier(count)
    outcomes: list[Any] = [None] * count

    def worker(index: int) -> None:
        barrier.wait()
        try:
            outcomes[index] = target(index)
        except Exception as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return outcomes


def test_request_digest_is_sha256_of_canonical_json() -> None:
    request = {"cmd": "echo é", "env": {"B": "2", "A": "1"}}
    canonical = '{"cmd":"echo é","env":{"A":"1","B":"2"}}'.encode()
    assert request_digest(request) == hashlib.sha256(canonical).hexdigest()
    assert request_digest({"env": {"A": "1", "B": "2"}, "cmd": "echo é"}) == request_digest(request)
    assert request_digest({"timeout_s": 60}) != request_digest({"timeout_s": 60.0})
    with pytest.raises(InvalidRequest, match="not plain JSON"):
        request_digest({"cmd": object()})


def test_begin_finish_then_the_same_step_replays(log: TrajectoryLog) -> None:
    step = begin_step(log, "s1", exec_request("echo hi"))
    assert (step.seq, step.state, step.result, step.finished_at) == (1, "started", None, None)
    assert step.request_digest == request_digest(exec_request("echo hi"))

    done = log.finish(step, exec_result("hi\n"))
    assert done.state == "done" and done.result == exec_result("hi\n") and not done.result_truncated
    assert done.finished_at is not None and done.finished_at >= done.started_at

    replay = log.begin(SANDBOX, "s1", "exec", exec_request("echo hi"))
    assert isinstance(replay, Replay)
    assert replay.step == done
    assert log.steps(SANDBOX) == [done]


def test_seq_is_gap_free_per_sandbox_and_steps_pages(log: TrajectoryLog) -> None:
    for index in range(5):
        log.finish(begin_step(log, f"s{index}", exec_request(f"echo {index}")), exec_result(f"{index}\n"))
    other = begin_step(log, "s0", exec_request("echo 0"), sandbox_id="sb-2")
    assert other.seq == 1  # seq and step ids are per sandbox

    steps = log.steps(SANDBOX)
    assert [s.seq for s in steps] == [1, 2, 3, 4, 5]
    assert [s.step_id for s in steps] == ["s0", "s1", "s2", "s3", "s4"]
    assert [s.seq for s in log.steps(SANDBOX, after_seq=2, limit=2)] == [3, 4]
    assert log.steps("sb-unknown") == []


def test_a_different_request_under_a_logged_step_id_diverges(log: TrajectoryLog) -> None:
    log.finish(begin_step(log, "s1", exec_request("ls")), exec_result())
    log.finish(begin_step(log, "s2", exec_request("pytest -q")), exec_result())

    with pytest.raises(Conflict) as caught:
        log.begin(SANDBOX, "s2", "exec", exec_request("pytest -x"))
    message = caught.value.message
    assert "diverge" in message and "seq 2" in message
    assert '"pytest -q"' in message and '"pytest -x"' in message
    assert "timeout_s" not in message  # only the fields that differ are shown

    with pytest.raises(Conflict, match="diverges .* at seq 1: logged exec, got write_file"):
        log.begin(SANDBOX, "s1", "write_file", exec_request("ls"))
    assert len(log.steps(SANDBOX)) == 2


def test_a_step_still_in_flight_is_a_conflict(log: TrajectoryLog) -> None:
    begin_step(log, "s1", exec_request("sleep 10"))
    with pytest.raises(Conflict, match="still running or its outcome is unknown"):
        log.begin(SANDBOX, "s1", "exec", exec_request("sleep 10"))


def test_mark_lost_then_the_step_cannot_replay(log: TrajectoryLog) -> None:
    done = begin_step(log, "s1", exec_request("true"))
    log.finish(done, exec_result())
    in_flight = begin_step(log, "s2", exec_request("make"))
    begin_step(log, "s1", exec_request("make"), sandbox_id="sb-2")

    assert log.mark_lost(SANDBOX) == 1
    assert [s.state for s in log.steps(SANDBOX)] == ["done", "lost"]
    assert log.steps("sb-2")[0].state == "started"
    assert log.mark_lost() == 1
    assert log.mark_lost() == 0

    with pytest.raises(Conflict, match="lost in a crash and did not record a result"):
        log.begin(SANDBOX, "s2", "exec", exec_request("make"))
    with pytest.raises(Conflict, match="already lost"):
        log.finish(in_flight, exec_result())
    assert isinstance(log.begin(SANDBOX, "s1", "exec", exec_request("true")), Replay)
    assert begin_step(log, "s3", exec_request("make")).seq == 3


def test_a_failed_step_replays_its_error(log: TrajectoryLog) -> None:
    step = log.begin(SANDBOX, "w1", "write_file", {"path": "/nope/a.txt", "size_bytes": 3})
    assert isinstance(step, Step)
    failed = log.fail(step, NotFound("no such directory: /nope").to_body()["error"])
    assert failed.state == "done"
    assert failed.result == {"error": {"code": "not_found", "message": "no such directory: /nope"}}

    replay = log.begin(SANDBOX, "w1", "write_file", {"path": "/nope/a.txt", "size_bytes": 3})
    assert isinstance(replay, Replay)
    assert replay.step.result is not None
    error = error_from_response(0, replay.step.result)
    assert isinstance(error, NotFound) and error.message == "no such directory: /nope"


def test_append_many_continues_each_sandboxs_seq_in_order_across_chunks(
    log: TrajectoryLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The steps without a client id are written as one batch (a bulk kill, a burst of execs): each sandbox's
    seq goes on from what it had, in the batch's order, also across the transactions of a long batch."""
    log.finish(begin_step(log, "s0", exec_request("echo 0")), exec_result("0\n"))
    monkeypatch.setattr(log_module, "_APPEND_CHUNK", 3)
    entries = [
        (SANDBOX if index % 2 else "sb-2", f"auto-{index}", "exec", exec_request(f"echo {index}"), exec_result())
        for index in range(7)
    ]
    appended = log.append_many(entries)
    assert [(s.sandbox_id, s.seq) for s in appended] == [
        ("sb-2", 1), (SANDBOX, 2), ("sb-2", 2), (SANDBOX, 3), ("sb-2", 3), (SANDBOX, 4), ("sb-2", 4),
    ]  # fmt: skip
    assert [s.step_id for s in log.steps(SANDBOX)] == ["s0", "auto-1", "auto-3", "auto-5"]
    assert [s.step_id for s in log.steps("sb-2")] == ["auto-0", "auto-2", "auto-4", "auto-6"]
    assert all(s.state == "done" and s.request_digest == request_digest(s.request) for s in log.steps("sb-2"))
    with pytest.raises(InvalidRequest):  # checked before anything is written
        log.append_many([("sb-3", "ok", "exec", {}, {}), ("sb-3", "x" * 300, "exec", {}, {})])
    assert log.steps("sb-3") == []


def test_output_over_the_cap_is_cut_on_a_character_boundary(open_engine: Callable[[], Engine]) -> None:
    log = TrajectoryLog(open_engine(), output_cap_bytes=10)
    stdout = "abcdefghié" + "x" * 50  # 'é' is two bytes: bytes 10-11, across the cap
    result = exec_result(stdout=stdout, stderr="short")
    done = log.finish(begin_step(log, "s1", exec_request("gen")), result)

    assert result == exec_result(stdout=stdout, stderr="short")  # the caller's dict is left alone
    assert done.result_truncated
    assert done.result is not None
    assert done.result["stdout"] == "abcdefghi"
    assert done.result["stdout_truncated"] is True
    assert done.result["stderr"] == "short" and "stderr_truncated" not in done.result
    assert done.result[LOG_CAP_KEY] == {"cap_bytes": 10, "stdout_bytes": len(stdout.encode())}

    replay = log.begin(SANDBOX, "s1", "exec", exec_request("gen"))
    assert isinstance(replay, Replay)
    assert replay.step.result_truncated and replay.step.result == done.result

    exact = log.finish(begin_step(log, "s2", exec_request("ok")), exec_result(stdout="é" * 5, stderr="e" * 10))
    assert not exact.result_truncated and exact.result == exec_result(stdout="é" * 5, stderr="e" * 10)


def test_concurrent_begins_with_distinct_step_ids_get_seqs_without_gaps(log: TrajectoryLog) -> None:
    outcomes = run_in_threads(8, lambda i: log.begin(SANDBOX, f"s{i}", "exec", exec_request(f"echo {i}")))
    assert all(isinstance(o, Step) for o in outcomes), outcomes
    assert sorted(o.seq for o in outcomes) == list(range(1, 9))
    assert {s.seq: s.step_id for s in log.steps(SANDBOX)} == {o.seq: o.step_id for o in outcomes}


def test_concurrent_begins_with_the_same_new_step_id_give_one_step(log: TrajectoryLog) -> None:
    def begin_and_finish(_index: int) -> Step | Replay:
        outcome = log.begin(SANDBOX, "s1", "exec", exec_request("echo once"))
        return log.finish(outcome, exec_result("once\n")) if isinstance(outcome, Step) else outcome

    outcomes = run_in_threads(8, begin_and_finish)
    assert sum(isinstance(o, Step) for o in outcomes) == 1, outcomes
    assert all(isinstance(o, Step | Replay | Conflict) for o in outcomes), outcomes
    assert [(s.seq, s.step_id, s.state) for s in log.steps(SANDBOX)] == [(1, "s1", "done")]


def test_export_jsonl_has_every_column_in_seq_order(log: TrajectoryLog, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(log_module, "_EXPORT_BATCH", 2)  # make the export page
    for index in range(5):
        log.finish(begin_step(log, f"s{index}", exec_request(f"echo {index}")), exec_result(f"{index}\n"))
    begin_step(log, "other", exec_request("x"), sandbox_id="sb-2")

    lines = list(log.export_jsonl(SANDBOX))
    assert all(line.endswith("\n") and line.count("\n") == 1 for line in lines)
    records = [json.loads(line) for line in lines]
    assert [r["seq"] for r in records] == [1, 2, 3, 4, 5]
    assert all(set(r) == set(trajectory_steps.columns.keys()) for r in records)
    first = records[0]
    assert first["step_id"] == "s0" and first["request"] == exec_request("echo 0")
    assert first["result"] == exec_result("0\n") and first["output_cap_bytes"] == 1 << 20
    assert list(log.export_jsonl("sb-unknown")) == []


def test_provenance_finds_the_steps_that_changed_a_path(log: TrajectoryLog) -> None:
    write = log.begin(SANDBOX, "w1", "write_file", {"path": "/work/a.py", "size_bytes": 8})
    assert isinstance(write, Step)
    log.finish(write, {"size_bytes": 8}, files=["/work/a.py"])
    log.finish(begin_step(log, "s2", exec_request("ls")), exec_result())
    build = log.finish(
        begin_step(log, "s3", exec_request("make")), exec_result(), files=["/work/./b.py", "//work/x/../a.py"]
    )
    assert build.files == ["/work/b.py", "/work/a.py"]

    assert [s.step_id for s in log.provenance(SANDBOX, "/work//a.py")] == ["w1", "s3"]
    assert [s.step_id for s in log.provenance(SANDBOX, "/work/b.py")] == ["s3"]
    assert log.provenance(SANDBOX, "/work/c.py") == []
    assert log.provenance("sb-2", "/work/a.py") == []


def test_the_log_survives_reopening_the_database(open_engine: Callable[[], Engine]) -> None:
    first = TrajectoryLog(open_engine())
    done = first.finish(begin_step(first, "s1", exec_request("true")), exec_result(), files=["/a"])
    begin_step(first, "s2", exec_request("sleep 100"))  # the server dies during this one

    restarted = TrajectoryLog(open_engine())
    assert restarted.mark_lost() == 1
    replay = restarted.begin(SANDBOX, "s1", "exec", exec_request("true"))
    assert isinstance(replay, Replay) and replay.step == done
    with pytest.raises(Conflict, match="lost"):
        restarted.begin(SANDBOX, "s2", "exec", exec_request("sleep 100"))
    assert begin_step(restarted, "s3", exec_request("true")).seq == 3
    assert [s.step_id for s in first.steps(SANDBOX)] == ["s1", "s2", "s3"]


def test_delete_forgets_one_sandbox(log: TrajectoryLog) -> None:
    log.finish(begin_step(log, "s1", exec_request("true")), exec_result())
    in_flight = begin_step(log, "s2", exec_request("true"))
    begin_step(log, "s1", exec_request("true"), sandbox_id="sb-2")

    assert log.delete(SANDBOX) == 2
    assert log.steps(SANDBOX) == [] and len(log.steps("sb-2")) == 1
    assert log.delete(SANDBOX) == 0
    with pytest.raises(NotFound, match="no longer in the trajectory log"):
        log.finish(in_flight, exec_result())
    assert begin_step(log, "s1", exec_request("other")).seq == 1


def test_a_result_is_recorded_once(log: TrajectoryLog) -> None:
    step = begin_step(log, "s1", exec_request("true"))
    log.finish(step, exec_result())
    with pytest.raises(Conflict, match="already done"):
        log.fail(step, {"code": "internal", "message": "late"})
    assert log.steps(SANDBOX)[0].result == exec_result()


@pytest.mark.parametrize(
    ("sandbox_id", "step_id", "kind"), [("", "s1", "exec"), (SANDBOX, "", "exec"), (SANDBOX, "s" * 257, "exec")]
)
def test_bad_ids_are_invalid_requests(log: TrajectoryLog, sandbox_id: str, step_id: str, kind: str) -> None:
    with pytest.raises(InvalidRequest, match="non-empty string"):
        log.begin(sandbox_id, step_id, kind, exec_request("true"))


def test_an_appends_seq_lookup_costs_the_same_however_long_the_trajectory(log: TrajectoryLog) -> None:
    """The last seq of each sandbox in a batch is one index seek each, not a read of every step it has: counted
    in SQLite's own virtual-machine instructions (its progress handler), the lookup for a sandbox with 2,000
    steps runs as many as for one with 10 (141 here; the GROUP BY it replaces ran 22,032)."""
    if log._engine.dialect.name != "sqlite":
        pytest.skip("counted in SQLite's virtual-machine instructions")
    for sandbox_id, count in (("sb-short", 10), ("sb-long", 2_000)):
        log.append_many([(sandbox_id, f"s{i}", "exec", exec_request("true"), exec_result()) for i in range(count)])

    def instructions(sandbox_ids: list[str]) -> tuple[dict[str, int], int]:
        counted = 0

        def count() -> int:
            nonlocal counted
            counted += 1
            return 0  # go on

        with log._engine.connect() as conn:
            driver = conn.connection.driver_connection
            assert driver is not None
            driver.set_progress_handler(count, 1)
            try:
                seqs = log_module._last_seqs_of(conn, sandbox_ids)
            finally:
                driver.set_progress_handler(None, 1)
        return seqs, counted

    short, short_cost = instructions(["sb-short"])
    long, long_cost = instructions(["sb-long"])
    assert (short, long) == ({"sb-short": 10}, {"sb-long": 2_000})
    assert 0 < long_cost <= short_cost + 5
    # three ids go in the statement for four (the last repeated); a sandbox without steps is absent
    assert instructions(["sb-long", "sb-none", "sb-short"])[0] == {"sb-long": 2_000, "sb-short": 10}
    assert log.append_many([("sb-long", "next", "exec", {}, {})])[0].seq == 2_001


def test_writes_together_share_one_transaction(log: TrajectoryLog) -> None:
    """``together``: the writes of a block are one transaction (the gateway's group commit on SQLite); a write's own
    error (a divergent resend) leaves the others, an error out of the block takes every write back."""
    done = begin_step(log, "done", exec_request("true"))
    log.finish(done, exec_result())
    with log.together():
        first = begin_step(log, "a", exec_request("echo a"))
        with pytest.raises(Conflict, match="diverges|different"):
            log.begin(SANDBOX, "done", "exec", exec_request("echo other"))
        second = begin_step(log, "b", exec_request("echo b"))
        log.finish(first, exec_result("a\n"))
        log.append_many([(SANDBOX, "auto-1", "exec", exec_request("true"), exec_result())])
    assert [(s.step_id, s.state) for s in log.steps(SANDBOX)] == [
        ("done", "done"), ("a", "done"), ("b", "started"), ("auto-1", "done")]  # fmt: skip
    assert second.seq == first.seq + 1
    with pytest.raises(RuntimeError, match="boom"), log.together():
        begin_step(log, "c", exec_request("echo c"))
        log.finish(second, exec_result("b\n"))
        raise RuntimeError("boom")
    assert [(s.step_id, s.state) for s in log.steps(SANDBOX)][-2:] == [("b", "started"), ("auto-1", "done")]
    assert begin_step(log, "c", exec_request("echo c")).seq == 5  # nothing of the block was kept
