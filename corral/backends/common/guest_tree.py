"""File operations inside a VM guest or a gVisor sandbox, through its agent.

The host cannot open such a sandbox's files (a guest kernel, or gVisor's
sentry, serves its root), so each operation is a short script run by the
project's own busybox (EXEC with the tool flag) inside the sandbox's root:
the sandbox's kernel resolves every path, symlinks included, within that
root. The class is a ``FileTree`` (backends/base.py), synchronous, for the
edge's worker threads; the agent traffic itself runs on the event loop.
"""

from __future__ import annotations

import asyncio
import io
import posixpath
import stat
import tarfile
from typing import BinaryIO

from corral.api.errors import (
    Conflict,
    CorralError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ServerUnavailable,
)
from corral.api.models import FileInfo
from corral.backends.common.agent_protocol import AgentConnection, AgentExit, AgentOutput, ExecOrder

__all__ = ["GuestTree"]

_OP_TIMEOUT_S = 120.0
# Script exit codes that mean a caller's mistake, not a failure of the guest.
_E_MISSING, _E_NOT_DIR, _E_IS_DIR, _E_EXISTS, _E_NOT_EMPTY, _E_TOO_BIG = 40, 41, 42, 43, 44, 45
_CALLER_ERRORS: dict[int, tuple[type[CorralError], str]] = {
    _E_MISSING: (NotFound, "no such file or directory in sandbox: {path}"),
    _E_NOT_DIR: (InvalidRequest, "not a directory: {path}"),
    _E_IS_DIR: (InvalidRequest, "is a directory: {path}"),
    _E_EXISTS: (Conflict, "already exists in sandbox: {path}; remove it first"),
    _E_NOT_EMPTY: (Conflict, "directory not empty: {path}; pass recursive=true"),
    _E_TOO_BIG: (PayloadTooLarge, "file is larger than {limit} bytes: {path}; download it as a stream"),
}
_KINDS = {stat.S_IFREG: "file", stat.S_IFDIR: "dir", stat.S_IFLNK: "symlink"}
_STAT_FORMAT = "%f|%s|%Y|%u|%g|%n"

_READ = """
[ -e "$1" ] || exit 40; [ -d "$1" ] && exit 42
[ "$(stat -L -c %s "$1")" -le "$2" ] || exit 45
exec cat -- "$1"
"""
_WRITE = """
dir="$(dirname -- "$1")"
if [ "$2" = 1 ]; then mkdir -p -- "$dir" || exit 1; chown "$4" "$dir"; fi
[ -d "$dir" ] || exit 40
[ -d "$1" ] && [ ! -L "$1" ] && exit 42
tmp="$dir/.corral-write.$$"
cat > "$tmp" && chmod "$3" "$tmp" && chown "$4" "$tmp" && mv -f -- "$tmp" "$1" || { rm -f -- "$tmp"; exit 1; }
stat -c '%f|%s|%Y|%u|%g|%n' -- "$1"
"""
_STAT = """
[ -e "$1" ] || [ -L "$1" ] || exit 40
stat -c '%f|%s|%Y|%u|%g|%n' -- "$1"
"""
_LIST = """
[ -e "$1" ] || exit 40; [ -d "$1" ] || exit 41
cd -- "$1" || exit 1
for f in * .*; do
    case "$f" in .|..) continue ;; esac
    [ -e "$f" ] || [ -L "$f" ] || continue
    stat -c '%f|%s|%Y|%u|%g|%n' -- "$f"
done
"""
_READLINK = """exec readlink -- "$1" """
_RENAME = """
[ -e "$1" ] || [ -L "$1" ] || exit 40
[ -d "$2" ] && [ ! -L "$2" ] && exit 43
mkdir -p -- "$(dirname -- "$2")" || exit 1
mv -f -- "$1" "$2" || exit 1
stat -c '%f|%s|%Y|%u|%g|%n' -- "$2"
"""
_MKDIR = """
if [ -e "$1" ] || [ -L "$1" ]; then
    [ -d "$1" ] && [ "$2" = 1 ] && exec stat -c '%f|%s|%Y|%u|%g|%n' -- "$1"
    exit 43
fi
if [ "$2" = 1 ]; then
    mkdir -p -- "$1" || exit 1
else
    [ -d "$(dirname -- "$1")" ] || exit 40
    mkdir -- "$1" || exit 1
fi
chmod "$3" "$1" && stat -c '%f|%s|%Y|%u|%g|%n' -- "$1"
"""
_REMOVE = """
[ -e "$1" ] || [ -L "$1" ] || exit 40
if [ -d "$1" ] && [ ! -L "$1" ]; then
    if [ "$2" = 1 ]; then exec rm -rf -- "$1"; fi
    rmdir -- "$1" 2>/dev/null || exit 44
else
    exec rm -f -- "$1"
fi
"""
_TAR_OUT = """
[ -e "$1" ] || exit 40
cd -- "$(dirname -- "$1")" || exit 1
if [ "$1" = / ]; then cd / && exec tar -cf - --exclude=./proc --exclude=./sys --exclude=./dev .; fi
exec tar -cf - -- "$(basename -- "$1")"
"""
_TAR_IN = """
mkdir -p -- "$1" || exit 1
exec tar -xf - -o -C "$1"
"""


