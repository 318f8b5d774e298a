"""Run a command with a pseudo-terminal as its stdin, stdout and stderr, as a person's shell would, and read the
screen it wrote (the CLI's progress bars draw only in a terminal)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

__all__ = ["run_in_terminal"]

_ESCAPES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def run_in_terminal(
    command: list[str], env: dict[str, str], cwd: Path, timeout_s: float, columns: int = 160
) -> tuple[int, str]:
    """The command's exit code and everything it wrote, colours and cursor moves taken out (frames of a bar
    stay, one after another). ``TERM`` is set to a colour terminal."""
    primary, secondary = pty.openpty()
    fcntl.ioctl(secondary, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    try:
        process = subprocess.Popen(command, stdin=secondary, stdout=secondary, stderr=secondary, cwd=cwd,
                                   env={**env, "TERM": "xterm-256color"})  # fmt: skip
    finally:
        os.close(secondary)
    written = bytearray()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if select.select([primary], [], [], 0.5)[0]:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:  # EIO: the terminal's last writer closed it
                    break
                if not chunk:
                    break
                written += chunk
        code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        return code, _ESCAPES.sub("", written.decode(errors="replace"))
    finally:
        os.close(primary)
        if process.poll() is None:
            process.kill()
            process.wait()
