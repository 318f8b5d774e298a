"""The OCI runtime command line (crun by default, runc or gVisor's runsc selectable).

Only this module runs the runtime binary. Containers are started detached
through corral-launch, which mounts the sandbox's overlay in a mount namespace
of its own and hands the agent's socket to the runtime as fd 3.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.api.errors import InternalError, InvalidRequest
from corral.backends.common.host import orphans
from corral.backends.common.spawn import finished_before_cancel, run_to_end

__all__ = ["RUNSC", "RUNSC_FLAGS", "OciRuntime", "OciRuntimeFailed", "ContainerState", "Overlay"]

RUNSC = "runsc"
# crun and runc make each container a session keyring of its own unless told not to, and the kernel finds a new
# one's name among every keyring of the user: a strcmp per live sandbox on every create (perf at 3,000-4,000 idle
# sandboxes: `find_keyring_by_name` and its strcmp, 1.7% of the host's samples). A sandbox cannot reach any
# keyring (keyctl, add_key and request_key are refused by its seccomp profile, /proc/keys is masked), so it keeps
# the server's.
_NO_NEW_KEYRING = ("--no-new-keyring",)
# gVisor's global flags, the same on every call (see gvisor.py): systrap (its kvm platform hangs on nested-PVM
# hosts), the writable layer on the host overlay (the default medium leaves .gvisor.filestore.* files in the
# rootfs after a forced delete), loopback only, and the agent may connect to the edge's socket.
RUNSC_FLAGS = ["--platform=systrap", "--overlay2=none", "--network=none", "--host-uds=open"]

_RUNTIME_TIMEOUT_S = 30.0
_SEALED_RUNTIMES = frozenset({"crun"})  # those that skip their self-copy when they run from a sealed memfd
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_SEALED_FD_FLOOR = 64  # above fd 3, which corral-launch makes the agent's socket
# The agent must survive its sandbox's OOM; it resets its children to 0 so
# they are the ones the kernel picks.
AGENT_OOM_SCORE_ADJ = -1000


def _sealed_copy(binary: str) -> int:
    """A sealed in-memory copy of the runtime's binary, to run it from (as /proc/self/fd/N). crun guards against
    CVE-2019-5736 (a container overwriting the runtime through /proc/self/exe) by copying itself into a sealed memfd
    and re-executing that on every run, exec and create, unless it already runs from one: made once here, each
    create skips the copy, the second execve and its dynamic linking. By hand, 50 `crun run --detach` in a row,
    4 alternating rounds: 1.87-1.99 ms of the runtime's CPU a create against 3.06-3.31 ms, 5.4-5.9 ms wall against
    6.6-7.0 ms (2026-12-05). The guard is the same: nothing can write a sealed memfd."""
    fd = os.memfd_create(f"corral-{os.path.basename(binary)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        with open(binary, "rb") as source:
            size, offset = os.fstat(source.fileno()).st_size, 0
            while offset < size:
                sent = os.sendfile(fd, source.fileno(), offset, size - offset)
                if sent == 0:
                    raise OSError(f"{binary} changed while it was copied (a package upgrade?): start again")
                offset += sent
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _SEALED_FD_FLOOR)
    finally:
        os.close(fd)
    return high


class OciRuntimeFailed(InternalError):
    """The OCI runtime failed; the message carries its stderr."""


@dataclass(frozen=True)
class ContainerState:
    id: str
    status: str  # "created" | "running" | "paused" | "stopped"
    pid: int


@dataclass(frozen=True)
class Overlay:
    lowers: list[Path]  # top first
    upper: Path
    work: Path


class OciRuntime:
    """One runtime binary with its own state directory."""

    def __init__(self, name: str, state_root: Path, launch_binary: Path) -> None:
        binary = shutil.which(name)
        if binary is None:
            raise InvalidRequest(f"OCI runtime {name!r} is not installed on this node (apt-get install {name})")
        self.name = name
        self._path = binary
        self._sealed_fd = _sealed_copy(binary) if name in _SEALED_RUNTIMES else None
        self._binary = f"/proc/self/fd/{self._sealed_fd}" if self._sealed_fd is not None else binary
        self._root = state_root
        self._launch = launch_binary
        state_root.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        """Let the sealed copy go; a call after this runs the binary from its path."""
        if self._sealed_fd is not None:
            os.close(self._sealed_fd)
            self._sealed_fd = None
            self._binary = self._path

    @property
    def gvisor(self) -> bool:
        return self.name == RUNSC

    def _base(self) -> list[str]:
        return [self._binary, "--root", str(self._root), *(RUNSC_FLAGS if self.gvisor else ())]

    async def _run(
        self, args: list[str], *, pass_fds: tuple[int, ...] = (), check: bool = True, log_file: Path | None = None
    ) -> tuple[int, bytes, str]:
        """Run the runtime to completion: (exit status, stdout, stderr text).

        Detached starts pass ``log_file``: the container inherits the runtime's
        stderr, so it must never be a pipe we wait on (it would stay open as
        long as the container lives)."""
        log = open(log_file, "ab+") if log_file is not None else None  # noqa: SIM115
        try:
            with orphans.spawned() as track:
                try:
                    code, stdout, stderr = await finished_before_cancel(run_to_end(
                        args, timeout_s=_RUNTIME_TIMEOUT_S, on_start=track,
                        stdout=subprocess.DEVNULL if log is not None else None, stderr=log,
                        pass_fds=(*pass_fds, self._sealed_fd) if self._sealed_fd is not None else pass_fds,
                    ))  # fmt: skip
                except TimeoutError:
                    raise OciRuntimeFailed(
                        f"{self.name} timed out after {_RUNTIME_TIMEOUT_S:.0f}s: {args[-3:]}"
                    ) from None
            if log is not None:
                log.seek(0)
                stderr = log.read()[-4096:]
        finally:
            if log is not None:
                log.close()
        message = stderr.decode(errors="replace").strip()
        if check and code != 0:
            last = message.splitlines()[-1] if message else f"exit status {code}"
            raise OciRuntimeFailed(f"{self.name} failed: {last}")
        return code, stdout, message

    def _launch_args(self, overlay: Overlay, bundle: Path, ctl: socket.socket | None) -> list[str]:
        """corral-launch: the overlay mounted at bundle/rootfs in a mount namespace of its own (and the agent's
        socket as fd 3), then the runtime."""
        lowers = ":".join(str(p) for p in overlay.lowers)
        args = [str(self._launch), "--overlay", lowers, str(overlay.upper), str(overlay.work), str(bundle / "rootfs")]
        if ctl is not None:
            args += ["--ctl-fd", str(ctl.fileno())]
        return [*args, "--oom-score-adj", str(AGENT_OOM_SCORE_ADJ), "--audit-session", "--refuse-clone3", "--"]

    async def run_detached(self, container_id: str, bundle: Path, overlay: Overlay, ctl: socket.socket | None) -> int:
        """Mount the overlay at bundle/rootfs and start the container detached; returns its init's host pid.

        ``ctl`` None: its init gets no socket (gVisor: the agent connects to the edge itself)."""
        pid_file = bundle.parent / "init.pid"
        args = [
            *self._launch_args(overlay, bundle, ctl), *self._base(), "run", "--detach",
            *(("--preserve-fds", "1") if ctl is not None else ()), *(() if self.gvisor else _NO_NEW_KEYRING),
            "--pid-file", str(pid_file), "--bundle", str(bundle), container_id,
        ]  # fmt: skip
        pass_fds = (ctl.fileno(),) if ctl is not None else ()
        await self._run(args, pass_fds=pass_fds, log_file=bundle.parent / "runtime.log")
        return int(pid_file.read_text())

    async def checkpoint(self, container_id: str, image_dir: Path) -> None:
        """gVisor: the sandbox's memory and processes into ``image_dir``; the sandbox keeps running (or paused)."""
        await self._run([*self._base(), "checkpoint", "--image-path", str(image_dir), "--leave-running", container_id])

    async def restore_detached(self, container_id: str, bundle: Path, overlay: Overlay, image_dir: Path) -> int:
        """gVisor: a new container from a checkpoint image, over this overlay; returns its sandbox's host pid."""
        pid_file = bundle.parent / "init.pid"
        args = [
            *self._launch_args(overlay, bundle, None), *self._base(), "restore", "--detach",
            "--image-path", str(image_dir), "--pid-file", str(pid_file), "--bundle", str(bundle), container_id,
        ]  # fmt: skip
        await self._run(args, log_file=bundle.parent / "runtime.log")
        return int(pid_file.read_text())

    async def exec_attached(self, container_id: str, ctl: socket.socket, agent_argv: list[str], log_file: Path) -> None:
        """Start a second agent in a running container (re-attach after an edge restart)."""
        args = [
            str(self._launch), "--ctl-fd", str(ctl.fileno()), "--audit-session", "--refuse-clone3", "--",
            *self._base(), "exec", "--detach", "--preserve-fds", "1", container_id, *agent_argv,
        ]  # fmt: skip
        await self._run(args, pass_fds=(ctl.fileno(),), log_file=log_file)

    async def state(self, container_id: str) -> ContainerState | None:
        code, out, _ = await self._run([*self._base(), "state", container_id], check=False)
        if code != 0:
            return None
        data = json.loads(out)
        return ContainerState(id=data["id"], status=data["status"], pid=int(data.get("pid") or 0))

    async def process_ids(self, container_id: str) -> set[int]:
        """gVisor: the pids of the sandbox's processes, in its own pid namespace (the host cannot see them)."""
        _, out, _ = await self._run([*self._base(), "ps", "--format", "json", container_id])
        return {int(pid) for pid in json.loads(out or b"[]") or []}

    async def list_ids(self) -> list[str]:
        _, out, _ = await self._run([*self._base(), "list", "--format", "json"])
        return [entry["id"] for entry in json.loads(out or b"[]") or []]

    async def signal_all(self, container_id: str, signal_name: str) -> None:
        """Send a signal to every process of the container but its init (which ignores what it does not handle;
        gVisor delivers it to init too, so there each other process gets it by pid)."""
        if not self.gvisor:
            await self._run([*self._base(), "kill", "--all", container_id, signal_name])
            return
        for pid in sorted(await self.process_ids(container_id) - {1}):
            await self._run([*self._base(), "kill", "--pid", str(pid), container_id, signal_name], check=False)

    async def pause(self, container_id: str) -> None:
        """Freeze every process of the container (cgroup freezer)."""
        await self._run([*self._base(), "pause", container_id])

    async def resume(self, container_id: str) -> None:
        await self._run([*self._base(), "resume", container_id])

    async def kill_and_delete(self, container_id: str) -> None:
        """SIGKILL the container and remove it, in one runtime process (idempotent): its init is its PID namespace's,
        so the kernel kills every process in it with the init, and the runtime's cgroup removal kills what is left.
        A ``kill --all`` first had cost a second process: 134-167 kills/s with one against 92-124/s with two, 9.5-11.9
        against 12.8-17.9 ms of the host's CPU a kill (300 at once, three runs each, alternating)."""
        await self._run([*self._base(), "delete", "--force", container_id], check=False)
