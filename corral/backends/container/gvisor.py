"""What differs for gVisor (``runtime="runsc"``) container sandboxes.

gVisor runs the sandbox on its own user-space kernel (the sentry, on the
systrap platform: its kvm platform hangs on nested-PVM hosts). What follows:

- the root filesystem is served through the sentry, so the host cannot open a
  running sandbox's files through ``/proc/<pid>/root``: files go through the
  agent as for VMs (GuestTree), running the host's static busybox, which is
  bind-mounted read-only at TOOL_PATH;
- memory and processes can be checkpointed (``runsc checkpoint``) and a new
  sandbox restored from that image (``runsc restore``). A checkpoint must hold
  no host socket (restore fails with "socket operation on non-socket"), and
  runsc kills on restore every process that ``runsc exec`` started, with its
  descendants. So the agent is the sandbox's init, and it connects to a Unix
  socket the edge listens on (bind-mounted at CTL_DIR): before a checkpoint the
  edge lets it go (the agent closes its end) and listens again after, and a
  restored sandbox's agent connects to its own edge the same way. A command
  streaming output at that moment loses its stream; its processes live on.
- the host's seccomp profile and kernel audit do not see the sandbox's system
  calls (the sentry answers them); gVisor's own syscall surface replaces them.

The runtime flags (runtime.RUNSC_FLAGS) keep the writable layer on the host's
overlay, so a checkpoint is runsc's memory image plus a copy of that layer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from corral.backends import checkpoints
from corral.backends.base import SandboxSpec
from corral.backends.common.agent_protocol import AgentConnection
from corral.backends.container.oci import AGENT_PATH
from corral.backends.container.runtime import RUNSC, RUNSC_FLAGS, OciRuntime, Overlay
from corral.sdk._exceptions import InternalError, InvalidRequest, NotFound, ServerUnavailable

__all__ = ["BUSYBOX", "CTL_DIR", "RUNSC", "RUNSC_FLAGS", "TOOL_PATH", "GvisorCheckpoints", "adapt_config"]

BUSYBOX = Path("/bin/busybox")
TOOL_PATH = "/.corral/busybox"
CTL_DIR = "/.corral/ctl"  # the edge's side: <sandbox dir>/ctl
_CTL_SOCKET = "agent.sock"
IMAGE_DIR = "image"  # runsc's checkpoint image, beside ``upper/`` (the writable layer at the same instant)
_LET_GO_TIMEOUT_S = 5.0


def adapt_config(config: dict[str, Any], ctl_dir: Path, busybox: Path = BUSYBOX) -> dict[str, Any]:
    """The crun/runc config.json made fit for runsc: the agent connects to the edge through ``ctl_dir`` and gets
    the busybox tool for file operations."""
    config["process"]["args"] = [AGENT_PATH, "--connect", f"{CTL_DIR}/{_CTL_SOCKET}", "--tool", TOOL_PATH]
    config["mounts"] += [
        {
            "destination": TOOL_PATH,
            "type": "bind",
            "source": str(busybox),
            "options": ["bind", "ro", "nosuid", "nodev"],
        },
        {
            "destination": CTL_DIR,
            "type": "bind",
            "source": str(ctl_dir),
            "options": ["bind", "nosuid", "nodev", "noexec"],
        },
    ]
    return config


@contextlib.contextmanager
def _listening(ctl_dir: Path) -> Iterator[socket.socket]:
    """The edge's socket for one agent connection, removed again once accepted (so the agent cannot reconnect
    while the edge does not want it to). Bound through /proc/self/fd: the path may exceed sun_path."""
    ctl_dir.mkdir(parents=True, exist_ok=True)
    dir_fd = os.open(ctl_dir, os.O_RDONLY | os.O_DIRECTORY)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = f"/proc/self/fd/{dir_fd}/{_CTL_SOCKET}"
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        listener.bind(path)
        listener.listen(1)
        listener.setblocking(False)
        yield listener
    finally:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(dir_fd)


def _copy_tree(source: Path, dest: Path) -> None:
    """A writable layer, whiteouts, opaque-dir xattrs and times kept (gVisor checks file sizes on restore)."""
    dest.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(["cp", "-a", f"{source}/.", str(dest)], capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise InternalError(f"cannot copy the sandbox's writable layer: {run.stderr.strip()}")


class GvisorCheckpoints:
    """gVisor sandboxes' start and agent connection, and their memory and process checkpoints with the VM
    backends' interface (mixed into ContainerBackend; crun and runc sandboxes are refused checkpoints: their
    snapshots are file layers)."""

    _dir: Path
    _agent_start_timeout_s: float

    def _get(self, sandbox_id: str) -> Any: ...  # noqa: ANN401 - ContainerBackend's _Container
    def _upper(self, sandbox_id: str) -> Path: ...

    def _ctl_dir(self, sandbox_id: str) -> Path:
        return self._dir / sandbox_id / "ctl"

    async def _accept_agent(self, sandbox_id: str, starting: Any = None) -> AgentConnection:  # noqa: ANN401
        """Listen, run ``starting`` (an awaitable that starts or restores the sandbox), and take the agent's
        connection and greeting."""
        with _listening(self._ctl_dir(sandbox_id)) as listener:
            if starting is not None:
                await starting
            loop = asyncio.get_running_loop()
            try:
                conn, _ = await asyncio.wait_for(loop.sock_accept(listener), self._agent_start_timeout_s)
            except TimeoutError:
                raise ServerUnavailable(
                    f"the agent of sandbox {sandbox_id} did not connect within {self._agent_start_timeout_s:.0f}s"
                ) from None
        agent = AgentConnection(conn)
        await agent.start(self._agent_start_timeout_s)
        return agent

    async def _start_gvisor(
        self, runtime: OciRuntime, spec: SandboxSpec, bundle: Path, overlay: Overlay
    ) -> tuple[int, AgentConnection]:
        """A new gVisor sandbox, or one restored from ``spec.restore_from`` over a copy of that instant's
        writable layer; its host pid (the sentry's) and its connected agent."""
        if spec.restore_from is None:
            started = runtime.run_detached(spec.sandbox_id, bundle, overlay, None)
        else:
            source = Path(spec.restore_from)
            if not (source / IMAGE_DIR).is_dir():
                raise NotFound(f"no gVisor checkpoint at {source} on this node")
            await asyncio.to_thread(_copy_tree, source / "upper", overlay.upper)
            started = runtime.restore_detached(spec.sandbox_id, bundle, overlay, source / IMAGE_DIR)
        pid_box: list[int] = []

        async def start() -> None:
            pid_box.append(await started)

        agent = await self._accept_agent(spec.sandbox_id, start())
        return pid_box[0], agent

    def _gvisor(self, sandbox_id: str) -> Any:  # noqa: ANN401
        container = self._get(sandbox_id)
        if not container.runtime.gvisor:
            raise InvalidRequest(
                f'{container.runtime.name} sandboxes have no memory checkpoints: create with runtime="runsc" '
                "(gVisor) for those; snapshot() and fork() keep a container's files as a layer"
            )
        return container

    async def checkpoint(self, sandbox_id: str, dest: Path) -> None:
        """Memory, processes and the writable layer of a gVisor sandbox into ``dest``, at one instant."""
        container = self._gvisor(sandbox_id)
        runtime: OciRuntime = container.runtime
        dest.mkdir(parents=True, exist_ok=True)
        was_paused = container.paused
        container.replacing = True  # the agent's going is not the sandbox's end
        try:
            if was_paused:  # its agent must run to let go
                await runtime.resume(sandbox_id)
            await container.agent.let_go(_LET_GO_TIMEOUT_S)
            await runtime.pause(sandbox_id)  # no file changes between the memory image and the layer copy
            try:
                await runtime.checkpoint(sandbox_id, dest / IMAGE_DIR)  # it flushes the sentry's file cache first
                await asyncio.to_thread(_copy_tree, self._upper(sandbox_id), dest / "upper")
            finally:
                await runtime.resume(sandbox_id)
        finally:
            try:
                if container.agent.closed.is_set():
                    container.agent = await self._accept_agent(sandbox_id)
                if was_paused:
                    await runtime.pause(sandbox_id)
            finally:
                container.replacing = False

    def _checkpoints(self, sandbox_id: str) -> Path:
        return self._dir / sandbox_id / "checkpoints"

    async def save_checkpoint(self, sandbox_id: str) -> dict[str, object]:
        """A named checkpoint kept beside the sandbox (and removed with it)."""
        self._gvisor(sandbox_id)
        return await checkpoints.save_checkpoint(
            self._checkpoints(sandbox_id), sandbox_id, lambda dest: self.checkpoint(sandbox_id, dest)
        )

    def list_checkpoints(self, sandbox_id: str) -> list[dict[str, object]]:
        self._gvisor(sandbox_id)
        return checkpoints.list_checkpoints(self._checkpoints(sandbox_id))

    def checkpoint_dir(self, sandbox_id: str, checkpoint_id: str) -> Path:
        self._gvisor(sandbox_id)
        return checkpoints.find_checkpoint(self._checkpoints(sandbox_id), sandbox_id, checkpoint_id)