def _normalise(path: str) -> str:
    if not path.startswith("/"):
        raise InvalidRequest(f"paths in a sandbox are absolute: {path!r}")
    if "\0" in path:
        raise InvalidRequest("NUL byte in path")
    return posixpath.normpath(path).replace("//", "/")


def _parse_stat(line: str, path: str) -> FileInfo:
    mode_hex, size, mtime, uid, gid, _name = line.split("|", 5)
    mode = int(mode_hex, 16)
    return FileInfo(
        path=path,
        name=posixpath.basename(path) or "/",
        type=_KINDS.get(stat.S_IFMT(mode), "other"),
        size=int(size),
        mode=stat.S_IMODE(mode),
        mtime=float(mtime),
        uid=int(uid),
        gid=int(gid),
    )


class GuestTree:
    """File operations confined to one guest sandbox root (same interface as ConfinedTree)."""

    def __init__(self, agent: AgentConnection, loop: asyncio.AbstractEventLoop) -> None:
        self._agent = agent
        self._loop = loop

    def close(self) -> None:
        pass

    def __enter__(self) -> GuestTree:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- running scripts ----------------------------------------------------

    async def _script(self, script: str, args: list[str], stdin: bytes | None, cap: int) -> tuple[int, bytes, bytes]:
        order = ExecOrder(
            argv=["sh", "-c", script, "sh", *args],
            env={"PATH": "/nonexistent", "LC_ALL": "C"},  # applets only: the image's own tools are not trusted
            cwd="/",
            user="root",
            timeout_ms=int(_OP_TIMEOUT_S * 1000),
            output_cap_bytes=cap,
            has_stdin=stdin is not None,
            tool="sandbox",
        )
        out, err = bytearray(), bytearray()
        code = -1
        async for event in self._agent.run(self._agent.new_job_id(), order, stdin):
            if isinstance(event, AgentOutput):
                (out if event.stream == "stdout" else err).extend(event.data)
            elif isinstance(event, AgentExit):
                code = event.exit_code
                if event.timed_out:
                    raise ServerUnavailable(f"file operation timed out in the guest after {_OP_TIMEOUT_S:.0f}s")
                if event.stdout_truncated:
                    raise PayloadTooLarge(f"guest output is larger than {cap} bytes")
        return code, bytes(out), bytes(err)

    def _call(
        self, script: str, args: list[str], *, path: str, stdin: bytes | None = None, cap: int = 1 << 20
    ) -> bytes:
        future = asyncio.run_coroutine_threadsafe(self._script(script, args, stdin, cap), self._loop)
        code, out, err = future.result(_OP_TIMEOUT_S + 10)
        if code == 0:
            return out
        if code in _CALLER_ERRORS:
            error, template = _CALLER_ERRORS[code]
            raise error(template.format(path=path, limit=args[1] if len(args) > 1 else ""))
        message = err.decode(errors="replace").strip()[-500:] or f"exit {code}"
        raise InvalidRequest(f"file operation on {path} failed in the guest: {message}")

    def _with_link(self, info: FileInfo) -> FileInfo:
        if info.type != "symlink":
            return info
        target = self._call(_READLINK, [info.path], path=info.path).decode(errors="replace").rstrip("\n")
        return info.model_copy(update={"link_target": target})

    # -- the ConfinedTree interface -----------------------------------------

    def read(self, path: str, *, max_bytes: int) -> bytes:
        normal = _normalise(path)
        return self._call(_READ, [normal, str(max_bytes)], path=normal, cap=max_bytes + 1)

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
        normal = _normalise(path)
        owner = f"{uid or 0}:{gid if gid is not None else uid or 0}"
        args = [normal, "1" if make_parents else "0", f"{mode & 0o7777:o}", owner]
        out = self._call(_WRITE, args, path=normal, stdin=data)
        return _parse_stat(out.decode().strip().splitlines()[-1], normal)

    def stat(self, path: str) -> FileInfo:
        normal = _normalise(path)
        out = self._call(_STAT, [normal], path=normal)
        return self._with_link(_parse_stat(out.decode(errors="replace").strip(), normal))

    def list(self, path: str) -> list[FileInfo]:
        normal = _normalise(path)
        out = self._call(_LIST, [normal], path=normal, cap=64 << 20).decode(errors="replace")
        infos = []
        for line in out.splitlines():
            name = line.split("|", 5)[-1]
            infos.append(self._with_link(_parse_stat(line, posixpath.join(normal, name))))
        return sorted(infos, key=lambda info: info.name)

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> FileInfo:
        normal = _normalise(path)
        out = self._call(_MKDIR, [normal, "1" if parents else "0", f"{mode & 0o7777:o}"], path=normal)
        return _parse_stat(out.decode().strip(), normal)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        normal = _normalise(path)
        if normal == "/":
            raise InvalidRequest("refusing to remove the sandbox's root")
        self._call(_REMOVE, [normal, "1" if recursive else "0"], path=normal)

    def rename(self, source: str, dest: str) -> FileInfo:
        src, dst = _normalise(source), _normalise(dest)
        if src == "/" or dst == "/":
            raise InvalidRequest("the sandbox's root cannot be renamed, nor replaced")
        if (dst + "/").startswith(src + "/"):
            raise InvalidRequest(f"cannot move {src} into itself ({dst})")
        try:
            out = self._call(_RENAME, [src, dst], path=src)
        except Conflict:
            raise Conflict(f"already exists in sandbox as a directory: {dst}; remove it first") from None
        return self._with_link(_parse_stat(out.decode().strip(), dst))

    def write_tar(self, path: str, fileobj: BinaryIO) -> None:
        normal = _normalise(path)
        fileobj.write(self._call(_TAR_OUT, [normal], path=normal, cap=1 << 30))

    def extract_tar(self, dest: str, fileobj: BinaryIO, *, max_bytes: int, keep_owners: bool = False) -> int:
        """Re-pack on the host (any compression in, plain tar out), counting bytes and dropping
        device nodes, fifos and setuid bits, then unpack in the guest without restoring owners."""
        if keep_owners:
            raise InvalidRequest("an upload that keeps owners and setuid bits (image builds) needs a container sandbox")
        normal = _normalise(dest)
        clean = io.BytesIO()
        total = members = 0
        with tarfile.open(fileobj=fileobj, mode="r|*") as source, tarfile.open(fileobj=clean, mode="w") as out:
            for member in source:
                if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
                    continue
                total += member.size if member.isreg() else 0
                if total > max_bytes:
                    raise PayloadTooLarge(f"archive holds more than {max_bytes} bytes of files")
                member.mode &= 0o1777
                out.addfile(member, source.extractfile(member) if member.isreg() else None)
                members += 1
        self._call(_TAR_IN, [normal], path=normal, stdin=clean.getvalue())
        return members
