"""fanotify(7) and open_by_handle_at(2) for the node's watchers: the constants of <linux/fanotify.h> they use and
libc's calls, typed for ctypes (the standard library has neither)."""

from __future__ import annotations

import ctypes
import struct

__all__ = [
    "AT_FDCWD",
    "EVENT_METADATA",
    "FAN_ATTRIB",
    "FAN_CLASS_NOTIF",
    "FAN_CLOEXEC",
    "FAN_CLOSE_WRITE",
    "FAN_CREATE",
    "FAN_DELETE",
    "FAN_EVENT_ON_CHILD",
    "FAN_MARK_ADD",
    "FAN_MARK_DONT_FOLLOW",
    "FAN_MARK_FILESYSTEM",
    "FAN_MARK_REMOVE",
    "FAN_MODIFY",
    "FAN_MOVED_FROM",
    "FAN_MOVED_TO",
    "FAN_NONBLOCK",
    "FAN_ONDIR",
    "FAN_OPEN",
    "FAN_Q_OVERFLOW",
    "FAN_REPORT_DFID_NAME",
    "FAN_REPORT_FID",
    "libc",
]

# fanotify_init flags
FAN_CLASS_NOTIF = 0x0
FAN_CLOEXEC = 0x1
FAN_NONBLOCK = 0x2
FAN_REPORT_FID = 0x200
FAN_REPORT_DFID_NAME = 0xC00  # FAN_REPORT_DIR_FID | FAN_REPORT_NAME
# fanotify_mark flags
FAN_MARK_ADD = 0x1
FAN_MARK_REMOVE = 0x2
FAN_MARK_DONT_FOLLOW = 0x4
FAN_MARK_FILESYSTEM = 0x100
# events
FAN_MODIFY = 0x2
FAN_ATTRIB = 0x4
FAN_CLOSE_WRITE = 0x8
FAN_OPEN = 0x20
FAN_MOVED_FROM = 0x40
FAN_MOVED_TO = 0x80
FAN_CREATE = 0x100
FAN_DELETE = 0x200
FAN_Q_OVERFLOW = 0x4000
FAN_EVENT_ON_CHILD = 0x08000000
FAN_ONDIR = 0x40000000

AT_FDCWD = -100
EVENT_METADATA = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid

libc = ctypes.CDLL(None, use_errno=True)
libc.fanotify_init.argtypes, libc.fanotify_init.restype = [ctypes.c_uint, ctypes.c_uint], ctypes.c_int
libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]
libc.fanotify_mark.restype = ctypes.c_int
libc.open_by_handle_at.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
libc.open_by_handle_at.restype = ctypes.c_int
