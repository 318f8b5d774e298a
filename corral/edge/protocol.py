"""The gateway-to-edge boundary, and sandbox ids that name their edge.

Edges will run on other nodes (as Ray actors), so the gateway talks to them
only through ``Edge``: every argument and result is a plain model or bytes.
``LocalEdge`` (edge/local.py) is the in-process implementation, ``RayEdge``
(cluster/ray_edge.py) the one that calls a node's edge actor, whose callable
surface is derived from ``EDGE_METHODS`` (cluster/edge_actor.py). So every
method the gateway calls is declared here, and nothing else is: what is not
here does not cross to another node.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from corral.api.errors import NotFound
from corral.api.models import (
    CommandInfo,
    EdgeLoad,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    NetworkRule,
    NodeStats,
)
from corral.backends.base import SandboxSpec

if TYPE_CHECKING:
    from prometheus_client.core import Metric

__all__ = ["EDGE_METHODS", "AuditedExec", "Edge", "EdgeDirectory", "EdgeEvents", "new_sandbox_id", "edge_of"]

_ID_PATTERN = re.compile(r"^sb-([a-z0-9]{1,16})-([0-9a-f]{16})$")


@dataclass(frozen=True)
class AuditedExec:
    """An exec's result, the audit's findings after it ((kind, severity, detail) each) and, when asked, the files
    it changed (``Edge.exec_audited``)."""

    result: ExecResult
    findings: list[tuple[str, str, dict[str, Any]]]
    files: list[str] | None = None


class EdgeEvents(Protocol):
    """What an edge tells the control plane about changes it made on its own."""

    def ended(self, sandbox_id: str, reason: str, message: str) -> None:
        """The sandbox stopped by itself (its init exited)."""

    def paused(self, sandbox_id: str, at: float) -> None:
        """Paused for being idle."""

    def resumed(self, sandbox_id: str, at: float) -> None:
        """Resumed because a request arrived while it was paused."""

    def audit(self, sandbox_id: str, kind: str, severity: str, detail: dict[str, Any]) -> None:
        """Something the audit log should record (e.g. denied network packets found by housekeeping)."""


def new_sandbox_id(edge_id: str) -> str:
    return f"sb-{edge_id}-{secrets.token_hex(8)}"


def edge_of(sandbox_id: str) -> str:
    match = _ID_PATTERN.match(sandbox_id)
    if match is None:
        raise NotFound(f"no sandbox {sandbox_id!r}: sandbox ids look like sb-e0-0123456789abcdef")
    return match.group(1)


class Edge(Protocol):
    edge_id: str

    async def start(self) -> None:
        """Begin the edge's own housekeeping; called once before adopt()."""

    async def load(self) -> EdgeLoad: ...

    async def stats(self) -> NodeStats:
        """What runs on the node, what is promised and used, and its pressure."""

    async def metric_families(self) -> list[Metric]:
        """The edge's own Prometheus counters and histograms (edge/metrics.py), for a gateway's scrape."""

    async def create(self, spec: SandboxSpec) -> str | None:
        """Admit and start a sandbox; raises CapacityExhausted if this node refuses. Returns a status note."""

    async def shutdown(self, sandbox_id: str, timeout_s: float) -> bool:
        """Ask the sandbox to stop cleanly; True if it did within ``timeout_s`` (the caller destroys it after)."""

    async def adopt(self, specs: list[SandboxSpec]) -> dict[str, str | None]:
        """Take back sandboxes that outlived a restart: "running", "paused", or None when gone."""

    async def claim(self, sandbox_id: str, spec: SandboxSpec) -> None:
        """A warm pool's sandbox becomes a client's: ``spec`` (the client's env, cwd, user, idle pause, egress
        allowlist) replaces the pool's; what was fixed when it started (layers, runtime, limits, CPU class, disk,
        guard paths, whether it has a network) must match."""

    async def destroy(self, sandbox_id: str) -> None: ...

    async def sandbox_ids(self) -> set[str]:
        """The sandboxes this edge runs (started, not still starting): what the records must account for."""

    async def pause(self, sandbox_id: str, wait_reclaim: bool) -> tuple[int, int]:
        """Freeze it and reclaim its memory; (bytes before, bytes resident when this returns)."""

    async def resume(self, sandbox_id: str) -> None: ...

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult: ...

    def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]: ...

    async def start_command(self, sandbox_id: str, request: ExecRequest) -> CommandInfo: ...

    async def command(self, sandbox_id: str, command_id: str, wait_s: float) -> CommandInfo: ...

    async def command_stdin(self, sandbox_id: str, command_id: str, data: bytes) -> None: ...

    async def command_signal(self, sandbox_id: str, command_id: str, signo: int) -> None: ...

    async def command_resize(self, sandbox_id: str, command_id: str, rows: int, cols: int) -> None: ...

    async def read_file(self, sandbox_id: str, path: str) -> bytes: ...

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> FileInfo: ...

    async def stat(self, sandbox_id: str, path: str) -> FileInfo: ...

    async def list_dir(self, sandbox_id: str, path: str) -> list[FileInfo]: ...

    async def mkdir(self, sandbox_id: str, path: str, parents: bool, mode: int) -> FileInfo: ...

    async def remove(self, sandbox_id: str, path: str, recursive: bool) -> None: ...

    async def rename(self, sandbox_id: str, source: str, dest: str) -> FileInfo: ...

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, keep_owners: bool = False) -> int:
        """Unpack a tar under ``path``; ``keep_owners`` (image builds only, never an API upload): the members'
        owners and setuid/setgid bits are kept, as an image's layers keep them."""
        ...

    async def download_tar(self, sandbox_id: str, path: str) -> bytes: ...

    async def exec_audited(self, sandbox_id: str, request: ExecRequest, *, step_files: bool = False) -> AuditedExec:
        """exec, then audit_after_command: one call, as the gateway wants both for every logged exec. With
        ``step_files`` (a step with a client's id) the filesystem's clock is taken just before the command and the
        files it changed are looked up after it, in the same call: one round trip to the node where it took
        three (fs_clock, this, changed_paths)."""

    def exec_stream_audited(
        self, sandbox_id: str, request: ExecRequest, *, step_files: bool = False
    ) -> AsyncIterator[ExecEvent | AuditedExec]:
        """exec_stream, with the exit event's place taken by an ``AuditedExec`` (the exit's result, the audit's
        findings after it and, with ``step_files``, the files it changed): one call to the node for a logged
        stream, where it took four (fs_clock, exec_stream, changed_paths, audit_after_command)."""
        ...

    async def audit_after_command(self, sandbox_id: str) -> list[tuple[str, str, dict[str, Any]]]:
        """New findings since the last call: protected paths changed, PID-limit hits; (kind, severity, detail)."""

    async def recycle(self, sandbox_id: str) -> bool:
        """End every process of its last use; True if nothing of that use is left (it can serve as new)."""

    async def fs_clock(self, sandbox_id: str) -> float:
        """'Now' on the clock that stamps the sandbox's file changes."""

    async def changed_paths(self, sandbox_id: str, since: float) -> list[str]:
        """Paths changed at or after ``since`` (from fs_clock), for the trajectory log's provenance."""

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        """Write the sandbox's filesystem changes (whiteouts kept) as an EROFS layer file."""

    async def checkpoint(self, sandbox_id: str, dest: Path) -> Path:
        """Memory, processes and disk into ``dest`` (VM and gVisor sandboxes; others are refused); returns where
        they are: ``dest``, or a scratch directory on the sandbox's node when ``dest`` is not on it."""

    async def discard_checkpoint(self, path: Path) -> None:
        """Remove a checkpoint that ``checkpoint`` wrote somewhere other than where it was asked to."""

    async def save_checkpoint(self, sandbox_id: str) -> dict[str, object]:
        """A named checkpoint kept beside the sandbox (removed with it): its id, time and size."""

    async def list_checkpoints(self, sandbox_id: str) -> list[dict[str, object]]: ...

    async def checkpoint_dir(self, sandbox_id: str, checkpoint_id: str) -> Path:
        """Where a named checkpoint is on the sandbox's node (forks restore from it there)."""

    async def rewind(self, sandbox_id: str, checkpoint_id: str) -> None:
        """Replace the running sandbox with the state saved in one of its named checkpoints."""

    async def set_network(self, sandbox_id: str, allow: list[NetworkRule]) -> tuple[str, int, int]:
        """Replace its egress allowlist (plugging it in if needed): (address, denied egress, denied ingress)."""

    async def network_status(self, sandbox_id: str) -> tuple[str | None, int, int]: ...

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        """Plug a service namespace (e.g. a package mirror) into this node's sandbox network."""

    async def close(self) -> None: ...


EDGE_METHODS = frozenset(name for name, value in vars(Edge).items() if callable(value) and not name.startswith("_"))
"""Every method of the ``Edge`` protocol, by name (what a remote edge must answer)."""


class EdgeDirectory(Protocol):
    """Edges on other nodes, by id (a Ray cluster's edge actors): they adopt and heartbeat on their own."""

    def get(self, edge_id: str) -> Edge: ...

    def set_silent(self, edge_id: str, silent: bool) -> bool:
        """Whether the node's heartbeats stopped (it is cut off or gone): calls to it, and calls already waiting
        on it, then end with ``ServerUnavailable`` instead of waiting for an answer that may never come. Returns
        whether calls go through now (a node heard again may need a moment before its edge answers)."""
        ...

    def restarting(self, last_seen: Mapping[str, float]) -> set[str]:
        """Of these edges (id -> when its node last heartbeat), those being restarted on a machine that is still
        up (the edge's process died, a new one has not spoken yet): they are silent for the restart, and their
        sandboxes are still there. Blocking (run it off the event loop)."""
        ...
