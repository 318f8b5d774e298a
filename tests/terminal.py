"""A real local pseudo-terminal for tests of interactive commands (`corral shell`, Inspect's connection) and of
what the CLI draws only in a terminal (progress bars)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

from tests.conftest import REPO

__all__ = ["LocalTerminal", "run_in_terminal"]

_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class LocalTerminal:
    """A command on a real local pseudo-terminal: its controlling terminal, as a user's would be."""

    def __init__(self, argv: list[str], env: dict[str, str], *, rows: int, cols: int, cwd: Path = REPO) -> None:
        self.master, slave = os.openpty()
        self.resize(rows, cols, slave)
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=cwd,
            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )  # fmt: skip
        os.close(slave)
        self.output = b""

    def resize(self, rows: int, cols: int, fd: int | None = None) -> None:
        fcntl.ioctl(self.master if fd is None else fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def _read(self, timeout_s: float) -> bool:
        """Add what the terminal shows within ``timeout_s``; False once its last writer closed it."""
        if not select.select([self.master], [], [], max(0.0, timeout_s))[0]:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the process closed the terminal
            return False
        self.output += chunk
        return bool(chunk)

    def expect(self, pattern: str, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern.encode(), self.output):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} on the terminal: {self.output[-2000:]!r}"
            if not self._read(left):
                raise AssertionError(f"the terminal closed without {pattern!r}: {self.output[-2000:]!r}")

    def read_until_closed(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._read(min(0.5, deadline - time.monotonic())):
            pass

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            os.close(self.master)


def run_in_terminal(
    command: list[str], env: dict[str, str], cwd: Path, timeout_s: float, columns: int = 160
) -> tuple[int, str]:
    """The command's exit code and everything it wrote, colours and cursor moves taken out (frames of a bar
    stay, one after another). ``TERM`` is set to a colour terminal."""
    terminal = LocalTerminal(command, {**env, "TERM": "xterm-256color"}, rows=40, cols=columns, cwd=cwd)
    try:
        terminal.read_until_closed(timeout_s)
    finally:
        code = terminal.close()
    return code, _ESCAPES.sub("", terminal.output.decode(errors="replace"))
