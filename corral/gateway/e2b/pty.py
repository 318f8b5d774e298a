"""E2B's PTY sessions (``sbx.pty``), emulated: Corral's agent gives commands pipes, not terminals.

util-linux ``script`` (in every Debian, so in ``base``) runs the command on a
pseudo-terminal of its own inside the sandbox and relays it to the pipes: what
the user types goes to the command's stdin, the terminal's output comes back
as ``pty`` data. The first size is set with ``stty`` before the command
starts; a resize finds that terminal (by a marker in its processes'
environment) and sets its size as the session's user, which also sends
SIGWINCH to the program in it.
"""

from __future__ import annotations

import secrets
import shlex
from typing import Any

from corral.api.errors import InvalidRequest
from corral.api.models import ExecRequest
from corral.gateway.operations import Operations

__all__ = ["PTY_MARKER_ENV", "new_marker", "pty_argv", "resize"]

PTY_MARKER_ENV = "CORRAL_E2B_PTY"
_RESIZE = """for p in /proc/[0-9]*; do
  if tr '\\0' '\\n' < "$p/environ" 2>/dev/null | grep -qx "$1"; then
    t=$(readlink "$p/fd/0"); case "$t" in /dev/pts/*) stty -F "$t" rows "$2" cols "$3"; exit $?;; esac
  fi
done
echo "no terminal found: the session ended" >&2; exit 1"""


def new_marker() -> str:
    return secrets.token_hex(8)


def _size(pty: dict[str, Any]) -> tuple[int, int]:
    size = pty.get("size") or {}
    rows, cols = int(size.get("rows") or 24), int(size.get("cols") or 80)
    if not (0 < rows <= 1000 and 0 < cols <= 1000):
        raise InvalidRequest(f"PTY size {rows}x{cols} is out of range (1-1000 rows and columns)")
    return rows, cols


def pty_argv(cmd: str, args: list[str], pty: dict[str, Any]) -> list[str]:
    rows, cols = _size(pty)
    inner = f"stty rows {rows} cols {cols}; exec {shlex.join([cmd, *args])}"
    return ["script", "--quiet", "--flush", "--return", "--command", inner, "/dev/null"]


async def resize(operations: Operations, sandbox_id: str, marker: str, user: str, pty: dict[str, Any]) -> None:
    """As the session's user: only its own processes' environments are readable (no CAP_SYS_PTRACE). A command in
    the sandbox, so a step of its trajectory like any other."""
    rows, cols = _size(pty)
    request = ExecRequest(
        cmd=["/bin/sh", "-c", _RESIZE, "resize", f"{PTY_MARKER_ENV}={marker}", str(rows), str(cols)],
        user=user,
        timeout_s=10,
    )
    result = await operations.exec(sandbox_id, request)
    if result.exit_code != 0:
        raise InvalidRequest(f"could not resize the PTY: {(result.stderr or result.stdout).strip()}")
