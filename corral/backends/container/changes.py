"""What a step changed in a sandbox's writable layer: a walk of the layer, or a journal of the pool's events.

A step with a client's id records the files it changed (the trajectory log's provenance): the entries of the
sandbox's overlay upper dir whose inode changed at or after the step's clock, whiteouts (deletions) included.
The walk answers that with a stat per entry of the layer, on every such step: ~100 ms for 20,000 entries here.
The journal answers it in O(changes): one fanotify group marks the btrfs pool that holds every sandbox's writable
layer (a subvolume each) and hears each create, delete, write, attribute change, rename and close after writing made
through any sandbox's overlay, as (directory handle, name). Those names are candidates only: each is checked as
the walk checks an entry (not a directory, changed at or after the clock), so the journal names what the walk
would. Where it cannot be sure it says so and the walk answers: events lost to a full queue, a hard link's other
names (a link count change names no path), a step it did not see begin (its clock came from before a restart).

Two differences, in the journal's favour. Overlayfs makes every whiteout a hard link of one shared inode, so a new
whiteout changes the ctime of all the old ones and the walk names them again; the journal names only the new one.
And a file only the writable layer held (an earlier step made it) leaves nothing behind when a step removes it or
moves it away, so the walk cannot name it; the journal names it from the event, unless the step also made a file
of that name (then it cannot tell whether the name was there before the step).
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
import errno
import fcntl
import logging
import os
import stat
import struct
import sys
import termios
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from corral.backends.base import ChangedPaths
from corral.backends.container import fanotify
from corral.backends.container.fanotify import EVENT_METADATA, libc
from corral.backends.container.oci import AGENT_PATH
from corral.backends.container.writable import QuotaPool

__all__ = ["CHANGED_PATHS_MAX", "ChangeJournal", "StepFiles", "changed_since"]

log = logging.getLogger(__name__)

CHANGED_PATHS_MAX = 10_000


def _since_ns(since: float) -> int:
    return round(since * 1e9) - 1_000  # float seconds lose ~100 ns; clock ticks are ms apart


def changed_since(upper: Path, since: float) -> list[str]:
    """Walk the upper dir (bounded) for entries whose inode changed at or after ``since``; whiteouts are deletions.

    O(entries), a stat each: strings and ``os.scandir`` only (Path objects and ``os.path.relpath`` per entry made
    it 2-3x slower: 20,200 entries 78-115 vs 188-333 ms by hand)."""
    changed: list[str] = []
    since_ns = _since_ns(since)
    root = str(upper)
    stack = [root]
    while stack and len(changed) < CHANGED_PATHS_MAX:
        try:
            entries = os.scandir(stack.pop())
        except OSError:
            continue
        with entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    continue
                try:
                    ctime_ns = entry.stat(follow_symlinks=False).st_ctime_ns
                except OSError:
                    continue
                relative = entry.path[len(root) :]
                if ctime_ns >= since_ns and relative != AGENT_PATH:
                    changed.append(relative)
    return sorted(changed)


# What changes an entry's inode: a write, a new name (create, link, rename, and overlay's copy-ups and whiteouts),
# an attribute (chmod, chown, utimes, xattrs; with no name: a link count), and a close after writing, which names
# a file written through a shared mapping (no event of its own) once the last mapping is gone. And a name taken away
# (delete, rename): a file only the writable layer held (an earlier step's) leaves no whiteout when it goes.
_MADE = fanotify.FAN_CREATE | fanotify.FAN_MOVED_TO
_REMOVED = fanotify.FAN_DELETE | fanotify.FAN_MOVED_FROM
_MASK = fanotify.FAN_MODIFY | fanotify.FAN_ATTRIB | fanotify.FAN_CLOSE_WRITE | _MADE | _REMOVED
_INFO_FID, _INFO_DFID_NAME = 1, 2  # FAN_EVENT_INFO_TYPE_*
_INFO_HEADER = struct.Struct("=BBH")  # info_type, pad, len; then a __kernel_fsid_t and a struct file_handle
_FSID_BYTES = 8
_HANDLE_HEADER = struct.Struct("=Ii")  # struct file_handle: handle_bytes, handle_type, then f_handle
# A btrfs file handle (struct btrfs_fid, types FILEID_BTRFS_*) starts with the inode's objectid, then the id of
# the subvolume (tree) it is in: which sandbox's layer, read without a syscall.
_BTRFS_HANDLE_TYPES = frozenset({0x4D, 0x4E, 0x4F})
_TREE_ID = struct.Struct("=Q")
_TREE_ID_OFFSET = _HANDLE_HEADER.size + 8
_FIRST_TREE_ID_OFFSET = _INFO_HEADER.size + _FSID_BYTES + _TREE_ID_OFFSET  # in an event's first record
_READ_BYTES = 1 << 16
_EVENT_BYTES_MAX = 1 << 10  # both records: 24 + 2 x (4 + 8 + 8 + 128-byte handle) + a 255-byte name, rounded up
_QUEUE_DEFAULT = 16_384  # fs.fanotify.max_queued_events when it cannot be read
_DRAIN_INTERVAL_S = 0.25  # the queue is read this often, so a burst of writes rarely fills it
_INLINE_DRAIN_BYTES = 16 << 10  # ~150 events: what a step's begin or answer reads on the event loop (~0.3 ms)
_INLINE_EVENTS = 32  # a step's answer on the event loop: a lookup of each event's directory, a stat of each name
_INLINE_PROCESSES = 8  # and a read of each of the sandbox's processes' maps
_STARTS_MAX = 64  # steps begun and not asked about, per sandbox; a step pushed out goes to the walk
_START_MAX_AGE_S = 3600.0  # a step not asked about in this long (it failed: nothing asks) is let go
_EVENTS_MAX = 20_000  # per sandbox for its open steps; past it they go to the walk (as fast, at that many changes)
_GONE = (errno.ESTALE, errno.ENOENT)


class _Unsure(Exception):
    """Only the walk can say what changed."""


def _checked(result: int, call: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{call}: {os.strerror(code)}")
    return result


def _queue_limit() -> int:
    try:
        return int(Path("/proc/sys/fs/fanotify/max_queued_events").read_text())
    except (OSError, ValueError):
        return _QUEUE_DEFAULT


# (position, handle, name, mask): a directory's handle and a name, or an inode's handle and "" (a link count)
_Event = tuple[int, bytes, str, int]


@dataclass
class _Layer:
    """A sandbox's writable layer while it has steps open: when they began, and the events since the first."""

    pending: list[int] = field(default_factory=list)  # positions of steps between begin and started
    starts: list[tuple[float, int]] = field(default_factory=list)  # (clock, position), by clock
    events: list[_Event] = field(default_factory=list)
    floor: int = 0  # a step that began below this position goes to the walk


