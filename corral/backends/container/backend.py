"""Container sandboxes: an OCI runtime over an overlay of EROFS layers.

Per sandbox, under ``<data_dir>/sandboxes/<id>/``: ``bundle/`` (config.json
and the rootfs mountpoint); ``upper/`` and ``work/`` (the writable layer, on
disk so it survives an edge restart) are in the sandbox's own size-limited
subvolume of the node's quota pool (writable.py), or beside ``bundle/`` on a
node without one. Layers are mounted once per edge by
``LayerMounts``; the overlay itself exists only in the container's mount
namespace (see native/launch.c). Commands run through corral-agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import resource
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from corral.api.errors import Conflict, CorralError, InternalError, NotFound, SandboxGone
from corral.backends.agent_command import AgentCommand
from corral.backends.base import (
    Capability,
    ChangedPaths,
    Checkpointing,
    CommandSpec,
    FileTree,
    ReclaimResult,
    SandboxSpec,
    offer_key,
)
from corral.backends.common import qos
from corral.backends.common.agent_protocol import (
    IpcCounts,
)
from corral.backends.common.host import (
    CgroupLayout,
    LayerMounts,
    NativeHelpers,
    NodeSysfs,
    orphans,
    remove_empty_cgroups,
    run_dir_of,
    runtime_dirs_of,
    runtime_state_root,
    vm_sockets_of,
)
from corral.backends.common.network import (
    DEFAULT_RESOLVE_INTERVAL_S,
    AllowRule,
    DeniedCounts,
    HostResolver,
    NetworkFabric,
)
from corral.backends.common.spawn import finished_before_cancel
from corral.backends.container.changes import CHANGED_PATHS_MAX, StepFiles
from corral.backends.container.gvisor import RUNSC, Gvisor
from corral.backends.container.isolation import CommandPaths, Container, Isolation, PlainOci
from corral.backends.container.kernel_watch import SeccompDenials, SensitiveReads, session_of
from corral.backends.container.memory import CgroupMemory, prefetch_swapped
from corral.backends.container.oci import (
    AGENT_PATH,
    DEFAULT_OPEN_FILES,
    ContainerLimits,
    build_config,
    masked_directories,
)
from corral.backends.container.runtime import OciRuntime, Overlay
from corral.backends.container.writable import QuotaPool
from corral.guard.audit import PACKAGE_PREFIXES, PROTECTED_PREFIXES, EventThrottle, denied_syscall_severity
from corral.images.erofs import build_erofs
from corral.images.lazy import check_layer
from corral.procfs import held_files, read_small

__all__ = ["ContainerBackend"]

log = logging.getLogger(__name__)


_RUNTIMES = ("crun", "runc", RUNSC)
# Runtimes that take masked directories as binds of the node's empty one (oci.py says why). runc refuses any
# mount inside /proc ("cannot be mounted because it is inside /proc"): its sandboxes keep the tmpfs masks.
_BIND_MASK_RUNTIMES = frozenset({"crun", RUNSC})
# Runtimes whose sandboxes bind the node's one sysfs and keep /dev/shm in /dev (oci.py): gVisor's sentry serves
# /sys and /dev itself; runc is left as it was (its masks are tmpfs anyway).
_NODE_SYSFS_RUNTIMES = frozenset({"crun"})
_TIER_NAMES = frozenset(tier.strip("/") for tier in qos.TIERS.values())  # top-level cgroups sandboxes live under


def _read_int(path: str) -> int:
    """A cgroup counter read after every command (pids.current): held open (see HeldFiles)."""
    return int(held_files.read(path))


_RECYCLE_POLLS = 50
_PRISTINE_MAX_ENTRIES = 256  # bounds the walk, which runs on the event loop
_TOO_MANY = "upper:too-many-entries"
_VOLATILE_DIRS = ("dev", "dev/shm", "dev/mqueue")  # tmpfs mounts: writes there are not in the upper dir
_AGENT_QUERY_TIMEOUT_S = 2.0
_FREEZE_TIMEOUT_S = 2.0  # after the runtime's pause, for the kernel to say the sandbox is frozen
_FREEZE_POLL_FIRST_S = 0.0005
_FREEZE_POLL_MAX_S = 0.01
_NO_IPC_OBJECTS = IpcCounts(0, 0, 0)


def _changed_under(upper: Path, prefixes: tuple[str, ...]) -> list[str]:
    """Entries of the writable layer under these prefixes: each one is a change (copy-up, new file or whiteout)."""
    try:
        touched = set(os.listdir(upper))  # the top directories anything was written under
    except OSError:
        return []
    found: list[str] = []
    for prefix in prefixes:
        relative = prefix.strip("/")
        if relative.partition("/")[0] not in touched:
            continue  # the usual case: nothing under its top directory was written, no stat
        base = upper / relative
        if not base.exists():
            continue
        if not base.is_dir() or base.is_symlink():
            found.append("/" + prefix.strip("/"))
            continue
        for entry in base.rglob("*"):
            if not entry.is_dir() or entry.is_symlink():
                found.append("/" + str(entry.relative_to(upper)))
            if len(found) >= CHANGED_PATHS_MAX:
                return found
    return sorted(set(found))


def _pristine_state(upper: Path, init_pid: int) -> frozenset[str]:
    """What a call could leave behind in files: every entry of the writable layer (with its metadata) and the
    tmpfs mounts' listings. (SysV IPC objects are only visible from inside: see ``AgentConnection.ipc_counts``.)"""
    state: set[str] = set()
    stack, count = [str(upper)], 0
    prefix = len(str(upper)) + 1
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            state.add(_TOO_MANY)  # unreadable: do not reuse
            break
        for entry in entries:
            count += 1
            if count > _PRISTINE_MAX_ENTRIES:  # a call that wrote this much is not reused: stop looking
                state.add(_TOO_MANY)
                return frozenset(state)
            st = entry.stat(follow_symlinks=False)
            state.add(f"upper:{entry.path[prefix:]}:{st.st_mode}:{st.st_size}:{st.st_mtime_ns}")
            if entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)
    root = f"/proc/{init_pid}/root/"
    for directory in _VOLATILE_DIRS:
        try:
            state.update(f"{directory}:{name}" for name in os.listdir(root + directory))
        except OSError:
            continue
    return frozenset(state)


