"""File operations on a sandbox's tree, done from the host and confined to its root.

Owns ``ConfinedTree``: read, write, stat, list, mkdir, remove and tar in/out for
one sandbox root (usually ``/proc/<init-pid>/root``). Every path is resolved by
the kernel with ``openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)`` from an
``O_PATH`` fd of the root, so ``..`` and symlinks (absolute or relative) stay in
the sandbox. stat, mkdir, remove and write act on the final component through
its parent's fd and never follow a final symlink; tree walks (recursive remove,
write_tar) never follow symlinks at all; tar members are created through the
same confined operations, never ``tarfile.extract`` on a host path. Anything
on procfs or sysfs is refused: the server is root and must not reach the
sandbox's /proc or /sys this way. OS errors become ``corral.sdk`` errors here.

User paths are normalised lexically first (``/a/../b`` is ``/b``) and are
always absolute inside the sandbox; relative paths are taken from ``/``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import math
import os
import posixpath
import secrets
import stat
import tarfile
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import IO, BinaryIO, Literal

from corral.api.errors import (
    Conflict,
    CorralError,
    InternalError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    PermissionDenied,
)
from corral.api.models import FileInfo

__all__ = ["ConfinedTree"]

MAX_PATH_BYTES = 4096
MAX_TAR_MEMBERS = 100_000
# Tree walks hold one fd per level; this keeps them well under RLIMIT_NOFILE.
MAX_TREE_DEPTH = 256
CHUNK_BYTES = 1 << 20
DIR_MODE = 0o755
# Permission bits we set; setuid/setgid are stripped because the server is root (except where an image build
# asks to keep them: extract_tar's keep_owners).
_MODE_BITS = 0o1777
_IMAGE_MODE_BITS = 0o7777

_SYS_OPENAT2 = 437  # same number on every architecture with the unified syscall table
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_RESOLVE_IN_ROOT = 0x10
_RESOLVE_IN_SANDBOX = _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS
_RESOLVE_ONE_NAME = _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS
_OPENAT2_RETRIES = 8  # EAGAIN: a concurrent rename or mount raced the lookup
_PROC_SUPER_MAGIC = 0x9FA0
_SYSFS_MAGIC = 0x62656572

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY
_PATH_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class _StatFs(ctypes.Structure):
    # Only f_type is read; the padding covers the rest of struct statfs (120 bytes on x86_64).
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]


def _openat2(dir_fd: int, path: str, flags: int, resolve: int) -> int:
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    encoded = os.fsencode(path)
    err = errno.EAGAIN
    for _ in range(_OPENAT2_RETRIES):
        fd = _libc.syscall(
            ctypes.c_long(_SYS_OPENAT2),
            ctypes.c_int(dir_fd),
            ctypes.c_char_p(encoded),
            ctypes.byref(how),
            ctypes.c_size_t(ctypes.sizeof(how)),
        )
        if fd >= 0:
            return int(fd)
        err = ctypes.get_errno()
        if err not in (errno.EAGAIN, errno.EINTR):
            break
    raise OSError(err, os.strerror(err), path)


def _is_pseudo_fs(fd: int) -> bool:
    buf = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf.f_type in (_PROC_SUPER_MAGIC, _SYSFS_MAGIC)


def _pseudo_fs_refused(display: str) -> InvalidRequest:
    return InvalidRequest(
        f"refusing to access {display}: it is on procfs or sysfs, which the file API "
        "does not expose; run a command inside the sandbox instead"
    )


def _open_checked(dir_fd: int, path: str, flags: int, resolve: int, display: str) -> int:
    """``_openat2``, refusing (and closing) an fd on procfs or sysfs."""
    fd = _openat2(dir_fd, path, flags, resolve)
    try:
        if _is_pseudo_fs(fd):
            raise _pseudo_fs_refused(display)
    except BaseException:
        os.close(fd)
        raise
    return fd


_ERRNO_ERRORS: dict[int, tuple[type[CorralError], str]] = {
    errno.ENOENT: (NotFound, "no such file or directory in sandbox: {path}"),
    errno.ENOTDIR: (InvalidRequest, "a component of the path is not a directory in sandbox: {path}"),
    errno.EISDIR: (InvalidRequest, "is a directory in sandbox: {path}; list it or name a file inside it"),
    errno.EEXIST: (Conflict, "already exists in sandbox: {path}; remove it first"),
    errno.ENOTEMPTY: (Conflict, "directory not empty in sandbox: {path}; pass recursive=True to remove its contents"),
    errno.EBUSY: (Conflict, "busy (a mount point or in use) in sandbox: {path}"),
    errno.EACCES: (PermissionDenied, "permission denied in sandbox: {path}"),
    errno.EPERM: (PermissionDenied, "operation not permitted in sandbox: {path}"),
    errno.EROFS: (PermissionDenied, "read-only file system in sandbox: {path}"),
    errno.ELOOP: (InvalidRequest, "too many symbolic links, or a symlink where none is allowed, in sandbox: {path}"),
    errno.ENAMETOOLONG: (InvalidRequest, "file name too long in sandbox: {path}; use shorter names"),
    errno.EXDEV: (InvalidRequest, "path crosses a mount it may not cross in sandbox: {path}"),
    errno.ENOSPC: (PayloadTooLarge, "no space left in sandbox writing {path}; free space or write less"),
    errno.EDQUOT: (PayloadTooLarge, "disk quota exceeded in sandbox writing {path}; free space or write less"),
}


@contextlib.contextmanager
def _translated(path: str) -> Iterator[None]:
    """Turn ``OSError`` into the matching Corral error naming the sandbox path."""
    try:
        yield
    except OSError as exc:
        cls, template = _ERRNO_ERRORS.get(exc.errno or 0, (InternalError, "{reason} in sandbox: {path}"))
        raise cls(template.format(path=path, reason=exc.strerror or exc)) from exc


def _normalise(path: str, *, final_component: bool = False) -> str:
    """Absolute, lexically normalised sandbox path; ``final_component`` also
    refuses a last component of ``.`` or ``..`` (operations that name an entry)."""
    if "\x00" in path:
        raise InvalidRequest(f"path contains a NUL byte: {path!r}; remove it")
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise InvalidRequest(f"path is longer than {MAX_PATH_BYTES} bytes; use a shorter path")
    normal = posixpath.normpath("/" + path.lstrip("/"))
    if final_component and (normal == "/" or path.rstrip("/").rpartition("/")[2] in (".", "..")):
        raise InvalidRequest(f"path must name an entry below /, not '/', '.' or '..': {path!r}")
    return normal


_KINDS: dict[int, Literal["file", "dir", "symlink"]] = {
    stat.S_IFREG: "file",
    stat.S_IFDIR: "dir",
    stat.S_IFLNK: "symlink",
}


def _file_info(path: str, st: os.stat_result, link_target: str | None) -> FileInfo:
    return FileInfo(
        path=path,
        name=posixpath.basename(path) or "/",
        type=_KINDS.get(stat.S_IFMT(st.st_mode), "other"),
        size=st.st_size,
        mode=stat.S_IMODE(st.st_mode),
        mtime=st.st_mtime,
        uid=st.st_uid,
        gid=st.st_gid,
        link_target=link_target,
    )


def _mtime_ns(mtime: float) -> tuple[int, int] | None:
    """``os.utime`` times for a tar mtime, or None when it cannot be represented."""
    if not math.isfinite(mtime):
        return None
    ns = int(mtime * 1_000_000_000)
    return (ns, ns) if -(1 << 63) < ns < (1 << 63) else None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fill_file(
    parent_fd: int,
    name: str,
    *,
    chunks: Iterable[bytes],
    mode: int,
    uid: int | None,
    gid: int | None,
    mtime: float | None,
    mode_bits: int = _MODE_BITS,
) -> None:
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=parent_fd)
    try:
        for chunk in chunks:
            _write_all(fd, chunk)
        if uid is not None or gid is not None:
            os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
        os.fchmod(fd, mode & mode_bits)  # after fchown, which clears setuid/setgid
        times = None if mtime is None else _mtime_ns(mtime)
        if times is not None:
            os.utime(fd, ns=times)
    finally:
        os.close(fd)


def _make_symlink(
    parent_fd: int, name: str, *, target: str, mtime: float, owner: tuple[int | None, int | None] = (None, None)
) -> None:
    os.symlink(target, name, dir_fd=parent_fd)
    if owner != (None, None):
        os.chown(name, -1 if owner[0] is None else owner[0], -1 if owner[1] is None else owner[1],
                 dir_fd=parent_fd, follow_symlinks=False)  # fmt: skip
    times = _mtime_ns(mtime)
    if times is not None:
        os.utime(name, ns=times, dir_fd=parent_fd, follow_symlinks=False)


def _make_hardlink(parent_fd: int, name: str, *, source_fd: int, source_name: str) -> None:
    os.link(source_name, name, src_dir_fd=source_fd, dst_dir_fd=parent_fd, follow_symlinks=False)


@dataclass
class _Budget:
    """Bytes still allowed; ``take`` raises PayloadTooLarge with ``message`` past zero."""

    remaining: int
    message: str

    def take(self, nbytes: int) -> None:
        self.remaining -= nbytes
        if self.remaining < 0:
            raise PayloadTooLarge(self.message)


def _budgeted_chunks(reader: IO[bytes], budget: _Budget) -> Iterator[bytes]:
    while chunk := reader.read(CHUNK_BYTES):
        budget.take(len(chunk))
        yield chunk


@dataclass
class _Entry:
    """One step of a tree walk: ``name`` inside ``dir_fd``; ``leaving`` marks a
    directory again after all its children (``st`` is then its earlier lstat)."""

    dir_fd: int
    name: str
    rel: str
    st: os.stat_result
    leaving: bool = False


_DirTimes = list[tuple[str, float]]


class ConfinedTree:
    """File operations confined to one sandbox root."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        root_path = os.fspath(root)
        try:
            self._root_fd = os.open(root_path, _PATH_DIR_FLAGS | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise NotFound(f"sandbox root does not exist: {root_path}; the sandbox may have ended") from exc
        except OSError as exc:
            raise InvalidRequest(f"cannot open sandbox root {root_path}: {exc.strerror}") from exc

    def close(self) -> None:
        if self._root_fd >= 0:
            fd, self._root_fd = self._root_fd, -1
            os.close(fd)

    def __enter__(self) -> ConfinedTree:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- public operations --------------------------------------------------

    def read(self, path: str, *, max_bytes: int) -> bytes:
        normal = _normalise(path)
        budget = _Budget(max_bytes, f"file is larger than {max_bytes} bytes: {normal}; download it as a stream")
        with _translated(normal), self._open_regular(normal) as reader:
            if os.fstat(reader.fileno()).st_size > max_bytes:
                raise PayloadTooLarge(budget.message)
            return b"".join(_budgeted_chunks(reader, budget))  # counted again: the file may grow

    def open_read(self, path: str) -> BinaryIO:
        normal = _normalise(path)
        with _translated(normal):
            return self._open_regular(normal)

    def write(
        self,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        make_parents: bool = True,
        uid: int | None = None,
        gid: int | None = None,
    ) -> FileInfo:
        """Atomic replace (temp file + rename); a symlink at ``path`` is replaced, not followed."""
        normal = _normalise(path, final_component=True)
        build = functools.partial(_fill_file, chunks=(data,), mode=mode, uid=uid, gid=gid, mtime=None)
        return self._replace(normal, build, make_parents=make_parents, uid=uid, gid=gid)

    def stat(self, path: str) -> FileInfo:
        """Metadata of ``path`` itself: a final symlink is not followed."""
        normal = _normalise(path)
        with _translated(normal), self._parent(normal) as (parent_fd, name):
            return self._info(parent_fd, name, normal)

    def list(self, path: str) -> list[FileInfo]:
        normal = _normalise(path)
        with _translated(normal), self._opened(normal, _DIR_FLAGS) as dir_fd:
            infos = []
            for name in sorted(os.listdir(dir_fd)):
                with contextlib.suppress(FileNotFoundError):  # removed while listing
                    infos.append(self._info(dir_fd, name, posixpath.join(normal, name)))
            return infos

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> FileInfo:
        normal = _normalise(path, final_component=True)
        with _translated(normal), self._parent(normal, create=parents) as (parent_fd, name):
            try:
                os.mkdir(name, 0o700, dir_fd=parent_fd)
            except FileExistsError:
                info = self._info(parent_fd, name, normal)
                if parents and info.type == "dir":
                    return info
                what = "a directory" if info.type == "dir" else f"a {info.type}, not a directory"
                raise Conflict(f"already exists in sandbox as {what}: {normal}; remove it first") from None
            dir_fd = self._child(parent_fd, name, _DIR_FLAGS, normal)
            try:
                os.fchmod(dir_fd, mode & _MODE_BITS)
            finally:
                os.close(dir_fd)
            return self._info(parent_fd, name, normal)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        """Remove an entry; a recursive removal walks by dir fd and never follows a symlink."""
        normal = _normalise(path, final_component=True)
        with _translated(normal), self._parent(normal) as (parent_fd, name):
            if not stat.S_ISDIR(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=parent_fd)
            elif not recursive:
                os.rmdir(name, dir_fd=parent_fd)
            else:
                with contextlib.closing(self._walk(parent_fd, name, name, normal, skip_pseudo_fs=False)) as walk:
                    for entry in walk:
                        if entry.leaving:
                            os.rmdir(entry.name, dir_fd=entry.dir_fd)
                        elif not stat.S_ISDIR(entry.st.st_mode):
                            with contextlib.suppress(FileNotFoundError):
                                os.unlink(entry.name, dir_fd=entry.dir_fd)

    def rename(self, source: str, dest: str) -> FileInfo:
        src, dst = _normalise(source, final_component=True), _normalise(dest, final_component=True)
        if src == "/" or dst == "/":
            raise InvalidRequest("the sandbox's root cannot be renamed, nor replaced")
        if (dst + "/").startswith(src + "/"):
            raise InvalidRequest(f"cannot move {src} into itself ({dst})")
        with _translated(src), self._parent(src) as (src_fd, src_name):
            os.stat(src_name, dir_fd=src_fd, follow_symlinks=False)  # a missing source: nothing made for the dest
            with _translated(dst), self._parent(dst, create=True) as (dst_fd, dst_name):
                return self._rename_into(src_fd, src_name, dst_fd, dst_name, dst)

    def _rename_into(self, src_fd: int, src_name: str, dst_fd: int, dst_name: str, dst: str) -> FileInfo:
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(os.stat(dst_name, dir_fd=dst_fd, follow_symlinks=False).st_mode):
                raise Conflict(f"already exists in sandbox as a directory: {dst}; remove it first")
        os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        return self._info(dst_fd, dst_name, dst)

    def write_tar(self, path: str, fileobj: BinaryIO) -> None:
        """Uncompressed PAX tar of ``path``; directories recurse, symlinks are
        stored as symlinks, other special files and procfs/sysfs mounts are skipped.
        On error the archive is left without its end marker, so it reads as truncated."""
        normal = _normalise(path)
        tar = tarfile.open(fileobj=fileobj, mode="w|", format=tarfile.PAX_FORMAT)
        with _translated(normal), self._parent(normal) as (parent_fd, name):
            rel = "" if normal == "/" else name  # the root's entries are stored without a prefix
            with contextlib.closing(self._walk(parent_fd, name, rel, normal, skip_pseudo_fs=True)) as walk:
                for entry in walk:
                    self._add_to_tar(tar, entry)
        tar.close()

    def extract_tar(self, dest: str, fileobj: BinaryIO, *, max_bytes: int, keep_owners: bool = False) -> int:
        """Unpack a plain or compressed tar stream under ``dest``; returns how many
        members were created. Regular file bytes count against ``max_bytes``.
        Device nodes and fifos are skipped; owners are not restored (entries
        belong to the server's user); setuid/setgid bits are stripped, unless
        ``keep_owners`` (an image build's COPY: owners and all mode bits as the
        archive says, as image layers keep them; sandboxes run with
        no_new_privs, so the bits grant nothing there, or root inside the sandbox where it allows setuid
        programs, ``corral.setuid``). Members
        are created through the sandbox root, so a member below a symlink that
        an earlier member created lands wherever that symlink points inside the
        sandbox, as with ``tar -x`` run inside it."""
        dest_normal = _normalise(dest)
        with _translated(dest_normal):
            os.close(self._ensure_dir(dest_normal, uid=None, gid=None))
        budget = _Budget(
            max_bytes,
            f"tar archive unpacks to more than {max_bytes} bytes into {dest_normal}; upload less or raise the limit",
        )
        created = 0
        dir_times: _DirTimes = []
        try:
            with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
                for index, member in enumerate(tar):
                    if index >= MAX_TAR_MEMBERS:
                        raise PayloadTooLarge(f"tar archive has more than {MAX_TAR_MEMBERS} members; split it")
                    if self._extract_member(tar, member, dest_normal, budget, dir_times, keep_owners):
                        created += 1
        except (tarfile.TarError, EOFError) as exc:
            raise InvalidRequest(f"not a valid (optionally compressed) tar archive: {exc}; check the upload") from exc
        for target, mtime in dir_times:
            times = _mtime_ns(mtime)
            if times is not None:
                with _translated(target), self._opened(target, _DIR_FLAGS) as dir_fd:
                    os.utime(dir_fd, ns=times)
        return created

    def open_fd(self, path: str, flags: int) -> int:
        """A raw fd for ``path``, resolved by the kernel inside the root (procfs and sysfs refused); the caller
        closes it. Raises OSError."""
        return self._open(_normalise(path), flags)

    # -- helpers ------------------------------------------------------------

    def _root(self) -> int:
        if self._root_fd < 0:
            raise InternalError("this ConfinedTree is closed; open a new one")
        return self._root_fd

    def _open(self, normal: str, flags: int) -> int:
        """Open a sandbox path, resolved by the kernel inside the root."""
        return _open_checked(self._root(), normal.lstrip("/") or ".", flags, _RESOLVE_IN_SANDBOX, normal)

    def _child(self, dir_fd: int, name: str, flags: int, display: str) -> int:
        """Open one entry of ``dir_fd`` without following any symlink."""
        return _open_checked(dir_fd, name, flags | os.O_NOFOLLOW, _RESOLVE_ONE_NAME, display)

    @contextlib.contextmanager
    def _opened(self, normal: str, flags: int) -> Iterator[int]:
        fd = self._open(normal, flags)
        try:
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _parent(
        self,
        normal: str,
        *,
        create: bool = False,
        uid: int | None = None,
        gid: int | None = None,
    ) -> Iterator[tuple[int, str]]:
        """The parent directory's fd and the final name (the root's are itself and
        "."), creating missing parents if asked."""
        parent, name = posixpath.split(normal)
        if normal == "/":
            fd, name = os.dup(self._root()), "."
        elif create:
            fd = self._ensure_dir(parent, uid=uid, gid=gid)
        else:
            fd = self._open(parent, _PATH_DIR_FLAGS)
        try:
            yield fd, name
        finally:
            os.close(fd)

    def _ensure_dir(self, normal: str, *, uid: int | None, gid: int | None) -> int:
        """Open directory ``normal``, creating missing levels (DIR_MODE, owned by uid/gid)."""
        missing: list[str] = []
        existing = normal
        while True:
            try:
                fd = self._open(existing, _DIR_FLAGS)
                break
            except FileNotFoundError:
                if existing == "/":
                    raise
                existing, name = posixpath.split(existing)
                missing.append(name)
        try:
            for name in reversed(missing):
                try:
                    os.mkdir(name, 0o700, dir_fd=fd)
                    made = True
                except FileExistsError:  # created concurrently
                    made = False
                child = self._child(fd, name, _DIR_FLAGS, normal)
                fd, parent_fd = child, fd
                os.close(parent_fd)
                if made:
                    if uid is not None or gid is not None:
                        os.fchown(fd, -1 if uid is None else uid, -1 if gid is None else gid)
                    os.fchmod(fd, DIR_MODE)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _info(self, dir_fd: int, name: str, path: str) -> FileInfo:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        target = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(st.st_mode) else None
        return _file_info(path, st, target)

    def _open_regular(self, normal: str) -> BinaryIO:
        return self._reopen_regular(self._open(normal, os.O_PATH), normal)

    def _reopen_regular(self, path_fd: int, display: str) -> BinaryIO:
        """Readable file for an ``O_PATH`` fd (which it closes) if it is a regular
        file; opening by O_PATH first means a fifo or device is never opened."""
        try:
            mode = os.fstat(path_fd).st_mode
            if stat.S_ISDIR(mode):
                raise InvalidRequest(f"is a directory in sandbox: {display}; list it or name a file inside it")
            if not stat.S_ISREG(mode):
                raise InvalidRequest(f"not a regular file in sandbox: {display}; only regular files can be read")
            fd = os.open(f"/proc/self/fd/{path_fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY)
        finally:
            os.close(path_fd)
        return os.fdopen(fd, "rb")

    def _replace(
        self,
        normal: str,
        build: Callable[[int, str], None],
        *,
        make_parents: bool,
        uid: int | None = None,
        gid: int | None = None,
    ) -> FileInfo:
        """Let ``build`` create a temporary entry beside ``normal``, then rename it
        over ``normal`` so readers see the old entry or the new one, never half.
        A final symlink is replaced, not followed."""
        with _translated(normal), self._parent(normal, create=make_parents, uid=uid, gid=gid) as (parent_fd, name):
            temp = f".corral-{secrets.token_hex(8)}.tmp"
            try:
                build(parent_fd, temp)
                os.rename(temp, name, src_dir_fd=parent_fd, dst_dir_fd=parent_fd)
            finally:
                # Also covers rename onto a hard link of the same file, which leaves temp in place.
                with contextlib.suppress(OSError):
                    os.unlink(temp, dir_fd=parent_fd)
            return self._info(parent_fd, name, normal)

    def _walk(
        self,
        parent_fd: int,
        name: str,
        rel: str,
        display: str,
        *,
        skip_pseudo_fs: bool,
        depth: int = 0,
    ) -> Generator[_Entry, None, None]:
        """Depth-first walk from ``name`` in ``parent_fd`` that never follows a
        symlink; yields each entry before its children and each directory again
        (``leaving``) after them. Entries removed meanwhile are skipped. A procfs
        or sysfs mount is refused, or yielded without its contents when ``skip_pseudo_fs``."""
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        yield _Entry(parent_fd, name, rel, st)
        if not stat.S_ISDIR(st.st_mode):
            return
        if depth >= MAX_TREE_DEPTH:
            raise InvalidRequest(
                f"directory tree under {display} is deeper than {MAX_TREE_DEPTH} levels; "
                "handle its deeper parts separately"
            )
        dir_fd = _openat2(parent_fd, name, _DIR_FLAGS | os.O_NOFOLLOW, _RESOLVE_ONE_NAME)
        try:
            if not _is_pseudo_fs(dir_fd):
                for child in sorted(os.listdir(dir_fd)):
                    with contextlib.suppress(FileNotFoundError):
                        yield from self._walk(
                            dir_fd,
                            child,
                            posixpath.join(rel, child),
                            display,
                            skip_pseudo_fs=skip_pseudo_fs,
                            depth=depth + 1,
                        )
            elif not skip_pseudo_fs:
                raise _pseudo_fs_refused(display)
        finally:
            os.close(dir_fd)
        yield _Entry(parent_fd, name, rel, st, leaving=True)

    def _add_to_tar(self, tar: tarfile.TarFile, entry: _Entry) -> None:
        if entry.leaving or not entry.rel:
            return
        st = entry.st
        info = tarfile.TarInfo(entry.rel)
        info.mode = stat.S_IMODE(st.st_mode)
        info.mtime = int(st.st_mtime)
        info.uid, info.gid = st.st_uid, st.st_gid
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        elif stat.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(entry.name, dir_fd=entry.dir_fd)
            tar.addfile(info)
        elif stat.S_ISREG(st.st_mode):
            path_fd = self._child(entry.dir_fd, entry.name, os.O_PATH, entry.rel)
            with self._reopen_regular(path_fd, entry.rel) as reader:
                info.size = os.fstat(reader.fileno()).st_size
                tar.addfile(info, reader)

    def _extract_member(
        self,
        tar: tarfile.TarFile,
        member: tarfile.TarInfo,
        dest: str,
        budget: _Budget,
        dir_times: _DirTimes,
        keep_owners: bool,
    ) -> bool:
        """Create one member under ``dest``; False if its type is skipped."""
        target = _member_path(dest, member.name)
        uid, gid = (member.uid, member.gid) if keep_owners else (None, None)
        mode_bits = _IMAGE_MODE_BITS if keep_owners else _MODE_BITS
        with _translated(target):
            if member.isdir():
                dir_fd = self._ensure_dir(target, uid=None, gid=None)
                try:
                    if keep_owners:
                        os.fchown(dir_fd, member.uid, member.gid)
                    os.fchmod(dir_fd, member.mode & mode_bits)
                finally:
                    os.close(dir_fd)
                dir_times.append((target, member.mtime))
            elif member.isreg():
                if member.size > budget.remaining:
                    raise PayloadTooLarge(budget.message)
                reader = tar.extractfile(member)
                chunks = _budgeted_chunks(reader, budget) if reader is not None else ()
                build = functools.partial(_fill_file, chunks=chunks, mode=member.mode, uid=uid, gid=gid,
                                          mtime=member.mtime, mode_bits=mode_bits)  # fmt: skip
                self._replace(target, build, make_parents=True)
            elif member.issym():
                build = functools.partial(_make_symlink, target=member.linkname, mtime=member.mtime, owner=(uid, gid))
                self._replace(target, build, make_parents=True)
            elif member.islnk():
                source = _member_path(dest, member.linkname)
                with self._parent(source) as (source_fd, source_name):
                    build = functools.partial(_make_hardlink, source_fd=source_fd, source_name=source_name)
                    self._replace(target, build, make_parents=True)
            else:
                return False
        return True


def _member_path(dest: str, name: str) -> str:
    """Sandbox path of a tar member name, which must stay under ``dest``."""
    relative = posixpath.normpath(name.lstrip("/") or ".")
    if relative == ".." or relative.startswith("../"):
        raise InvalidRequest(f"tar member {name!r} would land outside {dest}; remove '..' from its name")
    return _normalise(posixpath.join(dest, relative))
