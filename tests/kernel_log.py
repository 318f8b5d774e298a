"""What the host kernel reported while a test ran: its taint flags and the warnings in its log.

A test of an attack checks that the host's kernel came out of it unharmed. The taint flags alone cannot
say so on this host: its kernel is built with CONFIG_EXT4_DEBUG, whose ``ext4_check_map_extents_env``
warns (once per boot, TAINT_WARN) when ext4 maps a regular file's blocks with neither its i_rwsem nor its
invalidate_lock held. A file-backed EROFS mount reads its metadata from the image file exactly so
(``erofs_bread`` → ``read_mapping_folio``), once the file's extents dropped out of ext4's extent cache.
Layer images are never written while mounted, so the race that check guards against cannot happen there:
it is a debug assertion of the host's kernel, not a fault. So each warning report in the log is read and
only that one is set aside; any other report, or any other new taint flag, is a problem.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["KernelWatch", "judge", "split_reports"]

TAINT = Path("/proc/sys/kernel/tainted")
TAINT_WARN = 1 << 9
KMSG = "/dev/kmsg"
_CUT_HERE = "------------[ cut here ]------------"
_REPORT_START = (_CUT_HERE, "WARNING:", "BUG:", "Oops:", "general protection fault")
_REPORT_END = "---[ end trace"
# (the warning's function, a function of the call trace): both in one report make it the known one.
KNOWN_REPORTS = (("ext4_check_map_extents_env", "erofs_"),)


def _taint() -> int:
    return int(TAINT.read_text())


class KernelWatch:
    """Reads the kernel log from now on; ``problems()`` says what the kernel reported that is not known."""

    def __init__(self) -> None:
        self._taint = _taint()
        self._fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
        os.lseek(self._fd, 0, os.SEEK_END)

    def close(self) -> None:
        os.close(self._fd)

    def _messages(self) -> list[str]:
        """The log's records since the last read (one record per read; EPIPE: some were overwritten)."""
        messages = []
        while True:
            try:
                record = os.read(self._fd, 8192).decode(errors="replace")
            except BlockingIOError:
                return messages
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    messages.append("(records lost: the log's ring buffer wrapped)")
                    continue
                raise
            first_line = record.split("\n", 1)[0]
            messages.append(first_line.split(";", 1)[1] if ";" in first_line else first_line)

    def problems(self) -> list[str]:
        """What the kernel reported since the start that is not a known report, and new taint flags."""
        return judge(split_reports(self._messages()), _taint() & ~self._taint)


def split_reports(messages: list[str]) -> list[str]:
    """Each warning, bug or oops report among log messages, as one text."""
    reports: list[list[str]] = []
    inside = False
    for message in messages:
        just_cut = inside and reports[-1] == [_CUT_HERE]  # "cut here", then the WARNING line: one report
        if message.startswith(_REPORT_START) and not just_cut:
            reports.append([message])
            inside = True
        elif inside:
            reports[-1].append(message)
            inside = not message.startswith(_REPORT_END)
    return ["\n".join(report) for report in reports]


def judge(reports: list[str], new_taint: int) -> list[str]:
    """The reports that are not known ones, and taint flags no known report explains."""
    unknown = [r for r in reports if not any(a in r and b in r for a, b in KNOWN_REPORTS)]
    found = [f"kernel report:\n{report[:2000]}" for report in unknown]
    if new_taint & ~TAINT_WARN:
        found.append(f"new taint flags {new_taint & ~TAINT_WARN:#x} (/proc/sys/kernel/tainted)")
    if new_taint & TAINT_WARN and not reports:
        found.append("TAINT_WARN set, and no warning report found in the kernel log")
    return found
