"""Commands in real container sandboxes through the real HTTP API."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import corral
from tests.conftest import restartable_server


def test_exit_code_stdout_stderr(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec("echo out; echo err >&2; exit 3")
    assert (result.exit_code, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert not result.timed_out and not result.stdout_truncated


def test_argv_form_is_not_run_through_a_shell(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec(["echo", "$HOME", "a;b"])
    assert result.stdout == "$HOME a;b\n"


def test_missing_binary_is_exit_127(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec(["/no/such/binary"])
    assert result.exit_code == 127
    assert "cannot run" in result.stderr


def test_env_cwd_user_per_command(sandbox: corral.Sandbox) -> None:
    sandbox.exec("mkdir -p /work/sub")
    result = sandbox.exec(
        "echo $GREETING; pwd; id -u; echo $HOME", env={"GREETING": "hi"}, cwd="/work/sub", user="user"
    )
    assert result.stdout.split() == ["hi", "/work/sub", "1000", "/home/user"]
    assert sandbox.exec("id -u", user="1234:1234").stdout.strip() == "1234"


def test_sandbox_defaults_apply_to_every_command(client: corral.Client) -> None:
    with client.create("busybox", env={"MODE": "train"}, cwd="/tmp", user="user") as sb:
        result = sb.exec("echo $MODE; pwd; id -un")
        assert result.stdout.split() == ["train", "/tmp", "user"]


def test_bad_cwd_is_reported(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec("true", cwd="/does/not/exist")
    assert result.exit_code == 126
    assert "cannot change directory" in result.stderr


def test_stdin(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec("tr a-z A-Z", stdin="hello\n" * 10000)
    assert result.stdout == "HELLO\n" * 10000


def test_timeout_kills_the_command(sandbox: corral.Sandbox) -> None:
    start = time.monotonic()
    result = sandbox.exec("sleep 30; echo never", timeout_s=0.5)
    assert result.timed_out
    assert result.exit_code == -9
    assert "never" not in result.stdout
    assert time.monotonic() - start < 5
    assert "sleep 30" not in sandbox.exec("ps").stdout


def test_output_cap_truncates_and_flags(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec("yes | head -c 100000; yes e | head -c 50 >&2", output_cap_bytes=1000)
    assert len(result.stdout) == 1000 and result.stdout_truncated
    assert len(result.stderr) == 50 and not result.stderr_truncated


def test_unbounded_output_is_capped_and_timed_out(sandbox: corral.Sandbox) -> None:
    result = sandbox.exec("yes", output_cap_bytes=4096, timeout_s=1)
    assert result.timed_out and result.stdout_truncated and len(result.stdout) == 4096


def test_streaming_events_in_order(sandbox: corral.Sandbox) -> None:
    events = list(sandbox.exec_stream("echo first; sleep 0.5; echo second"))
    assert events[0].type == "started"
    assert events[-1].type == "exit" and events[-1].result is not None and events[-1].result.exit_code == 0
    assert "".join(e.data or "" for e in events if e.type == "stdout") == "first\nsecond\n"


def test_leaving_a_stream_kills_its_command_and_logs_why(sandbox: corral.Sandbox) -> None:
    """What the SDK promises ("leaving the stream kills it"), with a step id and without: the command's processes
    end, and its log entry says the client went away."""
    for step_id in ("left", None):
        marker = f"tick-{step_id or 'auto'}"
        stream = sandbox.exec_stream(f"while true; do echo {marker}; sleep 0.1; done", step_id=step_id, timeout_s=120)
        assert any(event.type == "stdout" for event in stream)  # stops at the first line
        stream.close()  # the HTTP response closes with it
        deadline = time.monotonic() + 10
        while marker in sandbox.exec("ps -o args").stdout:
            assert time.monotonic() < deadline, f"{marker}: the command outlived its stream"
            time.sleep(0.1)
    left = [step for step in sandbox.trajectory() if step.kind == "exec_stream"]
    assert [step.step_id == "left" for step in left] == [True, False]
    assert all(step.result is not None and step.result["error"]["code"] == "conflict"
               and "went away" in step.result["error"]["message"] for step in left), left  # fmt: skip


async def test_streaming_is_incremental(aclient: corral.AsyncClient) -> None:
    sandbox = await aclient.create("busybox")
    try:
        seen: list[tuple[str, float]] = []
        start = time.monotonic()
        async for event in sandbox.exec_stream("echo first; sleep 1; echo second"):
            if event.type == "stdout":
                seen.append((event.data or "", time.monotonic() - start))
        assert seen[0][0] == "first\n"
        assert seen[-1][1] - seen[0][1] > 0.5  # the first line arrived before the command ended
    finally:
        await sandbox.kill()


def test_background_command_with_stdin_and_wait(sandbox: corral.Sandbox) -> None:
    command = sandbox.start("read line; echo got:$line; sleep 0.2; echo done")
    assert command.running
    sandbox.send_stdin(command.command_id, "ping\n")
    finished = sandbox.command(command.command_id, wait_s=10)
    assert not finished.running
    assert finished.result.exit_code == 0
    assert finished.result.stdout == "got:ping\ndone\n"


def test_a_started_command_runs_when_start_answers(sandbox: corral.Sandbox) -> None:
    """The agent answers a start once the command has exec'd, not at its fork: here the child takes its time
    before the exec (its user is the last of 400,000 lines of /etc/passwd), and ps still shows the command, not
    a second copy of the agent."""
    sandbox.exec(
        'awk \'BEGIN { for (i = 0; i < 400000; i++) printf "u%d:x:%d:%d::/:/bin/false\\n", i, i + 10000, '
        "i + 10000 }' >> /etc/passwd && echo 'late:x:4242:4242::/tmp:/bin/sh' >> /etc/passwd"
    )
    for _ in range(3):
        command = sandbox.start("sleep 30", user="late")
        listing = sandbox.exec("ps -o args").stdout
        assert listing.count("sleep 30") == 1, listing
        sandbox.signal(command.command_id, 9)
        sandbox.command(command.command_id, wait_s=10)


def test_background_command_keeps_running_between_requests(sandbox: corral.Sandbox) -> None:
    command = sandbox.start("sleep 30")
    # `start` answers once the command runs (the agent waits for its exec), never before: ps shows it at once.
    assert sandbox.exec("ps").stdout.count("sleep 30") == 1
    assert sandbox.exec("ps").stdout.count("sleep 30") == 1  # and still there on the next request
    sandbox.signal(command.command_id, 15)
    finished = sandbox.command(command.command_id, wait_s=10)
    assert finished.result.exit_code == -15


def test_unknown_command_id(sandbox: corral.Sandbox) -> None:
    with pytest.raises(corral.NotFound):
        sandbox.command("c999")


async def test_many_commands_at_once(aclient: corral.AsyncClient) -> None:
    sandbox = await aclient.create("busybox")
    try:
        start = time.monotonic()
        results = await asyncio.gather(*(sandbox.exec(f"sleep 0.5; echo {i}") for i in range(20)))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(20)]
        assert time.monotonic() - start < 5  # they ran in parallel, not one after another
    finally:
        await sandbox.kill()


def test_background_output_is_bounded_per_sandbox(tmp_path: Path, test_env: dict[str, str]) -> None:
    """A sandbox's background commands cannot make the edge hold more output than its buffer: finished
    commands are forgotten first, then output past the buffer is dropped and flagged (issue 19)."""
    env = {**test_env, "CORRAL_SANDBOX_OUTPUT_BUFFER_MB": "1"}
    with restartable_server(tmp_path / "server", env) as server, server.client() as client:
        with client.create("busybox", memory_mb=64) as sandbox:
            first = sandbox.start("head -c 700000 /dev/zero")
            assert len(sandbox.command(first.command_id, wait_s=30).result.stdout) == 700_000
            second = sandbox.start("head -c 700000 /dev/zero")
            done = sandbox.command(second.command_id, wait_s=30).result
            assert (len(done.stdout), done.stdout_truncated) == (700_000, False)  # room made by forgetting the first
            with pytest.raises(corral.NotFound):
                sandbox.command(first.command_id)
            third = sandbox.start("head -c 3000000 /dev/zero", output_cap_bytes=4 << 20)
            cut = sandbox.command(third.command_id, wait_s=30).result
            assert (cut.exit_code, len(cut.stdout), cut.stdout_truncated) == (0, 1 << 20, True)


def test_commands_leave_the_agents_memory_as_it_was(sandbox: corral.Sandbox) -> None:
    """A command's child runs in the agent's memory until its exec (agent.c, child_stack): whatever it does there,
    failing included (an unknown user, a missing directory or binary), leaves the agent's heap as it was."""
    kinds = [
        lambda: sandbox.exec("true"),
        lambda: sandbox.exec(["/no/such/binary"]),
        lambda: sandbox.exec("true", user="nosuchuser"),
        lambda: sandbox.exec("true", cwd="/does/not/exist"),
        lambda: sandbox.exec("id -u", user="user", env={"A": "x" * 2000}),
    ]

    def agent_data_kib() -> int:
        status = sandbox.exec("cat /proc/1/status").stdout
        assert "Name:\tagent" in status  # the agent is the sandbox's init
        return int(next(line for line in status.splitlines() if line.startswith("VmData:")).split()[1])

    for run in kinds * 4:
        run()
    before = agent_data_kib()
    results = [run() for run in kinds * 60]
    assert [r.exit_code for r in results[:5]] == [0, 127, 126, 126, 0]
    assert agent_data_kib() == before
