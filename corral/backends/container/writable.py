"""Writable layers with a size limit: one btrfs per node, a subvolume and a quota per sandbox.

Every container sandbox's writable layer (its overlay upper and work dirs) is bounded by default, so one
agent cannot fill the disk that holds the state database, the layer cache and every other sandbox. The
bound must hold at density (thousands of sandboxes on a node), which rules out a loop device and a
filesystem per sandbox: measured here at 200 sandboxes, an ext4 image on a loop device cost ~185 ms
and ~1 MiB of kernel memory each. This kernel has no CONFIG_QUOTA (neither XFS ``prjquota`` nor ext4
project quotas mount), but btrfs qgroups do not depend on it: one sparse image under the data dir,
formatted btrfs once and loop-mounted once per server, with simple quotas (squota, kernel 6.7+), holds
a subvolume per sandbox with a referenced-bytes limit. Creating one and setting its limit are two
ioctls (~0.8 ms); removing one is one ioctl, and the kernel frees its space and its qgroup in the
background (its id is never reused: btrfs hands out subvolume ids in order). A writer past its limit
gets EDQUOT ("Disk quota exceeded"), btrfs's errno for a quota (XFS gives ENOSPC for a project quota).

The image is sparse, sized to the data dir's filesystem, and mounted with ``discard=async`` so space
freed inside goes back to the host. The btrfs itself is sized (``btrfs filesystem resize``, ~50 ms) so
that, full, it leaves ``reserve_bytes`` of the host's disk free: the quotas bound each sandbox, this bounds
them all together, so however much sandboxes write, the state database, the trajectory log and the layer
cache on the same disk keep that reserve (the node's free-space floor refuses creates before it). A new
pool is sized when it is made; later opens only grow it when the host has gained room (see ``_fit``).

The mount lives in the edge's mount namespace; each container's overlay keeps the btrfs alive while it
runs, so after a server restart the same loop device is mounted again (the same filesystem, never a second
one over the same image) and adopted sandboxes keep their layers and limits. When the server stops with
no sandbox left, the last unmount frees the loop device.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import struct
import subprocess
import threading
from pathlib import Path

from corral.api.errors import InternalError
from corral.procfs import held_files

__all__ = ["QuotaPool"]

log = logging.getLogger(__name__)

_IMAGE = "writable.img"
_MOUNTPOINT = "writable"
_MOUNT_OPTIONS = "loop,nosuid,nodev,noatime,discard=async"
_TIMEOUT_S = 60
_MIN_FS_BYTES = 256 << 20  # the kernel refuses a smaller btrfs


def _ioc(direction: int, number: int, size: int) -> int:
    """A btrfs ioctl request number (type 0x94), as the kernel's _IOC macro builds it."""
    return (direction << 30) | (size << 16) | (0x94 << 8) | number


_WRITE, _READ = 1, 2
_VOL_ARGS_BYTES = 4096  # struct btrfs_ioctl_vol_args: s64 fd, char name[4088]
_SUBVOL_CREATE = _ioc(_WRITE, 14, _VOL_ARGS_BYTES)
_SNAP_DESTROY = _ioc(_WRITE, 15, _VOL_ARGS_BYTES)
_INO_LOOKUP = _ioc(_READ | _WRITE, 18, 4096)  # struct btrfs_ioctl_ino_lookup_args: u64 treeid, objectid, name
_FS_INFO = _ioc(_READ, 31, 1024)  # struct btrfs_ioctl_fs_info_args: u64 max_id, num_devices, u8 fsid[16]...
_QUOTA_CTL = _ioc(_READ | _WRITE, 40, 16)  # struct btrfs_ioctl_quota_ctl_args: u64 cmd, status
_QGROUP_LIMIT = _ioc(_READ, 43, 48)  # u64 qgroupid, struct btrfs_qgroup_limit (flags, max_rfer, max_excl, rsv x2)
_QUOTA_CTL_ENABLE_SIMPLE = 4
_LIMIT_MAX_RFER = 1
_FIRST_FREE_OBJECTID = 256  # a subvolume's root directory
_COUNTED = ("referenced", "rsv_data", "rsv_meta_prealloc")  # a qgroup's sysfs files that add up to its usage


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_TIMEOUT_S, check=False)


