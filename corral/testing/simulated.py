"""A backend that isolates nothing and only keeps state: the control plane's test double.

``SimulatedBackend`` answers the ``Backend`` protocol from memory so that the
gateway, the scheduler, the state store and the edges' admission can be
measured alone at cluster scale (``corral bench control-plane``: 160 simulated
nodes in one process). It runs no process and confines nothing: a sandbox is
a dict entry, its files an in-memory dict. Commands are not run; the few a
control-plane test needs get honest canned answers (``true`` exits 0 with no
output, ``false`` 1, ``echo`` prints its words, ``exit N`` exits N), anything
else exits 127 saying it was not run. The real server never enables it.
"""

from __future__ import annotations

import asyncio
import posixpath
import shlex
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.api.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from corral.api.models import FileInfo
from corral.backends.base import (
    Capability,
    ChangedPaths,
    Checkpointing,
    CommandEvent,
    CommandExit,
    CommandOutput,
    CommandSpec,
    CommandStarted,
    ReclaimResult,
    SandboxSpec,
)
from corral.backends.common.network import AllowRule, DeniedCounts

__all__ = ["SimulatedBackend"]

_SIMULATED_RESIDENT_BYTES = 1 << 20  # what an idle container holds here (docs/spec.md, density)


def _normalise(path: str) -> str:
    if not path.startswith("/"):
        raise InvalidRequest(f"paths in a sandbox are absolute, got {path!r}")
    return posixpath.normpath(path).replace("//", "/")


@dataclass
class _Entry:
    data: bytes | None  # None: a directory
    mode: int
    mtime: float
    uid: int = 0
    gid: int = 0


class _MemoryTree:
    """A sandbox's files as a dict from absolute path to entry (the ConfinedTree calls the edge makes)."""

    def __init__(self, entries: dict[str, _Entry]) -> None:
        self._entries = entries

    def __enter__(self) -> _MemoryTree:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def _entry(self, path: str) -> _Entry:
        entry = self._entries.get(path)
        if entry is None:
            raise NotFound(f"no such file or directory in sandbox: {path}")
        return entry

    def _info(self, path: str) -> FileInfo:
        entry = self._entry(path)
        return FileInfo(
            path=path, name=posixpath.basename(path) or "/", type="dir" if entry.data is None else "file",
            size=len(entry.data or b""), mode=entry.mode, mtime=entry.mtime, uid=entry.uid, gid=entry.gid,
        )  # fmt: skip

    def _make_parents(self, path: str) -> None:
        parent = posixpath.dirname(path)
        while parent not in self._entries:
            self._entries[parent] = _Entry(None, 0o755, time.time())
            parent = posixpath.dirname(parent)

    def read(self, path: str, *, max_bytes: int) -> bytes:
        entry = self._entry(_normalise(path))
        if entry.data is None:
            raise InvalidRequest(f"is a directory: {path}")
        if len(entry.data) > max_bytes:
            raise PayloadTooLarge(f"file is larger than {max_bytes} bytes: {path}")
        return entry.data

    def write(self, path: str, data: bytes, *, mode: int = 0o644, uid: int | None = None,
              gid: int | None = None) -> FileInfo:  # fmt: skip
        normal = _normalise(path)
        existing = self._entries.get(normal)
        if existing is not None and existing.data is None:
            raise Conflict(f"already exists in sandbox as a directory: {normal}")
        self._make_parents(normal)
        self._entries[normal] = _Entry(bytes(data), mode, time.time(), uid or 0, gid or 0)
        return self._info(normal)

    def stat(self, path: str) -> FileInfo:
        return self._info(_normalise(path))

    def list(self, path: str) -> list[FileInfo]:
        normal = _normalise(path)
        if self._entry(normal).data is not None:
            raise InvalidRequest(f"not a directory: {normal}")
        return [self._info(p) for p in sorted(self._entries) if p != normal and posixpath.dirname(p) == normal]

    def mkdir(self, path: str, *, parents: bool = True, mode: int = 0o755) -> FileInfo:
        normal = _normalise(path)
        existing = self._entries.get(normal)
        if existing is not None:
            if parents and existing.data is None:
                return self._info(normal)
            raise Conflict(f"already exists in sandbox: {normal}; remove it first")
        if parents:
            self._make_parents(normal)
        elif posixpath.dirname(normal) not in self._entries:
            raise NotFound(f"no such directory in sandbox: {posixpath.dirname(normal)}")
        self._entries[normal] = _Entry(None, mode, time.time())
        return self._info(normal)

    def remove(self, path: str, *, recursive: bool = False) -> None:
        normal = _normalise(path)
        self._entry(normal)
        below = [p for p in self._entries if p.startswith(normal.rstrip("/") + "/")]
        if below and not recursive:
            raise Conflict(f"directory not empty: {normal}; remove it recursively")
        for child in [*below, normal]:
            del self._entries[child]

    def rename(self, source: str, dest: str) -> FileInfo:
        src, dst = _normalise(source), _normalise(dest)
        self._entry(src)
        if src == "/" or dst == "/" or (dst + "/").startswith(src + "/"):
            raise InvalidRequest(f"cannot move {src} to {dst}")
        existing = self._entries.get(dst)
        if existing is not None and existing.data is None:
            raise Conflict(f"already exists in sandbox as a directory: {dst}; remove it first")
        self._make_parents(dst)
        for path in [p for p in self._entries if p == src or p.startswith(src.rstrip("/") + "/")]:
            self._entries[dst + path[len(src) :]] = self._entries.pop(path)
        return self._info(dst)

    def extract_tar(self, dest: str, fileobj: object, *, max_bytes: int, keep_owners: bool = False) -> int:
        raise InvalidRequest("the simulated backend keeps single files only: tar upload is not simulated")

    def write_tar(self, path: str, fileobj: object) -> None:
        raise InvalidRequest("the simulated backend keeps single files only: tar download is not simulated")


