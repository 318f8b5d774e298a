"""Bad behaviour inside sandboxes and faults of the server itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import httpx

import corral
from corral.embedded import EmbeddedServer


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
        runtime_root = fresh_server.data_dir / "run" / "crun"
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
    runtime_root = fresh_server.data_dir / "run" / "crun"
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
            try:
                stat = open(f"{entry.path}/stat").read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z" and int(fields[1]) == pid:
                zombies.append(int(entry.name))
    return zombies


def test_nothing_left_behind(fresh_server: EmbeddedServer) -> None:
    """No mounts, cgroups, sandbox dirs or zombie processes after sandboxes end."""
    with fresh_server.client() as client:
        ids = [client.create("busybox").id for _ in range(3)]
        for sandbox_id in ids:
            client.kill(sandbox_id)
    for sandbox_id in ids:
        assert not (fresh_server.data_dir / "sandboxes" / sandbox_id).exists()
        for controller in ("memory", "pids", "cpu"):
            assert not os.path.exists(f"/sys/fs/cgroup/{controller}/corral/{sandbox_id}")
    mounts = open("/proc/mounts").read()
    assert str(fresh_server.data_dir) not in mounts  # overlays live only in the containers' namespaces
    assert fresh_server.process is not None
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
        ["crun", "--root", str(fresh_server.data_dir / "run" / "crun"), "list", "--format", "json"],
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
