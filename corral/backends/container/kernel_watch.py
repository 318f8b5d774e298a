"""What the kernel reports about a node's sandboxes, read without blocking from the edge's housekeeping.

- ``SeccompDenials``: every syscall a sandbox's seccomp filter refused. The filter carries
  SECCOMP_FILTER_FLAG_LOG (oci.py), so the kernel writes an audit record (type 1326) per refusal. They are
  read from the audit subsystem's read-only multicast group (NETLINK_AUDIT, AUDIT_NLGRP_READLOG), which gets
  every record; /dev/kmsg, where the kernel also prints them when no auditd runs, keeps at most 10 per 5 s
  for the whole node (printk rate limit). A record names the process's audit session: corral-launch starts
  a new one per container (``--audit-session``), so a record maps to its sandbox even after the process
  exited; a live process is also found by its cgroup.
  Only records of that type are read, which only the kernel writes (messages user space may send have
  types of their own).
- ``SensitiveReads``: opens of paths a sandbox spec marks sensitive, through fanotify marks on the paths
  and the directories holding them, as the sandbox's own overlay mount sees them (groups shared by the
  node; the event's mount names the sandbox, so the same layer shared by other sandboxes reports nothing).

Needs root (CAP_AUDIT_READ, CAP_SYS_ADMIN); on a kernel without either facility the watcher reports nothing
and says so once in the log.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import re
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from corral.api.errors import CorralError
from corral.backends.container import fanotify
from corral.backends.container.fanotify import (
    EVENT_METADATA,
    FAN_CLASS_NOTIF,
    FAN_CLOEXEC,
    FAN_EVENT_ON_CHILD,
    FAN_MARK_ADD,
    FAN_MARK_DONT_FOLLOW,
    FAN_NONBLOCK,
    FAN_ONDIR,
    FAN_OPEN,
    FAN_Q_OVERFLOW,
)
from corral.backends.container.files import ConfinedTree
from corral.guard.audit import under

__all__ = ["SeccompDenials", "SeccompRecord", "SensitiveRead", "SensitiveReads", "session_of"]

log = logging.getLogger(__name__)

_NETLINK_AUDIT = 9
_AUDIT_NLGRP_READLOG = 1
_AUDIT_SECCOMP = 1326
_NLMSG_HEADER = struct.Struct("=IHHII")
_RECEIVE_BUFFER_BYTES = 4 << 20
_UNSET_SESSION = 4294967295
_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')
_MAX_TEXT = 64
# Per housekeeping round, so a sandbox spinning on a refused call cannot keep the edge's event loop reading;
# what is left waits in the socket buffer, and what overflows it is counted as lost.
_MAX_RECORDS_PER_READ = 20_000


def session_of(pid: int) -> int | None:
    """The audit session id of a process (None if it is gone or has none)."""
    try:
        session = int(Path(f"/proc/{pid}/sessionid").read_text())
    except (OSError, ValueError):
        return None
    return None if session == _UNSET_SESSION else session


def _audit_text(value: str) -> str:
    """A field the process controls (comm, exe): quoted text, or hex when it contains odd characters."""
    if value.startswith('"'):
        return value.strip('"')[:_MAX_TEXT]
    try:
        return bytes.fromhex(value).decode(errors="replace")[:_MAX_TEXT]
    except ValueError:
        return value[:_MAX_TEXT]


class _SyscallNames:
    """Syscall numbers to names, from libseccomp (which crun links against too)."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], str] = {}
        self._lib: ctypes.CDLL | None
        try:
            self._lib = ctypes.CDLL("libseccomp.so.2")
            self._lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p
            self._lib.seccomp_syscall_resolve_num_arch.argtypes = [ctypes.c_uint32, ctypes.c_int]
            self._libc = ctypes.CDLL(None)
            self._libc.free.argtypes = [ctypes.c_void_p]
        except OSError:
            self._lib = None

    def __call__(self, arch: int, number: int) -> str:
        key = (arch, number)
        if key not in self._cache:
            name = f"syscall_{number}"
            if self._lib is not None:
                pointer = self._lib.seccomp_syscall_resolve_num_arch(arch, number)
                if pointer:
                    name = ctypes.string_at(pointer).decode()
                    self._libc.free(pointer)
            self._cache[key] = name
        return self._cache[key]


@dataclass(frozen=True)
class SeccompRecord:
    session: int | None
    pid: int
    syscall: str
    comm: str
    exe: str


