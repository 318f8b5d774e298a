"""Privileged host setup for every backend's sandboxes (containers, gVisor, VMs), kept in one place.

Everything here needs root and touches the host: detecting the cgroup layout,
moving the edge into a private mount namespace, mounting EROFS layers once per
node, compiling the two small native helpers, and reading cgroup counters.
Request handlers never do any of this directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import enum
import errno
import fcntl
import functools
import hashlib
import logging
import os
import resource
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from corral.procfs import mount_field, read_small, stat_fields

__all__ = [
    "CgroupLayout",
    "detect_cgroup_layout",
    "enter_private_mount_namespace",
    "remove_cgroup_dir",
    "remove_empty_cgroups",
    "RUN_ROOT",
    "ensure_run_tmpfs",
    "NodeSysfs",
    "fs_type_at",
    "run_dir_of",
    "runtime_dirs_of",
    "vm_sockets_of",
    "runtime_state_root",
    "LayerMounts",
    "NativeHelpers",
    "build_native_helpers",
    "native_helper_paths",
    "become_child_subreaper",
    "child_subreaper",
    "is_child_subreaper",
    "OrphanReaper",
    "orphans",
]

log = logging.getLogger(__name__)

_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_PRIVATE = 1 << 18
_MS_RDONLY = 1
_MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 2, 4, 8
_MNT_DETACH = 2
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_SETTLE_S = 2.0  # a killed sandbox's processes' exit, after its runtime's delete
_CGROUP_SETTLE_POLL_S = 0.01
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount_erofs(image_file: Path, target: Path) -> None:
    """Mount a layer file read-only, straight from the file (no loop device)."""
    try:
        _mount(str(image_file), str(target), "erofs", _MS_RDONLY, None)
    except OSError as exc:
        if exc.errno != errno.ENOTBLK:
            raise
        # The kernel backs EROFS by a file only on filesystems that can serve it (ext4, xfs, btrfs, FUSE), not
        # tmpfs (measured: ENOTBLK), and falls back to wanting a block device.
        raise OSError(
            exc.errno,
            f"{exc.strerror}: EROFS cannot mount {image_file} from the filesystem it is on (tmpfs, for one); keep "
            "the node dir (CORRAL_NODE_DIR) and the data dir on a disk filesystem such as ext4 or xfs",
        ) from None


def _mount(source: str, target: str, fstype: str, flags: int, data: str | None) -> None:
    _check(
        _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode() if data else None),
        f"mount {fstype} on {target}",
    )


class CgroupLayout(enum.Enum):
    """``unified``: pure cgroup v2. ``hybrid``: v1 controllers plus a v2 mount
    (crun refuses that unless the v2 mount is hidden). ``legacy``: v1 only."""

    UNIFIED = "unified"
    HYBRID = "hybrid"
    LEGACY = "legacy"


RUN_ROOT = Path("/run/corral")
"""Where nodes keep what lives exactly as long as their containers (the runtime's state, bundles): on a tmpfs,
as /run is on most hosts (crun's own default is /run/crun)."""
_RUN_TMPFS_OPTIONS = "mode=700,size=10%"


def fs_type_at(path: Path, mounts: str | None = None) -> str:
    """The type of the filesystem ``path`` is on: that of the last mount on it or on its nearest ancestor, from a
    mount table (default: this process's /proc/self/mounts)."""
    table = Path("/proc/self/mounts").read_text() if mounts is None else mounts
    target, best, found = os.path.abspath(path), -1, ""
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = mount_field(fields[1])
        if point == target or target.startswith(point.rstrip("/") + "/"):
            if len(point) >= best:  # a later mount on the same point is the one in effect
                best, found = len(point), fields[2]
    return found


def ensure_run_tmpfs(root: Path = RUN_ROOT) -> bool:
    """``root`` on a tmpfs, mounted here when the filesystem it would be on is not one (some hosts keep /run on
    disk); True if this call mounted it. Call in the host's mount namespace (before
    ``enter_private_mount_namespace``), so the mount outlives this server and the next one, started over the same
    containers, finds their state; it goes with the next boot, as they do.

    Why not on disk: a create and a delete write and remove a dozen small files there (runtime state, bundle), and
    on an ext4 without a journal (this machine's root) every new inode is sought past the ones deleted in the
    last 30 s (``recently_deleted``): 27–28% of a container burst's CPU under churn (perf, docs/spec.md)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "a") as lock:  # two servers starting at once mount one tmpfs
        fcntl.flock(lock, fcntl.LOCK_EX)
        if fs_type_at(root) == "tmpfs":
            return False
        _mount("tmpfs", str(root), "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, _RUN_TMPFS_OPTIONS)
        return True


class NodeSysfs:
    """One read-only sysfs for the node's loopback-only container sandboxes, which each bind at /sys.

    A sysfs mount in a sandbox's own network namespace is a superblock of its own, and every superblock costs
    every memory cgroup of the node a shrinker slot (oci.py: the term that grows with the square of the sandbox
    count). This one is mounted from a network namespace made for it, with only a loopback, as a sandbox without
    a network has: what it shows is what that sandbox's own sysfs showed. The namespace is kept by a bind of it
    (``unshare --net=FILE``); both are mounted in the server's private mount namespace
    (``enter_private_mount_namespace``), so they go with the server, and a sandbox keeps its bind."""

    def __init__(self, directory: Path) -> None:
        self._target = directory / "sysfs"
        self._netns = directory / "sysfs-netns"
        self._device: int | None = None  # the mount's st_dev, once mounted: a stat says it is still there
        self._failed = False

    def path(self) -> Path | None:
        """The mount, made on first use (and again if something unmounted it); None, with one warning, where it
        cannot be made: sandboxes then mount a sysfs of their own, as they did before."""
        if self._failed:
            return None
        if self._device is not None and os.stat(self._target).st_dev == self._device:
            return self._target
        try:
            self._target.mkdir(parents=True, exist_ok=True)
            # Kept by an earlier edge in this namespace (a restarted Ray edge's process did not close it): used
            # as it is. A half of one (an interrupted start) is undone first.
            if fs_type_at(self._target) != "sysfs":
                self._unmount()
                self._netns.touch()  # a plain file again: the nsfs bind over it refuses any change (EPERM)
                mount = ["mount", "-t", "sysfs", "-o", "ro,nosuid,nodev,noexec", "sysfs", str(self._target)]
                done = subprocess.run(["unshare", f"--net={self._netns}", "--", *mount],
                                      capture_output=True, text=True, check=False)  # fmt: skip
                if done.returncode != 0:
                    raise OSError(done.stderr.strip() or f"unshare exited {done.returncode}")
            self._device = os.stat(self._target).st_dev
        except OSError as exc:
            self._unmount()
            self._failed = True
            log.warning("cannot mount the node's sysfs on %s (%s): each sandbox mounts its own", self._target, exc)
            return None
        return self._target

    def close(self) -> None:
        if self._device is not None:
            self._unmount()
            self._device = None

    def _unmount(self) -> None:
        for target in (self._target, self._netns):
            _libc.umount2(str(target).encode(), _MNT_DETACH)


def run_dir_of(data_dir: Path, root: Path = RUN_ROOT) -> Path:
    """The run directory of the node whose data is in ``data_dir``: one per data dir, so servers side by side
    (tests, benches) keep apart."""
    return root / hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:12]


def runtime_dirs_of(data_dir: Path) -> Path:
    """Where, in its node's run dir, each container sandbox has its runtime dir (``<this>/<sandbox id>``): its bundle,
    its init's pid file, its runtime log."""
    return run_dir_of(data_dir) / "sandboxes"


def vm_sockets_of(data_dir: Path) -> Path:
    """Where, in its node's run dir, each VM sandbox has its QEMU's unix sockets (``<this>/<sandbox id>``: the
    monitor's and the agent channel's). Not beside its disk in the data dir: a socket's path has at most 107 bytes,
    which a deep data dir (pytest's own temp dirs) passed."""
    return run_dir_of(data_dir) / "vms"


def runtime_state_root(data_dir: Path, runtime: str) -> Path:
    """Where OCI runtime ``runtime`` (crun, runsc) keeps the state of this node's containers (its ``--root``): in the
    node's run dir, or in ``<data_dir>/run/<runtime>`` while containers an older server started there are left
    (an upgrade over running sandboxes: they stay manageable; once none is left, the next start moves on)."""
    old = data_dir / "run" / runtime
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        if any(old.iterdir()):
            return old
    return run_dir_of(data_dir) / runtime


def detect_cgroup_layout(mounts: str | None = None) -> CgroupLayout:
    """Read the layout from a mount table (default: this process's)."""
    table = Path("/proc/self/mounts").read_text() if mounts is None else mounts
    if fs_type_at(_CGROUP_ROOT, table) == "cgroup2":
        return CgroupLayout.UNIFIED
    if fs_type_at(_CGROUP_ROOT / "unified", table) == "cgroup2":
        return CgroupLayout.HYBRID
    return CgroupLayout.LEGACY


def enter_private_mount_namespace(layout: CgroupLayout) -> None:
    """Give this process its own mount namespace (call before any thread starts).

    Layer mounts made afterwards live and die with this process, so a crashed
    server leaves no mounts on the host. On hybrid hosts the v2 mount is hidden
    under a tmpfs so crun runs in plain v1 mode.
    """
    _check(_libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS) (run the server as root, before threads start)")
    _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    if layout is CgroupLayout.HYBRID:
        # Room for many thousands of crun cgroup paths (4 MB filled after ~1,000).
        _mount("tmpfs", str(_CGROUP_ROOT / "unified"), "tmpfs", 0, "size=64m,mode=755")


def remove_empty_cgroups(cgroup_path: str, *, settle_s: float = _CGROUP_SETTLE_S) -> None:
    """What a runtime left of a container's cgroups after its delete. On a hybrid host, crun's directory in the tmpfs
    over the v2 mount (see ``enter_private_mount_namespace``), its pid in a ``cgroup.procs`` file: a page of the
    tmpfs each, never removed, so a server would fill its 64 MB after about 16,000 creates (64 MB / 4 KiB; a 40 KiB
    tmpfs filled after 10) and start none after. And
    v1 cgroups crun left: a ``crun run`` that failed after making them (a full tmpfs) leaves them empty, and test
    runs left a sandbox's (all 9, empty) after a kill now and then, likeliest (not reproduced) a delete that gave up
    while the processes it killed were still exiting. A cgroup still busy is waited for up to ``settle_s``, then
    left."""
    relative = cgroup_path.lstrip("/")
    hierarchies, hidden_v2 = _cgroup_mounts()
    if hidden_v2 is not None:
        shutil.rmtree(hidden_v2 / relative, ignore_errors=True)
    deadline = time.monotonic() + settle_s
    for root in hierarchies:
        remove_cgroup_dir(root / relative, deadline=deadline)


def remove_cgroup_dir(directory: Path, *, deadline: float) -> bool:
    """Remove a cgroup's directory once it is empty: while a process is still in it (a killed one exiting: EBUSY)
    it is tried again until ``deadline`` (``time.monotonic``), then left. True if it is gone (or was)."""
    while True:
        try:
            os.rmdir(directory)
            return True
        except FileNotFoundError:
            return True
        except OSError as exc:  # EBUSY: a process is still in it (a QEMU's vCPU threads, a container's tasks)
            if exc.errno != errno.EBUSY or time.monotonic() >= deadline:
                return False
            time.sleep(_CGROUP_SETTLE_POLL_S)


@functools.cache
def _cgroup_mounts() -> tuple[list[Path], Path | None]:
    """This mount namespace's cgroup hierarchies (v2, every v1 controller, named ones such as systemd's) and the
    tmpfs hiding a hybrid host's v2 mount, if there is one; read once (they do not change while a node runs)."""
    table = Path("/proc/self/mounts").read_text()
    points = {Path(mount_field(fields[1])) for fields in (line.split() for line in table.splitlines())
              if len(fields) > 2 and fields[2] in ("cgroup", "cgroup2")}  # fmt: skip
    hierarchies = sorted(point for point in points if fs_type_at(point, table) in ("cgroup", "cgroup2"))
    unified = _CGROUP_ROOT / "unified"
    return hierarchies, unified if unified in points and fs_type_at(unified, table) == "tmpfs" else None


def raise_open_files_limit() -> int:
    """Lift this process's RLIMIT_NOFILE to the kernel's ceiling (fs.nr_open) and return the hard limit.

    A node holds fds per sandbox (agent sockets, cgroup and netns handles), so a distribution's default hard
    limit caps density; and a sandbox's own limit (set by the runtime after it drops CAP_SYS_RESOURCE) can be
    at most what it inherits."""
    try:
        ceiling = int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        ceiling = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (ceiling, ceiling))
    except (OSError, ValueError):  # not allowed here: keep what we have
        pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def become_child_subreaper() -> None:
    """Orphaned runtime processes re-parent to us and are reaped promptly."""
    _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


def is_child_subreaper() -> bool:
    """Whether orphaned descendants re-parent to this process (PR_GET_CHILD_SUBREAPER)."""
    value = ctypes.c_int(0)
    _check(_libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(value), 0, 0, 0), "prctl(PR_GET_CHILD_SUBREAPER)")
    return bool(value.value)


