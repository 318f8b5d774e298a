"""The contract every backend (container, microvm, vm; fncall runs on containers) meets.

The edge drives backends only through ``Backend`` and ``RunningCommand``, and
reads a sandbox's files through the ``FileTree`` its backend hands out.
What only some backends can do is declared, never probed for: each backend
lists the kinds of sandbox it ``offers`` (``container/crun``, ``microvm``,
...) with the ``Capability`` values each has, and a backend whose sandboxes
have memory checkpoints hands out a ``Checkpointing`` for them (found in one
place: ``checkpoints_of``). The edge reports the offers in its load, so the
scheduler and the gateway read the same declarations. The shared
conformance tests in tests/integration/test_backend_conformance.py run
against every implementation, each skipping only what it does not declare.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, BinaryIO, Protocol, TypeVar

from corral.api.errors import InvalidRequest
from corral.api.models import FileInfo
from corral.backends.common.network import AllowRule, DeniedCounts

__all__ = [
    "Backend",
    "Capability",
    "ChangedPaths",
    "Checkpointing",
    "FileTree",
    "LayerRef",
    "checkpoints_of",
    "find_offer",
    "offer_key",
    "split_offer",
    "CommandExit",
    "CommandOutput",
    "CommandStarted",
    "CommandSpec",
    "RunningCommand",
    "SETUID_LABEL",
    "SandboxSpec",
    "WARM_LABEL",
    "setuid_allowed",
]

# A sandbox labelled ``corral.setuid=allowed`` runs setuid programs (sudo) as root inside it: container sandboxes
# then run without no_new_privs; seccomp, capabilities and namespaces stay (corral/backends/container/oci.py).
# A label, so that forks and re-adopted sandboxes keep it with the rest of their record.
SETUID_LABEL = "corral.setuid"


def setuid_allowed(labels: Mapping[str, str]) -> bool:
    return labels.get(SETUID_LABEL) == "allowed"


# A warm pool's sandboxes not yet claimed carry this label (corral/gateway/warm_pool.py); their spec says
# ``pool_member``: they run at the lowest CPU weight until a claim (``Backend.claimed``), so that starting and
# priming them takes only what the node's other sandboxes leave (a claimed one's first commands above all).
WARM_LABEL = "corral.warm"


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
    setuid_allowed: bool = False  # setuid programs raise privileges inside the sandbox (SETUID_LABEL)
    pool_member: bool = False  # a warm pool's, not yet claimed (WARM_LABEL): the lowest CPU weight until claimed


@dataclass(frozen=True)
class CommandSpec:
    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: str
    timeout_s: float
    output_cap_bytes: int
    stdin: bytes | None  # None: no stdin; b"": stdin stays open for write_stdin
    terminal: tuple[int, int] | None = None  # (rows, cols): run on a pseudo-terminal (output comes as stdout)
    announce_start: bool = True  # False: events() may skip CommandStarted (a waited exec, which only wants the exit)


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
class ChangedPaths:
    """The files a step changed (``Backend.changed_paths``) and how they were found, which the edge counts: a
    step that falls to a slow way (a walk of a large layer) shows in its metrics, not only in its latency."""

    paths: list[str]
    how: str
    """``journal`` (a container's change journal), ``walk`` (its writable layer walked), ``guest`` (a walk inside a
    microvm), ``none`` (no writable layer of its own to look in: full VMs), ``record`` (the simulated backend)."""


@dataclass(frozen=True)
class ReclaimResult:
    """A sandbox's resident memory before and after a pause pushed it out."""

    before_bytes: int
    after_bytes: int


