"""`corral shell`: this terminal relayed to a command on a pseudo-terminal in a sandbox (like `docker exec -it`).

The command runs through ``exec/stream`` with ``pty`` (so it ends when this
process goes away); keystrokes go to ``commands/{id}/stdin`` in order, and a
SIGWINCH here becomes ``commands/{id}/resize``. The local terminal is put in
raw mode, so ^C, ^D and arrow keys reach the sandbox's terminal, which
interprets them; it is restored however the session ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import AsyncGenerator, Iterator
from typing import BinaryIO, cast

from corral.sdk import AsyncSandbox, ExecEvent

__all__ = ["DEFAULT_SHELL", "run_shell"]

DEFAULT_SHELL = ["/bin/sh", "-c", "if command -v bash >/dev/null; then exec bash -l; else exec sh -l; fi"]
_SESSION_TIMEOUT_S = 86400.0  # the longest command Corral runs
_EOT = b"\x04"  # what a terminal's ^D sends: the end of input when the local side is not a terminal
_READ_BYTES = 65536


def _size(fd: int) -> tuple[int, int]:
    try:
        columns, lines = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return max(1, min(lines, 1000)), max(1, min(columns, 1000))


@contextlib.contextmanager
def _raw(fd: int) -> Iterator[None]:
    """Raw mode while the session runs (when ``fd`` is a terminal), restored on every way out."""
    if not os.isatty(fd):
        yield
        return
    saved = termios.tcgetattr(fd)
    tty.setraw(fd)
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def run_shell(
    sandbox: AsyncSandbox,
    cmd: list[str],
    *,
    user: str | None = None,
    cwd: str | None = None,
    stdin_fd: int = 0,
    stdout: BinaryIO | None = None,
) -> int:
    """Relay until the command ends; its exit code (128 + signal for one killed by a signal)."""
    out = stdout or sys.stdout.buffer
    loop = asyncio.get_running_loop()
    typed: asyncio.Queue[bytes] = asyncio.Queue()
    command_id: asyncio.Future[str] = loop.create_future()
    is_terminal = os.isatty(stdin_fd)

    def on_input() -> None:
        data = os.read(stdin_fd, _READ_BYTES)
        if not data:  # the local input ended: end the remote one too
            loop.remove_reader(stdin_fd)
            data = b"" if is_terminal else _EOT
        if data:
            typed.put_nowait(data)

    async def forward_input() -> None:
        cid = await command_id
        while True:
            data = await typed.get()
            while not typed.empty():  # whatever else arrived meanwhile goes in the same request
                data += typed.get_nowait()
            await sandbox.send_stdin(cid, data)

    async def forward_resize() -> None:
        await sandbox.resize(await command_id, *_size(out.fileno()))

    resizes: set[asyncio.Task[None]] = set()

    def on_winch() -> None:
        if command_id.done():
            task = loop.create_task(forward_resize())
            resizes.add(task)
            task.add_done_callback(resizes.discard)

    env = {"TERM": os.environ.get("TERM") or "xterm-256color"}
    forwarder = loop.create_task(forward_input())
    loop.add_reader(stdin_fd, on_input)
    loop.add_signal_handler(signal.SIGWINCH, on_winch)
    exit_code = 1
    try:
        stream = cast(  # an async generator: closing it ends the request, which ends the command
            AsyncGenerator[ExecEvent, None],
            sandbox.exec_stream(
                cmd, env=env, user=user, cwd=cwd, timeout_s=_SESSION_TIMEOUT_S, pty=_size(out.fileno())
            ),
        )
        with _raw(stdin_fd):
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    if event.type == "started" and event.command_id and not command_id.done():
                        command_id.set_result(event.command_id)
                    elif event.type == "stdout" and event.data:
                        out.write(event.data.encode())
                        out.flush()
                    elif event.type == "exit" and event.result is not None:
                        code = event.result.exit_code
                        exit_code = code if code is not None and code >= 0 else 128 - (code or 0)
                    if forwarder.done():
                        forwarder.result()  # a failed keystroke request ends the session with its error
    finally:
        loop.remove_signal_handler(signal.SIGWINCH)
        loop.remove_reader(stdin_fd)
        forwarder.cancel()
        for task in (forwarder, *resizes):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    return exit_code