def _canned(argv: list[str]) -> tuple[int, bytes, bytes, float]:
    """Exit code, stdout, stderr and seconds it takes for the few commands the simulation answers; 127 for the rest.
    ``sleep S`` (up to 60 s) takes S seconds before it exits: commands in flight together, for tests."""
    words = argv[2:] if argv[:2] == ["/bin/sh", "-c"] else [shlex.join(argv)]
    try:
        parts = shlex.split(words[0]) if words else []
    except ValueError:
        parts = []
    if parts in (["true"], [":"]):
        return 0, b"", b"", 0.0
    if parts == ["false"]:
        return 1, b"", b"", 0.0
    if parts[:1] == ["echo"]:
        return 0, (" ".join(parts[1:]) + "\n").encode(), b"", 0.0
    if len(parts) == 2 and parts[0] == "exit" and parts[1].isdigit():
        return int(parts[1]) & 0xFF, b"", b"", 0.0
    if len(parts) == 2 and parts[0] == "sleep" and (seconds := _seconds(parts[1])) is not None:
        return 0, b"", b"", seconds
    return 127, b"", f"simulated backend: not run: {shlex.join(argv)}\n".encode(), 0.0


def _seconds(word: str) -> float | None:
    try:
        seconds = float(word)
    except ValueError:
        return None
    return seconds if 0 <= seconds <= 60 else None


class _CannedCommand:
    def __init__(self, command: CommandSpec) -> None:
        self._exit_code, self._stdout, self._stderr, self._takes_s = _canned(command.argv)

    async def events(self) -> AsyncIterator[CommandEvent]:
        yield CommandStarted(pid=0)
        if self._takes_s:
            await asyncio.sleep(self._takes_s)
        if self._stdout:
            yield CommandOutput("stdout", self._stdout)
        if self._stderr:
            yield CommandOutput("stderr", self._stderr)
        yield CommandExit(exit_code=self._exit_code)

    def write_stdin(self, data: bytes) -> None:
        return None

    def signal(self, signo: int) -> None:
        return None

    def resize(self, rows: int, cols: int) -> None:
        return None


