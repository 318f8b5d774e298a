"""The contract every backend (container, microvm, vm; fncall runs on containers) meets.

The edge drives backends only through ``Backend`` and ``RunningCommand``; the
shared conformance tests in tests/integration/test_backend_conformance.py run
against every implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from corral.backends.container.files import ConfinedTree
from corral.backends.container.network import AllowRule, DeniedCounts

__all__ = [
    "Backend",
    "LayerRef",
    "CommandExit",
    "CommandOutput",
    "CommandStarted",
    "CommandSpec",
    "RunningCommand",
    "SandboxSpec",
]


@dataclass(frozen=True)
class LayerRef:
    digest: str
    path: Path  # the EROFS file on this node
    alias: str = ""  # a second mount of a layer already lower in the stack (overlayfs refuses one dir twice)

    @property
    def mount_key(self) -> str:
        return f"{self.digest}#{self.alias}" if self.alias else self.digest


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    image: str
    layers: tuple[LayerRef, ...]  # bottom first
    runtime: str
    cpu: float
    memory_mb: int
    pids_max: int
    qos: str = "latency"  # CPU class: latency (normal weight) | batch (idle tier, lowest weight)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "/"
    user: str = "root"
    idle_pause_s: float | None = None
    network: tuple[AllowRule, ...] | None = None  # None: loopback only; else plugged in with this egress allowlist
    protected_paths: tuple[str, ...] = ()  # besides system binaries: changes raise audit events
    sensitive_paths: tuple[str, ...] = ()  # opening these (reading a file, listing a directory) raises audit events
    disk_mb: int | None = None  # size limit of the writable layer; None: the host disk
    backend: str = "container"  # which backend runs it: container | microvm | vm
    restore_from: str | None = None  # VM backends: start from this checkpoint directory (memory, devices, disk)


@dataclass(frozen=True)
class CommandSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: str
    timeout_s: float
    output_cap_bytes: int
    stdin: bytes | None  # None: no stdin; b"": stdin stays open for write_stdin


@dataclass(frozen=True)
class CommandStarted:
    pid: int


@dataclass(frozen=True)
class CommandOutput:
    stream: str  # "stdout" | "stderr"
    data: bytes


@dataclass(frozen=True)
class CommandExit:
    exit_code: int
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False


CommandEvent = CommandStarted | CommandOutput | CommandExit


@dataclass(frozen=True)
class ReclaimResult:
    """A sandbox's resident memory before and after a pause pushed it out."""

    before_bytes: int
    after_bytes: int


class RunningCommand(Protocol):
    def events(self) -> AsyncIterator[CommandEvent]:
        """Started, then output chunks, then exactly one CommandExit."""

    def write_stdin(self, data: bytes) -> None:
        """Feed stdin (when started with stdin=b""); empty data closes it."""

    def signal(self, signo: int) -> None: ...


class Backend(Protocol):
    name: str

    async def create(self, spec: SandboxSpec) -> str | None:
        """Start the sandbox; when this returns, commands can run in it. Returns a note for its status
        (e.g. a VM running on software emulation), or None."""

    async def destroy(self, sandbox_id: str) -> None:
        """Stop it and release everything it held; idempotent."""

    def run(self, sandbox_id: str, command: CommandSpec) -> RunningCommand: ...

    def files(self, sandbox_id: str) -> ConfinedTree:
        """The sandbox's root for file operations; the caller closes it."""

    async def adopt(self, spec: SandboxSpec) -> str | None:
        """Reconnect to a sandbox that outlived an edge restart: "running" or "paused", None if it is gone."""

    async def orphans(self, known_ids: set[str]) -> list[str]:
        """Sandboxes this backend still runs that no record owns (found after a restart)."""

    async def wait_ended(self, sandbox_id: str) -> str:
        """Return (with a reason) when the sandbox stops by itself; cancel to stop waiting."""

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        """Write the sandbox's filesystem changes as a layer file at ``dest``."""

    async def findings(self, sandbox_id: str) -> tuple[list[str], int]:
        """What a command may have done that the audit log wants: changed paths in the writable layer under
        the protected prefixes (system binaries, the spec's protected_paths), and PID-limit hits so far."""

    def resident_bytes(self, sandbox_id: str) -> int:
        """Host memory the sandbox holds now (node stats)."""

    def disk_usage(self, sandbox_id: str) -> tuple[int, int] | None:
        """(used, total) bytes of a size-limited writable layer; None without a limit."""

    async def recycle(self, sandbox_id: str) -> bool:
        """End every process of the last use; True if nothing of it is left, so it can be used as new."""

    async def fs_clock(self, sandbox_id: str) -> float:
        """A timestamp on the clock the sandbox's filesystem stamps changes with."""

    async def changed_paths(self, sandbox_id: str, since: float) -> list[str]:
        """Files changed at or after ``since`` (from fs_clock): where the sandbox's state came from."""

    async def shutdown(self, sandbox_id: str, timeout_s: float) -> bool:
        """Ask it to stop cleanly (a VM syncs and powers off; a container's processes get SIGTERM);
        True if it stopped within ``timeout_s``. The caller destroys it either way."""

    async def pause(self, sandbox_id: str, *, wait_reclaim: bool = False) -> ReclaimResult:
        """Stop every process with its state kept, then give back its memory (in the background
        unless ``wait_reclaim``); a resume stops the reclaim early."""

    async def resume(self, sandbox_id: str) -> None: ...

    async def set_network(self, sandbox_id: str, rules: tuple[AllowRule, ...]) -> str:
        """Replace the egress allowlist (plugging the sandbox in if it had no network); returns its address."""

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        """Plug another network namespace (a package mirror, an uplink) into the sandbox network."""

    async def network_status(self, sandbox_id: str) -> tuple[str | None, DeniedCounts | None]:
        """Its address (None without network) and the packets its policy dropped."""

    def housekeeping(self) -> None:
        """Periodic upkeep the edge calls about once a second (e.g. reaping)."""

    def kernel_events(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """Audit events the kernel reported since the last call (syscalls the profile refused, reads of
        sensitive paths), repeats aggregated: (sandbox_id, kind, severity, detail). Called with housekeeping."""

    async def close(self) -> None:
        """Release node resources; running sandboxes keep running."""
