"""Bad behaviour inside sandboxes and faults of the server itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

import corral
from corral.backends.common.host import runtime_dirs_of, runtime_state_root
from corral.embedded import EmbeddedServer
from corral.procfs import stat_fields
from corral.testing.leftovers import find_leftovers
from tests.conftest import SLOW_ENV, restartable_server


def _containers(data_dir: Path, status: str) -> set[str]:
    """Ids of the server's crun containers in ``status``. `crun list` fails when a container's state goes away
    while it reads it (another test's sandbox ending on the shared server, its TTL or a kill): asked again then."""
    command = ["crun", "--root", str(runtime_state_root(data_dir, "crun")), "list", "--format", "json"]
    for _ in range(10):
        listing = subprocess.run(command, capture_output=True, text=True, timeout=60)
        if listing.returncode == 0:
            return {c["id"] for c in json.loads(listing.stdout or "[]") or [] if c["status"] == status}
        time.sleep(0.1)
    raise AssertionError(f"crun list failed ten times: {listing.stderr.strip()}")


def test_out_of_memory_is_reported_and_contained(client: corral.Client, server: EmbeddedServer) -> None:
    with client.create("busybox", memory_mb=32) as sandbox:
        result = sandbox.exec("tail /dev/zero", timeout_s=60)  # tail buffers a line that never ends
        assert result.exit_code == -9
        assert result.oom_killed and not result.timed_out
        assert sandbox.exec("echo still-here").stdout == "still-here\n"
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_fork_bomb_is_contained_by_pid_limit(client: corral.Client) -> None:
    with client.create("busybox", pids_max=64) as sandbox:
        result = sandbox.exec("bomb() { bomb | bomb & }; bomb; sleep 2", timeout_s=3)
        assert result.timed_out or result.exit_code is not None
        deadline = time.monotonic() + 10
        while True:  # the bomb's leftovers die with its process group; the sandbox answers again
            try:
                after = sandbox.exec("echo alive", timeout_s=5).stdout
            except corral.Conflict as exc:  # "cannot start command (process limit reached?)"
                after = exc.message
            if after == "alive\n" or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert after == "alive\n"
        with client.create("busybox") as neighbour:  # the node is fine
            assert neighbour.exec("echo ok").stdout == "ok\n"


def test_init_exit_marks_sandbox_ended(fresh_server: EmbeddedServer) -> None:
    with fresh_server.client() as client:
        sandbox = client.create("busybox")
        runtime_root = runtime_state_root(fresh_server.data_dir, "crun")
        subprocess.run(
            ["crun", "--root", str(runtime_root), "kill", sandbox.id, "KILL"], check=True, capture_output=True
        )
        deadline = time.monotonic() + 10
        while client.get(sandbox.id).info.state == corral.SandboxState.RUNNING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        info = client.get(sandbox.id).info
        assert info.state == corral.SandboxState.ENDED and info.end_reason == "exited"
        try:
            sandbox.exec("true")
            raise AssertionError("exec on an ended sandbox must fail")
        except corral.SandboxGone as exc:
            assert "exited" in exc.message


def test_restart_keeps_running_sandboxes(fresh_server: EmbeddedServer) -> None:
    with fresh_server.client() as client:
        sandbox = client.create("busybox", labels={"keep": "1"}, env={"K": "v"})
        sandbox.files.write("/state.txt", "before restart")
        background = sandbox.start("sleep 600")
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client() as client:
        listed = client.list(labels={"keep": "1"})
        assert [s.id for s in listed] == [sandbox.id]
        assert listed[0].state == corral.SandboxState.RUNNING
        handle = client.connect(sandbox)
        assert handle.files.read_text("/state.txt") == "before restart"
        assert handle.exec("echo $K").stdout == "v\n"
        assert "sleep 600" in handle.exec("ps").stdout  # processes survived too
        status = handle.exec("grep -E 'NoNewPrivs|Seccomp:' /proc/self/status").stdout.split()
        assert status == ["NoNewPrivs:", "1", "Seccomp:", "2"]  # the re-attached agent keeps the profile
        del background


def test_sandbox_gone_during_restart_is_reported_lost(fresh_server: EmbeddedServer) -> None:
    with fresh_server.client() as client:
        doomed = client.create("busybox")
        survivor = client.create("busybox")
    fresh_server.stop(signal.SIGKILL)  # a crash, not a clean stop
    runtime_root = runtime_state_root(fresh_server.data_dir, "crun")
    subprocess.run(["crun", "--root", str(runtime_root), "kill", doomed.id, "KILL"], check=True, capture_output=True)
    time.sleep(0.3)
    fresh_server.start()
    with fresh_server.client() as client:
        lost = client.get(doomed.id).info
        assert lost.state == corral.SandboxState.LOST
        assert "restart" in (lost.status_message or "")
        assert client.get(survivor.id).info.state == corral.SandboxState.RUNNING
        assert client.connect(survivor).exec("echo ok").stdout == "ok\n"
        try:
            client.connect(doomed).exec("true")
            raise AssertionError("a lost sandbox must not accept commands")
        except corral.SandboxGone as exc:
            assert "lost" in exc.message
        state = subprocess.run(
            ["crun", "--root", str(runtime_root), "list", "--format", "json"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert doomed.id not in [c["id"] for c in json.loads(state.stdout or "[]") or []]


def _zombie_children(pid: int) -> list[int]:
    zombies = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields is not None and fields[0] == "Z" and int(fields[1]) == pid:
                zombies.append(int(entry.name))
    return zombies


def test_nothing_left_behind(fresh_server: EmbeddedServer) -> None:
    """No containers, processes, mounts, cgroups, veths, loop devices, sandbox dirs or zombies after sandboxes end:
    an idle one, one with a process of its own session still running, and a paused one (its teardown is one
    ``crun delete --force``)."""
    with fresh_server.client() as client:
        sandboxes = [client.create("busybox") for _ in range(3)]
        sandboxes[1].exec("setsid sleep 600 </dev/null >/dev/null 2>&1 &")
        assert "sleep 600" in sandboxes[1].exec("ps -o args").stdout
        sandboxes[2].exec("sleep 600 </dev/null >/dev/null 2>&1 &")
        sandboxes[2].pause()
        ids = [sandbox.id for sandbox in sandboxes]
        for sandbox_id in ids:
            client.kill(sandbox_id)
    for sandbox_id in ids:
        assert not (fresh_server.data_dir / "sandboxes" / sandbox_id).exists()
        assert not (runtime_dirs_of(fresh_server.data_dir) / sandbox_id).exists()
    assert fresh_server.process is not None
    assert not (left := find_leftovers(fresh_server.data_dir, ids, server_pid=fresh_server.process.pid)), left
    deadline = time.monotonic() + 5
    while _zombie_children(fresh_server.process.pid):  # the edge reaps what it inherits as subreaper
        assert time.monotonic() < deadline, _zombie_children(fresh_server.process.pid)
        time.sleep(0.1)


async def test_kill_during_create_wins(fresh_server: EmbeddedServer) -> None:
    """A sandbox killed while it is still starting never comes up, and nothing of it stays running."""
    import asyncio

    async with corral.AsyncClient(fresh_server.url, fresh_server.api_key) as client:
        creates = [asyncio.create_task(client.create("busybox", memory_mb=64, labels={"race": "1"})) for _ in range(24)]
        killed: set[str] = set()
        while not all(task.done() for task in creates):
            for info in await client.list(state=["creating"], labels={"race": "1"}):
                if info.id not in killed:
                    killed.add(info.id)
                    await client.kill(info.id)
            await asyncio.sleep(0)
        results = await asyncio.gather(*creates, return_exceptions=True)
        assert killed, "no create was caught in flight; the race was not exercised"
        errors = [r for r in results if not isinstance(r, corral.AsyncSandbox)]
        assert all(isinstance(e, corral.SandboxGone) and "while it was starting" in e.message for e in errors), errors
        # Some kills land after their create returned: those sandboxes ended too.
        survivors = {r.id for r in results if isinstance(r, corral.AsyncSandbox)} - killed
        running = {s.id for s in await client.list(labels={"race": "1"})}
        assert running == survivors
        for sandbox_id in killed:
            assert (await client.get(sandbox_id)).info.end_reason == "killed"
    listing = subprocess.run(
        ["crun", "--root", str(runtime_state_root(fresh_server.data_dir, "crun")), "list", "--format", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert {c["id"] for c in json.loads(listing.stdout or "[]") or []} == survivors


def test_admission_refuses_beyond_overcommit_and_frees_on_kill(tmp_path, test_env) -> None:  # type: ignore[no-untyped-def]
    """With CPU overcommit 1 on this node, sandboxes asking for all cores fit only while there is room."""
    cores = os.cpu_count() or 1
    env = {**test_env, "CORRAL_CPU_OVERCOMMIT": "1"}
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        first = client.create("busybox", cpu=cores)
        try:
            client.create("busybox", cpu=cores)
            raise AssertionError("the node admitted more CPU than it has")
        except corral.CapacityExhausted as exc:
            assert "retry later" in exc.message
        assert [s.id for s in client.list()] == [first.id]
        first.kill()
        second = client.create("busybox", cpu=cores)  # the killed sandbox's share was given back
        assert second.exec("true").exit_code == 0


# 1,000 with CORRAL_TEST_SLOW=1, as issue 19 asks; 60 by default: the fault is the same (the kill lands with
# creates in flight, up to per_node = 32 of them), but at 200 the test took 40 s here (creates ~16/s on 2
# shared cores, adoption ~110 ms per sandbox after the restart, the bulk kill ~50 ms each).
CRASH_BATCH = 1_000 if os.environ.get(SLOW_ENV) == "1" else 60
ADOPT_S = 0.25  # a restart adopts one sandbox after the other, ~110 ms each here (crun state, exec of an agent)
CRASH_ENV = {"CORRAL_CPU_OVERCOMMIT": "5000", "CORRAL_MEMORY_OVERCOMMIT": "50"}  # room for them all on 2 cores


def test_server_killed_mid_batch_create_leaves_records_that_match_reality(
    tmp_path: Path, test_env: dict[str, str]
) -> None:
    """SIGKILL while a batch create streams, then restart: no record stays creating; those running run and
    answer; the rest ended with a reason; a bulk kill then leaves nothing behind."""
    labels = {"fault": "mid-batch"}
    ready: list[str] = []
    outcome: list[BaseException] = []
    with restartable_server(tmp_path / "server", {**test_env, **CRASH_ENV}) as server:
        with server.client() as client:

            def consume() -> None:
                try:
                    for handle in client.create_many(CRASH_BATCH, "busybox", cpu=0.1, memory_mb=64, labels=labels):
                        ready.append(handle.id)
                except BaseException as exc:  # the test asserts on it below
                    outcome.append(exc)

            thread = threading.Thread(target=consume)
            thread.start()
            deadline = time.monotonic() + 120
            while len(ready) < CRASH_BATCH // 3 and thread.is_alive():
                assert time.monotonic() < deadline, f"only {len(ready)} of {CRASH_BATCH} ready"
                time.sleep(0.005)
            server.stop(signal.SIGKILL)
            thread.join(timeout=30)
        assert not thread.is_alive(), "the batch's client hung after its server died"
        assert outcome and isinstance(outcome[0], corral.CorralError), outcome  # told, not a silent short batch
        reported = list(ready)
        assert 0 < len(reported) < CRASH_BATCH
        server.start(timeout_s=60 + ADOPT_S * CRASH_BATCH)  # it answers once it has adopted every sandbox
        with server.client() as client:
            records = {info.id: info for info in client.list(state=list(corral.SandboxState), labels=labels)}
            states = Counter(info.state.value for info in records.values())
            assert set(reported) <= records.keys()
            assert states["creating"] == 0, states
            running = {sandbox_id for sandbox_id, info in records.items() if info.state == corral.SandboxState.RUNNING}
            assert set(reported) <= running, "a sandbox handed to the client was lost"
            assert running == _containers(server.data_dir, "running")  # and crun runs exactly those
            for sandbox_id in running:
                assert client.get(sandbox_id).exec(f"echo {sandbox_id}").stdout == f"{sandbox_id}\n"
            for info in records.values():
                if info.id not in running:
                    assert info.state in (corral.SandboxState.ENDED, corral.SandboxState.LOST), info
                    assert info.end_reason and info.status_message, info
            killed = client.bulk(labels, "kill")
            assert sorted(killed.done) == sorted(running) and not killed.failed
            assert client.list(labels=labels) == []
            assert server.process is not None
            left = find_leftovers(server.data_dir, records, server_pid=server.process.pid)
            assert not left, left


# A server holds about one fd per idle sandbox (its agent's socket) and 13 of its own; every runtime process
# of a teardown takes a few more while it runs. 220: room for 100 sandboxes and a bounded teardown (peak ~150
# here), not for 100 at once (it failed 50 of 100 with EMFILE), as 10,000 on a node of 20,000 fds did.
FD_LIMIT, FD_SANDBOXES = 220, 100


def test_a_bulk_kill_bounded_by_open_files_kills_every_sandbox(tmp_path: Path, test_env: dict[str, str]) -> None:
    labels = {"fault": "open-files"}
    launcher = ["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", "--"]  # it execs: the server's pid, its limit
    server = EmbeddedServer(tmp_path / "server", env={**test_env, **CRASH_ENV}, launcher=launcher)
    server.start()
    try:
        assert server.process is not None
        limits = Path(f"/proc/{server.process.pid}/limits").read_text()
        assert f"Max open files            {FD_LIMIT}" in limits, limits
        with server.client() as client:
            created = [handle.id for handle in client.create_many(FD_SANDBOXES, "busybox", cpu=0.1, memory_mb=64,
                                                                   labels=labels)]  # fmt: skip
            killed = client.bulk(labels, "kill")
            assert killed.failed == {} and sorted(killed.done) == sorted(created)
            records = client.list(state=list(corral.SandboxState), labels=labels)
            assert {info.state for info in records} == {corral.SandboxState.ENDED} and len(records) == FD_SANDBOXES
            assert _containers(server.data_dir, "running") == set()
            left = find_leftovers(server.data_dir, created, server_pid=server.process.pid)
            assert not left, left
    finally:
        server.shutdown()


def _crun_pid(data_dir: Path, sandbox_id: str) -> int:
    """The host pid of a container's init: the agent the sandbox was created with."""
    state = subprocess.run(["crun", "--root", str(runtime_state_root(data_dir, "crun")), "state", sandbox_id],
                           capture_output=True, text=True, check=True, timeout=30)  # fmt: skip
    return int(json.loads(state.stdout)["pid"])


def _until(predicate: Callable[[], bool], timeout_s: float, what: str) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"{what} not within {timeout_s:g} s"
        time.sleep(0.02)
    return time.monotonic() - started


def test_agent_killed_from_outside_ends_the_sandbox_and_says_so(client: corral.Client, server: EmbeddedServer) -> None:
    """kill -9 of the sandbox's agent (its init) from the host while a command runs, another streams and a
    background command streams into the edge: every client gets an error at once, and the sandbox is ended
    with a reason that says what happened (with its init gone the kernel ended every process in it, so it
    cannot serve again: ending it is the truth, not a choice)."""
    sandbox = client.create("busybox")
    background = sandbox.start("while true; do echo tick; sleep 0.1; done")
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as exc:  # asserted on below
            errors.append(exc)

    calls: list[Callable[[], object]] = [
        lambda: sandbox.exec("sleep 60", timeout_s=90),
        lambda: list(sandbox.exec_stream("echo streaming; sleep 60", timeout_s=90)),
        lambda: sandbox.command(background.command_id, wait_s=60),
    ]
    waiters = [threading.Thread(target=run, args=(call,)) for call in calls]
    for waiter in waiters:
        waiter.start()
    _until(lambda: "tick" in sandbox.command(background.command_id).result.stdout, 10, "the background output")
    time.sleep(0.2)  # the exec is in flight
    os.kill(_crun_pid(server.data_dir, sandbox.id), signal.SIGKILL)
    started = time.monotonic()
    for waiter in waiters:
        waiter.join(timeout=10)
    answered_s = time.monotonic() - started
    assert not any(waiter.is_alive() for waiter in waiters), "a client hung after the agent died"
    assert answered_s < 5, answered_s
    assert len(errors) == len(calls) and all(isinstance(e, corral.SandboxGone) for e in errors), errors
    assert all("agent" in e.message for e in errors if isinstance(e, corral.SandboxGone)), errors
    info = client.get(sandbox.id).info
    assert info.state == corral.SandboxState.ENDED and info.end_reason == "exited", info
    assert "agent" in (info.status_message or "") and "killed" in (info.status_message or ""), info
    assert sandbox.id not in _containers(server.data_dir, "running") | _containers(server.data_dir, "stopped")
    with pytest.raises(corral.SandboxGone, match="exited"):
        sandbox.exec("true")
