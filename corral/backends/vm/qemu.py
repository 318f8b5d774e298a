"""One QEMU process per VM sandbox: its command line, its QMP monitor, its files.

A machine lives in its own directory (console log, pid file, scratch disk), its
unix sockets (QMP, agent) in a short one of the node's run dir, and its guest
memory in a shared file under /dev/shm, so a
snapshot only has to write device state (``x-ignore-shared``) and copy that
file, and so the memory survives nothing but the machine itself. QEMU runs
daemonized: it outlives an edge restart and is re-adopted by its pid file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

from qemu.qmp import QMPClient

from corral.api.errors import InternalError
from corral.backends.common.host import orphans
from corral.backends.common.spawn import finished_before_cancel, process_ended, run_to_end
from corral.backends.vm.network import GUEST_ADDRESS, GUEST_GATEWAY
from corral.procfs import running

__all__ = ["Accelerator", "MachineConfig", "Machine", "QEMU_BINARY", "console_tail", "host_tsc_khz", "timing_arguments"]

QEMU_BINARY = "qemu-system-x86_64"
SHM_DIR = Path("/dev/shm")
AGENT_PORT_NAME = "corral.agent"
AGENT_SOCKET, QMP_SOCKET = "agent.sock", "qmp.sock"
_CONFIG_FILE = "machine.json"


@dataclass(frozen=True)
class Accelerator:
    name: str  # "kvm" | "tcg"
    reason: str  # why this one (shown in the sandbox's status and the logs)


@dataclass(frozen=True)
class MachineConfig:
    """Everything that decides a machine's command line; saved beside it for adoption and restore."""

    name: str
    kind: str  # "microvm" | "vm" (q35)
    accel: str  # "kvm" | "tcg"
    vcpus: int
    memory_mb: int
    kernel: str
    initramfs: str
    layers: tuple[str, ...]  # EROFS files, bottom first (microvm overlay)
    disk: str  # the writable disk: scratch (microvm) or root (vm), qcow2
    hostname: str
    tsc_khz: int | None = None  # TCG: the host's TSC rate, given to the guest (see timing_arguments)
    memory: str = "shared"  # "shared": a file in /dev/shm (cheap snapshots); "mergeable": anonymous, KSM merges it
    tap: str | None = None  # a tap device name, inside the machine's network namespace
    netns: str | None = None

    def save(self, directory: Path) -> None:
        (directory / _CONFIG_FILE).write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, directory: Path) -> MachineConfig:
        data = json.loads((directory / _CONFIG_FILE).read_text())
        data["layers"] = tuple(data["layers"])
        return cls(**data)


def host_tsc_khz() -> int | None:
    """The host's TSC rate in kHz (what a TCG guest's rdtsc counts at), from /proc/cpuinfo."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":", 1)[1]) * 1000)
    except (OSError, ValueError):
        pass
    return None


def timing_arguments(tsc_khz: int | None) -> list[str]:
    """Kernel arguments that spare a TCG guest its timer calibration.

    A microvm has no HPET or ACPI PM timer, so the kernel calibrates the TSC
    against the PIT; under TCG on a busy host that calibration fails, the TSC
    is marked unstable and boot hangs in calibrate_delay. A TCG guest's TSC
    runs at the host's rate, so give the kernel that rate instead."""
    if not tsc_khz:
        return []
    return [f"tsc_early_khz={tsc_khz}", "tsc=reliable", "no_timer_check"]


def kernel_command_line(config: MachineConfig) -> str:
    words = ["console=ttyS0", "panic=-1", "quiet", f"corral.layers={len(config.layers)}"]
    words += timing_arguments(config.tsc_khz)
    words.append(f"corral.hostname={config.hostname}")
    if config.kind == "vm":
        words += ["corral.root=disk", "corral.init=1"]
    if config.tap:
        words.append(f"corral.net={GUEST_ADDRESS}/30,{GUEST_GATEWAY}")
    return " ".join(words)