@contextlib.contextmanager
def child_subreaper() -> Iterator[None]:
    """This process a subreaper while the block runs (a bench, a test's backend in its own process), then as it
    was: a test process left one would adopt every orphan of the tests after it, and a server whose caller was
    killed would stay a zombie nobody reaps (its ``/proc`` entry there for good)."""
    was = is_child_subreaper()
    become_child_subreaper()
    try:
        yield
    finally:
        if not was:
            _check(_libc.prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")


@dataclass
class _LayerMount:
    target: Path
    users: int = 0
    idle_since: float | None = None


class LayerMounts:
    """Mounts each EROFS layer once per edge, read-only, shared by every sandbox
    that uses it (so its page cache is shared too), counted by users.

    A layer file is checked against its digest before its first mount; a
    corrupt file is refused and never mounted. Layers nobody has used for a
    while are unmounted by ``unmount_idle`` (the edge's housekeeping).
    """

    def __init__(self, mount_root: Path, verify: Callable[[str, Path], None]) -> None:
        self._root = mount_root
        self._verify = verify
        self._mounts: dict[str, _LayerMount] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def acquire(self, key: str, image_file: Path) -> Path:
        """The layer's mountpoint, mounting it on first use; pair with release().

        ``key`` is the digest, or ``digest#alias`` for a second mount of the same layer."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            mount = self._mounts.get(key)
            if mount is None:
                await asyncio.to_thread(self._verify, key.partition("#")[0], image_file)
                target = self._root / key.replace(":", "-").replace("#", "-")
                target.mkdir(parents=True, exist_ok=True)
                if os.path.ismount(target):
                    # An earlier edge's mount, left in the node's mount namespace when that edge died (of a file
                    # it may have verified differently, or whose helper exited since). Its sandboxes keep their
                    # own references; this edge's sandboxes get a mount of today's file.
                    _libc.umount2(str(target).encode(), _MNT_DETACH)
                _mount_erofs(image_file, target)
                mount = self._mounts[key] = _LayerMount(target)
            mount.users += 1
            mount.idle_since = None
            return mount.target

    def release(self, digest: str) -> None:
        mount = self._mounts.get(digest)
        if mount is not None and mount.users > 0:
            mount.users -= 1
            if mount.users == 0:
                mount.idle_since = time.monotonic()

    def users(self) -> dict[str, int]:
        return {digest: mount.users for digest, mount in self._mounts.items()}

    def unmount_idle(self, idle_s: float) -> list[str]:
        """Unmount layers unused for ``idle_s``; the sandboxes that used them hold their own references."""
        now, gone = time.monotonic(), []
        for digest, mount in list(self._mounts.items()):
            lock = self._locks.get(digest)
            if mount.users == 0 and mount.idle_since is not None and now - mount.idle_since >= idle_s:
                if lock is not None and lock.locked():
                    continue
                _libc.umount2(str(mount.target).encode(), _MNT_DETACH)
                del self._mounts[digest]
                gone.append(digest)
        return gone

    def unmount_all(self) -> None:
        for mount in self._mounts.values():
            _libc.umount2(str(mount.target).encode(), _MNT_DETACH)
        self._mounts.clear()


@dataclass(frozen=True)
class NativeHelpers:
    agent: Path
    launch: Path


_NATIVE_SOURCES = {name: Path(__file__).parent / "native" / f"{name}.c" for name in ("agent", "launch")}


def native_helper_paths(out_root: Path) -> NativeHelpers:
    """Where this source version's helpers are (or will be) under ``out_root``; builds nothing."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in _NATIVE_SOURCES.values())).hexdigest()[:16]
    out_dir = out_root / "bin" / digest
    return NativeHelpers(agent=out_dir / "corral-agent", launch=out_dir / "corral-launch")


def build_native_helpers(out_root: Path) -> NativeHelpers:
    """Compile corral-agent and corral-launch (static) once per source version."""
    helpers = native_helper_paths(out_root)
    binaries = {"agent": helpers.agent, "launch": helpers.launch}
    if all(b.exists() for b in binaries.values()):
        return helpers
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("a C compiler is needed to build corral-agent: apt-get install gcc libc6-dev")
    out_dir = helpers.agent.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, source in _NATIVE_SOURCES.items():
        tmp = out_dir / f".corral-{name}.{os.getpid()}"
        subprocess.run(
            [compiler, "-O2", "-Wall", "-static", "-o", str(tmp), str(source)], check=True, capture_output=True
        )
        os.replace(tmp, binaries[name])
    return helpers


_CONTAINER_INITS = frozenset({"agent"})  # corral-agent, bind-mounted as /.corral/agent


class OrphanReaper:
    """Reaps processes re-parented to this subreaper that nobody waits for:
    the runtime's intermediate forks and the inits of deleted containers.

    asyncio waits for the runtime processes it spawned by pid, so those are
    registered here (``spawned``) and left alone; while a spawn is in flight
    its pid is not known yet, so only container inits are reaped then.
    """

    def __init__(self) -> None:
        self._tracked: set[int] = set()
        self._spawning = 0

    @contextlib.contextmanager
    def spawned(self) -> Iterator[Callable[[int], None]]:
        """Wrap a spawn and the wait for it; call the yielded function with the pid."""
        pids: list[int] = []
        self._spawning += 1

        def track(pid: int) -> None:
            pids.append(pid)
            self._tracked.add(pid)
            self._spawning -= 1

        try:
            yield track
        finally:
            if not pids:
                self._spawning -= 1
            self._tracked.difference_update(pids)

    def reap(self) -> int:
        """Reap our zombie children that nobody waits for; returns how many.

        The kernel names them (``waitid`` without waiting, one call that answers "none" when no child has
        exited), so a node's thousands of live container inits are not read: reading every child's /proc stat
        every second was half the server's CPU during a bulk kill at 10,000 sandboxes. Only when the zombie
        it names is not ours to reap (its spawner waits for it) are the children read one by one."""
        reaped = 0
        while True:
            try:
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # no children at all
                return reaped
            if exited is None:  # none has exited
                return reaped
            if not self._ours(exited.si_pid, self._spawning > 0):
                return reaped + self._reap_each()
            try:
                if os.waitpid(exited.si_pid, os.WNOHANG)[0] == 0:
                    return reaped + self._reap_each()
                reaped += 1
            except ChildProcessError:  # its waiter was quicker
                continue

    def _ours(self, pid: int, spawning: bool) -> bool:
        """Whether a zombie child is ours to reap: not one a spawner waits for; while a spawn is in flight (its pid
        not known yet) only a container's init, which is never a process we spawned."""
        if pid in self._tracked:
            return False
        if not spawning:
            return True
        try:
            return read_small(f"/proc/{pid}/comm").strip() in _CONTAINER_INITS
        except OSError:
            return False

    def _reap_each(self) -> int:
        spawning = self._spawning > 0
        reaped = 0
        # An orphan is handed to any of our threads, so read every task's children.
        for children in Path("/proc/self/task").glob("*/children"):
            try:
                pids = [int(pid) for pid in read_small(str(children)).split()]
            except OSError:
                continue
            for pid in pids:
                fields = stat_fields(pid)
                if fields is not None and fields[0] == "Z" and self._ours(pid, spawning):
                    with contextlib.suppress(ChildProcessError):
                        os.waitpid(pid, os.WNOHANG)
                        reaped += 1
        return reaped


orphans = OrphanReaper()
"""The process-wide reaper (being a subreaper is a property of the process)."""
