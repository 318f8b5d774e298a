"""What /proc says about a process: the one parse of ``/proc/PID/stat`` that the layer helpers, the cluster's
process cleanup and the tests share."""

from __future__ import annotations

from pathlib import Path

__all__ = ["running", "stat_fields"]


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name, the state first (``R``, ``S``, ``Z``, ...), then
    the parent's pid, the group, the session; None when there is no such process. The name is in parentheses
    and may itself hold spaces and parentheses: the fields start after the last ``)``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2 :].split()


def running(pid: int) -> bool:
    """Whether the process is there and not a zombie (one that exited but was not reaped yet)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"
