"""VM sandboxes on QEMU: ``microvm`` (QEMU -M microvm) and ``vm`` (q35, a full disk).

microvm: Debian's PVH kernel boots the project's initramfs, which stacks the
sandbox's EROFS layers (read-only virtio-blk disks: the node's layer files,
shared, not copied) under an overlay whose upper lives on a per-sandbox qcow2
scratch disk, then runs corral-agent as PID 1 on a virtio-serial port.
vm: q35 boots the same kernel and initramfs, which mounts a per-sandbox qcow2
over an ext4 disk image built once per node from the sandbox's layers and
hands PID 1 to the image's own init system when it has one.

Per sandbox, under ``<data_dir>/vms/<id>/``: machine.json, the disk,
console.log and qemu.log; its QMP and agent sockets in the node's run dir
(``host.vm_sockets_of``: short paths); guest memory is a shared
file in /dev/shm, so snapshots (``checkpoint``) write only device state and
copy that file. QEMU is daemonized and re-adopted after an edge restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import io
import json
import logging
import math
import os
import secrets
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from corral.api.errors import Conflict, InternalError, InvalidRequest, NotFound, SandboxGone, ServerUnavailable
from corral.backends import checkpoints
from corral.backends.agent_command import AgentCommand
from corral.backends.base import (
    Capability,
    ChangedPaths,
    Checkpointing,
    CommandSpec,
    ReclaimResult,
    SandboxSpec,
)
from corral.backends.common import qos
from corral.backends.common.agent_protocol import AgentConnection, AgentExit, AgentOutput, ExecOrder, TreeWalk
from corral.backends.common.guest_tree import GuestTree
from corral.backends.common.host import CgroupLayout, orphans, vm_sockets_of
from corral.backends.common.network import GUEST_LINK_IFNAME, AllowRule, DeniedCounts, NetworkFabric
from corral.backends.common.spawn import finished_before_cancel
from corral.backends.vm.accel import choose_accelerator
from corral.backends.vm.cgroup import KILLED_QEMU_EXIT_S, VmCgroup
from corral.backends.vm.guest import GuestKit, ensure_guest_kit
from corral.backends.vm.network import create_guest_link, delete_namespace, name_again, namespace_name
from corral.backends.vm.qemu import (
    QMP_SOCKET,
    SHM_DIR,
    Accelerator,
    Machine,
    MachineConfig,
    console_tail,
    host_tsc_khz,
)
from corral.guard.audit import PROTECTED_PREFIXES
from corral.images.erofs import build_erofs

__all__ = [
    "VmBackend",
    "MIN_GUEST_MEMORY_MB",
    "DEFAULT_DISK_MB",
    "guest_upper_members",
    "root_disk_image",
    "root_disk_path",
    "ExitWalk",
    "walk_still_current",
]

log = logging.getLogger("corral.vm")

MIN_GUEST_MEMORY_MB = 192  # Debian's kernel and the initramfs need this much to boot
DEFAULT_DISK_MB = 2048
_CHANGED_MAX = 10_000
_FIND_CAP_BYTES = 1 << 20  # names of protected paths the audit's walk reports at most (as the busybox find's output)
_TEMPLATES_KEPT = 8  # boot templates per node (each holds a copy of a booted guest's memory)
_BALLOON_HEADROOM_MB = 32  # left above what the guest uses when a pause squeezes it
_BALLOON_WAIT_S = 2.0  # how long a pause waits for the balloon to inflate


@dataclass
class _Vm:
    spec: SandboxSpec
    machine: Machine
    agent: AgentConnection
    paused: bool = False
    replacing: bool = False  # being restored from a checkpoint: its QEMU's exit is not the sandbox's end
    walked: ExitWalk | None = None  # the audit's walk the agent did at the last command's exit


@dataclass(frozen=True)
class ExitWalk:
    """A walk the agent did as a command (job ``job_id``) exited: the audit's answer while no command started
    since (one that did may have changed the tree after it)."""

    job_id: int
    request: TreeWalk
    names: list[str]
    cut: bool


def walk_still_current(
    walked: ExitWalk | None, last_exec_id: int | None, request: TreeWalk
) -> tuple[list[str], bool] | None:
    """The names (and whether they were cut short) of the walk done at a command's exit, if it answers ``request``
    now: the same request, and no command started on the agent since (an exec, a file operation through it, a
    command in the background: any may have changed the tree after the walk). None: walk again."""
    if walked is None or walked.job_id != last_exec_id or walked.request != request:
        return None
    return walked.names, walked.cut


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise InternalError(f"{argv[0]} failed: {done.stderr.strip()[-500:]}")


def _scratch_template(vm_dir: Path, size_mb: int) -> Path:
    """An empty ext4 file system of ``size_mb``, made once per node per size (sparse)."""
    path = vm_dir / f"scratch-{size_mb}m.ext4"
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        with tmp.open("wb") as handle:
            handle.truncate(size_mb << 20)
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1", str(tmp)])
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    return path


# guest_upper_members did the checking; where tarfile has extraction filters (Python 3.11.4+), tell it so, since
# its own "tar" filter would refuse the absolute symlinks an upper dir legitimately holds.
_CHECKED_ALREADY: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def guest_upper_members(archive: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members of a guest's tar of its overlay upper dir, refusing any that would write outside the tree.

    The guest is not trusted, and Debian 12's own Python (3.11.2) predates tarfile's extraction filters, so the
    checks are here: no absolute or ``..`` names, nothing at or below a path the archive made a symlink (tarfile
    would write through it), no hard link out of the tree, no device but an overlayfs whiteout (character 0:0).
    Symlink targets are kept as they are, absolute ones too: they resolve inside a sandbox, never here."""
    symlinks: set[PurePosixPath] = set()

    def inside(name: str, what: str) -> PurePosixPath:
        path = PurePosixPath(name)
        parts = [part for part in path.parts if part not in ("", ".")]
        if path.is_absolute() or ".." in parts:
            raise InternalError(f"the guest's layer archive has {what} outside its tree: {name!r}")
        relative = PurePosixPath(*parts)
        if relative in symlinks or any(parent in symlinks for parent in relative.parents):
            raise InternalError(f"the guest's layer archive has {what} through a symlink it made: {name!r}")
        return relative

    for member in archive:
        path = inside(member.name, "a member")
        if member.islnk():
            inside(member.linkname, "a hard link")
        if member.isdev() and not (member.ischr() and member.devmajor == 0 and member.devminor == 0):
            raise InternalError(f"the guest's layer archive has a device node that is not a whiteout: {member.name!r}")
        if member.issym():
            symlinks.add(path)
        yield member