@dataclass
class _Simulated:
    spec: SandboxSpec
    files: dict[str, _Entry] = field(default_factory=lambda: {"/": _Entry(None, 0o755, time.time())})
    paused: bool = False
    network: tuple[AllowRule, ...] | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class SimulatedBackend:
    """Keeps each sandbox as state only; ``create_delay_s`` stands for a backend's start time if wanted."""

    name = "simulated"

    def __init__(self, *, create_delay_s: float = 0.0) -> None:
        self._create_delay_s = create_delay_s
        self._sandboxes: dict[str, _Simulated] = {}

    def __len__(self) -> int:
        return len(self._sandboxes)

    def offers(self) -> dict[str, frozenset[Capability]]:
        """It stands in for container sandboxes (any runtime); it has no layers to pack and no checkpoints."""
        return {"container": frozenset({Capability.RECYCLE})}

    def checkpoints(self, sandbox_id: str) -> Checkpointing | None:
        return None

    def _get(self, sandbox_id: str) -> _Simulated:
        sandbox = self._sandboxes.get(sandbox_id)
        if sandbox is None:
            raise NotFound(f"no simulated sandbox {sandbox_id}")
        return sandbox

    async def create(self, spec: SandboxSpec) -> str | None:
        if self._create_delay_s:
            await asyncio.sleep(self._create_delay_s)
        self._sandboxes[spec.sandbox_id] = _Simulated(spec, network=spec.network)
        return "simulated: no isolation, state only"

    async def destroy(self, sandbox_id: str) -> None:
        sandbox = self._sandboxes.pop(sandbox_id, None)
        if sandbox is not None:
            sandbox.ended.set()

    def run(self, sandbox_id: str, command: CommandSpec) -> _CannedCommand:
        self._get(sandbox_id)
        return _CannedCommand(command)

    def files(self, sandbox_id: str) -> _MemoryTree:
        return _MemoryTree(self._get(sandbox_id).files)

    async def adopt(self, spec: SandboxSpec) -> str | None:
        sandbox = self._sandboxes.get(spec.sandbox_id)
        if sandbox is None:
            return None  # nothing outlives the process that held the simulation
        return "paused" if sandbox.paused else "running"

    async def orphans(self, known_ids: set[str]) -> list[str]:
        return [sandbox_id for sandbox_id in self._sandboxes if sandbox_id not in known_ids]

    async def wait_ended(self, sandbox_id: str) -> str:
        await self._get(sandbox_id).ended.wait()
        return "exited"

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        raise InvalidRequest("the simulated backend has no filesystem layers to pack")

    async def findings(self, sandbox_id: str) -> tuple[list[str], int]:
        self._get(sandbox_id)
        return [], 0

    def resident_bytes(self, sandbox_id: str) -> int:
        return 0 if self._get(sandbox_id).paused else _SIMULATED_RESIDENT_BYTES

    def disk_usage(self, sandbox_id: str) -> tuple[int, int] | None:
        return None

    async def recycle(self, sandbox_id: str) -> bool:
        """As good as new while nothing but its root directory was ever written (commands leave nothing)."""
        return list(self._get(sandbox_id).files) == ["/"]

    async def claimed(self, spec: SandboxSpec) -> None:
        """No CPU to weigh: only that it still runs."""
        self._get(spec.sandbox_id)

    async def fs_clock(self, sandbox_id: str) -> float:
        self._get(sandbox_id)
        return time.time()

    async def changed_paths(self, sandbox_id: str, since: float) -> ChangedPaths:
        files = self._get(sandbox_id).files
        changed = sorted(path for path, entry in files.items() if entry.data is not None and entry.mtime >= since)
        return ChangedPaths(changed, "record")

    async def shutdown(self, sandbox_id: str, timeout_s: float) -> bool:
        self._get(sandbox_id)
        return True

    async def pause(self, sandbox_id: str, *, wait_reclaim: bool = False) -> ReclaimResult:
        sandbox = self._get(sandbox_id)
        before = 0 if sandbox.paused else _SIMULATED_RESIDENT_BYTES
        sandbox.paused = True
        return ReclaimResult(before_bytes=before, after_bytes=0)

    async def resume(self, sandbox_id: str) -> None:
        self._get(sandbox_id).paused = False

    async def set_network(self, sandbox_id: str, rules: tuple[AllowRule, ...]) -> str:
        self._get(sandbox_id).network = rules
        return "192.0.2.1"  # TEST-NET-1: documentation addresses, routed nowhere

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        return None

    async def network_status(self, sandbox_id: str) -> tuple[str | None, DeniedCounts | None]:
        if self._get(sandbox_id).network is None:
            return None, None
        return "192.0.2.1", DeniedCounts(0, 0, 0, 0)

    def housekeeping(self) -> None:
        return None

    def refresh_network(self) -> None:
        return None

    def kernel_events(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        return []

    async def close(self) -> None:
        return None
