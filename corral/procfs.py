"""What the kernel's own files say: the one parse of ``/proc/PID/stat`` that the layer helpers, the cluster's
process cleanup and the tests share, and the small reads of /proc, /sys and cgroup files on a command's path."""

from __future__ import annotations

import os
import re
import threading
from collections import OrderedDict

__all__ = [
    "HeldFiles", "held_files", "host_cpu_s", "mount_field", "process_cpu_s", "read_small", "running", "stat_fields",
    "superblocks",
]  # fmt: skip

_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def mount_field(text: str) -> str:
    """A path field of /proc/*/mounts or mountinfo as it is: the kernel writes a space, tab, newline and backslash
    in a mount's source or mount point as an octal escape (``\\040``), so a path holding one never equals its
    field as written."""
    return _OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), text) if "\\" in text else text


def superblocks(mountinfo: str) -> dict[str, tuple[str, str]]:
    """The superblocks of a mountinfo text by device (``major:minor``): its filesystem type and the first mount
    point that shows it. Two mounts of one device (a bind) share one superblock."""
    found: dict[str, tuple[str, str]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        found.setdefault(fields[2], (fields[fields.index("-") + 1], mount_field(fields[4])))
    return found


def host_cpu_s() -> dict[str, float]:
    """CPU seconds this host's cores have spent since boot (/proc/stat's cpu line): ``user`` (with nice),
    ``system`` (with interrupts) and ``steal`` (taken by the hypervisor); idle and iowait left out."""
    fields = [int(value) for value in read_small("/proc/stat").split("\n", 1)[0].split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    return {"user": (fields[0] + fields[1]) / tick, "system": (fields[2] + fields[5] + fields[6]) / tick,
            "steal": fields[7] / tick}  # fmt: skip


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


class HeldFiles:
    """Kernel files read after every command (a sandbox's pids.events, OOM counter, quota usage), kept open and read
    with ``pread`` at offset 0, which has the kernel render them afresh: one syscall where ``read_small`` walks the
    path and sets the file up and down each time (a cgroup's pids.events: 12 us against 1 us here; 4-6 such reads a
    command, ~0.1 ms of an exec round trip). At most ``limit`` stay open, the least recently read closed first; a
    file whose directory went away (a cgroup removed, re-made at the same path by a restore) reads as ENODEV and is
    opened again once. ``forget`` closes what is under a path that is about to go."""

    def __init__(self, limit: int) -> None:
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._limit = limit
        self._lock = threading.Lock()  # a thread's read never meets an fd another closes

    def read(self, path: str) -> str:
        with self._lock:
            try:
                data = os.pread(self._fd(path), 65536, 0)
            except OSError:
                self._close(path)
                data = os.pread(self._fd(path), 65536, 0)  # reopened: the file it named may be new
        if len(data) < 65536:
            return data.decode()
        return read_small(path)  # no kernel counter is this long, but read it whole if one is

    def forget(self, part: str) -> None:
        """Close every held file whose path contains ``part`` (a sandbox's cgroup directory, its quota group)."""
        with self._lock:
            for path in [path for path in self._fds if part in path]:
                self._close(path)

    def _fd(self, path: str) -> int:
        fd = self._fds.get(path)
        if fd is not None:
            self._fds.move_to_end(path)
            return fd
        fd = self._fds[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        if len(self._fds) > self._limit:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _close(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)


held_files = HeldFiles(limit=1024)  # the process's: about 145 sandboxes' worth of per-command reads


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, the state first (``R``, ``S``, ``Z``, ...), then
    the parent's pid, the group, the session; None when there is no such process. The name is in parentheses
    and may itself hold spaces and parentheses: the fields start after the last ``)``."""
    try:
        stat = read_small(f"/proc/{pid}/stat")
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds the process has spent, user and system, with those of its children it has reaped (the
    commands it ran and waited for); None when there is no such process."""
    fields = stat_fields(pid)
    if fields is None:
        return None
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")  # utime stime cutime cstime


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (one that exited but was not reaped yet)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"