class SeccompDenials:
    """Audit records of refused syscalls, read from the audit multicast group."""

    def __init__(self) -> None:
        self._names = _SyscallNames()
        self.lost = 0  # records dropped because the receive buffer overflowed
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK, _NETLINK_AUDIT)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER_BYTES)
            sock.bind((0, _AUDIT_NLGRP_READLOG))
        except OSError as exc:
            log.warning("refused syscalls will not be audit events: no kernel audit multicast (%s)", exc)
            self._sock: socket.socket | None = None
        else:
            self._sock = sock

    def read(self) -> list[SeccompRecord]:
        """The records received since the last call (at most _MAX_RECORDS_PER_READ)."""
        sock = self._sock
        if sock is None:
            return []
        records: list[SeccompRecord] = []
        for _ in range(_MAX_RECORDS_PER_READ):
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # the buffer overflowed: some records are lost, go on
                    self.lost += 1
                    log.warning("kernel audit records were lost (receive buffer full, %d times)", self.lost)
                    continue
                raise
            offset = 0
            while offset + _NLMSG_HEADER.size <= len(data):
                length, kind, _, _, _ = _NLMSG_HEADER.unpack_from(data, offset)
                if length < _NLMSG_HEADER.size:
                    break
                if kind == _AUDIT_SECCOMP:
                    record = self._parse(data[offset + _NLMSG_HEADER.size : offset + length].decode(errors="replace"))
                    if record is not None:
                        records.append(record)
                offset += (length + 3) & ~3
        return records

    def _parse(self, text: str) -> SeccompRecord | None:
        fields = dict(_FIELD.findall(text))
        try:
            session = int(fields.get("ses", _UNSET_SESSION))
            pid = int(fields["pid"])
            syscall = self._names(int(fields.get("arch", "c000003e"), 16), int(fields["syscall"]))
        except (KeyError, ValueError):
            return None
        return SeccompRecord(
            session=None if session == _UNSET_SESSION else session,
            pid=pid,
            syscall=syscall,
            comm=_audit_text(fields.get("comm", '""')),
            exe=_audit_text(fields.get("exe", '""')),
        )

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


_EVENT_BUFFER_BYTES = 1 << 16
_MAX_BUFFERS_PER_READ = 8  # about 20,000 events per housekeeping round; the kernel queues the rest
_MAX_MARKS = 1024  # per sandbox and refresh; a sensitive tree bigger than this is marked in part


def _mount_id(fd: int) -> int:
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("mnt_id:"):
            return int(line.split()[1])
    return -1


class _Group:
    """One fanotify notification group: each event comes with an fd on the opened file."""

    def __init__(self) -> None:
        self.overflows = 0
        self.fd = fanotify.libc.fanotify_init(
            FAN_CLASS_NOTIF | FAN_CLOEXEC | FAN_NONBLOCK, os.O_RDONLY | os.O_LARGEFILE | os.O_CLOEXEC
        )
        if self.fd < 0:
            log.warning("reads of sensitive paths will not be audit events: fanotify_init: %s",
                        os.strerror(ctypes.get_errno()))  # fmt: skip

    def mark(self, dir_fd: int, name: str | None, mask: int) -> bool:
        """Mark ``dir_fd`` itself, or its entry ``name`` (never following a symlink)."""
        encoded = os.fsencode(name) if name is not None else None
        if fanotify.libc.fanotify_mark(self.fd, FAN_MARK_ADD | FAN_MARK_DONT_FOLLOW, mask, dir_fd, encoded) == 0:
            return True
        log.debug("fanotify_mark %s: %s", name, os.strerror(ctypes.get_errno()))
        return False

    def events(self) -> list[tuple[int, int]]:
        """(fd, pid) of the events queued (bounded per call); the caller closes each fd."""
        found: list[tuple[int, int]] = []
        for _ in range(_MAX_BUFFERS_PER_READ if self.fd >= 0 else 0):
            try:
                data = os.read(self.fd, _EVENT_BUFFER_BYTES)
            except BlockingIOError:
                break
            offset = 0
            while offset + EVENT_METADATA.size <= len(data):
                length, _, _, _, mask, fd, pid = EVENT_METADATA.unpack_from(data, offset)
                offset += max(length, EVENT_METADATA.size)
                if mask & FAN_Q_OVERFLOW:
                    self.overflows += 1
                if fd >= 0:
                    found.append((fd, pid))
        return found

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class SensitiveRead:
    sandbox_id: str
    path: str
    pid: int


