"""What the kernel's own files say: the one parse of ``/proc/PID/stat`` that the layer helpers, the cluster's
process cleanup and the tests share, and the small reads of /proc, /sys and cgroup files on a command's path."""

from __future__ import annotations

import os
import re

__all__ = ["mount_field", "read_small", "running", "stat_fields"]

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def mount_field(text: str) -> str:
    """A path field of /proc/*/mounts or mountinfo as it is: the kernel writes a space, tab, newline and backslash
    in a mount's source or mount point as an octal escape (``\\040``), so a path holding one never equals its
    field as written."""
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), text) if "\\" in text else text


def read_small(path: str) -> str:
    """A kernel file (a counter, a cgroup's events or memory.stat) read os-level: a few microseconds where
    ``Path.read_text`` (a text wrapper, its encoding lookup) costs several times that on every command."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = [os.read(fd, 65536)]
        while chunks[-1]:
            chunks.append(os.read(fd, 65536))
        return b"".join(chunks).decode()
    finally:
        os.close(fd)


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, the state first (``R``, ``S``, ``Z``, ...), then
    the parent's pid, the group, the session; None when there is no such process. The name is in parentheses
    and may itself hold spaces and parentheses: the fields start after the last ``)``."""
    try:
        stat = read_small(f"/proc/{pid}/stat")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (one that exited but was not reaped yet)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"
