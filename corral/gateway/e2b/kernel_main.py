"""The Python kernel Corral ships into a sandbox for E2B's ``run_code`` (this file runs inside the sandbox).

It reads one JSON request per line on stdin (``{"code", "env"}``), runs the
code in one namespace that lives as long as the process (a context), and
writes E2B's execution messages, one JSON object per line, to the stdout it
started with: stdout/stderr as they are printed, the value of a final
expression as the main result, an error with its traceback, the execution
count, then ``end_of_execution``. Output written straight to file
descriptors 1 and 2 (by subprocesses) arrives on stderr. SIGINT interrupts
the running cell (KeyboardInterrupt), as Jupyter does. Standard library only.
"""

import ast
import io
import json
import os
import sys
import time
import traceback

_protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
os.dup2(2, 1)


def _send(message):
    _protocol.write(json.dumps(message) + "\n")
    _protocol.flush()


class _Stream(io.TextIOBase):
    def __init__(self, name):
        self._name = name

    def writable(self):
        return True

    def write(self, text):
        if text:
            _send({"type": self._name, "text": text, "timestamp": time.time_ns() // 1000})
        return len(text)


def _formats(value):
    """Rich representations a value offers (IPython's _repr_*_ convention), plus its text."""
    result = {"text": repr(value)}
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


def _run(code, namespace, count):
    tree = ast.parse(code, f"<cell-{count}>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, f"<cell-{count}>", "exec"), namespace)
    if last is not None:
        value = eval(compile(last, f"<cell-{count}>", "eval"), namespace)
        if value is not None:
            namespace["_"] = value
            _send({"type": "result", "is_main_result": True, **_formats(value)})


def main():
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    count = 0
    streams = (sys.stdout, sys.stderr)
    while True:
        try:
            line = sys.stdin.readline()
        except KeyboardInterrupt:
            continue  # an interrupt that came after the cell ended
        if not line:
            return
        request = json.loads(line)
        count += 1
        saved_env = dict(os.environ)
        os.environ.update(request.get("env") or {})
        sys.stdout, sys.stderr = _Stream("stdout"), _Stream("stderr")
        try:
            _run(request["code"], namespace, count)
        except BaseException as exc:  # noqa: B036 - SystemExit and KeyboardInterrupt are the cell's errors too
            lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
            _send({"type": "error", "name": type(exc).__name__, "value": str(exc), "traceback": "".join(lines)})
        finally:
            sys.stdout.flush()
            sys.stdout, sys.stderr = streams
            os.environ.clear()
            os.environ.update(saved_env)
            _send({"type": "number_of_executions", "execution_count": count})
            _send({"type": "end_of_execution"})


if __name__ == "__main__":
    main()