class SensitiveReads:
    """fanotify marks on the sensitive paths of each sandbox, and the opens they report.

    Two groups: ``exact`` marks the sensitive files and directories themselves, so any open of them counts
    wherever the sandbox moved them since (the mark follows the inode); ``near`` marks the directories that
    hold them for their children, which catches files that appeared since the last refresh and paths not
    there yet, and counts an open only when its path is sensitive."""

    def __init__(self) -> None:
        self._exact = _Group()
        self._near = _Group()
        self._sandbox_of_mount: dict[int, str] = {}
        self._paths: dict[str, tuple[str, ...]] = {}

    @property
    def overflows(self) -> int:
        return self._exact.overflows + self._near.overflows

    def mark(self, sandbox_id: str, root: str, paths: tuple[str, ...]) -> None:
        """Watch opens of ``paths`` (files or directory trees) in the sandbox whose root is ``root``
        (``/proc/<pid>/root``). Idempotent: called again after commands, it marks what appeared since (a
        sensitive file written later, a directory replaced)."""
        if self._exact.fd < 0 or not paths:
            return
        self._paths[sandbox_id] = paths
        try:
            tree = ConfinedTree(root)
        except CorralError:  # the sandbox's init is gone: nothing to mark
            return
        with tree:
            budget = [_MAX_MARKS]
            for path in paths:
                try:
                    self._mark_path(sandbox_id, tree, path.rstrip("/") or "/", budget)
                except OSError as exc:  # a tree changing under the walk: the next refresh tries again
                    log.warning("sandbox %s: could not watch %s: %s", sandbox_id, path, exc)

    def _open(self, tree: ConfinedTree, path: str, flags: int) -> int:
        try:
            return tree.open_fd(path, flags)
        except (OSError, CorralError):  # missing, or refused (procfs)
            return -1

    def _mark_path(self, sandbox_id: str, tree: ConfinedTree, path: str, budget: list[int]) -> None:
        """A directory is marked with everything in it; a file by itself and through its parent; a path not
        there yet through its parent."""
        fd = self._open(tree, path, os.O_PATH)
        is_dir = fd >= 0 and stat.S_ISDIR(os.fstat(fd).st_mode)
        if fd >= 0:
            os.close(fd)
        if is_dir:
            self._mark_tree(sandbox_id, tree, path, budget)
            return
        parent = self._open(tree, os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)  # not O_PATH: fanotify
        if parent < 0:
            return
        try:
            self._sandbox_of_mount[_mount_id(parent)] = sandbox_id
            self._near.mark(parent, None, FAN_OPEN | FAN_EVENT_ON_CHILD)
            if fd >= 0:
                self._exact.mark(parent, os.path.basename(path), FAN_OPEN)
            budget[0] -= 2
        finally:
            os.close(parent)

    def _mark_tree(self, sandbox_id: str, tree: ConfinedTree, top: str, budget: list[int]) -> None:
        stack = [top]
        while stack and budget[0] > 0:
            directory = stack.pop()
            fd = self._open(tree, directory, os.O_RDONLY | os.O_DIRECTORY)
            if fd < 0:
                continue
            try:
                self._sandbox_of_mount[_mount_id(fd)] = sandbox_id
                self._exact.mark(fd, None, FAN_OPEN | FAN_ONDIR)  # listing it
                self._near.mark(fd, None, FAN_OPEN | FAN_EVENT_ON_CHILD)
                budget[0] -= 2
                for entry in os.scandir(fd):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(f"{directory.rstrip('/')}/{entry.name}")
                    elif entry.is_file(follow_symlinks=False) and budget[0] > 0:
                        self._exact.mark(fd, entry.name, FAN_OPEN)
                        budget[0] -= 1
            finally:
                os.close(fd)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox ended (its marks went with its overlay)."""
        self._paths.pop(sandbox_id, None)
        for mount in [m for m, s in self._sandbox_of_mount.items() if s == sandbox_id]:
            del self._sandbox_of_mount[mount]

    def read(self) -> list[SensitiveRead]:
        """Opens of sensitive paths since the last call (the edge's own file API reads are left out)."""
        exact = [read for fd, pid in self._exact.events() if (read := self._match(fd, pid, anywhere=True))]
        seen = {(read.sandbox_id, read.pid, read.path) for read in exact}
        near = [read for fd, pid in self._near.events() if (read := self._match(fd, pid, anywhere=False))]
        return exact + [read for read in near if (read.sandbox_id, read.pid, read.path) not in seen]

    def _match(self, fd: int, pid: int, *, anywhere: bool) -> SensitiveRead | None:
        try:
            if pid == os.getpid():
                return None
            sandbox_id = self._sandbox_of_mount.get(_mount_id(fd))
            if sandbox_id is None:
                return None
            path = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        finally:
            os.close(fd)
        if not anywhere and not under(path, self._paths.get(sandbox_id, ())):
            return None
        return SensitiveRead(sandbox_id, path, pid)

    def close(self) -> None:
        self._exact.close()
        self._near.close()