def _empty_directory(path: Path) -> Path:
    """The node's empty, read-only directory that masks directories in its containers (oci.py says why); made
    again if anything was put there, so nothing shows through."""
    if path.is_dir() and any(path.iterdir()):
        shutil.rmtree(path)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o555)
    return path


def _clone_cpusets_in_tiers(
    layout: CgroupLayout, root: Path = Path("/sys/fs/cgroup/cpuset"), tiers: Iterable[str] = qos.TIERS.values()
) -> None:
    """On cgroup v1, the sandboxes' tiers (``qos.TIERS``) in the cpuset hierarchy made by hand, with the root's CPUs
    and memory nodes, and ``cgroup.clone_children`` set: a sandbox's cpuset then starts with its tier's, and the
    runtime writes neither. Each of its writes walked every sibling (``validate_change``) and rebuilt the
    scheduler's domains over every cpuset (``dl_rebuild_rd_accounting``, ``update_domain_attr_tree``): 8-9% of the
    host's CPU samples while creates ran at 3,000-4,000 idle sandboxes, against 3.6% for the clone's own walk of
    the siblings (``cpuset_css_online``; perf, docs/spec.md, Density). Corral never pins CPUs, so every sandbox has
    the root's anyway. Nothing to do on v2 or without a cpuset hierarchy; a failure is logged, not retried."""
    if layout is CgroupLayout.UNIFIED or not (root / "cgroup.clone_children").exists():
        return
    try:
        for tier in tiers:
            directory = root / tier.strip("/")
            directory.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if not read_small(str(directory / name)).strip():
                    (directory / name).write_text(read_small(str(root / name)))
            if read_small(str(directory / "cgroup.clone_children")).strip() != "1":
                (directory / "cgroup.clone_children").write_text("1")
    except OSError as exc:  # the runtime initialises each sandbox's cpuset itself, as before
        log.warning("cannot prepare the sandboxes' cpuset tiers (%s): creates cost more as the node fills", exc)


def _binds_node_sysfs(runtime: str, spec: SandboxSpec) -> bool:
    """Whether a sandbox binds the node's sysfs (``NodeSysfs``), whose /sys/class/net lists a loopback only: a
    sandbox created with a network has a sysfs of its own, which lists its interface. (One given a network later
    goes on listing the loopback there; ``ip`` asks the kernel and lists both.)"""
    return runtime in _NODE_SYSFS_RUNTIMES and spec.network is None


def _weighed_pool_member(spec: SandboxSpec) -> bool:
    """A warm pool's crun sandbox, which starts at the pool's weight until its claim. Not gVisor's: runsc makes its
    cgroups its own way (the backend never writes their weight)."""
    return spec.pool_member and spec.runtime != RUNSC


