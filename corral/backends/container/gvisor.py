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
import dataclasses
import os
import shutil
import socket
import subprocess
from collections.abc import Awaitable, Iterator
from pathlib import Path
from typing import Any

from corral.api.errors import InternalError, InvalidRequest, NotFound, ServerUnavailable
from corral.backends import checkpoints
from corral.backends.base import Capability, Checkpointing, FileTree, SandboxSpec
from corral.backends.common.agent_protocol import AgentConnection
from corral.backends.common.guest_tree import GuestTree
from corral.backends.container.isolation import Container, ContainerParts
from corral.backends.container.runtime import RUNSC, RUNSC_FLAGS, OciRuntime, Overlay

__all__ = ["BUSYBOX", "CTL_DIR", "RUNSC", "RUNSC_FLAGS", "TOOL_PATH", "Gvisor", "adapt_config"]

BUSYBOX = Path("/bin/busybox")
TOOL_PATH = "/.corral/busybox"
CTL_DIR = "/.corral/ctl"  # the edge's side: <sandbox dir>/ctl
_CTL_SOCKET = "agent.sock"
IMAGE_DIR = "image"  # runsc's checkpoint image, beside ``upper/`` (the writable layer at the same instant)
_LET_GO_TIMEOUT_S = 5.0


def adapt_config(config: dict[str, Any], ctl_dir: Path, busybox: Path = BUSYBOX) -> dict[str, Any]:
    """The crun/runc config.json made fit for runsc: the agent connects to the edge through ``ctl_dir`` and gets
    the busybox tool for file operations."""
    config["process"]["args"] += ["--connect", f"{CTL_DIR}/{_CTL_SOCKET}", "--tool", TOOL_PATH]
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


class Gvisor:
    """The runsc isolation (see the module docstring) of ContainerBackend: the agent connects to the edge's
    socket, files go through it, and memory and process checkpoints have the VM backends' interface
    (``Checkpointing``); crun and runc sandboxes (``PlainOci``) keep their snapshots as file layers only."""

    # No recycle: the sandbox's processes live in the sentry, so the host cannot tell whether a call left one.
    capabilities = frozenset({Capability.CPU_CLASSES, Capability.LAYERS, Capability.CHECKPOINTS, Capability.TERMINALS})

    def __init__(self, parts: ContainerParts) -> None:
        self._parts = parts

    def refuse(self, spec: SandboxSpec) -> None:
        if spec.network is not None:
            raise InvalidRequest(
                "runsc sandboxes have loopback only: gVisor's netstack reads its interfaces at start and cannot be "
                "plugged into the sandbox network afterwards; use crun or runc for a network"
            )

    def refuse_network(self) -> None:
        raise InvalidRequest("runsc sandboxes have loopback only: create a crun or runc sandbox for a network")

    def config(self, config: dict[str, Any], sandbox_id: str) -> dict[str, Any]:
        return adapt_config(config, self._ctl_dir(sandbox_id))

    def files(self, container: Container) -> FileTree:
        """The sentry serves its root, which the host cannot open: through the agent, as for VMs."""
        return GuestTree(container.agent, asyncio.get_running_loop())

    async def only_agents_left(self, container: Container, procs: Path) -> bool:
        """The sentry's host processes are not the sandbox's: ask runsc for the sandbox's own."""
        return len(await container.runtime.process_ids(container.spec.sandbox_id)) <= 1

    def checkpoints(self) -> Checkpointing | None:
        return self

    def _ctl_dir(self, sandbox_id: str) -> Path:
        return self._parts.sandbox_dir(sandbox_id) / "ctl"

    async def _accept_agent(self, sandbox_id: str, starting: Awaitable[None] | None = None) -> AgentConnection:
        """Listen, run ``starting`` (starts or restores the sandbox), and take the agent's connection and greeting."""
        timeout_s = self._parts.agent_start_timeout_s
        with _listening(self._ctl_dir(sandbox_id)) as listener:
            if starting is not None:
                await starting
            loop = asyncio.get_running_loop()
            try:
                conn, _ = await asyncio.wait_for(loop.sock_accept(listener), timeout_s)
            except TimeoutError:
                raise ServerUnavailable(
                    f"the agent of sandbox {sandbox_id} did not connect within {timeout_s:.0f}s"
                ) from None
        agent = AgentConnection(conn)
        await agent.start(timeout_s)
        return agent

    async def reattach(self, runtime: OciRuntime, spec: SandboxSpec) -> AgentConnection:
        """Its init agent connects again by itself."""
        return await self._accept_agent(spec.sandbox_id)

    async def start(
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

    async def checkpoint(self, sandbox_id: str, dest: Path) -> None:
        """Memory, processes and the writable layer of a gVisor sandbox into ``dest``, at one instant."""
        container = self._parts.container(sandbox_id)
        runtime = container.runtime
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
                await asyncio.to_thread(_copy_tree, self._parts.upper(sandbox_id), dest / "upper")
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

    async def rewind(self, sandbox_id: str, checkpoint_id: str) -> None:
        """Replace the running sandbox with the one saved in ``checkpoint_id`` (memory, processes, files)."""
        container = self._parts.container(sandbox_id)
        source = self.checkpoint_dir(sandbox_id, checkpoint_id)
        spec = dataclasses.replace(container.spec, restore_from=str(source))
        container.replacing = True
        upper, work = self._parts.upper(sandbox_id), self._parts.work(sandbox_id)
        try:
            container.agent.close()
            await container.runtime.kill_and_delete(sandbox_id)
            for path in (upper, work):
                await asyncio.to_thread(shutil.rmtree, path, True)
                path.mkdir()
            lowers = await self._parts.acquire_layers(spec)
            self._parts.release_layers(spec)  # the sandbox still holds its own reference
            bundle = self._parts.runtime_dir(sandbox_id) / "bundle"
            init_pid, agent = await self.start(container.runtime, spec, bundle, Overlay(lowers, upper, work))
        except BaseException:
            self._parts.replace(sandbox_id, None)  # its watcher reports it ended
            await container.runtime.kill_and_delete(sandbox_id)
            self._parts.release_layers(spec)
            raise
        replaced = Container(container.spec, container.runtime, self, agent, init_pid, container.memory)
        self._parts.replace(sandbox_id, replaced)

    def _checkpoints(self, sandbox_id: str) -> Path:
        return self._parts.sandbox_dir(sandbox_id) / "checkpoints"

    async def save_checkpoint(self, sandbox_id: str) -> dict[str, object]:
        """A named checkpoint kept beside the sandbox (and removed with it)."""
        self._parts.container(sandbox_id)
        return await checkpoints.save_checkpoint(
            self._checkpoints(sandbox_id), sandbox_id, lambda dest: self.checkpoint(sandbox_id, dest)
        )

    def list_checkpoints(self, sandbox_id: str) -> list[dict[str, object]]:
        self._parts.container(sandbox_id)
        return checkpoints.list_checkpoints(self._checkpoints(sandbox_id))

    def checkpoint_dir(self, sandbox_id: str, checkpoint_id: str) -> Path:
        self._parts.container(sandbox_id)
        return checkpoints.find_checkpoint(self._checkpoints(sandbox_id), sandbox_id, checkpoint_id)