class Capability(StrEnum):
    """What a kind of sandbox can do beyond what every backend does (declared in ``Backend.offers``)."""

    CHECKPOINTS = "checkpoints"
    """Memory and processes are saved with the disk (``Checkpointing``): checkpoints, rewinds, forks that keep
    running processes, and creates with ``SandboxSpec.restore_from``."""
    CPU_CLASSES = "cpu_classes"
    """``qos="batch"`` puts it in an idle CPU tier (corral/backends/common/qos.py)."""
    LAYERS = "layers"
    """Its file changes are kept as a writable layer of their own: they pack into a layer (``pack_diff``:
    snapshots, forks that copy files) and ``changed_paths`` lists them (the trajectory log's provenance)."""
    TERMINALS = "terminals"
    """Commands can run on a pseudo-terminal (``CommandSpec.terminal``) and be resized (``RunningCommand.resize``):
    every kind whose commands go through corral-agent."""
    RECYCLE = "recycle"
    """``recycle`` can find a sandbox as good as new after a call, so fncall pools reuse it; without it,
    ``recycle`` always answers False."""


def offer_key(backend: str, runtime: str | None = None) -> str:
    """How an offer is named: ``backend`` for a backend that takes no OCI runtime, else ``backend/runtime``."""
    return f"{backend}/{runtime}" if runtime else backend


def split_offer(key: str) -> tuple[str, str | None]:
    """An ``offer_key`` back into (backend, runtime or None)."""
    backend, _, runtime = key.partition("/")
    return backend, runtime or None


T = TypeVar("T")


def find_offer(offers: Mapping[str, T], backend: str, runtime: str | None) -> T | None:
    """What a create for ``backend`` with ``runtime`` gets from ``offers`` (keyed by ``offer_key``): the backend
    with that OCI runtime, else the backend's offer that takes none (VMs ignore the runtime); None if neither."""
    if runtime:
        found = offers.get(offer_key(backend, runtime))
        if found is not None:
            return found
    return offers.get(backend)


class FileTree(Protocol):
    """One sandbox's root for file operations, confined to it (a context manager: leaving it closes it).

    Paths are absolute inside the sandbox; errors are Corral errors (NotFound, Conflict, PayloadTooLarge, ...)."""

    def __enter__(self) -> FileTree: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def read(self, path: str, *, max_bytes: int) -> bytes: ...

    def write(
        self, path: str, data: bytes, *, mode: int = 0o644, uid: int | None = None, gid: int | None = None
    ) -> FileInfo:
        """Replace the file atomically, making its parent directories."""

    def stat(self, path: str) -> FileInfo:
        """``path`` itself: a final symlink is not followed."""

    def list(self, path: str) -> list[FileInfo]: ...

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> FileInfo: ...

    def remove(self, path: str, *, recursive: bool = False) -> None: ...

    def rename(self, source: str, dest: str) -> FileInfo:
        """rename(2): ``dest`` is the new path (its parents are made); a file or symlink there is replaced, a
        directory there is a Conflict; a symlink is moved, not followed. Returns the entry at ``dest``."""

    def extract_tar(self, dest: str, fileobj: BinaryIO, *, max_bytes: int, keep_owners: bool = False) -> int:
        """Unpack a tar stream under ``dest``, member by member, confined like every other call; bytes written.
        Owners are not restored and setuid/setgid bits are dropped, unless ``keep_owners`` (image builds)."""

    def write_tar(self, path: str, fileobj: BinaryIO) -> None:
        """A tar stream of the tree at ``path``."""


class Checkpointing(Protocol):
    """Memory, process and disk checkpoints of a backend's sandboxes (``Capability.CHECKPOINTS``)."""

    async def checkpoint(self, sandbox_id: str, dest: Path) -> None:
        """Everything the sandbox is, at one instant, into ``dest``; a create with ``restore_from=dest`` resumes it."""

    async def save_checkpoint(self, sandbox_id: str) -> dict[str, object]:
        """A named checkpoint kept beside the sandbox (removed with it): id, sandbox_id, created_at, size_bytes."""

    def list_checkpoints(self, sandbox_id: str) -> list[dict[str, object]]:
        """Its named checkpoints, oldest first."""

    def checkpoint_dir(self, sandbox_id: str, checkpoint_id: str) -> Path:
        """Where a named checkpoint is (NotFound if it has none of that id)."""

    async def rewind(self, sandbox_id: str, checkpoint_id: str) -> None:
        """Replace the running sandbox with the one saved in ``checkpoint_id``."""