def machine_argv(config: MachineConfig, directory: Path, sockets: Path, *, incoming: bool = False) -> list[str]:
    """The QEMU command line: no default devices, virtio only, console to a file (never a pipe), its monitor's
    and agent channel's unix sockets in ``sockets``."""
    memory_file = SHM_DIR / f"corral-{config.name}.mem"
    bus = "device" if config.kind == "microvm" else "pci"
    machine = (
        "microvm,x-option-roms=off,isa-serial=on,rtc=on,memory-backend=mem"
        if config.kind == "microvm"
        else "q35,memory-backend=mem"
    )
    cpu = "host,-arch-capabilities" if config.accel == "kvm" else "max"
    argv = [
        QEMU_BINARY,
        "-name", f"corral-{config.name},process=corral-{config.name}",
        "-M", machine,
        "-accel", config.accel,
        "-cpu", cpu,
        "-smp", str(config.vcpus),
        "-m", f"{config.memory_mb}M",
        "-object", memory_backend(config, memory_file),
        "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
        # QEMU's own seccomp filter: no obsolete syscalls, no scheduler/affinity changes (denying setuid breaks
        # -daemonize). Spawning stays allowed: checkpoints write their device state through `exec:cat`.
        "-sandbox", "on,obsolete=deny,resourcecontrol=deny",
        "-kernel", config.kernel,
        "-initrd", config.initramfs,
        "-append", kernel_command_line(config),
        "-serial", f"file:{directory / 'console.log'}",
    ]  # fmt: skip
    for index, layer in enumerate(config.layers):
        argv += [
            "-drive", f"id=l{index},file={layer},format=raw,if=none,readonly=on,file.locking=off",
            "-device", f"virtio-blk-{bus},drive=l{index},serial=l{index}",
        ]  # fmt: skip
    disk_serial = "root" if config.kind == "vm" else "scratch"
    argv += [
        "-drive", f"id=disk,file={config.disk},format=qcow2,if=none,discard=unmap",
        "-device", f"virtio-blk-{bus},drive=disk,serial={disk_serial}",
        "-device", f"virtio-serial-{bus}",
        "-chardev", f"socket,id=agent,path={sockets / AGENT_SOCKET},server=on,wait=off",
        "-device", f"virtserialport,chardev=agent,name={AGENT_PORT_NAME}",
        "-device", f"virtio-balloon-{bus},id=balloon,free-page-reporting=on,deflate-on-oom=on",
        "-qmp", f"unix:{sockets / QMP_SOCKET},server=on,wait=off",
        "-pidfile", str(directory / "qemu.pid"),
        "-daemonize",
    ]  # fmt: skip
    if config.tap:
        argv += ["-netdev", f"tap,id=net,ifname={config.tap},script=no,downscript=no"]
        argv += ["-device", f"virtio-net-{bus},netdev=net"]
    if incoming:
        argv += ["-incoming", "defer"]
    return argv


def memory_backend(config: MachineConfig, memory_file: Path) -> str:
    """Guest RAM: a shared file (a snapshot writes device state only and copies the file) or anonymous
    memory QEMU marks mergeable, which KSM dedupes across guests (a snapshot then streams all of it)."""
    if config.memory == "mergeable":
        return f"memory-backend-ram,id=mem,size={config.memory_mb}M,merge=on"
    return f"memory-backend-file,id=mem,size={config.memory_mb}M,mem-path={memory_file},share=on"


def console_tail(directory: Path, lines: int = 15) -> str:
    try:
        text = (directory / "console.log").read_text(errors="replace")
    except OSError:
        return "(no console output)"
    tail = [line for line in text.splitlines() if line.strip()][-lines:]
    return "\n".join(tail) or "(no console output)"


_UNIX_PATH_MAX = 107  # sun_path holds 108 bytes, the last a NUL
_LAUNCH_TIMEOUT_S = 300.0  # QEMU daemonizes once its machine is set up: a launcher still there after this is stuck


