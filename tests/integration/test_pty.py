"""Commands on a pseudo-terminal (``pty=``), through the real HTTP API into real container sandboxes."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Iterator

import pytest

import corral
from corral.api.errors import InvalidRequest
from corral.embedded import EmbeddedServer
from tests.terminal import LocalTerminal


@pytest.fixture(scope="module")
def debian(server: EmbeddedServer) -> Iterator[corral.Sandbox]:
    with server.client() as client, client.create("debian-12", ttl_s=600) as sb:
        yield sb


def _wait_output(sandbox: corral.Sandbox, command_id: str, pattern: str, timeout_s: float = 10) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        stdout = sandbox.command(command_id).result.stdout
        if re.search(pattern, stdout):
            return stdout
        assert time.monotonic() < deadline, f"no {pattern!r} in the terminal's output: {stdout!r}"
        time.sleep(0.05)


def test_a_pty_command_has_a_terminal_of_the_size_asked(debian: corral.Sandbox) -> None:
    command = debian.start(
        "stty size; tty; [ -t 0 ] && [ -t 1 ] && [ -t 2 ] && echo all-ttys; echo $TERM", pty=(30, 100)
    )
    done = debian.command(command.command_id, wait_s=10)
    assert done.result.exit_code == 0
    lines = done.result.stdout.split("\r\n")  # the terminal's line discipline turns \n into \r\n
    assert lines[0] == "30 100"
    assert re.fullmatch(r"/dev/pts/\d+", lines[1])
    assert lines[2:4] == ["all-ttys", "xterm-256color"]
    assert done.result.stderr == ""  # a terminal has one output


def test_keystrokes_are_echoed_and_ctrl_c_interrupts_the_foreground_program(debian: corral.Sandbox) -> None:
    command = debian.start(["/bin/bash", "--norc", "-i"], pty=(24, 80), env={"PS1": "$ "})
    debian.send_stdin(command.command_id, "echo $((6*7))\r")
    _wait_output(
        debian, command.command_id, r"echo \$\(\(6\*7\)\)\r\n.*\r42\r\n"
    )  # the typed line echoed, then the answer
    debian.send_stdin(command.command_id, "sleep 100\r")
    # ^C must find sleep in the foreground, not bash still starting it (bash's child takes the terminal before its
    # exec, so once a process is named sleep it has it); a fixed wait missed under load.
    deadline = time.monotonic() + 10
    while "sleep" not in debian.exec("cat /proc/[0-9]*/comm").stdout.split():
        assert time.monotonic() < deadline, "sleep 100 did not start"
        time.sleep(0.05)
    debian.send_stdin(command.command_id, "\x03")  # the terminal turns ^C into SIGINT for its foreground group
    debian.send_stdin(command.command_id, "echo after:$?\r")
    _wait_output(debian, command.command_id, r"after:130")
    debian.send_stdin(command.command_id, "exit 7\r")
    assert debian.command(command.command_id, wait_s=10).result.exit_code == 7


def test_resize_sends_sigwinch_with_the_new_size(debian: corral.Sandbox) -> None:
    script = "trap 'echo size:$(stty size)' WINCH; echo ready; while :; do sleep 0.1; done"
    command = debian.start(["/bin/bash", "-c", script], pty=(24, 80))
    _wait_output(debian, command.command_id, "ready")
    debian.resize(command.command_id, 40, 132)
    _wait_output(debian, command.command_id, r"size:40 132")
    debian.signal(command.command_id, 9)


def test_the_terminal_belongs_to_the_commands_user(debian: corral.Sandbox) -> None:
    command = debian.start("stat -c %U:%a $(tty)", user="nobody", pty=(24, 80))
    result = debian.command(command.command_id, wait_s=10).result
    assert result.stdout.strip() == "nobody:620"


async def test_an_interactive_session_over_exec_stream(aclient: corral.AsyncClient) -> None:
    async with await aclient.create("busybox", ttl_s=300) as sandbox:
        output = ""
        async for event in sandbox.exec_stream("/bin/sh", pty=(24, 80), env={"PS1": "# "}):
            if event.type == "started":
                assert event.command_id is not None
                await sandbox.send_stdin(event.command_id, "echo $((6*7)); exit 3\r")
            elif event.type == "stdout":
                output += event.data or ""
            elif event.type == "exit":
                assert event.result is not None and event.result.exit_code == 3
        assert "\r\n42\r\n" in output


def test_resize_refuses_a_command_without_a_pty(sandbox: corral.Sandbox) -> None:
    command = sandbox.start("sleep 30")
    with pytest.raises(InvalidRequest, match="not started with a pty"):
        sandbox.resize(command.command_id, 30, 100)
    sandbox.signal(command.command_id, 9)


def test_corral_shell_is_an_interactive_terminal_in_the_sandbox(server: EmbeddedServer, debian: corral.Sandbox) -> None:
    terminal = LocalTerminal(
        [sys.executable, "-m", "corral.cli.main", "shell", debian.id], server.env(), rows=33, cols=111
    )
    try:
        terminal.expect(r"root@\S*:\S*# ")  # bash's login prompt, from the sandbox's terminal
        terminal.type("stty size; echo $((6*7))\r")
        terminal.expect(r"33 111\r\n42\r\n")
        terminal.resize(50, 150)  # SIGWINCH to `corral shell`, which resizes the sandbox's terminal
        time.sleep(0.5)
        terminal.type("stty size\r")
        terminal.expect(r"50 150\r\n")
        terminal.type("sleep 100\r")
        time.sleep(0.3)
        terminal.type("\x03")  # raw mode here: ^C is a byte for the sandbox's terminal, not a SIGINT for corral
        terminal.type("echo after:$?; exit 4\r")
        terminal.expect(r"after:130")
    finally:
        code = terminal.close()
    assert code == 4