class RunningCommand(Protocol):
    def events(self) -> AsyncIterator[CommandEvent]:
        """Started, then output chunks, then exactly one CommandExit."""

    def write_stdin(self, data: bytes) -> None:
        """Feed stdin (when started with stdin=b""); empty data closes it."""

    def signal(self, signo: int) -> None: ...

    def resize(self, rows: int, cols: int) -> None:
        """Set the window size of a command started with a terminal; ignored for one without."""


class Backend(Protocol):
    name: str

    def offers(self) -> dict[str, frozenset[Capability]]:
        """The kinds of sandbox it runs, by ``offer_key`` (a create's backend, and its OCI runtime for backends that
        take one), each with the capabilities it has."""

    def checkpoints(self, sandbox_id: str) -> Checkpointing | None:
        """The checkpoints of the sandbox, None when its kind has no ``Capability.CHECKPOINTS``."""

    async def create(self, spec: SandboxSpec) -> str | None:
        """Start the sandbox; when this returns, commands can run in it. Returns a note for its status
        (e.g. a VM running on software emulation), or None."""

    async def destroy(self, sandbox_id: str) -> None:
        """Stop it and release everything it held; idempotent."""

    def run(self, sandbox_id: str, command: CommandSpec) -> RunningCommand: ...

    def files(self, sandbox_id: str) -> FileTree:
        """The sandbox's root for file operations; the caller closes it."""

    async def adopt(self, spec: SandboxSpec) -> str | None:
        """Reconnect to a sandbox that outlived an edge restart: "running" or "paused", None if it is gone."""

    async def orphans(self, known_ids: set[str]) -> list[str]:
        """Sandboxes this backend still runs that no record owns (found after a restart)."""

    async def wait_ended(self, sandbox_id: str) -> str:
        """Return (with a reason) when the sandbox stops by itself; cancel to stop waiting."""

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        """Write the sandbox's filesystem changes as a layer file at ``dest`` (``Capability.LAYERS``; a backend
        without it raises InvalidRequest)."""

    async def findings(self, sandbox_id: str) -> tuple[list[str], int]:
        """What a command may have done that the audit log wants: changed paths in the writable layer under
        the protected prefixes (system binaries, the spec's protected_paths), and PID-limit hits so far."""

    def resident_bytes(self, sandbox_id: str) -> int:
        """Host memory the sandbox holds now (node stats)."""

    def disk_usage(self, sandbox_id: str) -> tuple[int, int] | None:
        """(used, total) bytes of a size-limited writable layer; None without a limit."""

    async def recycle(self, sandbox_id: str) -> bool:
        """End every process of the last use; True if nothing of it is left, so it can be used as new."""

    async def claimed(self, spec: SandboxSpec) -> None:
        """A warm pool's sandbox is a client's now (``spec``): it takes its CPU class's weight (SandboxSpec's
        ``pool_member`` ran at the lowest). SandboxGone if it ended meanwhile."""

    async def fs_clock(self, sandbox_id: str) -> float:
        """A timestamp on the clock the sandbox's filesystem stamps changes with."""

    async def changed_paths(self, sandbox_id: str, since: float) -> ChangedPaths:
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

    def refresh_network(self) -> None:
        """Re-resolve host names in egress rules when due, reloading what changed; may block on the node's
        resolver, so the edge calls it in a thread, about once a second."""

    def kernel_events(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        """Audit events the kernel reported since the last call (syscalls the profile refused, reads of
        sensitive paths), repeats aggregated: (sandbox_id, kind, severity, detail). Called with housekeeping."""

    async def close(self) -> None:
        """Release node resources; running sandboxes keep running."""


def checkpoints_of(backend: Backend, spec: SandboxSpec) -> Checkpointing:
    """The one place a sandbox's checkpoints are looked up: its backend's, or InvalidRequest saying where they are."""
    found = backend.checkpoints(spec.sandbox_id)
    if found is None:
        raise InvalidRequest(
            f"{offer_key(spec.backend, spec.runtime)} sandboxes have no memory checkpoints: VM sandboxes and gVisor "
            '(runtime="runsc") containers have them; snapshot() and fork() keep a sandbox\'s files as a layer'
        )
    return found
