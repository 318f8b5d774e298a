"""The Python kernel Corral ships into a sandbox for E2B's ``run_code`` (this file runs inside the sandbox).

It reads one JSON request per line on stdin (``{"code", "env"}``), runs the
code in one namespace that lives as long as the process (a context), and
writes E2B's execution messages, one JSON object per line, to the stdout it
started with: stdout/stderr as they are printed, the value of a final
expression as the main result, an error with its traceback, the execution
count, then ``end_of_execution``. Output written straight to file
descriptors 1 and 2 (by subprocesses) arrives as stdout and stderr. SIGINT interrupts
the running cell (KeyboardInterrupt), as Jupyter does. Standard library only.
"""

import ast
import io
import json
import os
import select
import signal
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any

_protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
_protocol_lock = threading.Lock()
_DRAIN_WAIT_S = 2.0


def _send(message: dict[str, Any]) -> None:
    line = json.dumps(message) + "\n"
    with _protocol_lock:
        _protocol.write(line)
        _protocol.flush()


class _Descriptors:
    """Output written to file descriptors 1 and 2 (by subprocesses, C code) as stdout/stderr messages.

    Each descriptor becomes a pipe that a thread reads; at the end of a cell the
    thread is asked to empty the pipes first, so that output belongs to its cell.
    """

    def __init__(self) -> None:
        self._names: dict[int, str] = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            self._names[read_end] = name
        self._drain_asked = threading.Event()
        self._drained = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        while True:
            ready, _, _ = select.select(list(self._names), [], [], 0.05)
            for fd in ready:
                data = os.read(fd, 65536)
                if data:
                    text = data.decode(errors="replace")
                    _send({"type": self._names[fd], "text": text, "timestamp": time.time_ns() // 1000})
            if not ready and self._drain_asked.is_set():
                self._drain_asked.clear()
                self._drained.set()

    def drain(self) -> None:
        self._drained.clear()
        self._drain_asked.set()
        self._drained.wait(_DRAIN_WAIT_S)


class _Stream(io.TextIOBase):
    """print() writes the text and the newline separately: send whole lines (the rest at flush)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._pending = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        if "\n" in self._pending:
            complete, _, self._pending = self._pending.rpartition("\n")
            self._send(complete + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._send(self._pending)
            self._pending = ""

    def _send(self, text: str) -> None:
        _send({"type": self._name, "text": text, "timestamp": time.time_ns() // 1000})


def _formats(value: object) -> dict[str, Any]:
    """Rich representations a value offers (IPython's _repr_*_ convention), plus its text."""
    result: dict[str, Any] = {"text": repr(value)}
    for name in ("html", "markdown", "svg", "png", "jpeg", "latex", "json", "javascript"):
        method = getattr(value, f"_repr_{name}_", None)
        if callable(method):
            try:
                rendered = method()
            except Exception:
                continue
            if rendered is not None:
                result[name] = rendered
    return result


def _run(code: str, namespace: dict[str, Any], count: int) -> None:
    tree = ast.parse(code, f"<cell-{count}>", "exec")
    last: ast.Expression | None = None
    final = tree.body[-1] if tree.body else None
    if isinstance(final, ast.Expr):
        tree.body.pop()
        last = ast.Expression(final.value)
    exec(compile(tree, f"<cell-{count}>", "exec"), namespace)
    if last is not None:
        value = eval(compile(last, f"<cell-{count}>", "eval"), namespace)
        if value is not None:
            namespace["_"] = value
            _send({"type": "result", "is_main_result": True, **_formats(value)})


class _Interrupts:
    """SIGINT interrupts a running cell only: between cells (or while a cell's end is sent) it is ignored."""

    def __init__(self) -> None:
        self.armed = False
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt


def main() -> None:
    interrupts = _Interrupts()
    descriptors = _Descriptors()
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": __builtins__}
    count = 0
    streams = (sys.stdout, sys.stderr)
    while True:
        line = sys.stdin.readline()
        if not line:
            return
        request = json.loads(line)
        count += 1
        saved_env = dict(os.environ)
        os.environ.update(request.get("env") or {})
        sys.stdout, sys.stderr = _Stream("stdout"), _Stream("stderr")
        try:
            interrupts.armed = True
            try:
                _run(request["code"], namespace, count)
            finally:
                interrupts.armed = False
        except BaseException as exc:  # noqa: B036 - SystemExit and KeyboardInterrupt are the cell's errors too
            lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
            _send({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": "".join(lines)})
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            descriptors.drain()
            sys.stdout, sys.stderr = streams
            os.environ.clear()
            os.environ.update(saved_env)
            _send({"type": "number_of_executions", "execution_count": count})
            _send({"type": "end_of_execution"})


if __name__ == "__main__":
    main()
