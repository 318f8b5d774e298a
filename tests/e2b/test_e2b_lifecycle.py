"""The unmodified e2b SDK's lifecycle calls on Corral: snapshots, fork, pause with and without memory, connect.

A snapshot is a tagged Corral image (its id an image ref), a fork is Corral's
fork, a filesystem-only pause or a ``reboot`` resume keeps the files and drops
the processes, as a cold boot would.
"""

from __future__ import annotations

import datetime as dt
import time

import pytest
from e2b import Sandbox, SandboxException, SandboxState

import corral
from tests.e2b.sdk import FILESYSTEM_ONLY, HAS_SNAPSHOT_MODES


@pytest.fixture
def sbx(e2b_sandboxes: list) -> Sandbox:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", metadata={"suite": "lifecycle"}, timeout=300)
    e2b_sandboxes.append(sandbox)
    return sandbox


def _sleepers(sandbox: Sandbox) -> int:
    """How many ``sleep`` processes run in the sandbox (the image has no procps)."""
    return int(sandbox.commands.run("cat /proc/[0-9]*/comm | grep -cx sleep || true").stdout)


def _start_sleeper(sandbox: Sandbox) -> None:
    """``sleep 600`` in the background, once it runs. The SDK starts a command as ``bash -l -c``: the start
    answers once bash runs, and bash execs ``sleep`` only after its login profile, so a count (or a pause) right
    after the start can come before it (a full run failed so, its machine loaded)."""
    before = _sleepers(sandbox)
    sandbox.commands.run("sleep 600", background=True)
    deadline = time.monotonic() + 10
    while _sleepers(sandbox) != before + 1:
        assert time.monotonic() < deadline, "the background sleep never ran"
        time.sleep(0.05)


def test_snapshots_create_list_delete_and_start_sandboxes(sbx: Sandbox, e2b_sandboxes: list) -> None:  # type: ignore[type-arg]
    sbx.files.write("/home/user/state.txt", "at step 1")
    unnamed = sbx.create_snapshot()
    assert unnamed.snapshot_id.startswith(f"e2b-snapshot-{sbx.sandbox_id}:") and unnamed.names == [unnamed.snapshot_id]
    sbx.files.write("/home/user/state.txt", "at step 2")
    named = sbx.create_snapshot(name="step-2", **({"mode": "filesystem"} if HAS_SNAPSHOT_MODES else {}))
    assert named.snapshot_id == "e2b-snapshot-step-2:latest"
    listed = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
    assert listed == [named.snapshot_id, unnamed.snapshot_id]  # this sandbox's, newest first
    assert [s.snapshot_id for s in Sandbox.list_snapshots(name="step-2").next_items()] == [named.snapshot_id]
    pager = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, limit=1)
    assert [s.snapshot_id for s in pager.next_items() + pager.next_items()] == listed and not pager.has_next
    for snapshot, expected in ((unnamed, "at step 1"), (named, "at step 2")):
        child = Sandbox.create(snapshot.snapshot_id, timeout=120)
        e2b_sandboxes.append(child)
        assert child.files.read("/home/user/state.txt") == expected
        assert child.get_info().template_id == snapshot.snapshot_id
        assert child.commands.run("whoami").stdout == "user\n"
    if HAS_SNAPSHOT_MODES:
        with pytest.raises(SandboxException, match=r"mode='full'.*not supported"):
            sbx.create_snapshot(mode="full")
    assert Sandbox.delete_snapshot(named.snapshot_id) is True
    assert Sandbox.delete_snapshot(named.snapshot_id) is False  # already gone
    assert [s.snapshot_id for s in sbx.list_snapshots().next_items()] == [unnamed.snapshot_id]
    with pytest.raises(SandboxException, match="templates are Corral images"):
        Sandbox.delete_snapshot("base")


def test_fork_copies_files_and_settings(sbx: Sandbox, e2b_sandboxes: list, client: corral.Client) -> None:  # type: ignore[type-arg]
    sbx.files.write("/home/user/state.txt", "before the fork")
    forks = sbx.fork(count=2, timeout=120)
    assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks)
    e2b_sandboxes.extend(forks)
    first, second = forks
    assert len({first.sandbox_id, second.sandbox_id, sbx.sandbox_id}) == 3
    first.files.write("/home/user/state.txt", "changed in the first fork")
    assert second.files.read("/home/user/state.txt") == "before the fork"  # each fork has its own copy
    assert sbx.files.read("/home/user/state.txt") == "before the fork"
    info = second.get_info()
    assert info.metadata == {"suite": "lifecycle"} and info.template_id == "base"
    assert 110 <= (info.end_at - info.started_at).total_seconds() <= 121
    assert client.get(second.sandbox_id).info.labels["corral.forked_from"] == sbx.sandbox_id
    assert sbx.pause() is True
    (from_paused,) = Sandbox.fork(sbx.sandbox_id, timeout=60)
    e2b_sandboxes.append(from_paused)
    assert from_paused.files.read("/home/user/state.txt") == "before the fork"
    assert sbx.get_info().state == SandboxState.PAUSED  # the parent is left as it was