class Machine:
    """A running (or starting) QEMU process and its monitor: its files in ``directory``, its unix sockets in
    ``sockets``."""

    def __init__(self, config: MachineConfig, directory: Path, sockets: Path) -> None:
        self.config = config
        self.directory = directory
        self.sockets = sockets
        self.memory_file = SHM_DIR / f"corral-{config.name}.mem"
        self.pid: int | None = None
        self._qmp: QMPClient | None = None
        self._qmp_lock = asyncio.Lock()

    @property
    def agent_socket(self) -> Path:
        return self.sockets / AGENT_SOCKET

    async def launch(self, *, incoming: bool = False) -> None:
        """Start QEMU daemonized; returns once it runs (its guest is still booting)."""
        longest = max(len(os.fsencode(self.sockets / name)) for name in (AGENT_SOCKET, QMP_SOCKET))
        if longest > _UNIX_PATH_MAX:  # QEMU would refuse it with a message about a socket nobody asked for
            raise InternalError(
                f"the VM's sockets under {self.sockets} would be {longest} bytes long, over the {_UNIX_PATH_MAX} a "
                "unix socket's path may have"
            )
        self.sockets.mkdir(parents=True, exist_ok=True)
        self.config.save(self.directory)
        argv = machine_argv(self.config, self.directory, self.sockets, incoming=incoming)
        if self.config.netns:
            argv = ["ip", "netns", "exec", self.config.netns, *argv]
        with (self.directory / "qemu.log").open("ab") as log, orphans.spawned() as track:
            try:
                code, _, _ = await finished_before_cancel(run_to_end(
                    argv, timeout_s=_LAUNCH_TIMEOUT_S, on_start=track, stdout=log, stderr=log, new_session=True,
                ))  # fmt: skip
            except asyncio.CancelledError:
                self.adopt()  # the launcher has daemonized and written its pid file: the cleanup kills by it
                raise
        if code != 0:
            detail = (self.directory / "qemu.log").read_text(errors="replace").strip()[-1500:]
            raise RuntimeError(f"QEMU did not start (exit {code}): {detail}")
        self.pid = int((self.directory / "qemu.pid").read_text().strip())
        await self.qmp()

    def adopt(self) -> bool:
        """Find a machine that outlived an edge restart; False if its process is gone."""
        try:
            pid = int((self.directory / "qemu.pid").read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            return False
        if f"corral-{self.config.name}".encode() not in cmdline:
            return False
        self.pid = pid
        return True

    def alive(self) -> bool:
        return self.pid is not None and running(self.pid)

    async def qmp(self) -> QMPClient:
        if self._qmp is not None and self._qmp.runstate.name != "RUNNING":
            await self.close_monitor()  # a dropped monitor: its disconnect collects the reader's EOFError
        if self._qmp is None:
            client = QMPClient(f"corral-{self.config.name}")
            for _ in range(100):
                try:
                    await client.connect(str(self.sockets / QMP_SOCKET))
                    break
                except (OSError, ConnectionError, Exception):  # noqa: BLE001 - qemu.qmp wraps OS errors in its own
                    if not self.alive():
                        raise
                    await asyncio.sleep(0.02)
            self._qmp = client
        return self._qmp

    async def execute(self, command: str, arguments: dict[str, object] | None = None) -> object:
        async with self._qmp_lock:
            client = await self.qmp()
            return await client.execute(command, arguments)

    async def wait_exit(self) -> None:
        """Return once the QEMU process has gone (it is not our child after -daemonize)."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            await process_ended(self.pid)

    async def kill(self) -> None:
        """Forced stop: SIGKILL, then wait for the process to go."""
        await self.close_monitor()
        if self.pid is not None and self.alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                await asyncio.wait_for(self.wait_exit(), 10)
            except TimeoutError:
                pass

    async def close_monitor(self) -> None:
        if self._qmp is not None:
            try:
                await self._qmp.disconnect()
            except Exception:  # noqa: BLE001 - the monitor may already be gone with the process
                pass
            self._qmp = None

    def _proc_kib(self, name: str, field: str) -> int:
        try:
            for line in Path(f"/proc/{self.pid}/{name}").read_text().splitlines():
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def pss_bytes(self) -> int:
        """Host memory the QEMU process accounts for, shared pages split among their users."""
        return self._proc_kib("smaps_rollup", "Pss:")

    def rss_bytes(self) -> int:
        """Host memory the QEMU process holds (its RSS, shared guest memory included)."""
        return self._proc_kib("status", "VmRSS:")