def _vol_args(name: str) -> bytearray:
    return bytearray(struct.pack("q4088s", 0, name.encode()))  # mutable: fcntl passes it without a size cap


class QuotaPool:
    """The node's btrfs of writable layers under ``data_dir``: ``open`` it (idempotent), then a subvolume
    with a limit per sandbox. Unusable (no btrfs, no mkfs.btrfs, not root) is reported by ``open``."""

    def __init__(self, data_dir: Path, reserve_bytes: int = 0) -> None:
        self._image = data_dir / _IMAGE
        self._reserve_bytes = reserve_bytes
        self.mountpoint = data_dir / _MOUNTPOINT
        self._lock = threading.Lock()
        self._sysfs: Path | None = None  # /sys/fs/btrfs/<fsid>/qgroups once open
        self._qgroups: dict[str, str] = {}  # sandbox id -> its subvolume's (level 0) qgroup in sysfs (usage's reads)
        self._tree_ids: dict[str, int] = {}  # sandbox id -> its subvolume's id, once looked up

    @property
    def is_open(self) -> bool:
        return self._sysfs is not None

    @property
    def made(self) -> bool:
        """This data dir has a pool (open or not): sandboxes from before a restart may have layers in it."""
        return self._image.exists()

    def open(self) -> None:
        """Mount the pool, making it first if there is none; after a restart, the loop device that running
        sandboxes still hold. Raises InternalError with the reason when this node cannot have one."""
        with self._lock:
            if self._sysfs is None:
                self._fit(made=self._mount())
                self._sysfs = Path("/sys/fs/btrfs") / self._fsid() / "qgroups"

    def _mount(self) -> bool:
        """Mount the pool; whether it was made just now (empty)."""
        if os.path.ismount(self.mountpoint):
            return False
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        attached = _run(["losetup", "-j", str(self._image)]).stdout.split(":")[0] if self._image.exists() else ""
        if attached:  # sandboxes from before a restart hold it: mount that filesystem, not the image anew
            self._check(_run(["mount", "-o", _MOUNT_OPTIONS.removeprefix("loop,"), attached, str(self.mountpoint)]))
            return False
        made = False
        if not self._image.exists():
            if shutil.which("mkfs.btrfs") is None:
                raise InternalError("cannot limit sandbox disks: mkfs.btrfs is missing (Debian: btrfs-progs)")
            st = os.statvfs(self._image.parent)
            with open(self._image, "wb") as f:  # sparse: costs the host only what is written
                f.truncate(st.f_blocks * st.f_frsize)
            formatted = _run(["mkfs.btrfs", "-q", "-f", "-m", "single", "-d", "single", str(self._image)])
            if formatted.returncode != 0:
                self._image.unlink(missing_ok=True)
                self._check(formatted)
            made = True
        self._check(_run(["mount", "-o", _MOUNT_OPTIONS, str(self._image), str(self.mountpoint)]))
        if made:
            self._ioctl(self.mountpoint, _QUOTA_CTL, bytearray(struct.pack("QQ", _QUOTA_CTL_ENABLE_SIMPLE, 0)))
        return made

    def _fit(self, *, made: bool) -> None:
        """Size the filesystem so that, full, it leaves ``reserve_bytes`` free on the host's disk: what it holds
        there now plus the host's free space, less the reserve (at least the smallest btrfs, at most the image).
        Only a pool made just now is sized down: shrinking one in use relocates its chunks, and tried here on a
        nearly full one it aborted a transaction with ENOSPC and left the filesystem read-only."""
        if not self._reserve_bytes:
            return
        host, image = os.statvfs(self._image.parent), self._image.stat()
        held_bytes = image.st_blocks * 512
        size_bytes = held_bytes + host.f_bavail * host.f_frsize - self._reserve_bytes
        size_bytes = max(_MIN_FS_BYTES, min(image.st_size, size_bytes))
        pool = os.statvfs(self.mountpoint)
        if not made and size_bytes <= pool.f_blocks * pool.f_frsize:
            return
        resized = _run(["btrfs", "filesystem", "resize", str(size_bytes), str(self.mountpoint)])
        if resized.returncode != 0:  # it stays as it is; the floor still refuses creates
            log.warning(
                "could not size the writable-layer pool to %d MiB: %s", size_bytes >> 20, resized.stderr.strip()
            )

    def _check(self, run: subprocess.CompletedProcess[str]) -> None:
        if run.returncode != 0:
            raise InternalError(f"cannot limit sandbox disks: {' '.join(run.args[:1])}: {run.stderr.strip()}")

    def _ioctl(self, path: Path, request: int, arg: bytearray) -> bytearray:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.ioctl(fd, request, arg)
        finally:
            os.close(fd)
        return arg

    def _fsid(self) -> str:
        fsid = self._ioctl(self.mountpoint, _FS_INFO, bytearray(1024))[16:32].hex()
        return f"{fsid[:8]}-{fsid[8:12]}-{fsid[12:16]}-{fsid[16:20]}-{fsid[20:]}"

    def layer_dir(self, sandbox_id: str) -> Path:
        return self.mountpoint / sandbox_id

    def has(self, sandbox_id: str) -> bool:
        return self.is_open and self.layer_dir(sandbox_id).is_dir()

    def sandbox_ids(self) -> list[str]:
        return sorted(os.listdir(self.mountpoint)) if self.is_open else []

    def add(self, sandbox_id: str, limit_bytes: int) -> Path:
        """A subvolume for the sandbox's writable layer, at most ``limit_bytes`` (data and metadata)."""
        self._ioctl(self.mountpoint, _SUBVOL_CREATE, _vol_args(sandbox_id))
        path = self.layer_dir(sandbox_id)
        try:
            self._ioctl(path, _QGROUP_LIMIT, bytearray(struct.pack("6Q", 0, _LIMIT_MAX_RFER, limit_bytes, 0, 0, 0)))
        except BaseException:
            self.remove(sandbox_id)  # no unbounded layer, and none left behind
            raise
        return path

    def remove(self, sandbox_id: str) -> int | None:
        """Its subvolume, contents and all (the kernel frees the space and the qgroup in the background); the
        subvolume's id if it was looked up (ids are never reused)."""
        qgroup = self._qgroups.pop(sandbox_id, None)
        if qgroup is not None:
            held_files.forget(qgroup)
        tree_id = self._tree_ids.pop(sandbox_id, None)
        if not self.has(sandbox_id):
            return tree_id
        try:
            self._ioctl(self.mountpoint, _SNAP_DESTROY, _vol_args(sandbox_id))
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        return tree_id

    def known_tree_id(self, sandbox_id: str) -> int | None:
        """Its subvolume's id if ``tree_id`` found it before (and it was not removed since)."""
        return self._tree_ids.get(sandbox_id)

    def tree_id(self, sandbox_id: str) -> int:
        """Its subvolume's id (its tree's, in file handles; its qgroup is 0/<id>)."""
        if sandbox_id not in self._tree_ids:
            args = bytearray(struct.pack("QQ4080s", 0, _FIRST_FREE_OBJECTID, b""))
            found = self._ioctl(self.layer_dir(sandbox_id), _INO_LOOKUP, args)
            self._tree_ids[sandbox_id] = struct.unpack_from("Q", found)[0]
        return self._tree_ids[sandbox_id]

    def _qgroup(self, sandbox_id: str) -> str:
        if sandbox_id not in self._qgroups:
            self._qgroups[sandbox_id] = f"{self._sysfs}/0_{self.tree_id(sandbox_id)}/"
        return self._qgroups[sandbox_id]

    def usage(self, sandbox_id: str) -> tuple[int, int] | None:
        """(bytes used, limit in bytes) of the sandbox's writable layer; None when it has none here. Read after
        every command: a sandbox seen once goes straight to its qgroup's files (no stat, no path to build)."""
        try:
            if sandbox_id not in self._qgroups and (self._sysfs is None or not self.has(sandbox_id)):
                return None
            qgroup = self._qgroup(sandbox_id)
            # Written back (referenced) plus reserved for what is still dirty: what counts against the limit.
            used = sum(int(held_files.read(qgroup + name)) for name in _COUNTED)
            return used, int(held_files.read(qgroup + "max_referenced"))
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        """Unmount it from the edge's namespace (running sandboxes keep the filesystem alive)."""
        with self._lock:
            if self._sysfs is not None and os.path.ismount(self.mountpoint):
                _run(["umount", "-l", str(self.mountpoint)])
            self._sysfs = None
            self._qgroups.clear()
            self._tree_ids.clear()
