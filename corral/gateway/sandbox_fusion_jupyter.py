"""The driver of SandboxFusion's ``run_jupyter`` (this file runs inside the sandbox; standard library only).

It reads one JSON request on stdin (``{"kernel", "cells", "cell_timeout"}``),
starts the Python kernel that the E2B code interpreter uses
(corral/gateway/e2b/kernel_main.py, passed as ``kernel``), sends it the
cells one at a time, so that they share one namespace, and collects each
cell's stdout, stderr, displayed values (the value of a final expression,
by MIME type) and errors as SandboxFusion reports them. A cell that runs
past ``cell_timeout`` seconds (0: no limit) is interrupted (SIGINT) and
gets a ``TimeoutError``; the cells after it still run. The outcome is
written after a marker on stdout; the run's total timeout is the exec's.
"""

import json
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

MARKER = "\x1ecorral-jupyter:"
# The kernel's names for a value's representations (its _repr_*_ methods) and their MIME types, as Jupyter shows them.
_MIME_TYPES = {
    "text": "text/plain",
    "html": "text/html",
    "markdown": "text/markdown",
    "svg": "image/svg+xml",
    "png": "image/png",
    "jpeg": "image/jpeg",
    "latex": "text/latex",
    "json": "application/json",
    "javascript": "application/javascript",
}


class _Lines:
    """The kernel's stdout, one message line at a time, waiting at most until a deadline."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending = b""

    def next(self, deadline: float | None) -> bytes | None:
        """The next line; None at the deadline; b"" when the kernel has exited."""
        while b"\n" not in self._pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._fd], [], [], wait_s)
            if not ready:
                return None
            data = os.read(self._fd, 65536)
            if not data:
                return b""
            self._pending += data
        line, _, self._pending = self._pending.partition(b"\n")
        return line


def _run_cell(
    kernel: "subprocess.Popen[bytes]", lines: _Lines, code: str, timeout_s: float
) -> tuple[dict[str, Any], bool]:
    """One cell's outcome, and whether the kernel is still alive."""
    cell: dict[str, Any] = {"stdout": "", "stderr": "", "display": [], "error": []}
    assert kernel.stdin is not None
    kernel.stdin.write(json.dumps({"code": code}).encode() + b"\n")
    kernel.stdin.flush()
    deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
    timed_out = False
    while True:
        line = lines.next(deadline)
        if line is None:  # past cell_timeout: interrupt it; its end still comes
            kernel.send_signal(signal.SIGINT)
            timed_out, deadline = True, None
            continue
        if not line:
            cell["error"].append({"ename": "KernelDied", "evalue": "the Python kernel exited", "traceback": []})
            return cell, False
        if not line.strip():
            continue
        message = json.loads(line)
        kind = message["type"]
        if kind in ("stdout", "stderr"):
            cell[kind] += message["text"]
        elif kind == "result":
            cell["display"].append({_MIME_TYPES[key]: value for key, value in message.items() if key in _MIME_TYPES})
        elif kind == "error":
            if timed_out and message["name"] == "KeyboardInterrupt":
                message = {"name": "TimeoutError", "value": f"the cell ran past cell_timeout ({timeout_s:g} s)",
                           "traceback": message["traceback"]}  # fmt: skip
            cell["error"].append(
                {"ename": message["name"], "evalue": message["value"], "traceback": message["traceback"].splitlines()}
            )
        elif kind == "end_of_execution":
            return cell, True


def main() -> None:
    request = json.load(sys.stdin)
    kernel = subprocess.Popen([sys.executable, "-u", "-c", request["kernel"]], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)  # fmt: skip
    assert kernel.stdout is not None and kernel.stdin is not None
    lines = _Lines(kernel.stdout.fileno())
    cells = []
    alive = True
    for code in request["cells"]:
        if not alive:
            break
        cell, alive = _run_cell(kernel, lines, code, float(request.get("cell_timeout") or 0))
        cells.append(cell)
    kernel.stdin.close()
    try:
        kernel.wait(timeout=5)
    except subprocess.TimeoutExpired:
        kernel.kill()
    sys.stdout.write(MARKER + json.dumps({"cells": cells}))


if __name__ == "__main__":
    main()
