"""The subreaper's reaping: zombies nobody waits for go; a pid its spawner waits for is left to it, and while a
spawn is in flight only container inits are reaped."""

from __future__ import annotations

import os
import time

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


def _is_zombie(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] == "Z"


def test_a_zombie_nobody_waits_for_is_reaped() -> None:
    pid = _zombie()
    assert OrphanReaper().reap() >= 1
    assert stat_fields(pid) is None  # gone from /proc: reaped


def test_a_zombie_its_spawner_waits_for_is_left_and_the_others_still_go() -> None:
    reaper = OrphanReaper()
    tracked = _zombie()  # the older child: the one the kernel names first
    untracked = _zombie()
    try:
        with reaper.spawned() as track:
            track(tracked)
            assert reaper.reap() >= 1
            assert _is_zombie(tracked), "reaped a pid its spawner waits for"
            assert stat_fields(untracked) is None, "a zombie behind a tracked one was not reaped"
    finally:
        os.waitpid(tracked, 0)


def test_while_a_spawn_is_in_flight_only_container_inits_are_reaped() -> None:
    reaper = OrphanReaper()
    pid = _zombie()  # named "python": it could be the spawn whose pid is not known yet
    try:
        with reaper.spawned():
            reaper.reap()
            assert _is_zombie(pid)
        assert reaper.reap() >= 1 and stat_fields(pid) is None
    finally:
        if _is_zombie(pid):
            os.waitpid(pid, 0)