def test_pause_without_memory_keeps_files_not_processes(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/state.txt", "kept")
    _start_sleeper(sbx)
    assert sbx.pause(**FILESYSTEM_ONLY) is True
    assert sbx.get_info().state == SandboxState.PAUSED
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.read("/home/user/state.txt") == "kept"
    assert _sleepers(resumed) == 0  # as after a cold boot


def test_connect_with_reboot_drops_processes_and_full_pause_keeps_them(sbx: Sandbox) -> None:
    _start_sleeper(sbx)
    assert sbx.pause() is True  # mode="full": memory and processes kept
    assert _sleepers(Sandbox.connect(sbx.sandbox_id)) == 1
    assert sbx.pause() is True
    rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    assert rebooted.get_info().state == SandboxState.RUNNING and _sleepers(rebooted) == 0
    _start_sleeper(sbx)
    Sandbox.connect(sbx.sandbox_id, on_resume="reboot")  # running: a no-op
    assert _sleepers(sbx) == 1


def _wait_for_state(sandbox: Sandbox, state: SandboxState, within_s: float) -> float:
    """Seconds until the sandbox is in ``state`` (asked through the control plane, which resumes nothing)."""
    started = time.monotonic()
    while sandbox.get_info().state != state:
        assert time.monotonic() - started < within_s, f"not {state.value} within {within_s} s"
        time.sleep(0.2)
    return time.monotonic() - started


def test_on_timeout_pause_pauses_and_a_resume_starts_a_new_period(e2b_sandboxes: list, client: corral.Client) -> None:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", timeout=4, lifecycle={"on_timeout": "pause", "auto_resume": True})
    e2b_sandboxes.append(sandbox)
    assert sandbox.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
    sandbox.files.write("/home/user/state.txt", "kept")
    _start_sleeper(sandbox)
    assert 1.5 <= _wait_for_state(sandbox, SandboxState.PAUSED, within_s=10) <= 8  # at its timeout, not killed
    time.sleep(3)  # past the end of its TTL: paused, not reaped
    assert client.get(sandbox.sandbox_id).info.state == corral.SandboxState.PAUSED
    resumed = Sandbox.connect(sandbox.sandbox_id, timeout=3)  # shorter than its period: the period stands
    info = resumed.get_info()
    assert info.state == SandboxState.RUNNING and 2 <= (info.end_at - dt.datetime.now(dt.UTC)).total_seconds() <= 4.5
    assert resumed.files.read("/home/user/state.txt") == "kept" and _sleepers(resumed) == 1  # memory kept
    _wait_for_state(sandbox, SandboxState.PAUSED, within_s=10)  # the next period ends with a pause too
    assert _sleepers(sandbox) == 1  # a request resumes it (autoResume)
    assert sandbox.get_info().state == SandboxState.RUNNING


def test_on_timeout_pause_without_memory_keeps_the_files(e2b_sandboxes: list, client: corral.Client) -> None:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", timeout=3, lifecycle={"on_timeout": {"action": "pause", **FILESYSTEM_ONLY}})
    e2b_sandboxes.append(sandbox)
    sandbox.files.write("/home/user/state.txt", "kept")
    _start_sleeper(sandbox)
    _wait_for_state(sandbox, SandboxState.PAUSED, within_s=10)
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.files.read("/home/user/state.txt") == "kept" and _sleepers(resumed) == 0
    killed = Sandbox.create("base", timeout=2)  # on_timeout left out: the API's default, kill
    assert killed.get_info().lifecycle == {"on_timeout": "kill", "auto_resume": False}
    started = time.monotonic()
    while client.get(killed.sandbox_id).info.state != corral.SandboxState.ENDED:
        assert time.monotonic() - started < 10, "not reaped at its timeout"
        time.sleep(0.2)
    assert client.get(killed.sandbox_id).info.end_reason == "ttl_expired"
