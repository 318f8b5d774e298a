"""A real local pseudo-terminal for tests of interactive commands (`corral shell`, Inspect's connection)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import select
import struct
import subprocess
import termios
import time

from tests.conftest import REPO

__all__ = ["LocalTerminal"]


class LocalTerminal:
    """A command (`corral shell`) on a real local pseudo-terminal: its controlling terminal, as a user's would be."""

    def __init__(self, argv: list[str], env: dict[str, str], *, rows: int, cols: int) -> None:
        self.master, slave = os.openpty()
        self.resize(rows, cols, slave)
        self.proc = subprocess.Popen(
            argv, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO,
            start_new_session=True, preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        )  # fmt: skip
        os.close(slave)
        self.output = b""

    def resize(self, rows: int, cols: int, fd: int | None = None) -> None:
        fcntl.ioctl(self.master if fd is None else fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: str, timeout_s: float = 20) -> None:
        deadline = time.monotonic() + timeout_s
        while not re.search(pattern.encode(), self.output):
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} on the terminal: {self.output[-2000:]!r}"
            if select.select([self.master], [], [], left)[0]:
                with contextlib.suppress(OSError):  # EIO: the process closed the terminal
                    self.output += os.read(self.master, 65536)

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)
