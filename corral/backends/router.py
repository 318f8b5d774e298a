"""Several backends behind one ``Backend``: the edge stays backend-neutral.

Each backend declares the kinds of sandbox it offers (``Backend.offers``:
``container/crun``, ``container/runsc``, ``microvm``, ...); a create goes to
the backend that offers the spec's backend with its runtime
(``find_offer``), and the router remembers which backend owns each sandbox
id from its create or adopt and sends every later call there.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from corral.api.errors import InvalidRequest, NotFound
from corral.backends.base import (
    Backend,
    Capability,
    ChangedPaths,
    Checkpointing,
    CommandSpec,
    FileTree,
    ReclaimResult,
    RunningCommand,
    SandboxSpec,
    find_offer,
    offer_key,
)
from corral.backends.common.network import AllowRule, DeniedCounts

__all__ = ["BackendRouter"]


class BackendRouter:
    name = "router"

    def __init__(self, backends: Iterable[Backend]) -> None:
        self.backends = list(backends)
        self._by_offer = {key: backend for backend in self.backends for key in backend.offers()}
        self._owner: dict[str, Backend] = {}

    def offers(self) -> dict[str, frozenset[Capability]]:
        return {key: caps for backend in self.backends for key, caps in backend.offers().items()}

    def _for_spec(self, spec: SandboxSpec) -> Backend:
        backend = find_offer(self._by_offer, spec.backend, spec.runtime)
        if backend is None:
            raise InvalidRequest(
                f"{offer_key(spec.backend, spec.runtime)} sandboxes are not offered on this node "
                f"(it offers: {', '.join(sorted(self._by_offer))})"
            )
        return backend

    def owner(self, sandbox_id: str) -> Backend:
        backend = self._owner.get(sandbox_id)
        if backend is None:
            raise NotFound(f"no running sandbox {sandbox_id} on this node")
        return backend

    async def create(self, spec: SandboxSpec) -> str | None:
        backend = self._for_spec(spec)
        self._owner[spec.sandbox_id] = backend
        try:
            return await backend.create(spec)
        except BaseException:
            self._owner.pop(spec.sandbox_id, None)
            raise

    async def destroy(self, sandbox_id: str) -> None:
        backend = self._owner.pop(sandbox_id, None)
        if backend is not None:
            await backend.destroy(sandbox_id)
            return
        for candidate in self.backends:  # an orphan, or one whose create failed half-way
            await candidate.destroy(sandbox_id)

    def run(self, sandbox_id: str, command: CommandSpec) -> RunningCommand:
        return self.owner(sandbox_id).run(sandbox_id, command)

    def files(self, sandbox_id: str) -> FileTree:
        return self.owner(sandbox_id).files(sandbox_id)

    async def adopt(self, spec: SandboxSpec) -> str | None:
        backend = self._for_spec(spec)
        state = await backend.adopt(spec)
        if state is not None:
            self._owner[spec.sandbox_id] = backend
        return state

    async def orphans(self, known_ids: set[str]) -> list[str]:
        found: list[str] = []
        for backend in self.backends:
            found += await backend.orphans(known_ids)
        return found

    async def wait_ended(self, sandbox_id: str) -> str:
        return await self.owner(sandbox_id).wait_ended(sandbox_id)

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        await self.owner(sandbox_id).pack_diff(sandbox_id, dest)

    def checkpoints(self, sandbox_id: str) -> Checkpointing | None:
        return self.owner(sandbox_id).checkpoints(sandbox_id)

    async def findings(self, sandbox_id: str) -> tuple[list[str], int]:
        return await self.owner(sandbox_id).findings(sandbox_id)

    def resident_bytes(self, sandbox_id: str) -> int:
        return self.owner(sandbox_id).resident_bytes(sandbox_id)

    def disk_usage(self, sandbox_id: str) -> tuple[int, int] | None:
        return self.owner(sandbox_id).disk_usage(sandbox_id)

    async def recycle(self, sandbox_id: str) -> bool:
        return await self.owner(sandbox_id).recycle(sandbox_id)

    async def claimed(self, spec: SandboxSpec) -> None:
        await self.owner(spec.sandbox_id).claimed(spec)

    async def fs_clock(self, sandbox_id: str) -> float:
        return await self.owner(sandbox_id).fs_clock(sandbox_id)

    async def changed_paths(self, sandbox_id: str, since: float) -> ChangedPaths:
        return await self.owner(sandbox_id).changed_paths(sandbox_id, since)

    async def shutdown(self, sandbox_id: str, timeout_s: float) -> bool:
        return await self.owner(sandbox_id).shutdown(sandbox_id, timeout_s)

    async def pause(self, sandbox_id: str, *, wait_reclaim: bool = False) -> ReclaimResult:
        return await self.owner(sandbox_id).pause(sandbox_id, wait_reclaim=wait_reclaim)

    async def resume(self, sandbox_id: str) -> None:
        await self.owner(sandbox_id).resume(sandbox_id)

    async def set_network(self, sandbox_id: str, rules: tuple[AllowRule, ...]) -> str:
        return await self.owner(sandbox_id).set_network(sandbox_id, rules)

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        for backend in self.backends:
            await backend.attach_network_peer(name, netns_path, address)

    async def network_status(self, sandbox_id: str) -> tuple[str | None, DeniedCounts | None]:
        return await self.owner(sandbox_id).network_status(sandbox_id)

    def kernel_events(self) -> list[tuple[str, str, str, dict[str, Any]]]:
        found: list[tuple[str, str, str, dict[str, Any]]] = []
        for backend in self.backends:
            found += backend.kernel_events()
        return found

    def housekeeping(self) -> None:
        for backend in self.backends:
            backend.housekeeping()

    def refresh_network(self) -> None:
        for backend in self.backends:
            backend.refresh_network()

    async def close(self) -> None:
        for backend in self.backends:
            await backend.close()
