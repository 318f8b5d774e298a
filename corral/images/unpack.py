"""Unpack untrusted tar archives and OCI/docker image archives into a directory for mkfs.erofs.

Every archive is treated as hostile:

* Member names are made relative ("/etc/x" lands at dest/etc/x, as docker
  does); a ".." that climbs above dest is refused, and so are names deeper
  than ``MAX_PATH_DEPTH``.
* No symlink in dest is ever followed: parents are opened one component at a
  time relative to the previous fd with ``O_NOFOLLOW | O_DIRECTORY`` and the
  leaf is made through that fd, so ``a -> /etc`` then ``a/passwd`` is refused.
  Symlink targets are stored as-is: they are only data in the image.
  Hardlinks may only point at what is already under dest.
* File bytes count against ``max_bytes`` and members against ``MAX_MEMBERS``
  (PayloadTooLarge). Device nodes and FIFOs are skipped.
* Modes are kept, setuid/setgid included (/usr/bin/passwd is image content;
  sandboxes run with no_new_privs, so the bits grant nothing, except in
  sandboxes labelled ``corral.setuid=allowed``, where they give root inside
  the sandbox, as the API's ``user="root"`` does). Owners are
  kept when running as root, else left alone. Directory metadata is set last.

OCI layers go through the same code plus whiteouts: ``dir/.wh.name`` deletes
``dir/name`` left by lower layers; ``dir/.wh..wh..opq`` deletes every child of
``dir`` this layer has not itself written. Layer blobs are checked against
their sha256 before they are applied. On error the caller deletes dest.

``unpack_oci_layer`` unpacks one layer on its own instead (a pulled image keeps
each OCI layer as an EROFS layer of its own, stacked by overlayfs), so its
whiteouts become overlayfs ones: ``.wh.name`` a 0/0 character device ``name``,
``.wh..wh..opq`` the ``trusted.overlay.opaque=y`` xattr on the directory. An
entry the same layer also writes wins over its whiteout, as the OCI spec says.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import importlib
import json
import lzma
import os
import posixpath
import re
import shutil
import stat
import tarfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal, cast

from corral.api.errors import InternalError, InvalidRequest, NotFound, PayloadTooLarge

try:
    _zstandard: Any = importlib.import_module("zstandard")
except ImportError:  # optional: only zstd-compressed layers need it
    _zstandard = None

__all__ = ["MAX_MEMBERS", "MAX_PATH_DEPTH", "OciImageInfo", "extract_tar", "unpack_oci_archive", "unpack_oci_layer"]

MAX_MEMBERS = 1_000_000
# Bounds the recursion of shutil.rmtree and the fds it holds when a whiteout deletes a deep tree.
MAX_PATH_DEPTH = 256
MAX_JSON_BYTES = 16 << 20
MAX_INDEX_DEPTH = 4
_CHUNK_BYTES = 1 << 20
_HEAD_BYTES = 512  # tarfile's "r|*" sniffs compression from its first 512-byte read
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_IMPLICIT_DIR_MODE = 0o755
_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"
_OVERLAY_OPAQUE_XATTR = "trusted.overlay.opaque"
_REF_NAME = "org.opencontainers.image.ref.name"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_COMPRESSED_MAGIC = (b"\x1f\x8b", _ZSTD_MAGIC, b"BZh", b"\xfd7zXZ\x00")
_DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
# Docker-save names that contain the content digest. Legacy "<id>/layer.tar" does not:
# <id> is a v1 layer ID (a hash of JSON), so those layers are checked against rootfs.diff_ids.
_NAMED_BY_DIGEST_RE = re.compile(r"^(?:blobs/sha256/([0-9a-f]{64})|([0-9a-f]{64})\.json)$")
_DECODE_ERRORS: tuple[type[BaseException], ...] = (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError)
_DECODE_ERRORS += (gzip.BadGzipFile,) + ((_zstandard.ZstdError,) if _zstandard is not None else ())

Progress = Callable[[str], None]
_DirMeta = tuple[int, int, int, int]  # mode, uid, gid, mtime_ns


@dataclass(frozen=True)
class OciImageInfo:
    layer_digests: tuple[str, ...]  # "sha256:<hex>" of each layer blob as stored, bottom first
    config: dict[str, Any]  # the image config JSON (Env, Cmd, WorkingDir, User ... under "config"), {} if none
    repo_tags: tuple[str, ...]  # docker save's RepoTags, or the OCI annotation org.opencontainers.image.ref.name


def extract_tar(source: BinaryIO, dest: Path, *, max_bytes: int, progress: Progress | None = None) -> int:
    """Extract a streamed tar (plain, gzip, xz, bzip2 or zstd) into the empty directory ``dest``.

    Returns the number of members extracted (skipped device nodes not counted).
    """
    writer = _TreeWriter(dest, max_bytes=max_bytes, progress=progress)
    try:
        writer.apply_tar(source, whiteouts=False, what="the uploaded archive")
        writer.finish()
        return writer.members_extracted
    finally:
        writer.close()


def unpack_oci_layer(
    source: BinaryIO, dest: Path, *, max_bytes: int, what: str, progress: Progress | None = None
) -> int:
    """Unpack one OCI layer tar (plain, gzip or zstd) into the empty ``dest`` with overlayfs whiteouts.

    The tree is the layer alone, ready for mkfs.erofs and for stacking over the layers below it.
    Returns the number of members extracted (whiteouts included). Needs root (whiteouts are device nodes).
    """
    writer = _TreeWriter(dest, max_bytes=max_bytes, progress=progress, overlay_whiteouts=True)
    try:
        writer.apply_tar(source, whiteouts=True, what=what)
        writer.finish()
        return writer.members_extracted
    finally:
        writer.close()


def unpack_oci_archive(archive: Path, dest: Path, *, max_bytes: int, progress: Progress | None = None) -> OciImageInfo:
    """Flatten a ``docker save`` archive or an OCI image layout tar into the empty directory ``dest``.

    Layers are applied bottom to top with whiteouts; ``max_bytes`` bounds the
    file bytes written over all layers together.
    """
    archive = Path(archive)
    if not archive.is_file():
        raise NotFound(f"image archive {archive} does not exist")
    report = progress or _ignore
    writer = _TreeWriter(dest, max_bytes=max_bytes, progress=progress)
    try:
        with _decode_errors(f"image archive {archive.name}"), tarfile.open(archive, "r:*") as outer:
            image = _ImageArchive(outer)
            plan = _read_docker_save(image) if image.has("manifest.json") else _read_oci_layout(image)
            layer_digests = []
            for number, layer in enumerate(plan.layers, 1):
                info = image.member(layer.path, f"layer {layer.digest or layer.path}")
                digest, head = image.hash(info)
                expected = layer.digest or (layer.diff_id if not head.startswith(_COMPRESSED_MAGIC) else None)
                if expected is not None and digest != expected:
                    raise InvalidRequest(
                        f"layer {layer.digest or layer.path} is corrupt: digest mismatch (its bytes hash to {digest})"
                    )
                report(f"layer {number}/{len(plan.layers)} {_short(digest)} {info.size / 1e6:.1f} MB")
                writer.apply_tar(image.open(info), whiteouts=True, what=f"layer {_short(digest)}")
                layer_digests.append(digest)
            writer.finish()
    finally:
        writer.close()
    return OciImageInfo(layer_digests=tuple(layer_digests), config=plan.config, repo_tags=plan.repo_tags)


class _TreeWriter:
    """Applies tar streams to one destination tree, never following a symlink inside it."""

    def __init__(
        self, dest: Path, *, max_bytes: int, progress: Progress | None, overlay_whiteouts: bool = False
    ) -> None:
        """``overlay_whiteouts``: record whiteouts as overlayfs ones instead of deleting what lower layers left."""
        dest = Path(dest)
        if not dest.is_dir():
            raise InvalidRequest(f"unpack destination {dest} is not a directory: create it empty first")
        if any(dest.iterdir()):
            raise InvalidRequest(f"unpack destination {dest} is not empty: unpack into a fresh directory")
        self._root_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._max_bytes = max_bytes
        self._progress = progress or _ignore
        self._as_root = os.geteuid() == 0
        self._overlay_whiteouts = overlay_whiteouts
        if overlay_whiteouts and not self._as_root:
            raise InternalError("unpacking an OCI layer with its whiteouts needs root (they are device nodes)")
        self._bytes_written = 0
        self._members_seen = 0
        self.members_extracted = 0
        self._dir_meta: dict[tuple[str, ...], _DirMeta] = {}
        # Paths the current OCI layer has written (with their parents), which an opaque marker keeps.
        self._layer_paths: set[tuple[str, ...]] | None = None
        # Tar members come grouped by directory, so the last parent fd is kept open for the next one.
        self._cached_parent: tuple[tuple[str, ...], int] | None = None

    def close(self) -> None:
        self._drop_cached_parent()
        os.close(self._root_fd)

    def apply_tar(self, source: BinaryIO, *, whiteouts: bool, what: str) -> None:
        self._layer_paths = set() if whiteouts else None
        with _decode_errors(what):
            stream, mode = _tar_stream(source, what)
            with tarfile.open(fileobj=stream, mode=mode) as tar:
                while (member := tar.next()) is not None:
                    # tarfile keeps every TarInfo even when streaming: ~0.5 KB each, 500 MB at the member limit.
                    tar.members.clear()  # type: ignore[attr-defined]
                    self._members_seen += 1
                    if self._members_seen > MAX_MEMBERS:
                        raise PayloadTooLarge(f"{what} has more than {MAX_MEMBERS} members")
                    self._apply_member(tar, member, whiteouts=whiteouts)

    def finish(self) -> None:
        """Set directory owners, modes and mtimes, deepest first, now that their contents exist."""
        for parts, (mode, uid, gid, mtime_ns) in sorted(self._dir_meta.items(), key=lambda item: -len(item[0])):
            fd = self._walk(parts, create=False, member=None)
            if fd is None:  # deleted or replaced by a later layer
                continue
            try:
                self._set_meta(fd, mode, uid, gid, mtime_ns)
            finally:
                os.close(fd)

    def _apply_member(self, tar: tarfile.TarFile, member: tarfile.TarInfo, *, whiteouts: bool) -> None:
        parts = _member_parts(member.name)
        if whiteouts and parts and parts[-1].startswith(_WHITEOUT):
            self._whiteout(parts, member.name)
            return
        if not parts and not member.isdir():
            raise InvalidRequest(f"archive member {member.name!r} has an empty path")
        if not (member.isdir() or member.isreg() or member.issym() or member.islnk()):
            kind = "fifo" if member.isfifo() else "device node" if member.isdev() else f"member of type {member.type!r}"
            self._progress(f"skipped {kind} {'/'.join(parts)}")
            return
        try:
            if member.isdir():
                self._make_dir(parts, member)
            elif member.isreg():
                self._make_file(parts, member, tar)
            elif member.issym():
                self._make_symlink(parts, member)
            else:
                self._make_hardlink(parts, member)
        except OSError as exc:
            if exc.errno not in (errno.ENAMETOOLONG, errno.EINVAL, errno.EEXIST, errno.ENOTDIR, errno.ELOOP):
                raise
            raise InvalidRequest(f"cannot extract archive member {member.name!r}: {exc.strerror}") from None
        self.members_extracted += 1
        if self._layer_paths is not None:
            self._layer_paths.update(parts[:end] for end in range(1, len(parts) + 1))

    def _make_dir(self, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        if parts:
            parent_fd = self._parent(parts[:-1], member.name)
            if not self._clear(parent_fd, parts, keep_dir=True):
                os.mkdir(parts[-1], _IMPLICIT_DIR_MODE, dir_fd=parent_fd)
        self._dir_meta[parts] = (member.mode & 0o7777, member.uid, member.gid, _mtime_ns(member))

    def _make_file(self, parts: tuple[str, ...], member: tarfile.TarInfo, tar: tarfile.TarFile) -> None:
        if self._bytes_written + member.size > self._max_bytes:
            raise PayloadTooLarge(
                f"archive unpacks to more than {self._max_bytes} bytes (at member {member.name!r}): "
                "raise the limit or use a smaller image"
            )
        self._bytes_written += member.size
        parent_fd = self._parent(parts[:-1], member.name)
        self._clear(parent_fd, parts)
        source = tar.extractfile(member)
        if source is None:
            raise InternalError(f"tarfile gave no data for regular member {member.name!r}")
        with open(os.open(parts[-1], _FILE_FLAGS, 0o600, dir_fd=parent_fd), "wb") as out:
            shutil.copyfileobj(source, out, _CHUNK_BYTES)
            out.flush()
            self._set_meta(out.fileno(), member.mode & 0o7777, member.uid, member.gid, _mtime_ns(member))

    def _make_symlink(self, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        parent_fd = self._parent(parts[:-1], member.name)
        self._clear(parent_fd, parts)
        os.symlink(member.linkname, parts[-1], dir_fd=parent_fd)
        if self._as_root:
            os.chown(parts[-1], member.uid, member.gid, dir_fd=parent_fd, follow_symlinks=False)
        mtime_ns = _mtime_ns(member)
        os.utime(parts[-1], ns=(mtime_ns, mtime_ns), dir_fd=parent_fd, follow_symlinks=False)

    def _make_hardlink(self, parts: tuple[str, ...], member: tarfile.TarInfo) -> None:
        """Link to an entry already under dest; the shared inode keeps the target's metadata."""
        target = _member_parts(member.linkname)
        missing = InvalidRequest(
            f"hardlink {member.name!r} points to {member.linkname!r}, which is not a file extracted before it"
        )
        target_fd = self._walk(target[:-1], create=False, member=member.name) if target else None
        if target_fd is None:
            raise missing
        try:
            try:
                target_stat = os.stat(target[-1], dir_fd=target_fd, follow_symlinks=False)
            except FileNotFoundError:
                raise missing from None
            if stat.S_ISDIR(target_stat.st_mode):
                raise missing
            parent_fd = self._parent(parts[:-1], member.name)
            self._clear(parent_fd, parts)
            try:
                os.link(target[-1], parts[-1], src_dir_fd=target_fd, dst_dir_fd=parent_fd, follow_symlinks=False)
            except FileNotFoundError:  # the target was the entry _clear just removed, or inside it
                raise missing from None
        finally:
            os.close(target_fd)

    def _whiteout(self, parts: tuple[str, ...], name: str) -> None:
        if self._overlay_whiteouts:
            self._overlay_whiteout(parts, name)
            return
        dir_parts, marker = parts[:-1], parts[-1]
        if marker == _OPAQUE:
            layer_paths = self._layer_paths
            assert layer_paths is not None  # whiteouts are only read in OCI layers
            dir_fd = self._walk(dir_parts, create=True, member=name)
            assert dir_fd is not None  # create=True never gives None
            try:
                for child in os.listdir(dir_fd):
                    if dir_parts + (child,) not in layer_paths:
                        self._clear(dir_fd, dir_parts + (child,))
            finally:
                os.close(dir_fd)
            layer_paths.update(dir_parts[:end] for end in range(1, len(dir_parts) + 1))
            return
        if marker.startswith(_WHITEOUT + _WHITEOUT):  # other AUFS metadata, e.g. .wh..wh.plnk
            self._progress(f"skipped whiteout metadata {'/'.join(parts)}")
            return
        target = marker[len(_WHITEOUT) :]
        if target in ("", ".", ".."):
            raise InvalidRequest(f"malformed whiteout {name!r} in layer")
        dir_fd = self._walk(dir_parts, create=False, member=name)
        if dir_fd is None:  # nothing there to delete
            return
        try:
            self._clear(dir_fd, dir_parts + (target,))
        finally:
            os.close(dir_fd)

    def _overlay_whiteout(self, parts: tuple[str, ...], name: str) -> None:
        """The whiteout as overlayfs stores it, in this layer's own tree (nothing below it is here to delete)."""
        dir_parts, marker = parts[:-1], parts[-1]
        layer_paths = self._layer_paths
        assert layer_paths is not None  # whiteouts are only read in OCI layers
        if marker.startswith(_WHITEOUT + _WHITEOUT) and marker != _OPAQUE:
            self._progress(f"skipped whiteout metadata {'/'.join(parts)}")
            return
        target = marker[len(_WHITEOUT) :]
        if marker != _OPAQUE and target in ("", ".", ".."):
            raise InvalidRequest(f"malformed whiteout {name!r} in layer")
        dir_fd = self._parent(dir_parts, name)
        if marker == _OPAQUE:
            os.setxattr(dir_fd, _OVERLAY_OPAQUE_XATTR, b"y")
        elif dir_parts + (target,) not in layer_paths:  # an entry this layer writes itself stays
            os.mknod(target, stat.S_IFCHR | 0o000, os.makedev(0, 0), dir_fd=dir_fd)
        layer_paths.update(dir_parts[:end] for end in range(1, len(dir_parts) + 1))
        self.members_extracted += 1

    def _clear(self, parent_fd: int, parts: tuple[str, ...], *, keep_dir: bool = False) -> bool:
        """Remove the entry ``parts`` (in ``parent_fd``) if any; True if it is a directory kept by ``keep_dir``."""
        try:
            existing = os.stat(parts[-1], dir_fd=parent_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if not stat.S_ISDIR(existing.st_mode):
            os.unlink(parts[-1], dir_fd=parent_fd)
            return False
        if keep_dir:
            return True
        if self._cached_parent is not None and self._cached_parent[0][: len(parts)] == parts:
            self._drop_cached_parent()
        self._dir_meta.pop(parts, None)
        shutil.rmtree(parts[-1], dir_fd=parent_fd)  # fd-based on Linux: does not follow symlinks
        return False

    def _parent(self, dir_parts: tuple[str, ...], member: str) -> int:
        """The fd of directory ``dir_parts`` (created if missing), owned by the cache: do not close it."""
        if self._cached_parent is not None and self._cached_parent[0] == dir_parts:
            return self._cached_parent[1]
        fd = self._walk(dir_parts, create=True, member=member)
        assert fd is not None  # create=True never gives None
        self._drop_cached_parent()
        self._cached_parent = (dir_parts, fd)
        return fd

    def _drop_cached_parent(self) -> None:
        if self._cached_parent is not None:
            os.close(self._cached_parent[1])
            self._cached_parent = None

    def _walk(self, parts: tuple[str, ...], *, create: bool, member: str | None) -> int | None:
        """Open dest/parts as a directory, one component at a time, following no symlink.

        Missing components are made (0755) when ``create``, else None is
        returned. A component that is a symlink or a file raises InvalidRequest
        naming ``member``, or gives None when ``member`` is None.
        """
        fd = os.open(".", _DIR_FLAGS, dir_fd=self._root_fd)
        for depth, part in enumerate(parts):
            try:
                try:
                    child_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        return None
                    os.mkdir(part, _IMPLICIT_DIR_MODE, dir_fd=fd)
                    child_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                    raise
                if member is None:
                    return None
                where = "/".join(parts[: depth + 1])
                raise InvalidRequest(
                    f"archive member {member!r} goes through {where!r}, which is a symlink or a file, "
                    "not a directory: refusing to write through it"
                ) from None
            finally:
                os.close(fd)
            fd = child_fd
        return fd

    def _set_meta(self, fd: int, mode: int, uid: int, gid: int, mtime_ns: int) -> None:
        if self._as_root:
            os.fchown(fd, uid, gid)  # before fchmod: chown clears setuid/setgid
        os.fchmod(fd, mode)
        os.utime(fd, ns=(mtime_ns, mtime_ns))


@dataclass(frozen=True)
class _LayerRef:
    path: str  # inside the image archive
    digest: str | None  # the content digest, when the archive names the blob by it
    diff_id: str | None = None  # config rootfs.diff_ids entry: the digest of the uncompressed tar


@dataclass(frozen=True)
class _ImagePlan:
    layers: tuple[_LayerRef, ...]
    config: dict[str, Any]
    repo_tags: tuple[str, ...]


class _ImageArchive:
    """Random access to the files of an image archive, without extracting it."""

    def __init__(self, outer: tarfile.TarFile) -> None:
        self._tar = outer
        self._members: dict[str, tarfile.TarInfo] = {}
        for count, info in enumerate(outer, 1):
            if count > MAX_MEMBERS:
                raise PayloadTooLarge(f"image archive has more than {MAX_MEMBERS} members")
            self._members[_archive_path(info.name)] = info

    def has(self, path: str) -> bool:
        return path in self._members

    def member(self, path: str, what: str) -> tarfile.TarInfo:
        """The regular file at ``path``, following links inside the archive (docker save dedupes layers so)."""
        for _ in range(8):
            info = self._members.get(path)
            if info is None:
                raise NotFound(f"{what} is not in the image archive (no {path!r})")
            if info.isfile():
                return info
            if info.issym():
                path = _archive_path(posixpath.join(posixpath.dirname(path), info.linkname))
            elif info.islnk():
                path = _archive_path(info.linkname)
            else:
                raise InvalidRequest(f"{what} ({path!r}) in the image archive is not a file")
        raise InvalidRequest(f"{what} ({path!r}) in the image archive is a chain of more than 8 links")

    def open(self, info: tarfile.TarInfo) -> BinaryIO:
        stream = self._tar.extractfile(info)
        if stream is None:
            raise InternalError(f"tarfile gave no data for regular member {info.name!r}")
        return cast(BinaryIO, stream)

    def hash(self, info: tarfile.TarInfo) -> tuple[str, bytes]:
        """The ``sha256:`` digest of a file and its first bytes (to tell compressed from plain)."""
        source, sha256 = self.open(info), hashlib.sha256()
        head = source.read(_HEAD_BYTES)
        sha256.update(head)
        while chunk := source.read(_CHUNK_BYTES):
            sha256.update(chunk)
        return f"sha256:{sha256.hexdigest()}", head

    def json(self, path: str, what: str, digest: str | None) -> Any:
        info = self.member(path, what)
        if info.size > MAX_JSON_BYTES:
            raise InvalidRequest(f"{what} ({path!r}) is {info.size} bytes; JSON over {MAX_JSON_BYTES} bytes is refused")
        data = self.open(info).read()
        if digest is not None and f"sha256:{hashlib.sha256(data).hexdigest()}" != digest:
            raise InvalidRequest(f"{what} is corrupt: digest mismatch")
        try:
            return json.loads(data)
        except ValueError as exc:
            raise InvalidRequest(f"{what} ({path!r}) is not valid JSON: {exc}") from None


def _read_docker_save(image: _ImageArchive) -> _ImagePlan:
    """manifest.json: [{"Config": path, "RepoTags": [...], "Layers": [path, ...]}]; the first image is used."""
    manifest = image.json("manifest.json", "docker save manifest.json", None)
    if not isinstance(manifest, list) or not manifest or not isinstance(manifest[0], dict):
        raise InvalidRequest("docker save manifest.json must be a non-empty list of image objects")
    entry = manifest[0]
    layer_paths, repo_tags, config_path = entry.get("Layers"), entry.get("RepoTags") or [], entry.get("Config")
    if not isinstance(layer_paths, list) or not all(isinstance(path, str) for path in layer_paths):
        raise InvalidRequest("docker save manifest.json: Layers must be a list of paths")
    if not isinstance(repo_tags, list) or not all(isinstance(tag, str) for tag in repo_tags):
        raise InvalidRequest("docker save manifest.json: RepoTags must be a list of strings")
    config: Any = {}
    if config_path is not None:
        if not isinstance(config_path, str):
            raise InvalidRequest("docker save manifest.json: Config must be a path")
        config_path = _archive_path(config_path)
        config = image.json(config_path, f"image config {config_path}", _digest_in_name(config_path))
    if not isinstance(config, dict):
        raise InvalidRequest("the image config is not a JSON object")
    rootfs = config.get("rootfs")
    diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
    if not isinstance(diff_ids, list) or len(diff_ids) != len(layer_paths):
        diff_ids = [None] * len(layer_paths)
    paths = [_archive_path(path) for path in layer_paths]
    layers = tuple(
        _LayerRef(path, _digest_in_name(path), diff_id if isinstance(diff_id, str) else None)
        for path, diff_id in zip(paths, diff_ids, strict=True)
    )
    return _ImagePlan(layers=layers, config=config, repo_tags=tuple(repo_tags))


def _read_oci_layout(image: _ImageArchive) -> _ImagePlan:
    """index.json -> (nested indexes, linux/amd64 else the first) -> manifest -> config and layer blobs."""
    if not image.has("index.json"):
        raise InvalidRequest(
            "not an image archive: neither manifest.json (docker save) nor index.json (OCI image layout) found"
        )
    descriptor = _pick_platform(image.json("index.json", "OCI index.json", None), "index.json")
    annotations = descriptor.get("annotations")
    ref_name = annotations.get(_REF_NAME) if isinstance(annotations, dict) else None
    for _ in range(MAX_INDEX_DEPTH):
        digest = _descriptor_digest(descriptor, "manifest")
        document = image.json(_blob_path(digest), f"manifest {digest}", digest)
        if not isinstance(document, dict):
            raise InvalidRequest(f"manifest {digest} is not a JSON object")
        if "manifests" not in document:
            break
        descriptor = _pick_platform(document, f"image index {digest}")
    else:
        raise InvalidRequest(f"image indexes are nested more than {MAX_INDEX_DEPTH} deep")
    layer_descriptors = document.get("layers")
    if not isinstance(layer_descriptors, list):
        raise InvalidRequest(f"manifest {digest} has no layers list")
    layer_digests = [_descriptor_digest(layer_descriptor, "layer") for layer_descriptor in layer_descriptors]
    layers = tuple(_LayerRef(_blob_path(layer_digest), layer_digest) for layer_digest in layer_digests)
    config: Any = {}
    if document.get("config") is not None:
        config_digest = _descriptor_digest(document["config"], "config")
        config = image.json(_blob_path(config_digest), f"image config {config_digest}", config_digest)
        if not isinstance(config, dict):
            raise InvalidRequest(f"image config {config_digest} is not a JSON object")
    repo_tags = (ref_name,) if isinstance(ref_name, str) else ()
    return _ImagePlan(layers=layers, config=config, repo_tags=repo_tags)


def _pick_platform(index: Any, where: str) -> dict[str, Any]:
    manifests = index.get("manifests") if isinstance(index, dict) else None
    if not isinstance(manifests, list) or not manifests or not all(isinstance(item, dict) for item in manifests):
        raise InvalidRequest(f"{where} has no manifests: expected a non-empty list of descriptors")
    for descriptor in manifests:
        platform = descriptor.get("platform")
        if isinstance(platform, dict) and (platform.get("os"), platform.get("architecture")) == ("linux", "amd64"):
            return cast(dict[str, Any], descriptor)
    return cast(dict[str, Any], manifests[0])


def _descriptor_digest(descriptor: Any, what: str) -> str:
    digest = descriptor.get("digest") if isinstance(descriptor, dict) else None
    if not isinstance(digest, str) or not _DIGEST_RE.match(digest):
        raise InvalidRequest(f"{what} descriptor has a missing or unsupported digest {digest!r}; expected sha256")
    return digest


def _blob_path(digest: str) -> str:
    return f"blobs/sha256/{digest.removeprefix('sha256:')}"


def _digest_in_name(path: str) -> str | None:
    match = _NAMED_BY_DIGEST_RE.match(path)
    return f"sha256:{match.group(1) or match.group(2)}" if match else None


def _archive_path(name: str) -> str:
    """A name inside the image archive, normalised; only ever a lookup key, never a path on disk."""
    return posixpath.normpath("/" + name).lstrip("/")


def _member_parts(name: str) -> tuple[str, ...]:
    """Split a member name into components under dest; refuse one whose '..' climbs above it."""
    parts: list[str] = []
    for part in name.split("/"):
        if part in ("", "."):
            continue
        if part != "..":
            parts.append(part)
        elif parts:
            parts.pop()
        else:
            raise InvalidRequest(f"archive member {name!r} points outside the destination ('..' above the root)")
    if len(parts) > MAX_PATH_DEPTH:
        raise InvalidRequest(f"archive member {name[:200]!r}... is more than {MAX_PATH_DEPTH} directories deep")
    return tuple(parts)


class _HeadReader:
    """A read-only stream whose first bytes were read ahead, so compression can be told from them."""

    def __init__(self, raw: BinaryIO) -> None:
        self._raw = raw
        chunks, size = [], 0
        while size < _HEAD_BYTES and (chunk := raw.read(_HEAD_BYTES - size)):
            chunks.append(chunk)
            size += len(chunk)
        self.head = self._pending = b"".join(chunks)

    def read(self, size: int = -1) -> bytes:
        if not self._pending:
            return self._raw.read(size)
        data, self._pending = (self._pending, b"") if size < 0 else (self._pending[:size], self._pending[size:])
        return data


def _tar_stream(source: BinaryIO, what: str) -> tuple[BinaryIO, Literal["r|*", "r|"]]:
    """The stream and tarfile mode for ``source``; tarfile itself only knows gzip, bzip2 and xz."""
    reader = _HeadReader(source)
    if not reader.head.startswith(_ZSTD_MAGIC):
        return cast(BinaryIO, reader), "r|*"
    if _zstandard is None:
        raise InvalidRequest(
            f"{what} is zstd-compressed, but the zstandard Python module is not installed on this server: "
            "install it or use a gzip-compressed image"
        )
    return _zstandard.ZstdDecompressor().stream_reader(reader, read_across_frames=True, closefd=False), "r|"


@contextmanager
def _decode_errors(what: str) -> Iterator[None]:
    """Turn errors of tarfile and the decompressors into InvalidRequest naming ``what``."""
    try:
        yield
    except _DECODE_ERRORS as exc:
        raise InvalidRequest(f"cannot read {what} as a tar archive: {exc}") from None


def _mtime_ns(member: tarfile.TarInfo) -> int:
    return round(member.mtime * 1_000_000_000)


def _short(digest: str) -> str:
    return f"{digest[:19]}…"


def _ignore(message: str) -> None:
    pass
