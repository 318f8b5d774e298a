"""run_to_end (corral/backends/common/spawn.py) on both event loops the project runs: real processes, their whole
output whatever its size, their exit status, a timeout that kills, and files given for their output."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import uvloop

from corral.backends.common.spawn import finished_before_cancel, run_to_end
from corral.procfs import running

LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def _run(loop: str, make: Callable[[], Awaitable[Any]]) -> Any:
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        return runner.run(make())  # type: ignore[arg-type]


@pytest.mark.parametrize("loop", LOOPS)
def test_exit_status_and_the_whole_output_of_each_stream(loop: str) -> None:
    started: list[int] = []
    script = "import sys; sys.stdout.write('o' * 3_000_000); sys.stderr.write('e' * 100_000); sys.exit(7)"
    code, out, err = _run(loop, lambda: run_to_end([sys.executable, "-c", script], timeout_s=30,
                                                    on_start=started.append))  # fmt: skip
    assert (code, len(out), len(err)) == (7, 3_000_000, 100_000)  # more than a pipe holds: nothing to drain
    assert set(out) == {ord("o")} and set(err) == {ord("e")}
    assert len(started) == 1 and not running(started[0])  # reaped


@pytest.mark.parametrize("loop", LOOPS)
def test_a_process_over_its_time_is_killed(loop: str) -> None:
    started: list[int] = []
    begun = time.monotonic()
    with pytest.raises(TimeoutError):
        _run(loop, lambda: run_to_end(["sleep", "30"], timeout_s=0.3, on_start=started.append))
    assert time.monotonic() - begun < 10
    assert not running(started[0])


@pytest.mark.parametrize("loop", LOOPS)
def test_output_to_files_and_a_session_of_its_own(loop: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with log.open("ab") as sink:
        code, out, err = _run(loop, lambda: run_to_end(
            ["sh", "-c", "echo to-out; echo to-err >&2; ps -o sid= -p $$"], timeout_s=30, on_start=lambda _: None,
            stdout=sink, stderr=sink, new_session=True,
        ))  # fmt: skip
    assert (code, out, err) == (0, b"", b"")
    lines = log.read_text().split()
    assert lines[:2] == ["to-out", "to-err"]
    assert int(lines[2]) != os.getsid(0)  # a session of its own
    code, out, _ = _run(loop, lambda: run_to_end(["echo", "x"], timeout_s=30, on_start=lambda _: None,
                                                 stdout=subprocess.DEVNULL))  # fmt: skip
    assert (code, out) == (0, b"")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cancelled_wait_leaves_the_process_to_finish(loop: str, tmp_path: Path) -> None:
    marker = tmp_path / "done"
    started: list[int] = []

    async def cancel_early() -> None:
        waiting = asyncio.ensure_future(run_to_end(["sh", "-c", f"sleep 0.3; touch {marker}"], timeout_s=30,
                                                   on_start=started.append))  # fmt: skip
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    _run(loop, cancel_early)
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.exists()
    os.waitpid(started[0], 0)  # the node's reaper's part in the server


@pytest.mark.parametrize("loop", LOOPS)
def test_a_step_finished_before_cancel_has_ended_when_the_cancellation_arrives(loop: str, tmp_path: Path) -> None:
    """The caller's cleanup runs after the runtime process did what it does (two cancellations on the way, as a
    server's stop may send), and the cancellation still reaches the caller."""
    marker = tmp_path / "done"
    seen_at_cancel: list[bool] = []

    async def cancel_twice() -> None:
        step = finished_before_cancel(run_to_end(["sh", "-c", f"sleep 0.3; touch {marker}"], timeout_s=30,
                                                 on_start=lambda _: None))  # fmt: skip
        waiting = asyncio.ensure_future(step)
        await asyncio.sleep(0.05)
        waiting.cancel()
        await asyncio.sleep(0.05)
        waiting.cancel()
        try:
            await waiting
        except asyncio.CancelledError:
            seen_at_cancel.append(marker.exists())

    _run(loop, cancel_twice)
    assert seen_at_cancel == [True]


@pytest.mark.parametrize("loop", LOOPS)
def test_a_step_finished_before_cancel_gives_its_result_or_error_when_not_cancelled(loop: str) -> None:
    async def quiet() -> int:
        return 7

    async def failing() -> int:
        raise OSError("no such runtime")

    assert _run(loop, lambda: finished_before_cancel(quiet())) == 7
    with pytest.raises(OSError, match="no such runtime"):
        _run(loop, lambda: finished_before_cancel(failing()))