class ChangeJournal:
    """One fanotify group on the pool's filesystem: ``begin`` before a step's clock, ``started`` with it,
    ``changed`` after the step. ``open`` (root only) may fail; ``changed`` answers None until it succeeds.

    A position is the number of the read an event came in: ``begin`` hands out the next one, so every event queued
    after it is read at or after it (events queued before and read later are extra candidates, which the clock's
    check drops). A thread reads the queue every ``drain_interval_s``, and ``changed`` reads it before answering.
    Thread-safe: the event loop calls ``begin``, ``started``, ``abandon``, ``forget`` and ``changed`` with
    ``wait=False`` (each bounded); a worker thread ``changed``, which reads the whole queue."""

    def __init__(self, mountpoint: Path, *, drain_interval_s: float = _DRAIN_INTERVAL_S) -> None:
        self._mountpoint = mountpoint
        self._drain_interval_s = drain_interval_s
        self._fd = -1
        self._mount_fd = -1
        self._next = 1  # the position the next read gets
        self._reading = threading.Lock()  # a read and its position, against begin's
        self._draining = threading.Lock()  # one drain at a time: events go into the layers in order
        self._lock = threading.Lock()  # the layers and the floor
        self._layers: dict[int, _Layer] = {}  # by subvolume (tree) id, while it has steps open
        self._marked = False  # the filesystem mark is there (while a layer is)
        self._uppers: dict[int, str] = {}  # tree id -> its upper dir's real path, until forgotten
        self._floor = 0  # events were lost: steps that began below this position go to the walk
        self._queue_limit = _queue_limit()
        self._stop = threading.Event()
        self._drainer: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return self._fd >= 0

    def open(self) -> None:
        """The group, its mark on the pool's filesystem and its reader. Raises OSError when the kernel refuses."""
        if self._fd >= 0:
            return
        flags = fanotify.FAN_CLOEXEC | fanotify.FAN_NONBLOCK | fanotify.FAN_REPORT_DFID_NAME | fanotify.FAN_REPORT_FID
        fd = _checked(libc.fanotify_init(flags, os.O_RDONLY | os.O_LARGEFILE), "fanotify_init")
        try:
            self._mount_fd = os.open(self._mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            self._fd = fd
            self._mark(fanotify.FAN_MARK_ADD)  # once, to fail here where this node cannot have a journal
            self._mark(fanotify.FAN_MARK_REMOVE)
        except BaseException:
            os.close(fd)
            if self._mount_fd >= 0:
                os.close(self._mount_fd)
            self._fd = self._mount_fd = -1
            raise
        self._stop.clear()
        self._drainer = threading.Thread(target=self._keep_draining, name="corral-change-journal", daemon=True)
        self._drainer.start()

    def close(self) -> None:
        self._stop.set()
        if self._drainer is not None:
            self._drainer.join()
            self._drainer = None
        with self._draining, self._lock:
            for fd in (self._fd, self._mount_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._mount_fd = -1
            self._layers.clear()
            self._uppers.clear()

    def _mark(self, action: int) -> None:
        """Add or remove the mark on the pool's filesystem: it is there only while a step is open, because while it
        is, every create and write of every sandbox costs an event (creating 20,000 files in a sandbox with no step
        took ~20% longer, and ~100 ms of the server's CPU to read them)."""
        flags = action | fanotify.FAN_MARK_FILESYSTEM
        _checked(libc.fanotify_mark(self._fd, flags, _MASK, self._mount_fd, None), "fanotify_mark")
        self._marked = action == fanotify.FAN_MARK_ADD

    def begin(self, tree_id: int, upper: Path) -> int:
        """The position of a step about to take its clock in the layer of subvolume ``tree_id`` (upper dir
        ``upper``): its events are kept from here on. Then ``started`` with the clock, or ``abandon``.

        Reads the queue first when little is queued and no drain is under way (it runs on the event loop), so what
        happened before the step is not among its candidates: those pass the clock's check only where a step's
        change touched their inode too, as a new whiteout does every whiteout's (overlayfs links them all to one
        inode). Left queued, a whiteout made just before the step would be named again by it, as the walk names it."""
        self._drain(wait=False, up_to_bytes=_INLINE_DRAIN_BYTES)
        with self._lock:  # the layer is there before the position is handed out (the drain's lookup relies on it)
            layer = self._layers.get(tree_id)
            if layer is None:
                if tree_id not in self._uppers:  # as the kernel writes a directory's path (the events' are matched)
                    self._uppers[tree_id] = os.path.realpath(upper)
                layer = self._layers[tree_id] = _Layer()
            with self._reading:
                position = self._next
            layer.pending.append(position)
            if not self._marked:
                try:
                    self._mark(fanotify.FAN_MARK_ADD)
                except OSError:
                    log.exception("could not watch the writable layers' changes; this step walks its layer")
                    layer.floor = max(layer.floor, position + 1)
        return position

    def started(self, tree_id: int, clock: float, position: int) -> None:
        """The step that got ``position`` from ``begin`` took ``clock``."""
        with self._lock:
            layer = self._layers.get(tree_id)
            if layer is not None and position in layer.pending:
                layer.pending.remove(position)
                bisect.insort(layer.starts, (clock, position))
                self._trim(tree_id, layer)

    def abandon(self, tree_id: int, position: int) -> None:
        """The step that got ``position`` took no clock."""
        with self._lock:
            layer = self._layers.get(tree_id)
            if layer is not None and position in layer.pending:
                layer.pending.remove(position)
                self._trim(tree_id, layer)

    def forget(self, tree_id: int) -> None:
        """The sandbox has gone."""
        with self._lock:
            self._layers.pop(tree_id, None)
            self._uppers.pop(tree_id, None)
            self._unmark_when_idle()

    def is_small(self, tree_id: int) -> bool:
        """Whether the layer's open steps hold few events, so an answer is cheap enough for the event loop."""
        layer = self._layers.get(tree_id)
        return layer is not None and len(layer.events) <= _INLINE_EVENTS

    def changed(self, tree_id: int, since: float, pids: Iterable[int] = (), *, wait: bool = True) -> list[str] | None:
        """What the walk would name for the step whose clock is ``since``, and what it removed that the walk cannot
        see (module docstring); None when only the walk can say.

        ``pids``: the sandbox's processes; a file they map shared and writable is a candidate (writes through a
        mapping send no event). Reads the queue first, in a thread; with ``wait=False`` (on the event loop, after
        ``is_small``) only when little is queued and no other read is under way, else None with the step left as it
        was, for a call in a thread."""
        if self._fd < 0 or not self._drain(wait=wait, up_to_bytes=None if wait else _INLINE_DRAIN_BYTES):
            return None
        with self._lock:
            layer = self._layers.get(tree_id)
            if layer is None:
                return None
            index = bisect.bisect_right(layer.starts, (since, float("inf"))) - 1
            if index < 0:  # no step of this layer began at or before the clock: not one this journal saw
                return None
            position = layer.starts.pop(index)[1]
            events = layer.events[bisect.bisect_left(layer.events, position, key=lambda event: event[0]) :]
            answerable = position >= max(layer.floor, self._floor)
            upper = self._uppers[tree_id]
            self._trim(tree_id, layer)
        if not answerable:
            return None
        try:
            return self._check(upper, events, pids, _since_ns(since))
        except _Unsure:
            return None

    def _trim(self, tree_id: int, layer: _Layer) -> None:
        """Keep only the steps still open and the events they may ask about; a layer with none stops collecting."""
        old = time.time() - _START_MAX_AGE_S
        while layer.starts and (len(layer.starts) > _STARTS_MAX or layer.starts[0][0] < old):
            del layer.starts[0]
        if not layer.starts and not layer.pending:
            self._layers.pop(tree_id, None)
            self._unmark_when_idle()
            return
        oldest = min([position for _, position in layer.starts] + layer.pending)
        del layer.events[: bisect.bisect_left(layer.events, oldest, key=lambda event: event[0])]

    def _unmark_when_idle(self) -> None:
        if not self._layers and self._marked:
            try:
                self._mark(fanotify.FAN_MARK_REMOVE)
            except OSError:  # it stays: events with no step to keep them are read and dropped
                log.exception("could not remove the writable layers' fanotify mark")

    def _keep_draining(self) -> None:
        while not self._stop.wait(self._drain_interval_s):
            self._drain()

    def _queued_bytes(self) -> int:
        """What the queue holds (FIONREAD: the kernel adds up its events' sizes)."""
        if self._fd < 0:
            return 0
        found = bytearray(4)
        fcntl.ioctl(self._fd, termios.FIONREAD, found)
        return int.from_bytes(found, sys.byteorder)

    def _drain(self, *, wait: bool = True, up_to_bytes: int | None = None) -> bool:
        """Read the queue until it is empty as of this call (what comes meanwhile may wait for the next); with
        ``wait=False`` only if no other drain is under way, with ``up_to_bytes`` only if it holds no more: whether
        it read. A read that fails loses its events: the steps open then go to the walk."""
        if not self._draining.acquire(blocking=wait):
            return False
        try:
            queued = self._queued_bytes()
            if up_to_bytes is not None and queued > up_to_bytes:
                return False
            if queued:
                self._read_queue()
        except OSError:
            log.exception("reading the writable layers' change events failed; the steps open go to the walk")
            with self._lock:
                self._floor = self._next + 1
        finally:
            self._draining.release()
        return True

    def _read_queue(self) -> None:
        read_events = 0
        while self._fd >= 0 and read_events <= self._queue_limit:
            with self._reading:
                position = self._next
                self._next += 1
                try:
                    data = os.read(self._fd, _READ_BYTES)
                except BlockingIOError:
                    return
            read_events += self._file(data, position)
            if len(data) < _READ_BYTES - _EVENT_BYTES_MAX:  # the read emptied the queue
                return

    def _file(self, data: bytes, position: int) -> int:
        """Put a read's events into the layers they happened in; how many events it held."""
        count, offset, lost = 0, 0, False
        filed: dict[int, list[_Event]] = {}
        while offset + EVENT_METADATA.size <= len(data):
            event_len, _, _, metadata_len, mask, _, _ = EVENT_METADATA.unpack_from(data, offset)
            info, end = offset + metadata_len, offset + event_len
            offset = end
            count += 1
            if mask & fanotify.FAN_Q_OVERFLOW:
                lost = True
                continue
            if info + _FIRST_TREE_ID_OFFSET + _TREE_ID.size > end:
                continue
            # Every record of an event is of one subvolume: the first one's tree id says whose layer it is.
            tree_id = _TREE_ID.unpack_from(data, info + _FIRST_TREE_ID_OFFSET)[0]
            if tree_id not in self._layers:  # a dict lookup is atomic; begin adds a layer before its position
                continue
            event = _parse(data, info, end, position, mask)
            if event is not None:
                filed.setdefault(tree_id, []).append(event)
        with self._lock:
            for tree_id, events in filed.items():
                layer = self._layers.get(tree_id)
                if layer is None:
                    continue
                layer.events += events
                if len(layer.events) > _EVENTS_MAX:
                    layer.floor = position + 1
                    layer.events.clear()
            if lost:
                self._floor = position + 1
        return count

    def _check(self, upper: str, events: list[_Event], pids: Iterable[int], since_ns: int) -> list[str]:
        """The candidates' entries that the walk would name; _Unsure when a changed inode has a name no event gave."""
        directories: dict[bytes, str | None] = {}
        candidates: set[str] = set()
        made: set[str] = set()  # names the step gave a file (created, linked, moved there)
        removed: set[str] = set()  # names it took one from (deleted, moved away)
        relinked: list[tuple[int, int]] = []  # (inode, links) of files whose link count changed
        for _, handle, name, mask in events:
            if not name:
                found = self._stat(handle)
                if found is not None and found.st_nlink and not _is_directory_or_whiteout(found):
                    relinked.append((found.st_ino, found.st_nlink))
                continue
            if handle not in directories:
                directories[handle] = self._directory(handle)
            directory = directories[handle]
            if directory == upper:
                relative = "/" + name
            elif directory is not None and directory.startswith(upper) and directory[len(upper)] == "/":
                relative = f"{directory[len(upper) :]}/{name}"
            else:
                continue  # gone, or overlay's work dir
            candidates.add(relative)
            if mask & _MADE:
                made.add(relative)
            if mask & _REMOVED:
                removed.add(relative)
        candidates.update(_shared_writable_mappings(pids))
        changed: list[str] = []
        inodes: set[int] = set()
        for relative in candidates:
            try:
                entry = os.lstat(upper + relative)
            except OSError:  # gone, or a mapping of a file outside the layer
                if relative in removed and relative not in made and relative != AGENT_PATH:
                    changed.append(relative)  # a file from before the step (an earlier one's), removed: no whiteout
                continue
            if stat.S_ISDIR(entry.st_mode):
                continue
            inodes.add(entry.st_ino)
            if entry.st_ctime_ns >= since_ns and relative != AGENT_PATH:
                changed.append(relative)
        if any(links > 1 or inode not in inodes for inode, links in relinked):
            raise _Unsure  # another name of a hard link changed (its ctime) with no event naming it
        changed.sort()
        return changed[:CHANGED_PATHS_MAX]

    def _open(self, handle: bytes, flags: int) -> int | None:
        """An O_PATH descriptor of the handle's inode; None when it is gone."""
        fd: int = libc.open_by_handle_at(self._mount_fd, handle, os.O_PATH | os.O_CLOEXEC | flags)
        if fd >= 0:
            return fd
        if ctypes.get_errno() in _GONE:
            return None
        raise _Unsure

    def _stat(self, handle: bytes) -> os.stat_result | None:
        fd = self._open(handle, os.O_NOFOLLOW)
        if fd is None:
            return None
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def _directory(self, handle: bytes) -> str | None:
        """The directory's path as this process sees it (the kernel connects a directory's handle to its path);
        None when it is gone."""
        fd = self._open(handle, os.O_DIRECTORY)
        if fd is None:
            return None
        try:
            return os.readlink(f"/proc/self/fd/{fd}") if os.fstat(fd).st_nlink else None
        finally:
            os.close(fd)


def _parse(data: bytes, info: int, end: int, position: int, mask: int) -> _Event | None:
    """An event's directory handle and name, or, for a link count (no name), the inode's own handle."""
    handle, name = b"", ""
    while info + _INFO_HEADER.size <= end:
        info_type, _, info_len = _INFO_HEADER.unpack_from(data, info)
        if info_type == _INFO_DFID_NAME or (info_type == _INFO_FID and not handle):
            start = info + _INFO_HEADER.size + _FSID_BYTES
            handle_bytes, handle_type = _HANDLE_HEADER.unpack_from(data, start)
            if handle_type not in _BTRFS_HANDLE_TYPES:
                return None
            handle = data[start : start + _HANDLE_HEADER.size + handle_bytes]
            if info_type == _INFO_DFID_NAME:
                name_start = start + len(handle)
                name = os.fsdecode(data[name_start : data.index(b"\0", name_start)])
                break
        info += max(info_len, _INFO_HEADER.size)
    return (position, handle, name, mask) if handle else None


def _is_directory_or_whiteout(entry: os.stat_result) -> bool:
    """Overlayfs's whiteouts share one inode (a 0/0 character device): its link count says nothing of a name."""
    return stat.S_ISDIR(entry.st_mode) or (stat.S_ISCHR(entry.st_mode) and entry.st_rdev == 0)


def _shared_writable_mappings(pids: Iterable[int]) -> set[str]:
    """Files the processes map shared and writable, as they see them (their root is the sandbox's layer).

    The kernel writes a mapping's path relative to the reader's root: a process in its own mount namespace
    (a container) has it as it sees it; one that is only chrooted, under its root's path, which is taken off."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps", "rb") as maps:
                text = maps.read()
            if b"w-s " not in text and b"wxs " not in text:  # the usual case: no shared writable mapping
                continue
            root = os.readlink(f"/proc/{pid}/root").rstrip("/")
        except OSError:
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[1][1:2] == b"w" and fields[1][3:4] == b"s" and fields[5][:1] == b"/":
                path = os.fsdecode(fields[5])  # a deleted file's ends " (deleted)": no entry, and the check drops it
                found.add(path[len(root) :] if root and path.startswith(root + "/") else path)
    return found


class StepFiles:
    """A container sandbox's step clock and the files its step changed: the journal's answer where the sandbox's
    writable layer is a subvolume of the pool (the journal opened by the first step that asks), else the walk's."""

    def __init__(self, pool: QuotaPool) -> None:
        self._pool = pool
        self._journal = ChangeJournal(pool.mountpoint)
        self._journal_error: OSError | None = None

    def _tree(self, sandbox_id: str) -> int | None:
        """The sandbox's subvolume id; None when it has none or this node cannot have a journal."""
        if self._journal.is_open and (known := self._pool.known_tree_id(sandbox_id)) is not None:
            return known  # every step after the sandbox's first: no stat
        if not self._pool.has(sandbox_id) or self._journal_error is not None:
            return None
        if not self._journal.is_open:
            try:
                self._journal.open()
            except OSError as exc:
                self._journal_error = exc
                log.warning("%s: a step's changed files are found by walking its sandbox's writable layer", exc)
                return None
        return self._pool.tree_id(sandbox_id)

    async def clock(self, sandbox_id: str, marker: Path, upper: Path) -> float:
        """The step's clock: ``marker``'s ctime once it has ticked past what it was (the journal is told the step
        begins before, and given the clock after)."""
        tree_id = self._tree(sandbox_id)
        position = self._journal.begin(tree_id, upper) if tree_id is not None else 0
        try:
            before = _touch(marker)
            while (now := _touch(marker)) <= before:
                await asyncio.sleep(0.0005)
        except BaseException:
            if tree_id is not None:
                self._journal.abandon(tree_id, position)
            raise
        if tree_id is not None:
            self._journal.started(tree_id, now / 1e9, position)
        return now / 1e9

    async def changed(self, sandbox_id: str, upper: Path, since: float, pids: Callable[[], list[int]]) -> ChangedPaths:
        """The paths the step whose clock is ``since`` changed, and whether the journal or the walk found them.
        ``pids``: the sandbox's processes (whose shared writable mappings are candidates). A small answer is made
        on the event loop: a thread's hand-off cost ~300 µs in the server, more than the answer."""
        tree_id = self._tree(sandbox_id) if self._journal.is_open else None
        processes: list[int] | None = None
        if tree_id is not None and self._journal.is_small(tree_id):
            processes = pids()
            if len(processes) <= _INLINE_PROCESSES:
                found = self._journal.changed(tree_id, since, processes, wait=False)
                if found is not None:
                    return ChangedPaths(found, "journal")

        def answer() -> ChangedPaths:
            in_sandbox = pids() if processes is None else processes
            found = self._journal.changed(tree_id, since, in_sandbox) if tree_id is not None else None
            return (
                ChangedPaths(changed_since(upper, since), "walk") if found is None else ChangedPaths(found, "journal")
            )

        return await asyncio.to_thread(answer)

    def forget(self, tree_id: int | None) -> None:
        """A sandbox's subvolume has gone (None: it was never looked up)."""
        if tree_id is not None:
            self._journal.forget(tree_id)

    def close(self) -> None:
        self._journal.close()


def _touch(marker: Path) -> int:
    """The marker's ctime once its times are set to now (one syscall: 13 against 48 µs for a write and a close;
    made first for a sandbox an older server started, which has none)."""
    try:
        os.utime(marker)
    except FileNotFoundError:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_bytes(b"")
    return os.stat(marker).st_ctime_ns
