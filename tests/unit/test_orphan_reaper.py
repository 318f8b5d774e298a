"""The subreaper's reaping: zombies nobody waits for go; a pid being waited for, or known alive, is not touched."""

from __future__ import annotations

import os
import time
from pathlib import Path

from corral.backends.common.host import OrphanReaper
from corral.procfs import stat_fields


def _zombie() -> int:
    """A child of this process that exited and was not waited for."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while (fields := stat_fields(pid)) is not None and fields[0] != "Z":
        assert time.monotonic() < deadline, "the child did not exit"
        time.sleep(0.01)
    return pid


def _children() -> set[int]:
    return {int(pid) for path in Path("/proc/self/task").glob("*/children") for pid in path.read_text().split()}


def test_a_zombie_nobody_waits_for_is_reaped() -> None:
    pid = _zombie()
    others = _children() - {pid}  # this test process's other children (a server of another test) are not ours
    assert OrphanReaper().reap(alive=others) == 1
    assert stat_fields(pid) is None  # gone from /proc: reaped


def test_pids_known_alive_or_tracked_are_left_to_their_waiters() -> None:
    reaper = OrphanReaper()
    known, tracked = _zombie(), _zombie()
    try:
        with reaper.spawned() as track:
            track(tracked)
            assert reaper.reap(alive=_children() - {tracked}) == 0
            assert stat_fields(known) is not None and stat_fields(tracked) is not None  # both still zombies
    finally:
        for pid in (known, tracked):
            os.waitpid(pid, 0)