def root_disk_path(vm_dir: Path, layers: tuple[Path, ...], size_mb: int) -> Path:
    """Where ``root_disk_image`` keeps the disk of this stack of layers; builds nothing."""
    key = hashlib.sha256("|".join([str(size_mb), *(p.name for p in layers)]).encode()).hexdigest()[:16]
    return vm_dir / "disks" / f"root-{key}.ext4"


def root_disk_image(vm_dir: Path, layers: tuple[Path, ...], size_mb: int) -> Path:
    """A full ext4 disk of the stacked layers (what a q35 guest boots as its root), once per node per stack."""
    path = root_disk_path(vm_dir, layers, size_mb)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=vm_dir, prefix=".disk-") as tmp:
        work = Path(tmp)
        mounts: list[Path] = []
        try:
            for index, layer in enumerate(layers):
                point = work / f"l{index}"
                point.mkdir()
                _run(["mount", "-t", "erofs", "-o", "ro", str(layer), str(point)])
                mounts.append(point)
            tree = mounts[0]
            if len(mounts) > 1:
                tree = work / "tree"
                tree.mkdir()
                lower = ":".join(str(p) for p in reversed(mounts))
                _run(["mount", "-t", "overlay", "overlay", "-o", f"ro,lowerdir={lower}", str(tree)])
                mounts.append(tree)
            image = work / "root.ext4"
            with image.open("wb") as handle:
                handle.truncate(size_mb << 20)
            _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-d", str(tree), str(image)])
        finally:
            for point in reversed(mounts):
                subprocess.run(["umount", "-l", str(point)], capture_output=True)
        os.chmod(image, 0o444)
        os.replace(image, path)
    return path


def _parse_stamp(text: str) -> float:
    """busybox ``stat -c '%Y|%y'`` (epoch seconds | "2026-11-30 10:00:00.123456789 +0000") as float seconds."""
    seconds, _, human = text.partition("|")
    clock = human.split()[1] if len(human.split()) > 1 else ""
    fraction = clock.partition(".")[2] or "0"
    return float(f"{seconds}.{fraction}") if seconds.isdigit() else 0.0


def _prune_templates(directory: Path, keep: int) -> None:
    """Keep the ``keep`` most recently made boot templates."""
    found = sorted((p for p in directory.iterdir() if not p.name.startswith(".")), key=lambda p: p.stat().st_mtime)
    for old in found[:-keep] if keep else found:
        shutil.rmtree(old, ignore_errors=True)


def _copy_sparse(source: Path, dest: Path) -> None:
    _run(["cp", "--sparse=always", "--reflink=auto", str(source), str(dest)])


@dataclass
class _PendingCopy:
    """A file made at its full size whose data is still to be copied in (``_fill``)."""

    source: Path
    dest: Path


def _sized_like(source: Path, dest: Path) -> _PendingCopy:
    """``dest`` made empty at ``source``'s size, so a process may map it before its data is in: QEMU refuses a
    memory file shorter than the guest's RAM, and ``cp`` would truncate it to nothing first."""
    with open(dest, "wb") as handle:
        handle.truncate(source.stat().st_size)
    return _PendingCopy(source, dest)