class ContainerBackend:
    """Runs container sandboxes on this node with crun (default), runc or runsc (gVisor); what differs by runtime
    is the sandbox's ``Isolation`` (isolation.py), to which this backend is ``ContainerParts``."""

    name = "container"

    def __init__(
        self,
        *,
        data_dir: Path,
        helpers: NativeHelpers,
        layout: CgroupLayout,
        default_runtime: str,
        agent_start_timeout_s: float,
        layer_idle_unmount_s: float,
        create_concurrency: int,
        destroy_concurrency: int,
        audit_repeat_window_s: float,
        default_disk_mb: int = 0,
        disk_reserve_mb: int = 0,
        open_files: int = DEFAULT_OPEN_FILES,
        resolver: HostResolver | None = None,
        resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S,
    ) -> None:
        self._dir = data_dir / "sandboxes"
        self._dir.mkdir(parents=True, exist_ok=True)
        self._data_dir = data_dir
        # On a tmpfs (host.ensure_run_tmpfs, which a node mounts before this): what lives as long as the containers.
        self._run_dir = run_dir_of(data_dir)
        self._runtime_dirs = runtime_dirs_of(data_dir)
        self._vm_sockets = vm_sockets_of(data_dir)
        self._runtime_dirs.mkdir(parents=True, exist_ok=True)
        self._helpers = helpers
        self._layout = layout
        self._default_runtime = default_runtime
        self._runtimes: dict[str, OciRuntime] = {}
        # On disk, not the run dir's tmpfs: a bind of it shows the host's disk filesystem in the sandbox.
        self._mask_dir = _empty_directory(data_dir / "run" / "mask")
        self._masked_dirs = masked_directories()
        self._sysfs = NodeSysfs(data_dir / "run")
        self._node_prepared = False
        self._node_preparing = asyncio.Lock()  # creates that arrive together at the start prepare it once
        self._mounts = LayerMounts(data_dir / "mnt" / "layers", verify=check_layer)
        self._containers: dict[str, Container] = {}
        self.agent_start_timeout_s = agent_start_timeout_s
        self._layer_idle_unmount_s = layer_idle_unmount_s
        self._create_slots = asyncio.Semaphore(create_concurrency)
        self._destroy_slots = asyncio.Semaphore(destroy_concurrency)
        self._default_disk_mb = default_disk_mb
        self._open_files = min(open_files, resource.getrlimit(resource.RLIMIT_NOFILE)[1])  # at most what we have
        self._pool = QuotaPool(data_dir, disk_reserve_mb << 20)
        self._pool_lock = asyncio.Lock()
        self._pool_error: InternalError | None = None
        self._step_files = StepFiles(self._pool)
        # One router namespace per server (its data dir), created when the first sandbox needs a network.
        self._fabric = NetworkFabric(
            "n" + hashlib.sha256(str(data_dir).encode()).hexdigest()[:10],
            resolver=resolver,
            resolve_interval_s=resolve_interval_s,
        )
        self._fabric_started = False
        self._fabric_lock = asyncio.Lock()
        self._denials = SeccompDenials()
        self._reads = SensitiveReads()
        self._kernel_events = EventThrottle(window_s=audit_repeat_window_s)
        self._sandbox_of_session: dict[int, str] = {}
        self._own_session = session_of(os.getpid())
        plain = PlainOci(self)
        self._isolations: dict[str, Isolation] = {"crun": plain, "runc": plain, RUNSC: Gvisor(self)}

    def _prepare_node(self) -> None:
        """What this node's container sandboxes share, made before the first of them: the cpuset tiers, the sysfs."""
        _clone_cpusets_in_tiers(self._layout)
        self._sysfs.path()

    def runtime(self, name: str | None) -> OciRuntime:
        name = name or self._default_runtime
        if name not in self._runtimes:
            self._runtimes[name] = OciRuntime(name, runtime_state_root(self._data_dir, name), self._helpers.launch)
        return self._runtimes[name]

    def _layer_root(self, sandbox_id: str) -> Path:
        """Where its writable layer lives: its subvolume of the quota pool when it has a limit, else the data dir."""
        return self._pool.layer_dir(sandbox_id) if self._pool.has(sandbox_id) else self._dir / sandbox_id

    async def _open_pool(self) -> bool:
        """The quota pool, mounted on first use; False (and one warning) when this node cannot have one."""
        async with self._pool_lock:
            if not self._pool.is_open and self._pool_error is None:
                try:
                    await asyncio.to_thread(self._pool.open)
                except InternalError as exc:
                    self._pool_error = exc
                    log.warning("%s: sandboxes' writable layers are not size-limited on this node", exc)
        return self._pool.is_open

    async def _limit_layer(self, spec: SandboxSpec) -> None:
        """Its writable layer in a subvolume of ``disk_mb`` (else the node default); an explicit size this node
        cannot enforce is refused, the default is skipped (with the warning ``_open_pool`` logged)."""
        disk_mb = spec.disk_mb if spec.disk_mb is not None else self._default_disk_mb
        if not disk_mb:
            return
        if not await self._open_pool():
            if spec.disk_mb is not None:
                raise InternalError(f"cannot give the sandbox a {disk_mb} MiB disk: {self._pool_error}")
            return
        await asyncio.to_thread(self._pool.add, spec.sandbox_id, disk_mb << 20)

    def upper(self, sandbox_id: str) -> Path:
        return self._layer_root(sandbox_id) / "upper"

    def work(self, sandbox_id: str) -> Path:
        return self._layer_root(sandbox_id) / "work"

    def sandbox_dir(self, sandbox_id: str) -> Path:
        return self._dir / sandbox_id

    def runtime_dir(self, sandbox_id: str) -> Path:
        return self._runtime_dirs / sandbox_id

    def replace(self, sandbox_id: str, container: Container | None) -> None:
        if container is None:
            self._containers.pop(sandbox_id, None)
        else:
            self._containers[sandbox_id] = container

    def resident_bytes(self, sandbox_id: str) -> int:
        container = self._containers.get(sandbox_id)
        try:
            return container.memory.usage_bytes() if container is not None else 0
        except OSError:
            return 0

    def disk_usage(self, sandbox_id: str) -> tuple[int, int] | None:
        """(bytes used, bytes total) of a size-limited writable layer; None when it has no limit."""
        return self._pool.usage(sandbox_id)

    def _memory(self, spec: SandboxSpec) -> CgroupMemory:
        return CgroupMemory(self._layout, qos.cgroup_path(spec.sandbox_id, spec.qos))

    async def create(self, spec: SandboxSpec) -> str | None:
        if not self._node_prepared:  # once, off the event loop: from then on a stat a create
            async with self._node_preparing:
                if not self._node_prepared:
                    await asyncio.to_thread(self._prepare_node)
                    self._node_prepared = True
        runtime = self.runtime(spec.runtime)
        isolation = self._isolations[runtime.name]
        isolation.refuse(spec)
        bundle = self.runtime_dir(spec.sandbox_id) / "bundle"
        # Each step that takes something pushes how to give it back; a failure at any later step (a disk that
        # cannot be made, a layer that cannot be mounted, an agent that never answers) undoes them, last first.
        async with contextlib.AsyncExitStack() as undo:
            undo.push_async_callback(asyncio.to_thread, self._remove_dirs, spec.sandbox_id)
            bundle.joinpath("rootfs").mkdir(parents=True, exist_ok=True)
            await self._limit_layer(spec)
            upper, work = self.upper(spec.sandbox_id), self.work(spec.sandbox_id)
            for path in (upper, work):
                path.mkdir(parents=True, exist_ok=True)
            lowers = await self.acquire_layers(spec)
            undo.callback(self.release_layers, spec)
            config = build_config(
                hostname=spec.sandbox_id[-12:],
                limits=ContainerLimits(
                    cpu=spec.cpu,
                    memory_mb=spec.memory_mb,
                    pids_max=spec.pids_max,
                    cpu_shares=qos.weight_to_shares(qos.start_weight(spec.qos, pool_member=_weighed_pool_member(spec))),
                    open_files=self._open_files,
                ),
                cgroup_path=qos.cgroup_path(spec.sandbox_id, spec.qos),
                agent_binary=self._helpers.agent,
                log_denials=runtime.name == "crun",
                setuid_allowed=spec.setuid_allowed,
                mask_dir=self._mask_dir if runtime.name in _BIND_MASK_RUNTIMES else None,
                masked_dirs=self._masked_dirs,
                node_sysfs=self._sysfs.path() if _binds_node_sysfs(runtime.name, spec) else None,
            )
            (bundle / "config.json").write_text(json.dumps(isolation.config(config, spec.sandbox_id)))
            undo.push_async_callback(runtime.kill_and_delete, spec.sandbox_id)
            async with self._create_slots:
                init_pid, agent = await isolation.start(runtime, spec, bundle, Overlay(lowers, upper, work))
            undo.callback(agent.close)
            # What a pristine sandbox holds, for recycle (where its isolation allows recycling at all).
            recycles = Capability.RECYCLE in isolation.capabilities
            baseline = await asyncio.to_thread(_pristine_state, upper, init_pid) if recycles else frozenset()
            container = Container(spec, runtime, isolation, agent, init_pid, self._memory(spec), baseline=baseline)
            self._containers[spec.sandbox_id] = container
            undo.callback(self._containers.pop, spec.sandbox_id, None)
            self._watch_kernel(container)
            undo.pop_all()  # the sandbox is whole: from here destroy gives all of it back
            if spec.network is not None:
                undo.push_async_callback(self.destroy, spec.sandbox_id)
                await self._plug(container, spec.network)
                undo.pop_all()
        return None

    async def acquire_layers(self, spec: SandboxSpec) -> list[Path]:
        """Mountpoints of the sandbox's layers, top first (overlayfs lowerdir order); all or none."""
        acquired: list[Path] = []
        with contextlib.ExitStack() as undo:
            for layer in reversed(spec.layers):
                acquired.append(await self._mounts.acquire(layer.mount_key, layer.path))
                undo.callback(self._mounts.release, layer.mount_key)
            undo.pop_all()
        return acquired

    def release_layers(self, spec: SandboxSpec) -> None:
        for layer in spec.layers:
            self._mounts.release(layer.mount_key)

    async def adopt(self, spec: SandboxSpec) -> str | None:
        runtime = self.runtime(spec.runtime)
        isolation = self._isolations[runtime.name]
        state = await runtime.state(spec.sandbox_id)
        # Its writable layer may be in the pool: mount that first (the same filesystem), for a sandbox that is gone
        # too, whose layer goes with it. Adoptions run at once: the gone one's teardown had looked for its layer
        # before another's adoption mounted the pool, and left it (a one-process teardown made that race likely).
        if self._pool.made:
            await self._open_pool()
        if state is None or state.status not in ("running", "paused"):
            await self.destroy(spec.sandbox_id)
            return None
        await self.acquire_layers(spec)  # counted like a new sandbox; released on destroy
        paused = state.status == "paused"
        try:
            if paused:  # a new agent in a frozen cgroup would freeze before its hello
                await runtime.resume(spec.sandbox_id)
            agent = await isolation.reattach(runtime, spec)
            if paused:
                try:
                    await self._freeze(runtime, spec)
                except Conflict as exc:  # kept, running (it was thawed for the agent): a later pause may take
                    log.warning("sandbox %s adopted running, not paused: %s", spec.sandbox_id, exc)
                    paused = False
        except Exception:
            log.exception("could not re-attach to sandbox %s", spec.sandbox_id)
            self.release_layers(spec)
            await self.destroy(spec.sandbox_id)
            return None
        container = Container(spec, runtime, isolation, agent, state.pid, self._memory(spec), paused=paused)
        self._containers[spec.sandbox_id] = container
        self._watch_kernel(container)
        if spec.network is not None:  # the router namespace died with the old server: plug in again
            await self._plug(container, spec.network)
        return "paused" if paused else "running"

    @property
    def runtimes(self) -> list[str]:
        """The OCI runtimes installed on this node, each a level of isolation a create may ask for."""
        return [name for name in _RUNTIMES if shutil.which(name)]

    def offers(self) -> dict[str, frozenset[Capability]]:
        return {offer_key(self.name, runtime): self._isolations[runtime].capabilities for runtime in self.runtimes}

    def checkpoints(self, sandbox_id: str) -> Checkpointing | None:
        return self.container(sandbox_id).isolation.checkpoints()

    async def orphans(self, known_ids: set[str]) -> list[str]:
        """Containers in our runtime state that no sandbox record owns."""
        found: list[str] = []
        for name in _RUNTIMES:
            if shutil.which(name) and runtime_state_root(self._data_dir, name).exists():
                found += [cid for cid in await self.runtime(name).list_ids() if cid not in known_ids]
        if self._pool.made and await self._open_pool():  # writable layers of sandboxes no record owns
            found += [sid for sid in self._pool.sandbox_ids() if sid not in known_ids and sid not in found]
        return found

    def container(self, sandbox_id: str) -> Container:
        container = self._containers.get(sandbox_id)
        if container is None:
            raise NotFound(f"no running container for sandbox {sandbox_id}")
        if container.replacing:
            raise Conflict(f"sandbox {sandbox_id} is being checkpointed or restored: retry in a moment")
        if container.agent.closed.is_set():
            raise SandboxGone(f"sandbox {sandbox_id} stopped: its init process exited")
        return container

    def run(self, sandbox_id: str, command: CommandSpec) -> AgentCommand:
        container = self.container(sandbox_id)
        return AgentCommand(container.agent, command, container.memory.oom_kills)

    def files(self, sandbox_id: str) -> FileTree:
        container = self.container(sandbox_id)
        return container.isolation.files(container)

    async def wait_ended(self, sandbox_id: str) -> str:
        container = self.container(sandbox_id)
        while True:
            agent = container.agent
            await agent.closed.wait()
            while container.replacing and self._containers.get(sandbox_id) is container:
                await asyncio.sleep(0.05)  # gVisor: a checkpoint or rewind attaches a new agent: follow it
            current = self._containers.get(sandbox_id)
            if current is None:
                return "exited"
            if current is not container or current.agent is not agent:
                container = current
                continue
            return "exited"

    async def destroy(self, sandbox_id: str) -> None:
        """Gone from the node's map at once; its teardown (runtime processes, network, directories) waits for
        one of ``destroy_concurrency`` slots: a bulk kill of 10,000 started every teardown at once, a runtime process
        and its pipes each, and ran out of the node's open files (EMFILE for half of them), for no more speed."""
        container = self._containers.pop(sandbox_id, None)
        self._forget_kernel(sandbox_id)
        async with self._destroy_slots:
            await self._tear_down(sandbox_id, container)

    async def _tear_down(self, sandbox_id: str, container: Container | None) -> None:
        if self._fabric.address_of(sandbox_id) is not None:
            await asyncio.to_thread(self._fabric.detach, sandbox_id)
        if container is not None:
            container.agent.close()
            await container.runtime.kill_and_delete(sandbox_id)
            self.release_layers(container.spec)
        else:
            for name in _RUNTIMES:
                if shutil.which(name):
                    await self.runtime(name).kill_and_delete(sandbox_id)
        await asyncio.to_thread(self._remove_dirs, sandbox_id)

    def _remove_dirs(self, sandbox_id: str) -> None:
        """Its bundle, its writable layer (with its quota, if any), and what the runtime left of its cgroups."""
        self._step_files.forget(self._pool.remove(sandbox_id))
        for tier in qos.TIERS.values():
            remove_empty_cgroups(f"{tier}/{sandbox_id}")
        shutil.rmtree(self.runtime_dir(sandbox_id), ignore_errors=True)
        shutil.rmtree(self._dir / sandbox_id, ignore_errors=True)

    def _remove_run_dir_if_unused(self) -> None:
        """The run dir goes once nothing of a container is left in it: no sandbox's runtime dir (each has one until
        its teardown ends) and no runtime state (a delete that failed leaves its container's, for the next start's
        orphan sweep). So servers that came and went (tests, benches) leave nothing on the host's tmpfs; with
        containers left, it stays for the next server to adopt them. Nor while a VM's sockets are there (its QEMU
        outlives the server as a container does)."""
        roots = [self._runtime_dirs, self._vm_sockets, *(self._run_dir / name for name in _RUNTIMES)]
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if any(any(root.iterdir()) for root in roots if root.is_dir()):
                return
            shutil.rmtree(self._run_dir, ignore_errors=True)

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        """Pack the sandbox's writable layer (whiteouts and opaque dirs kept) into an EROFS file.

        The sandbox is frozen meanwhile, so the layer is a consistent point in
        time; the agent's mountpoint is left out."""
        container = self.container(sandbox_id)
        upper = self.upper(sandbox_id)
        was_paused = container.paused
        if not was_paused:
            await self._freeze(container.runtime, container.spec)
        try:
            await asyncio.to_thread(build_erofs, upper, dest, exclude=[AGENT_PATH.strip("/").split("/")[0]])
        finally:
            if not was_paused:
                await container.runtime.resume(sandbox_id)

    async def fs_clock(self, sandbox_id: str) -> float:
        """The filesystem's own 'now', on the coarse clock the kernel stamps files with.

        It waits for that clock to tick once, so everything changed before the call is
        strictly older than the returned time (at most one tick, a few ms)."""
        # In the run dir: never in the writable layer's subvolume, whose quota a full sandbox has used up. The
        # clock is the kernel's for every filesystem (multigrain timestamps keep coarse ones after fine ones).
        paths = self._command_paths(self.container(sandbox_id))
        return await self._step_files.clock(sandbox_id, paths.clock, paths.upper)

    def _netns(self, container: Container) -> str:
        return f"/proc/{container.init_pid}/ns/net"

    async def _plug(self, container: Container, rules: tuple[AllowRule, ...]) -> str:
        fabric = await self.network_fabric()
        return await finished_before_cancel(  # a create's undo detaches what it attached
            asyncio.to_thread(fabric.attach, container.spec.sandbox_id, self._netns(container), rules)
        )

    async def network_fabric(self) -> NetworkFabric:
        """This edge's sandbox network, started once on first use (concurrent first users wait for that one
        start); VM sandboxes plug into it too."""
        async with self._fabric_lock:
            if not self._fabric_started:
                await asyncio.to_thread(self._fabric.start)
                self._fabric_started = True
        return self._fabric

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        fabric = await self.network_fabric()
        await asyncio.to_thread(fabric.attach_peer, name, netns_path, address)

    async def set_network(self, sandbox_id: str, rules: tuple[AllowRule, ...]) -> str:
        container = self.container(sandbox_id)
        container.isolation.refuse_network()
        address = self._fabric.address_of(sandbox_id)
        if address is None:
            return await self._plug(container, rules)
        await asyncio.to_thread(self._fabric.set_policy, self._netns(container), rules)
        return address

    async def network_status(self, sandbox_id: str) -> tuple[str | None, DeniedCounts | None]:
        container = self.container(sandbox_id)
        address = self._fabric.address_of(sandbox_id)
        if address is None:
            return None, None
        return address, await asyncio.to_thread(self._fabric.denied, self._netns(container))

    async def findings(self, sandbox_id: str) -> tuple[list[str], int]:
        container = self.container(sandbox_id)
        paths = self._command_paths(container)
        prefixes = (*PACKAGE_PREFIXES, *PROTECTED_PREFIXES, *container.spec.protected_paths)
        changed = _changed_under(paths.upper, prefixes)  # one listdir in the usual case: no thread hop
        if container.spec.sensitive_paths:  # files written or directories replaced since get marks too
            await asyncio.to_thread(self._reads.mark, sandbox_id, self._root(container), container.spec.sensitive_paths)
        try:
            events = held_files.read(paths.pids_events).split()
            pid_limit_hits = int(events[events.index("max") + 1]) if "max" in events else 0
        except OSError:
            pid_limit_hits = 0
        return changed, pid_limit_hits

    async def _no_ipc_objects(self, container: Container) -> bool:
        """A new IPC namespace starts empty, so any SysV object was left by a call. False when the agent does
        not answer in time. The counts the last command's exit carried, taken with the agent alone, spare the
        query's round trip (a wakeup of the agent and one of the edge: 16 callers' fncalls 3-12% faster, 5 pairs);
        a sandbox that is recycled has its commands' exits carry them from then on."""
        container.agent.ipc_at_exit = True
        counts = container.agent.ipc_when_alone()
        if counts is not None:
            return counts == _NO_IPC_OBJECTS
        try:
            counts = await asyncio.wait_for(container.agent.ipc_counts(), _AGENT_QUERY_TIMEOUT_S)
        except (TimeoutError, CorralError):
            return False
        return counts == _NO_IPC_OBJECTS

    async def recycle(self, sandbox_id: str) -> bool:
        """Kill every process but the agent; True if nothing of the last use is left (no process, no file,
        no IPC object differs from right after start), so the sandbox can serve another caller as new."""
        container = self.container(sandbox_id)
        if Capability.RECYCLE not in container.isolation.capabilities:
            return False
        paths = self._command_paths(container)
        pids = paths.pids_current
        if _read_int(pids) > 1:  # something outlived the call (else the agent is alone: one read a call)
            await container.agent.kill_all()
            for _ in range(_RECYCLE_POLLS):
                if _read_int(pids) <= 1:
                    break
                await asyncio.sleep(0.002)
            else:
                return False
        state = _pristine_state(paths.upper, container.init_pid)  # small: cheaper than a thread hop
        if state != container.baseline or _TOO_MANY in state:
            return False
        return await self._no_ipc_objects(container)

    def _command_paths(self, container: Container) -> CommandPaths:
        if container.command_paths is None:
            sandbox_id = container.spec.sandbox_id
            container.command_paths = CommandPaths(
                self.upper(sandbox_id),
                str(self._cgroup_file(sandbox_id, "pids", "pids.events")),
                str(self._cgroup_file(sandbox_id, "pids", "pids.current")),
                self.runtime_dir(sandbox_id) / "clock",
            )
        return container.command_paths

    def _cgroup_file(self, sandbox_id: str, controller: str, name: str) -> Path:
        return self._cgroup_dir(qos.cgroup_path(sandbox_id, self.container(sandbox_id).spec.qos), controller) / name

    def _cgroup_dir(self, cgroup_path: str, controller: str) -> Path:
        relative = cgroup_path.lstrip("/")
        if self._layout is CgroupLayout.UNIFIED:
            return Path("/sys/fs/cgroup") / relative
        return Path("/sys/fs/cgroup") / controller / relative

    def apply_qos(self, spec: SandboxSpec) -> None:
        """What config.json cannot say about its CPU class: on v2 the weight itself (the runtime's own
        shares → weight map differs by version), and the batch tier's cpu.idle and lowest weight (the
        runtime made the tier as the sandbox's parent; setting it again is harmless)."""
        sandbox_dir = self._cgroup_dir(qos.cgroup_path(spec.sandbox_id, spec.qos), "cpu")
        weight = qos.weight_of(spec.qos)
        self._write_weight(sandbox_dir, qos.start_weight(spec.qos, pool_member=_weighed_pool_member(spec)))
        tier = sandbox_dir.parent
        if qos.TIERS[spec.qos] in qos.IDLE_TIERS:
            if (tier / "cpu.idle").exists():  # an idle cgroup has the lowest weight and refuses another
                (tier / "cpu.idle").write_text("1")
            else:  # kernels before 5.15
                self._write_weight(tier, weight)

    async def claimed(self, spec: SandboxSpec) -> None:
        """A claimed warm sandbox takes its class's weight (it started at the pool's lowest)."""
        self.container(spec.sandbox_id)
        if spec.runtime == RUNSC:  # started at its class's weight: see _weighed_pool_member
            return
        try:
            self._write_weight(self._cgroup_dir(qos.cgroup_path(spec.sandbox_id, spec.qos), "cpu"),
                               qos.weight_of(spec.qos))  # fmt: skip
        except FileNotFoundError:
            raise SandboxGone(f"sandbox {spec.sandbox_id} ended before its claim") from None

    def _write_weight(self, cgroup_dir: Path, weight: int) -> None:
        qos.write_weight(cgroup_dir, weight, self._layout)

    async def changed_paths(self, sandbox_id: str, since: float) -> ChangedPaths:
        """Paths in the sandbox's writable layer changed (written, created or deleted) at or after ``since``."""
        container = self.container(sandbox_id)
        paths = self._command_paths(container)

        def processes() -> list[int]:
            """The sandbox's processes but its agent, none read while the agent is alone (pids.current 1: a step
            that left nothing running), which maps no file at all (agent.c) and is not dumpable, so nothing in
            the sandbox can ptrace it into mapping one: its maps were a read of /proc on every step."""
            if container.spec.runtime == RUNSC:  # the sentry writes a mapping back through its gofer (events)
                return []
            with contextlib.suppress(OSError, ValueError):  # unreadable: the sandbox is ending, its cgroup going
                if _read_int(paths.pids_current) <= 1:
                    return []
            return [pid for pid in container.memory.pids() if pid != container.init_pid]

        return await self._step_files.changed(sandbox_id, paths.upper, since, processes)

    async def shutdown(self, sandbox_id: str, timeout_s: float) -> bool:
        """SIGTERM to every process (the agents ignore it), then wait until only agents are left."""
        container = self.container(sandbox_id)
        if container.paused:
            await self.resume(sandbox_id)
        await container.runtime.signal_all(sandbox_id, "TERM")
        procs = self._cgroup_file(sandbox_id, "pids", "cgroup.procs")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if await container.isolation.only_agents_left(container, procs):
                    return True
            except OSError:
                return True
            await asyncio.sleep(0.05)
        return False

    async def pause(self, sandbox_id: str, *, wait_reclaim: bool = False) -> ReclaimResult:
        """Freeze every process (state and memory kept), then push the memory out in the background.

        Returns once frozen (a few ms) unless ``wait_reclaim``; ``after_bytes`` is what is resident then."""
        container = self.container(sandbox_id)
        if not container.paused:
            await self._freeze(container.runtime, container.spec)
            container.paused = True
        before = container.memory.usage_bytes()
        if container.reclaim is None or container.reclaim.done():
            container.stop_reclaim = threading.Event()
            container.reclaim = asyncio.ensure_future(
                asyncio.to_thread(container.memory.reclaim, container.stop_reclaim)
            )
        if wait_reclaim:
            return ReclaimResult(before, (await container.reclaim).after_bytes)
        return ReclaimResult(before, container.memory.usage_bytes())

    async def _freeze(self, runtime: OciRuntime, spec: SandboxSpec) -> None:
        """Pause, and return once the kernel says the sandbox is frozen. crun's pause returns while the v1 freezer
        may still say FREEZING, some tasks not caught yet (by hand: 92 of 300 pauses of a forking loop on a loaded
        host, for up to 47 ms): the sandbox ran on meanwhile, and a snapshot then packed a layer still being
        written. FROZEN is asked for again meanwhile (the v1 freezer then tries the tasks it missed); a sandbox that
        does not freeze within ``_FREEZE_TIMEOUT_S`` is thawed and the pause refused."""
        await runtime.pause(spec.sandbox_id)
        if runtime.gvisor:  # gVisor stops its own kernel
            return
        cgroup_path = qos.cgroup_path(spec.sandbox_id, spec.qos)
        v2 = self._layout is CgroupLayout.UNIFIED
        state = self._cgroup_dir(cgroup_path, "freezer") / ("cgroup.events" if v2 else "freezer.state")
        ask, asked_for = ("cgroup.freeze", "1") if v2 else ("freezer.state", "FROZEN")
        deadline, delay = time.monotonic() + _FREEZE_TIMEOUT_S, _FREEZE_POLL_FIRST_S
        while True:
            try:
                reported = state.read_text()
            except FileNotFoundError:
                raise SandboxGone(f"sandbox {spec.sandbox_id} ended while it was being paused") from None
            if ("frozen 1" in reported.split("\n")) if v2 else reported.strip() == "FROZEN":
                return
            if time.monotonic() > deadline:
                await runtime.resume(spec.sandbox_id)
                raise Conflict(f"sandbox {spec.sandbox_id} did not freeze within {_FREEZE_TIMEOUT_S:.0f}s (a process "
                               "the kernel could not stop): it was left running; retry the pause")  # fmt: skip
            await asyncio.sleep(delay)
            delay = min(delay * 2, _FREEZE_POLL_MAX_S)
            (state.parent / ask).write_text(asked_for)

    async def resume(self, sandbox_id: str) -> None:
        container = self.container(sandbox_id)
        if container.reclaim is not None and not container.reclaim.done():
            container.stop_reclaim.set()  # the reclaim stops after its current chunk
            await container.reclaim
        if container.paused:
            container.memory.stop_swapping()
            await container.runtime.resume(sandbox_id)
            container.paused = False
            # Swapped-out memory comes back in the background: the caller need not wait for it.
            container.prefetch = asyncio.ensure_future(asyncio.to_thread(prefetch_swapped, container.memory.pids()))

    def housekeeping(self) -> None:
        orphans.reap()
        self._mounts.unmount_idle(self._layer_idle_unmount_s)

    def refresh_network(self) -> None:
        if self._fabric_started:  # VM sandboxes share this fabric: their rules are refreshed here too
            self._fabric.refresh_hosts()

    def _root(self, container: Container) -> str:
        return f"/proc/{container.init_pid}/root"

    def _watch_kernel(self, container: Container) -> None:
        """Map the container's audit sessions (its init's, and an adopted agent's) to it, and mark its
        sensitive paths."""
        sandbox_id = container.spec.sandbox_id
        for pid in {container.init_pid, *container.memory.pids()}:
            session = session_of(pid)
            if session is not None and session != self._own_session:
                self._sandbox_of_session[session] = sandbox_id
        self._reads.mark(sandbox_id, self._root(container), container.spec.sensitive_paths)

    def _forget_kernel(self, sandbox_id: str) -> None:
        for session in [k for k, v in self._sandbox_of_session.items() if v == sandbox_id]:
            del self._sandbox_of_session[session]
        self._reads.forget(sandbox_id)
        self._kernel_events.forget(sandbox_id)
        held_files.forget(f"/{sandbox_id}/")  # its cgroups' files, closed before the runtime removes them

    def _sandbox_of_pid(self, session: int | None, pid: int) -> str | None:
        """By the audit session (works after the process exited), else by a live process's cgroup."""
        if session is not None and session in self._sandbox_of_session:
            return self._sandbox_of_session[session]
        try:
            lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            parts = line.split(":", 2)[-1].split("/")
            if len(parts) > 2 and parts[1] in _TIER_NAMES and parts[2] in self._containers:
                return parts[2]
        return None

    def kernel_events(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        for record in self._denials.read():
            sandbox_id = self._sandbox_of_pid(record.session, record.pid)
            if sandbox_id is None:
                continue
            sample = {"pid": record.pid, "comm": record.comm, "exe": record.exe}
            severity = denied_syscall_severity(record.syscall)
            self._kernel_events.add(sandbox_id, "syscall_denied", severity, record.syscall, sample)
        for read in self._reads.read():
            if read.sandbox_id in self._containers:
                sample = {"pid": read.pid, "path": read.path}
                self._kernel_events.add(read.sandbox_id, "sensitive_path_read", "critical", read.path, sample)
        return self._kernel_events.due(time.monotonic())

    async def close(self) -> None:
        for container in self._containers.values():
            container.agent.close()
        self._containers.clear()
        for runtime in self._runtimes.values():
            runtime.close()
        self._runtimes.clear()
        self._remove_run_dir_if_unused()
        self._denials.close()
        self._reads.close()
        self._mounts.unmount_all()
        self._sysfs.close()
        await asyncio.to_thread(self._step_files.close)
        await asyncio.to_thread(self._pool.close)
        if self._fabric_started:
            await asyncio.to_thread(self._fabric.close)
