"""The unmodified e2b SDK (sync) drives Corral sandboxes: lifecycle, commands, files, refusals.

Everything goes through the real client against the real server with real
sandboxes; the same sandboxes are visible through Corral's own API.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
import os
import re
import subprocess
import sys
import time

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

import corral
from corral.embedded import EmbeddedServer
from tests.e2b.sdk import SandboxGoneError


@pytest.fixture
def sbx(e2b_sandboxes: list) -> Sandbox:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", timeout=300)
    e2b_sandboxes.append(sandbox)
    return sandbox


def test_create_with_metadata_env_and_timeout(e2b_sandboxes: list, client: corral.Client) -> None:  # type: ignore[type-arg]
    sandbox = Sandbox.create("base", metadata={"job": "e2b-sync", "episode": "1"}, envs={"GREETING": "hi"}, timeout=120)
    e2b_sandboxes.append(sandbox)
    info = sandbox.get_info()
    assert info.template_id == "base" and info.metadata == {"job": "e2b-sync", "episode": "1"}
    assert info.state == SandboxState.RUNNING and info.memory_mb == 512
    assert 110 <= (info.end_at - info.started_at).total_seconds() <= 121
    assert sandbox.commands.run("echo $GREETING").stdout == "hi\n"
    same = client.get(sandbox.sandbox_id).info  # the same sandbox through Corral's own API
    assert same.image == "e2b-base:latest" and same.labels["job"] == "e2b-sync" and same.user == "user"
    sandbox.set_timeout(600)
    assert (sandbox.get_info().end_at - info.started_at).total_seconds() > 590
    assert sandbox.is_running()


def test_base_template_is_what_e2b_users_assume(sbx: Sandbox) -> None:
    result = sbx.commands.run("whoami; echo $HOME; pwd; python3 -c 'print(6*7)'; bash -c 'echo $BASH_VERSION'")
    user, home, cwd, answer, bash_version = result.stdout.splitlines()
    assert (user, home, cwd, answer) == ("user", "/home/user", "/home/user", "42")
    assert bash_version.startswith("5.")
    assert sbx.commands.run("sudo -n true", user="root").exit_code == 0
    assert "user ALL=(ALL:ALL) NOPASSWD: ALL" in sbx.files.read("/etc/sudoers.d/user", user="root")
    assert sbx.commands.run("sudo -n id -u").stdout == "0\n"  # as on E2B (test_e2b_sudo.py: the boundary)


def test_list_filters_and_pages(e2b_sandboxes: list) -> None:  # type: ignore[type-arg]
    tag = f"list-{time.monotonic_ns()}"
    for episode in range(3):
        e2b_sandboxes.append(Sandbox.create("base", metadata={"run": tag, "episode": str(episode)}))
    e2b_sandboxes[0].pause()
    query = SandboxQuery(metadata={"run": tag})
    everything = Sandbox.list(query=query).next_items()
    assert [s.metadata["episode"] for s in everything] == ["2", "1", "0"]  # no order given: newest first
    since = e2b_sandboxes[1].get_info().started_at.astimezone(dt.timezone(dt.timedelta(hours=2)))  # an offset
    later = Sandbox.list(query=SandboxQuery(metadata={"run": tag}, started_after=since)).next_items()
    assert [s.metadata["episode"] for s in later] == ["2", "1"]  # startedAt >= startedAfter
    paused = Sandbox.list(query=SandboxQuery(metadata={"run": tag}, state=[SandboxState.PAUSED])).next_items()
    assert [s.sandbox_id for s in paused] == [e2b_sandboxes[0].sandbox_id]
    running = Sandbox.list(query=SandboxQuery(metadata={"run": tag, "episode": "2"}, state=[SandboxState.RUNNING]))
    assert [s.sandbox_id for s in running.next_items()] == [e2b_sandboxes[2].sandbox_id]
    pager = Sandbox.list(query=query, limit=2)
    first, second = pager.next_items(), pager.next_items()
    assert len(first) == 2 and len(second) == 1 and not pager.has_next
    assert {s.sandbox_id for s in first + second} == {s.sandbox_id for s in e2b_sandboxes}


def test_pause_then_connect_resumes_with_state(sbx: Sandbox, client: corral.Client) -> None:
    sbx.files.write("/home/user/state.txt", "kept")
    background = sbx.commands.run("sleep 600", background=True)
    assert sbx.pause() is True
    assert client.get(sbx.sandbox_id).info.state == corral.SandboxState.PAUSED
    assert not sbx.is_running()  # envd's /health: 502 while paused, and asking does not resume it
    assert client.get(sbx.sandbox_id).info.state == corral.SandboxState.PAUSED
    assert sbx.get_info().state == SandboxState.PAUSED
    assert sbx.pause() is False  # 409: already paused
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.get_info().state == SandboxState.RUNNING
    assert again.files.read("/home/user/state.txt") == "kept"
    assert background.pid in [p.pid for p in again.commands.list()]


def test_killing_the_sandbox_ends_its_commands(e2b_env: dict[str, str]) -> None:
    sandbox = Sandbox.create("base")
    handle = sandbox.commands.run("sleep 600", background=True)
    assert sandbox.kill() is True
    with pytest.raises(SandboxGoneError, match="killed|was not found"):
        handle.wait()
    with pytest.raises(SandboxGoneError):
        sandbox.commands.run("true")


def test_kill_and_unknown_sandboxes(e2b_env: dict[str, str], client: corral.Client) -> None:
    sandbox = Sandbox.create("base")
    assert sandbox.kill() is True
    assert client.get(sandbox.sandbox_id).info.state == corral.SandboxState.ENDED
    assert Sandbox.kill(sandbox.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.connect(sandbox.sandbox_id)
    with pytest.raises(NotFoundException):
        Sandbox.get_info("sb-e0-0000000000000000")
    assert not sandbox.is_running()


def test_commands_stream_and_report_exit(sbx: Sandbox) -> None:
    stdout: list[str] = []
    stderr: list[str] = []
    result = sbx.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.1; done",
        on_stdout=stdout.append,
        on_stderr=stderr.append,
    )
    assert result.exit_code == 0 and result.stdout == "out1\nout2\nout3\n" and result.stderr == "err1\nerr2\nerr3\n"
    assert "".join(stdout) == result.stdout and len(stdout) >= 2  # delivered as produced, not at the end
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo oops >&2; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stderr == "oops\n"


def test_commands_env_cwd_user(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/work")
    result = sbx.commands.run("echo $A-$B; pwd; whoami", envs={"A": "1", "B": "two"}, cwd="/home/user/work")
    assert result.stdout == "1-two\n/home/user/work\nuser\n"
    assert sbx.commands.run("whoami; echo $HOME", user="root").stdout == "root\n/root\n"
    assert sbx.commands.run("pwd", cwd="work").stdout == "/home/user/work\n"


def test_command_timeout_ends_the_stream_with_a_timeout_error(sbx: Sandbox) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1.5)
    assert time.monotonic() - started < 10
    time.sleep(0.5)
    running = sbx.commands.run("cat /proc/[0-9]*/cmdline | tr '\\0' ' '").stdout
    assert "sleep 30" not in running  # killed at the deadline, as envd does


def test_background_wait_kill_list_connect(sbx: Sandbox) -> None:
    handle = sbx.commands.run("sleep 0.3; echo done", background=True)
    assert handle.wait().stdout == "done\n"
    sleeper = sbx.commands.run("echo started; sleep 600", background=True)
    listed = {p.pid: p for p in sbx.commands.list()}
    assert sleeper.pid in listed and listed[sleeper.pid].cmd == "/bin/bash"
    assert listed[sleeper.pid].args[-1] == "echo started; sleep 600"
    sleeper.disconnect()
    reattached = sbx.commands.connect(sleeper.pid)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException) as killed:
        reattached.wait()
    assert killed.value.exit_code == -1
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is False


def test_stdin_send_and_close(sbx: Sandbox) -> None:
    handle = sbx.commands.run("tr a-z A-Z", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "hello ")
    sbx.commands.send_stdin(handle.pid, b"world\n")
    sbx.commands.close_stdin(handle.pid)
    assert handle.wait().stdout == "HELLO WORLD\n"
    streamed = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.stream_input(streamed.pid, (f"line {i}\n" for i in range(3)))
    sbx.commands.close_stdin(streamed.pid)
    assert streamed.wait().stdout == "line 0\nline 1\nline 2\n"
    assert sbx.commands.run("cat").stdout == ""  # stdin=False: empty, never hangs


def test_commands_go_to_the_trajectory_log(sbx: Sandbox, client: corral.Client) -> None:
    """Through the operations layer, as Corral's own API: commands, what is sent to them, and the sandbox's life."""
    sbx.commands.run("echo logged-step")
    handle = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(handle.pid, "to-cat\n")
    sbx.commands.kill(handle.pid)
    sbx.set_timeout(900)
    steps = client.get(sbx.sandbox_id).trajectory()
    assert any(s.kind == "exec_stream" and "echo logged-step" in str(s.request) for s in steps)
    sent = [s for s in steps if s.kind == "stdin"]
    assert [base64.b64decode(s.request["data_b64"]) for s in sent] == [b"to-cat\n"]
    assert [s.request["signal"] for s in steps if s.kind == "signal"] == [9]
    # By kind, not position: the background command's own step is written when its stream ends, which may
    # come after the TTL's (seen once in a full run).
    assert [s.request for s in steps if s.kind == "set_ttl"] == [{"ttl_s": 900}]


def test_files_read_write_list_stat(sbx: Sandbox) -> None:
    info = sbx.files.write("notes/a.txt", "line 1\n")  # relative: the user's home
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("/home/user/notes/a.txt") == "line 1\n"
    assert sbx.files.read("notes/a.txt", format="bytes") == b"line 1\n"
    assert b"".join(sbx.files.read("notes/a.txt", format="stream")) == b"line 1\n"
    payload = bytes(range(256)) * 1000
    sbx.files.write("/home/user/blob.bin", io.BytesIO(payload))  # file-like: octet-stream upload
    sbx.files.write("/home/user/blob.gz.bin", payload, gzip=True)  # gzip-compressed octet-stream
    assert sbx.files.read("/home/user/blob.bin", format="bytes") == payload
    assert sbx.files.read("/home/user/blob.gz.bin", format="bytes", gzip=True) == payload
    sbx.files.write_files([{"path": "/home/user/m/1.txt", "data": "one"}, {"path": "/home/user/m/2.txt", "data": "2"}])
    assert sorted(e.name for e in sbx.files.list("/home/user/m")) == ["1.txt", "2.txt"]
    assert sbx.commands.run("stat -c %U /home/user/m/1.txt").stdout == "user\n"
    entry = sbx.files.get_info("/home/user/blob.bin")
    assert entry.type.value == "file" and entry.size == len(payload) and entry.owner == "user"
    assert entry.permissions == "-rw-r--r--"
    deep = sbx.files.list("/home/user", depth=2)
    assert "/home/user/notes/a.txt" in [e.path for e in deep]
    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/missing.txt")


def test_files_exists_make_dir_rename_remove(sbx: Sandbox) -> None:
    assert sbx.files.make_dir("/home/user/d/e") is True
    assert sbx.files.make_dir("/home/user/d/e") is False
    assert sbx.files.exists("/home/user/d/e") and not sbx.files.exists("/home/user/nope")
    sbx.files.write("/home/user/d/e/f.txt", "x")
    moved = sbx.files.rename("/home/user/d/e/f.txt", "/home/user/d/g.txt")
    assert moved.path == "/home/user/d/g.txt" and sbx.files.read("/home/user/d/g.txt") == "x"
    assert not sbx.files.exists("/home/user/d/e/f.txt")
    sbx.files.remove("/home/user/d")
    assert not sbx.files.exists("/home/user/d")
    sbx.files.remove("/home/user/d")  # already gone: succeeds, as envd's RemoveAll does
    with pytest.raises(SandboxException):
        sbx.files.make_dir("/etc/forbidden")  # the user cannot write there, as in E2B


def test_watch_dir_reports_changes(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/new.txt", "1")
        time.sleep(0.3)
        events = handle.get_new_events()
        sbx.files.remove("/home/user/watched/new.txt")
        time.sleep(0.3)
        events += handle.get_new_events()
    finally:
        handle.stop()
    seen = [(e.name, e.type) for e in events]
    assert ("new.txt", FilesystemEventType.CREATE) in seen and ("new.txt", FilesystemEventType.REMOVE) in seen


def test_metrics(sbx: Sandbox) -> None:
    (idle,) = sbx.get_metrics()
    spinner = sbx.commands.run("while :; do :; done", background=True)
    try:  # a sample is 0.2 s of the sandbox's CPU: on a host busy with the test run the spinner may get little of
        samples = [sbx.get_metrics()[0]]  # one (15% of a core, once), so a few are taken until one shows it
        while samples[-1].cpu_used_pct <= 20 and len(samples) < 10:
            samples.append(sbx.get_metrics()[0])
    finally:
        spinner.kill()
    sample = max(samples, key=lambda each: each.cpu_used_pct)
    assert sample.cpu_count == 1 and sample.cpu_used_pct > 20, samples
    assert idle.cpu_used_pct < sample.cpu_used_pct
    assert sample.mem_total == 512 << 20 and 0 < sample.mem_used < sample.mem_total
    used_kb, total_kb = map(int, sbx.commands.run("df -kP / | awk 'NR == 2 {print $3, $2}'").stdout.split())
    assert abs(sample.disk_used - used_kb * 1024) < 64 << 20 and sample.disk_total == total_kb * 1024  # in bytes,
    assert total_kb * 1024 > 2**31  # not clamped to 2^31 - 1 (the host disk here is far bigger)
    before = sbx.get_info().started_at - dt.timedelta(hours=1)
    assert sbx.get_metrics(start=before, end=before + dt.timedelta(minutes=1)) == []  # a window long past
    (in_window,) = sbx.get_metrics(start=before, end=dt.datetime.now(dt.UTC))
    assert in_window.mem_total == 512 << 20


def test_unsupported_options_are_refused(sbx: Sandbox) -> None:
    with pytest.raises(SandboxException, match="404: template 'no-such-image' not found"):
        Sandbox.create("no-such-image")
    with pytest.raises(SandboxException, match="out of range"):
        sbx.pty.create(PtySize(rows=5000, cols=80))
    assert sbx.get_info().state == SandboxState.RUNNING  # nothing was half-done


def test_wrong_keys_are_refused(sbx: Sandbox, e2b_env: dict[str, str]) -> None:
    with pytest.raises(AuthenticationException, match="wrong API key"):
        Sandbox.list(api_key="e2b_" + "0" * 40).next_items()
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983", "Content-Type": "application/json"}
    url = f"{e2b_env['E2B_SANDBOX_URL']}/process.Process/List"
    wrong = httpx.post(url, headers={**headers, "X-Access-Token": "ea_" + "0" * 40}, content=b"{}")
    assert wrong.status_code == 401 and "X-Access-Token" in wrong.json()["message"]
    right = httpx.post(url, headers={**headers, "X-Access-Token": sbx._envd_access_token}, content=b"{}")
    assert right.status_code == 200 and "processes" in right.json()
    other_port = httpx.get(f"{e2b_env['E2B_SANDBOX_URL']}/health", headers={**headers, "E2b-Sandbox-Port": "8080"})
    assert other_port.status_code == 502 and "port 8080 is not open" in other_port.json()["message"]


def test_e2b_env_prints_what_points_the_sdk_here(server: EmbeddedServer, e2b_env: dict[str, str]) -> None:
    env = {**os.environ, "CORRAL_URL": server.url, "CORRAL_API_KEY": server.api_key}
    done = subprocess.run([sys.executable, "-m", "corral.cli.main", "e2b-env"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    printed = dict(part.split("=", 1) for part in done.stdout.split()[1:])
    assert printed == e2b_env
    assert re.fullmatch(r"e2b_[0-9a-f]{40}", printed["E2B_API_KEY"])  # what e2b 2.2x-2.4x check client-side