def _fill(copy: _PendingCopy) -> None:
    """Copy the data extents of ``copy.source`` into the same offsets of its ``dest``; holes stay holes."""
    with open(copy.source, "rb") as src, open(copy.dest, "r+b") as dst:
        size, offset = os.fstat(src.fileno()).st_size, 0
        while offset < size:
            try:
                start = os.lseek(src.fileno(), offset, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # no data after offset
                    break
                raise
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            os.lseek(dst.fileno(), start, os.SEEK_SET)
            while start < end:  # sendfile writes at dst's position, reads src at ``start``
                sent = os.sendfile(dst.fileno(), src.fileno(), start, end - start)
                if sent == 0:
                    raise InternalError(f"{copy.source} ended at {start} bytes while being copied")
                start += sent
            offset = end


def _give_up(greeting: asyncio.Future[None], agent: AgentConnection) -> None:
    """Stop waiting for an agent's greeting: its wait may end with the connection's error rather than the cancel
    (both land at once), an outcome nobody else reads."""
    greeting.add_done_callback(lambda done: done.cancelled() or done.exception())
    greeting.cancel()
    agent.close()


class VmBackend:
    """One backend object per machine kind ("microvm" or "vm"); both share the node's guest kit."""

    def __init__(
        self,
        *,
        kind: str,
        data_dir: Path,
        node_dir: Path,
        guest_agent: Path,
        accel: str = "auto",
        memory: str = "shared",
        templates: bool = True,
        boot_timeout_s: float = 90.0,
        network_fabric: Callable[[], Awaitable[NetworkFabric]] | None = None,
        cgroup_layout: CgroupLayout | None = None,
    ) -> None:
        if kind not in ("microvm", "vm"):
            raise ValueError(f"unknown VM kind {kind!r}")
        self.name = kind
        self._dir = data_dir / "vms"
        self._sockets_root = vm_sockets_of(data_dir)
        self._vm_dir = node_dir / "vm"
        self._guest_agent = guest_agent
        self._accel_setting = accel
        self._boot_timeout_s = boot_timeout_s
        self._network_fabric = network_fabric
        self._memory = memory
        self._templates = templates
        self._cgroup_layout = cgroup_layout  # None: QEMU runs in the server's cgroup (backend-level tests)
        self._vms: dict[str, _Vm] = {}
        # Machines not yet in _vms (a create or rewind under way): a failure's cleanup kills them and closes their
        # monitors (a dropped QMP client leaves its reader's EOFError unretrieved, logged whenever it is collected).
        self._starting: dict[str, Machine] = {}
        self._ready_lock = asyncio.Lock()
        self._kit: GuestKit | None = None
        self.accelerator: Accelerator | None = None

    def offers(self) -> dict[str, frozenset[Capability]]:
        """One kind of machine, whatever OCI runtime a create names; no CPU classes yet, never pooled. A microvm's
        changes are an overlay's upper directory; a full VM's are inside its root disk, with no layer of their own."""
        layers = {Capability.LAYERS} if self.name == "microvm" else set()
        return {self.name: frozenset({Capability.CHECKPOINTS, Capability.TERMINALS, *layers})}

    def checkpoints(self, sandbox_id: str) -> Checkpointing | None:
        return self

    # -- node setup -----------------------------------------------------------

    async def ready(self) -> tuple[GuestKit, Accelerator]:
        """The guest kit and the accelerator, prepared once (downloads the kernel on first use)."""
        async with self._ready_lock:
            if self._kit is None or self.accelerator is None:
                try:
                    kit = await asyncio.to_thread(ensure_guest_kit, self._vm_dir.parent, self._guest_agent)
                except Exception as exc:
                    raise ServerUnavailable(f"cannot prepare the VM guest kernel and initramfs: {exc}") from exc
                self.accelerator = await asyncio.to_thread(choose_accelerator, kit, self._vm_dir, self._accel_setting)
                self._kit = kit
            return self._kit, self.accelerator

    # -- lifecycle --------------------------------------------------------------

    def _machine_dir(self, sandbox_id: str) -> Path:
        return self._dir / sandbox_id

    def _sockets(self, sandbox_id: str) -> Path:
        return self._sockets_root / sandbox_id

    def _sockets_of_existing(self, sandbox_id: str) -> Path:
        """Where a machine already started keeps its sockets: beside its files if an older server started it."""
        directory = self._machine_dir(sandbox_id)
        return directory if (directory / QMP_SOCKET).exists() else self._sockets(sandbox_id)

    async def _config(self, spec: SandboxSpec, directory: Path) -> MachineConfig:
        """The machine this spec asks for; its disk is not made yet (``_make_disk``: a restore copies its own)."""
        kit, accel = await self.ready()
        if not spec.layers:
            raise InvalidRequest("a VM sandbox needs at least one layer")
        disk = directory / "disk.qcow2"
        machine_layers = tuple(str(layer.path) for layer in spec.layers) if self.name == "microvm" else ()
        return MachineConfig(
            name=spec.sandbox_id,
            kind=self.name,
            accel=accel.name,
            vcpus=max(1, min(os.cpu_count() or 1, math.ceil(spec.cpu))),
            memory_mb=max(MIN_GUEST_MEMORY_MB, spec.memory_mb),
            kernel=str(kit.vmlinux if self.name == "microvm" else kit.bzimage),
            initramfs=str(kit.initramfs),
            layers=machine_layers,
            disk=str(disk),
            hostname=spec.sandbox_id[-12:],
            tsc_khz=host_tsc_khz() if accel.name == "tcg" else None,
            memory=self._memory,
        )

    async def _make_disk(self, spec: SandboxSpec, config: MachineConfig) -> None:
        """A booting machine's writable disk: a qcow2 over the node's empty scratch file system (microvm) or over
        the root disk built from the layers (vm), each made once per node."""
        size_mb = spec.disk_mb or DEFAULT_DISK_MB
        if self.name == "microvm":
            backing = await asyncio.to_thread(_scratch_template, self._vm_dir, size_mb)
        else:
            layer_files = tuple(layer.path for layer in spec.layers)
            backing = await asyncio.to_thread(root_disk_image, self._vm_dir, layer_files, size_mb)
        await asyncio.to_thread(
            _run, ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(backing), config.disk]
        )

    async def _connect_agent(self, machine: Machine, timeout_s: float) -> AgentConnection:
        """Wait for the guest agent (it proves the guest booted); fail fast if QEMU dies meanwhile."""
        deadline = time.monotonic() + timeout_s
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(machine.agent_socket))
        agent = AgentConnection(sock)
        greeting = asyncio.ensure_future(agent.start(timeout_s, ping=True))
        exited = asyncio.ensure_future(machine.wait_exit())
        try:
            done, _ = await asyncio.wait({greeting, exited}, timeout=max(0.1, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
        except BaseException:  # a cancelled create: its greeting would fail unread once the cleanup kills QEMU
            _give_up(greeting, agent)
            raise
        finally:
            exited.cancel()
        if greeting in done and greeting.exception() is None:
            return agent
        _give_up(greeting, agent)
        what = "QEMU exited" if exited in done else f"no agent answered within {timeout_s:.0f}s"
        raise ServerUnavailable(f"the guest did not boot ({what}); console:\n{console_tail(machine.directory)}")

    async def create(self, spec: SandboxSpec) -> str | None:
        if spec.sensitive_paths:
            raise InvalidRequest(
                f"sensitive_paths are watched from the host's kernel, which cannot see into a {self.name}: "
                "use a container for sandboxes with sensitive paths"
            )
        directory = self._machine_dir(spec.sandbox_id)
        directory.mkdir(parents=True, exist_ok=True)
        machine: Machine | None = None
        agent: AgentConnection | None = None
        template: Path | None = None  # a booted machine like this one, to restore instead of booting
        restored = False
        try:
            netns = await self._plug(spec) if spec.network is not None else None
            if spec.restore_from is not None:
                machine = await self._restore(spec, Path(spec.restore_from), directory, netns)
                restored = True
            else:
                config = await self._config(spec, directory)
                if netns is not None:
                    config = MachineConfig(**{**config.__dict__, "tap": GUEST_LINK_IFNAME, "netns": netns})
                elif self._templates:
                    template = self._template_dir(config, spec)
                if template is not None and (template / "checkpoint.json").exists():
                    machine = await self._restore(spec, template, directory, None)
                    restored = True
                else:
                    await self._make_disk(spec, config)
                    machine = self._starting[spec.sandbox_id] = Machine(
                        config, directory, self._sockets(spec.sandbox_id)
                    )
                    await self._launch(machine, spec)
            agent = await self._connect_agent(machine, self._boot_timeout_s)
            vm = _Vm(spec, machine, agent)
            if restored:
                await self._diverge(vm)
        except BaseException:
            if agent is not None:
                agent.close()
            await self.destroy(spec.sandbox_id)  # finds a QEMU started half-way by its pid file
            raise
        self._vms[spec.sandbox_id] = vm
        self._starting.pop(spec.sandbox_id, None)
        if not restored and template is not None:
            await self._save_template(spec.sandbox_id, template)
        accel = self.accelerator
        note = f"{self.name} on {accel.name.upper()}: {accel.reason}" if accel is not None else None
        log.info("sandbox %s: %s", spec.sandbox_id, note)
        return note

    def _cgroup(self, sandbox_id: str) -> VmCgroup | None:
        return VmCgroup(self._cgroup_layout, sandbox_id) if self._cgroup_layout is not None else None

    async def _launch(self, machine: Machine, spec: SandboxSpec, *, incoming: bool = False) -> None:
        """Start QEMU and put it (all its threads) in the sandbox's cgroup: CPU and memory capped."""
        cgroup = self._cgroup(spec.sandbox_id)
        if cgroup is not None:
            cgroup.create(spec.cpu, machine.config.memory_mb, weight=qos.POOL_WEIGHT if spec.pool_member else None)
        with orphans.spawned():
            await machine.launch(incoming=incoming)
        if cgroup is not None and machine.pid is not None:
            cgroup.add(machine.pid)

    def _template_dir(self, config: MachineConfig, spec: SandboxSpec) -> Path:
        """Where a booted machine with this exact configuration (but its identity) is kept. The layers and
        disk size name the disk it was made over (a vm's root disk is built from the layers)."""
        shape = {k: v for k, v in config.__dict__.items() if k not in ("name", "disk", "hostname", "tap", "netns")}
        shape["disk"] = {"layers": [layer.digest for layer in spec.layers], "mb": spec.disk_mb or DEFAULT_DISK_MB}
        key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:20]
        return self._vm_dir / "templates" / key

    async def _save_template(self, sandbox_id: str, template: Path) -> None:
        """Checkpoint a just-booted sandbox (nothing of its user has run yet) as the template for its shape."""
        staging = template.with_name(f".{template.name}.{secrets.token_hex(4)}")
        try:
            await self.checkpoint(sandbox_id, staging)
            (staging / "checkpoint.json").write_text(json.dumps({"id": template.name, "created_at": time.time()}))
            try:
                staging.rename(template)  # the first one wins; a concurrent twin is dropped
            except OSError:
                pass
            await asyncio.to_thread(_prune_templates, template.parent, _TEMPLATES_KEPT)
        except Exception:  # noqa: BLE001 - a template is an optimisation: the sandbox itself is fine
            log.warning("could not keep a boot template for %s", sandbox_id, exc_info=True)
        finally:
            await asyncio.to_thread(shutil.rmtree, staging, True)

    async def _diverge(self, vm: _Vm) -> None:
        """A restored guest is a copy: give it its own hostname and stir fresh host entropy into its RNG. The
        agent does it itself; one restored from a checkpoint an older Corral made needs a shell for it."""
        hostname = vm.spec.sandbox_id[-12:]
        if await vm.agent.identify(hostname, os.urandom(512)):
            return
        script = 'echo "$1" > /proc/sys/kernel/hostname && exec cat > /dev/urandom'
        order = ExecOrder(["sh", "-c", script, "sh", hostname], {}, "/", "root", 10_000, 4096, True, tool="guest")
        async for _ in vm.agent.run(vm.agent.new_job_id(), order, os.urandom(512)):
            pass

    async def _plug(self, spec: SandboxSpec) -> str:
        """The sandbox's own namespace, plugged into the edge's network with its allowlist; its name."""
        if self._network_fabric is None:
            raise InvalidRequest("this node has no sandbox network for VMs")
        fabric = await self._network_fabric()
        name = namespace_name(spec.sandbox_id)
        # Each step ends before a cancellation goes on: the create's undo removes a namespace it finds on disk.
        path = await finished_before_cancel(asyncio.to_thread(create_guest_link, name))
        await finished_before_cancel(asyncio.to_thread(fabric.attach, spec.sandbox_id, path, spec.network or ()))
        return name

    async def _unplug(self, sandbox_id: str) -> None:
        if not os.path.exists(f"/run/netns/{namespace_name(sandbox_id)}"):
            return  # never plugged in: leave the edge's network alone (it may not even be started)
        if self._network_fabric is not None:
            fabric = await self._network_fabric()
            if fabric.address_of(sandbox_id) is not None:
                await asyncio.to_thread(fabric.detach, sandbox_id)
        await asyncio.to_thread(delete_namespace, namespace_name(sandbox_id))

    async def _restore(self, spec: SandboxSpec, source: Path, directory: Path, netns: str | None) -> Machine:
        """A new machine from a checkpoint: its memory, devices and disk as they were (processes included)."""
        if not (source / "state").exists():
            raise NotFound(f"no VM checkpoint at {source} on this node")
        saved = MachineConfig.load(source)
        if saved.kind != self.name:
            raise InvalidRequest(f"a {saved.kind} checkpoint cannot start a {self.name} sandbox")
        if (saved.tap is not None) != (netns is not None):
            raise InvalidRequest("a VM is restored with the devices it was saved with: network on both or neither")
        kit, accel = await self.ready()
        disk = directory / "disk.qcow2"
        await asyncio.to_thread(_copy_sparse, source / "disk.qcow2", disk)
        config = MachineConfig(
            **{
                **saved.__dict__,
                "name": spec.sandbox_id,
                "disk": str(disk),
                "accel": accel.name,
                "layers": tuple(str(layer.path) for layer in spec.layers) if saved.layers else (),
                "netns": netns,
                "hostname": spec.sandbox_id[-12:],
            }
        )
        machine = self._starting[spec.sandbox_id] = Machine(config, directory, self._sockets(spec.sandbox_id))
        shared = config.memory == "shared"
        if shared:  # QEMU starts meanwhile: waiting for its migration stream, it leaves guest RAM alone
            memory = await asyncio.to_thread(_sized_like, source / "memory", machine.memory_file)
            outcomes = await asyncio.gather(
                self._launch(machine, spec, incoming=True), asyncio.to_thread(_fill, memory), return_exceptions=True
            )  # both finish before a failure is raised: the caller's cleanup must find QEMU's pid file
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        else:
            await self._launch(machine, spec, incoming=True)
        await machine.execute("migrate-set-capabilities",
                              {"capabilities": [{"capability": "x-ignore-shared", "state": shared}]})  # fmt: skip
        await machine.execute("migrate-incoming", {"uri": f"exec:cat {source / 'state'}"})
        await self._wait_migration(machine, incoming=True)
        await machine.execute("cont")
        return machine

    async def _wait_migration(self, machine: Machine, *, incoming: bool) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if incoming:
                status = await machine.execute("query-status")
                if isinstance(status, dict) and status.get("status") in ("paused", "prelaunch", "running"):
                    if status.get("status") != "inmigrate":
                        return
            else:
                info = await machine.execute("query-migrate")
                migration = info if isinstance(info, dict) else {}
                state = migration.get("status")
                if state == "completed":
                    return
                if state in ("failed", "cancelled"):
                    raise InternalError(f"VM snapshot failed: {migration.get('error-desc', state)}")
            await asyncio.sleep(0.005)
        raise InternalError("VM snapshot/restore did not finish within 120s")

    async def adopt(self, spec: SandboxSpec) -> str | None:
        directory = self._machine_dir(spec.sandbox_id)
        try:
            machine = Machine(MachineConfig.load(directory), directory, self._sockets_of_existing(spec.sandbox_id))
        except (OSError, ValueError, TypeError):
            return None
        if not machine.adopt():
            await self.destroy(spec.sandbox_id)
            return None
        try:
            status = await machine.execute("query-status")
            paused = isinstance(status, dict) and status.get("status") != "running"
            if paused:
                await machine.execute("cont")  # the agent must answer our greeting
            agent = await self._connect_agent(machine, 15)
            if paused:
                await machine.execute("stop")
            if spec.network is not None and self._network_fabric is not None:
                # The router namespace went with the old server, and so did the VM's namespace's name (a mount in
                # the old server's mount namespace): name it again by its QEMU, then plug it in again.
                if machine.config.netns is None or machine.pid is None:
                    raise InternalError(f"VM sandbox {spec.sandbox_id} has a network but its machine no namespace")
                path = await asyncio.to_thread(name_again, machine.config.netns, machine.pid)
                fabric = await self._network_fabric()
                await asyncio.to_thread(fabric.attach, spec.sandbox_id, path, spec.network)
        except Exception:
            log.exception("could not re-attach to VM sandbox %s", spec.sandbox_id)
            await machine.kill()
            await self.destroy(spec.sandbox_id)
            return None
        self._vms[spec.sandbox_id] = _Vm(spec, machine, agent, paused=paused)
        return "paused" if paused else "running"

    async def orphans(self, known_ids: set[str]) -> list[str]:
        if not self._dir.exists():
            return []
        found = []
        for directory in self._dir.iterdir():
            if directory.name in known_ids or not (directory / "machine.json").exists():
                continue
            try:
                if MachineConfig.load(directory).kind == self.name:
                    found.append(directory.name)
            except (OSError, ValueError, TypeError):
                continue
        return found

    def _get(self, sandbox_id: str) -> _Vm:
        vm = self._vms.get(sandbox_id)
        if vm is None:
            raise NotFound(f"no running {self.name} for sandbox {sandbox_id}")
        if vm.agent.closed.is_set() or not vm.machine.alive():
            raise SandboxGone(
                f"sandbox {sandbox_id} stopped: its VM exited; console:\n{console_tail(vm.machine.directory, 5)}"
            )
        return vm

    def run(self, sandbox_id: str, command: CommandSpec) -> AgentCommand:
        vm = self._get(sandbox_id)
        if self.name != "microvm":
            return AgentCommand(vm.agent, command)
        walk = self._audit_walk(vm)

        def keep(job_id: int, names: list[str], cut: bool) -> None:
            vm.walked = ExitWalk(job_id, walk, names, cut)

        return AgentCommand(vm.agent, command, walk_after=walk, on_walked=keep)

    def files(self, sandbox_id: str) -> GuestTree:
        return GuestTree(self._get(sandbox_id).agent, asyncio.get_running_loop())

    async def wait_ended(self, sandbox_id: str) -> str:
        while True:
            vm = self._get(sandbox_id)
            await vm.machine.wait_exit()
            while vm.replacing and self._vms.get(sandbox_id) is vm:
                await asyncio.sleep(0.05)  # a restore replaces the machine: follow the new one
            if self._vms.get(sandbox_id) not in (None, vm):
                continue
            break
        log.warning("the VM of sandbox %s exited; console:\n%s", sandbox_id, console_tail(vm.machine.directory))
        return "exited"

    async def destroy(self, sandbox_id: str) -> None:
        vm = self._vms.pop(sandbox_id, None)
        directory = self._machine_dir(sandbox_id)
        starting = self._starting.pop(sandbox_id, None)
        machine = vm.machine if vm is not None else starting
        if vm is not None:
            vm.agent.close()
        if starting is not None and starting is not machine:
            await starting.kill()  # a rewind's new machine, not yet in place of the old one
        if machine is not None and machine.pid is None:
            machine.adopt()  # failed or cancelled in its start: its pid file, if QEMU got as far as writing it
        if machine is None and (directory / "machine.json").exists():
            try:
                machine = Machine(MachineConfig.load(directory), directory, self._sockets_of_existing(sandbox_id))
                machine.adopt()  # sets its pid if the process still runs
            except (OSError, ValueError, TypeError):
                machine = None
        if machine is not None:
            await machine.kill()
        (SHM_DIR / f"corral-{sandbox_id}.mem").unlink(missing_ok=True)  # also when it never got a config
        cgroup = self._cgroup(sandbox_id)
        if cgroup is not None:
            if cgroup.pids():  # a QEMU whose pid was not known, or still exiting after it died by itself
                cgroup.kill_all()
            await asyncio.to_thread(cgroup.remove, KILLED_QEMU_EXIT_S)
        await self._unplug(sandbox_id)
        await asyncio.to_thread(shutil.rmtree, directory, True)
        await asyncio.to_thread(shutil.rmtree, self._sockets(sandbox_id), True)

    async def shutdown(self, sandbox_id: str, timeout_s: float = 10.0) -> bool:
        """Clean stop: sync the guest's disks and power it off; True if it stopped within ``timeout_s``."""
        vm = self._get(sandbox_id)
        if vm.paused:
            await self.resume(sandbox_id)
        order = ExecOrder(["poweroff", "-f"], {}, "/", "root", 10_000, 4096, False, tool="guest")
        try:
            await self._tool(vm, ["sync"], tool="guest")
            async for _ in vm.agent.run(vm.agent.new_job_id(), order):
                pass
        except Exception:  # noqa: BLE001 - the agent goes away with the guest, mid-answer
            pass
        try:
            await asyncio.wait_for(vm.machine.wait_exit(), timeout_s)
            return True
        except TimeoutError:
            return False

    # -- pause, snapshots ---------------------------------------------------------

    async def pause(self, sandbox_id: str, *, wait_reclaim: bool = False) -> ReclaimResult:
        """vCPUs stop with guest memory kept. With ``wait_reclaim`` the balloon first squeezes the
        guest down to what it uses (its page cache and free memory come back to the host), bounded
        in time; the guest can take memory back on resume or, under pressure, by deflating."""
        vm = self._get(sandbox_id)
        before = vm.machine.rss_bytes()
        if wait_reclaim and not vm.paused:
            await self._squeeze(vm)
        await vm.machine.execute("stop")
        vm.paused = True
        return ReclaimResult(before, vm.machine.rss_bytes())

    async def _squeeze(self, vm: _Vm) -> None:
        meminfo = (await self._tool(vm, ["cat", "/proc/meminfo"], tool="guest")).decode()
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo.splitlines() if ":" in line}
        used = fields.get("MemTotal", 0) - fields.get("MemAvailable", 0)
        target = max(MIN_GUEST_MEMORY_MB << 19, used + (_BALLOON_HEADROOM_MB << 20))
        full = vm.machine.config.memory_mb << 20
        if target >= full:
            return
        await vm.machine.execute("balloon", {"value": target})
        deadline = time.monotonic() + _BALLOON_WAIT_S
        last = -1
        while time.monotonic() < deadline:
            actual = await vm.machine.execute("query-balloon")
            now = actual.get("actual", full) if isinstance(actual, dict) else full
            if now <= target or now == last:
                break
            last = now
            await asyncio.sleep(0.05)

    async def claimed(self, spec: SandboxSpec) -> None:
        """The claimed guest runs at the kernel's default CPU weight, as a cold one does."""
        self._get(spec.sandbox_id)
        cgroup = self._cgroup(spec.sandbox_id)
        if cgroup is not None:
            try:
                cgroup.set_weight(qos.V2_DEFAULT_WEIGHT)
            except FileNotFoundError:
                raise SandboxGone(f"sandbox {spec.sandbox_id} ended before its claim") from None

    async def resume(self, sandbox_id: str) -> None:
        vm = self._get(sandbox_id)
        await vm.machine.execute("cont")
        vm.paused = False
        await vm.machine.execute("balloon", {"value": vm.machine.config.memory_mb << 20})  # all of it back

    async def checkpoint(self, sandbox_id: str, dest: Path) -> None:
        """Memory, device state and disk of the running VM into ``dest`` (processes included)."""
        vm = self._get(sandbox_id)
        dest.mkdir(parents=True, exist_ok=True)
        machine = vm.machine
        was_paused = vm.paused
        if not was_paused:
            await machine.execute("stop")
        try:
            shared = machine.config.memory == "shared"  # else the guest's memory goes into the stream
            await machine.execute("migrate-set-capabilities",
                                  {"capabilities": [{"capability": "x-ignore-shared", "state": shared}]})  # fmt: skip
            await machine.execute("migrate", {"uri": f"exec:cat > {dest / 'state'}"})
            await self._wait_migration(machine, incoming=False)
            if shared:
                await asyncio.to_thread(_copy_sparse, machine.memory_file, dest / "memory")
            await asyncio.to_thread(_copy_sparse, Path(machine.config.disk), dest / "disk.qcow2")
            machine.config.save(dest)
        except BaseException:
            with contextlib.suppress(Exception):  # a migration still writing into dest must stop first
                await machine.execute("migrate_cancel")
            raise
        finally:
            if not was_paused:
                await machine.execute("cont")

    def _checkpoints(self, sandbox_id: str) -> Path:
        return self._machine_dir(sandbox_id) / "checkpoints"

    async def save_checkpoint(self, sandbox_id: str) -> dict[str, object]:
        """A named checkpoint kept beside the machine (and removed with it)."""
        return await checkpoints.save_checkpoint(
            self._checkpoints(sandbox_id), sandbox_id, lambda dest: self.checkpoint(sandbox_id, dest)
        )

    def list_checkpoints(self, sandbox_id: str) -> list[dict[str, object]]:
        self._get(sandbox_id)
        return checkpoints.list_checkpoints(self._checkpoints(sandbox_id))

    def checkpoint_dir(self, sandbox_id: str, checkpoint_id: str) -> Path:
        return checkpoints.find_checkpoint(self._checkpoints(sandbox_id), sandbox_id, checkpoint_id)

    async def rewind(self, sandbox_id: str, checkpoint_id: str) -> None:
        """Replace the running machine with the one saved in ``checkpoint_id``: memory, processes, disk."""
        vm = self._get(sandbox_id)
        source = self.checkpoint_dir(sandbox_id, checkpoint_id)
        vm.replacing = True
        try:
            vm.agent.close()
            await vm.machine.kill()
            vm.machine.memory_file.unlink(missing_ok=True)
            machine = await self._restore(vm.spec, source, vm.machine.directory, vm.machine.config.netns)
            agent = await self._connect_agent(machine, self._boot_timeout_s)
        except BaseException:
            self._vms.pop(sandbox_id, None)  # its watcher reports it ended
            raise
        self._vms[sandbox_id] = _Vm(vm.spec, machine, agent)
        self._starting.pop(sandbox_id, None)

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        """The guest's writable layer as an EROFS diff layer (microvm: the overlay's upper directory)."""
        vm = self._get(sandbox_id)
        if self.name != "microvm":
            raise Conflict("a full VM has no separate writable layer to pack: fork it (memory and disk) instead")
        await self._tool(vm, ["sync"], tool="guest")
        data = await self._tool(vm, ["tar", "-C", "/scratch/upper", "-cf", "-", "."], tool="guest", cap=8 << 30)
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".vm-diff-") as tmp:
            tree = Path(tmp) / "upper"
            tree.mkdir()

            def unpack() -> None:
                with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
                    archive.extractall(tree, members=guest_upper_members(archive), **_CHECKED_ALREADY)

            await asyncio.to_thread(unpack)
            await asyncio.to_thread(build_erofs, tree, dest)

    async def _tool(self, vm: _Vm, argv: list[str], *, tool: str, cap: int = 1 << 20) -> bytes:
        order = ExecOrder(argv, {"PATH": "/nonexistent"}, "/", "root", 120_000, cap, False, tool=tool)
        out = bytearray()
        async for event in vm.agent.run(vm.agent.new_job_id(), order):
            if isinstance(event, AgentOutput) and event.stream == "stdout":
                out.extend(event.data)
            elif isinstance(event, AgentExit) and (event.exit_code != 0 or event.stdout_truncated):
                raise InternalError(f"{argv[0]} in the guest failed (exit {event.exit_code})")
        return bytes(out)

    # -- what the audit log and the trajectory log ask --------------------------

    async def findings(self, sandbox_id: str) -> tuple[list[str], int]:
        vm = self._get(sandbox_id)
        if self.name != "microvm":
            return [], 0  # a full VM's root disk has no separate writable layer to look at
        walk = self._audit_walk(vm)
        found = walk_still_current(vm.walked, vm.agent.last_exec_id, walk)
        vm.walked = None
        if found is None:  # no walk at the exit, or a command started since: the agent walks now
            found = await vm.agent.find(walk.root, walk.paths, walk.cap_bytes)
        if found is not None:
            names, cut = found
            if cut:
                log.warning("sandbox %s: the audit's walk of the writable layer was cut short", sandbox_id)
        else:  # an agent of an older build (a guest restored from an older checkpoint): the project's busybox
            script = 'cd /scratch/upper || exit 0; for p in "$@"; do [ -e "$p" ] && find "$p" ! -type d; done; exit 0'
            out = await self._tool(vm, ["sh", "-c", script, "sh", *walk.paths], tool="guest")
            names = out.decode(errors="replace").splitlines()
        return ["/" + name for name in names[:_CHANGED_MAX] if name], 0

    @staticmethod
    def _audit_walk(vm: _Vm) -> TreeWalk:
        """What the audit after each command looks at: protected paths in a microvm's writable layer."""
        prefixes = sorted({p.strip("/") for p in (*PROTECTED_PREFIXES, *vm.spec.protected_paths)})
        return TreeWalk("/scratch/upper", tuple(prefixes), _FIND_CAP_BYTES)

    def resident_bytes(self, sandbox_id: str) -> int:
        vm = self._vms.get(sandbox_id)
        return vm.machine.pss_bytes() if vm is not None else 0

    def disk_usage(self, sandbox_id: str) -> tuple[int, int] | None:
        return None

    async def recycle(self, sandbox_id: str) -> bool:
        return False  # VM sandboxes are not pooled

    async def fs_clock(self, sandbox_id: str) -> float:
        vm = self._get(sandbox_id)
        # The stamp the guest's file system puts on a file it touches now: the same clock as changed_paths reads.
        script = "f=/dev/.corral-clock; [ -d /scratch ] && f=/scratch/.corral-clock; touch $f && stat -c '%Y|%y' $f"
        out = await self._tool(vm, ["sh", "-c", script], tool="guest")
        return _parse_stamp(out.decode(errors="replace").strip())

    async def changed_paths(self, sandbox_id: str, since: float) -> ChangedPaths:
        vm = self._get(sandbox_id)
        if self.name != "microvm":
            return ChangedPaths([], "none")
        script = "cd /scratch/upper && find . ! -type d -exec stat -c '%Y|%y|%n' {} +"
        out = await self._tool(vm, ["sh", "-c", script], tool="guest", cap=16 << 20)
        changed = []
        for line in out.decode(errors="replace").splitlines():
            seconds, human, name = (line.split("|", 2) + ["", ""])[:3]
            if _parse_stamp(f"{seconds}|{human}") >= since:
                changed.append(name.removeprefix("."))
        return ChangedPaths(sorted(changed)[:_CHANGED_MAX], "guest")

    # -- network (not yet for VMs) ------------------------------------------------

    async def set_network(self, sandbox_id: str, rules: tuple[AllowRule, ...]) -> str:
        vm = self._get(sandbox_id)
        if vm.machine.config.netns is None or self._network_fabric is None:
            raise InvalidRequest(
                f"a {self.name} gets its network card at create: create it with `network` (an empty allow list "
                "keeps it closed) to change the allowlist later"
            )
        fabric = await self._network_fabric()
        await asyncio.to_thread(fabric.set_policy, f"/run/netns/{vm.machine.config.netns}", rules)
        return fabric.address_of(sandbox_id) or ""

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        return None  # peers join the edge's fabric, which the container backend owns and VMs share

    async def network_status(self, sandbox_id: str) -> tuple[str | None, DeniedCounts | None]:
        vm = self._get(sandbox_id)
        if vm.machine.config.netns is None or self._network_fabric is None:
            return None, None
        fabric = await self._network_fabric()
        denied = await asyncio.to_thread(fabric.denied, f"/run/netns/{vm.machine.config.netns}")
        return fabric.address_of(sandbox_id), denied

    def kernel_events(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        return []  # a guest's syscalls go to its own kernel: the host's audit log never sees them

    def housekeeping(self) -> None:
        return None

    def refresh_network(self) -> None:
        return None  # VMs plug into the container backend's fabric, which refreshes their rules

    async def close(self) -> None:
        """Running VMs keep running (they are re-adopted, their sockets left in the run dir); only our connections
        close. With none left, their sockets' directory goes, and the run dir if nothing else is in it."""
        for vm in self._vms.values():
            vm.agent.close()
            await vm.machine.close_monitor()
        self._vms.clear()
        for empty in (self._sockets_root, self._sockets_root.parent):
            with contextlib.suppress(OSError):  # not empty (a VM left running, a container's state) or gone
                empty.rmdir()
