"""What differs between the OCI runtimes a container sandbox runs on, as one object per runtime.

``ContainerBackend`` does what every runtime shares (layers, overlay, bundle,
cgroups, pause and memory reclaim, the writable layer's findings and
snapshots, the network, kernel audit) and asks the sandbox's ``Isolation``
for the rest: ``PlainOci`` here for crun and runc (the agent is init on a
socket it inherits; the host reads the root through ``/proc/<pid>/root``),
``Gvisor`` (gvisor.py) for runsc (the sentry serves the root; memory
checkpoints). An isolation reaches the backend only through
``ContainerParts``, so what it may touch is written down here.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from corral.api.errors import Conflict, InvalidRequest, NotFound
from corral.backends.base import Capability, Checkpointing, FileTree, ReclaimResult, SandboxSpec
from corral.backends.common.agent_protocol import AgentConnection
from corral.backends.container.files import ConfinedTree
from corral.backends.container.memory import CgroupMemory
from corral.backends.container.oci import AGENT_NEW_PRIVS_ARGS, AGENT_PATH
from corral.backends.container.runtime import OciRuntime, Overlay

__all__ = ["CommandPaths", "Container", "ContainerParts", "Isolation", "PlainOci"]


@dataclass
class Container:
    spec: SandboxSpec
    runtime: OciRuntime
    isolation: Isolation
    agent: AgentConnection
    init_pid: int
    memory: CgroupMemory
    paused: bool = False
    baseline: frozenset[str] = frozenset()  # its writable layer right after start (for recycle)
    reclaim: asyncio.Future[ReclaimResult] | None = None  # pushing memory out while paused
    stop_reclaim: threading.Event = field(default_factory=threading.Event)
    prefetch: asyncio.Future[int] | None = None  # swap-in after a resume
    replacing: bool = False  # gVisor: being restored from a checkpoint, its agent's end is not the sandbox's
    command_paths: CommandPaths | None = None  # read after every command: found once (fixed for its life)


@dataclass(frozen=True)
class CommandPaths:
    """What the audit after a command, a step's clock and files, and a pool's recycle read, by paths found once per
    container (finding its writable layer stats the quota pool's subvolume: ~20 us a step, twice)."""

    upper: Path  # its writable layer's upper dir
    pids_events: str  # its pids cgroup's pids.events (limit hits)
    pids_current: str  # and pids.current (processes left)
    clock: Path  # the marker a step's clock ticks (in the run dir)


class ContainerParts(Protocol):
    """What of ContainerBackend an isolation may use."""

    agent_start_timeout_s: float

    def sandbox_dir(self, sandbox_id: str) -> Path:
        """What of it is kept on disk: gVisor's checkpoints and control socket; its writable layer when it has no
        size limit."""

    def runtime_dir(self, sandbox_id: str) -> Path:
        """Its bundle, init's pid file and runtime log: in the node's run dir (a tmpfs), gone with its teardown."""

    def upper(self, sandbox_id: str) -> Path: ...

    def work(self, sandbox_id: str) -> Path: ...

    def container(self, sandbox_id: str) -> Container:
        """The running container (NotFound, Conflict while it is being replaced, SandboxGone once it ended)."""

    def replace(self, sandbox_id: str, container: Container | None) -> None:
        """Make ``container`` the sandbox's (None: it has none any more, so its watcher reports it ended)."""

    async def acquire_layers(self, spec: SandboxSpec) -> list[Path]:
        """Its layers' mountpoints, top first, each counted as used by the sandbox."""

    def release_layers(self, spec: SandboxSpec) -> None: ...

    def apply_qos(self, spec: SandboxSpec) -> None:
        """What config.json cannot say about its CPU class, once the runtime made its cgroup."""


class Isolation(Protocol):
    """One runtime's way of running a container sandbox."""

    capabilities: frozenset[Capability]

    def refuse(self, spec: SandboxSpec) -> None:
        """Raise InvalidRequest if a create asks for what this runtime cannot give."""

    def refuse_network(self) -> None:
        """Raise InvalidRequest if its sandboxes cannot be plugged into the network while they run."""

    def config(self, config: dict[str, Any], sandbox_id: str) -> dict[str, Any]:
        """The shared config.json made fit for this runtime."""

    async def start(
        self, runtime: OciRuntime, spec: SandboxSpec, bundle: Path, overlay: Overlay
    ) -> tuple[int, AgentConnection]:
        """Start (or restore) the sandbox: its init's host pid and its connected agent."""

    async def reattach(self, runtime: OciRuntime, spec: SandboxSpec) -> AgentConnection:
        """An agent for a sandbox that an earlier edge started."""

    def files(self, container: Container) -> FileTree: ...

    async def only_agents_left(self, container: Container, procs: Path) -> bool:
        """After a SIGTERM to all: whether every process but the agents has gone (``procs``: its cgroup.procs)."""

    def checkpoints(self) -> Checkpointing | None: ...


def _comm(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None  # gone meanwhile


class PlainOci:
    """crun and runc: the agent is the container's init, on the socket it inherits as fd 3."""

    capabilities = frozenset({Capability.CPU_CLASSES, Capability.LAYERS, Capability.RECYCLE, Capability.TERMINALS})

    def __init__(self, parts: ContainerParts) -> None:
        self._parts = parts

    def refuse(self, spec: SandboxSpec) -> None:
        if spec.restore_from is not None:
            raise InvalidRequest("only runsc (gVisor) container sandboxes start from a memory checkpoint")

    def refuse_network(self) -> None:
        return None

    def config(self, config: dict[str, Any], sandbox_id: str) -> dict[str, Any]:
        return config

    async def start(
        self, runtime: OciRuntime, spec: SandboxSpec, bundle: Path, overlay: Overlay
    ) -> tuple[int, AgentConnection]:
        edge_end, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        agent = AgentConnection(edge_end)
        try:
            try:
                init_pid = await runtime.run_detached(spec.sandbox_id, bundle, overlay, agent_end)
            finally:
                agent_end.close()
            self._parts.apply_qos(spec)
            await agent.start(self._parts.agent_start_timeout_s)
        except BaseException:
            agent.close()
            raise
        return init_pid, agent

    async def reattach(self, runtime: OciRuntime, spec: SandboxSpec) -> AgentConnection:
        """A second agent, through exec (the first one's socket died with the earlier edge)."""
        edge_end, agent_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        agent = AgentConnection(edge_end)
        try:
            try:
                log_file = self._parts.runtime_dir(spec.sandbox_id) / "runtime.log"
                log_file.parent.mkdir(parents=True, exist_ok=True)  # started by an older server: its bundle on disk
                argv = [AGENT_PATH, *(AGENT_NEW_PRIVS_ARGS if spec.setuid_allowed else ())]
                await runtime.exec_attached(spec.sandbox_id, agent_end, argv, log_file)
            finally:
                agent_end.close()
            await agent.start(self._parts.agent_start_timeout_s)
        except BaseException:
            agent.close()
            raise
        return agent

    def files(self, container: Container) -> FileTree:
        try:
            return ConfinedTree(f"/proc/{container.init_pid}/root")
        except NotFound as exc:
            raise Conflict(f"sandbox {container.spec.sandbox_id} is not running") from exc

    async def only_agents_left(self, container: Container, procs: Path) -> bool:
        agent_name = Path(AGENT_PATH).name  # the init agent, and a second one re-attached after a restart
        return all(_comm(pid) in (agent_name, None) for pid in procs.read_text().split())

    def checkpoints(self) -> Checkpointing | None:
        return None
