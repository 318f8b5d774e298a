"""Taking back the sandboxes a restarted edge left running, from their records in the shared store.

Used by the embedded server for its own edge and by a Ray cluster's edge
actor when Ray restarts it: the records say what ran on this edge, the edge
finds which of them survived, and the records are brought up to date
(running, paused, or lost with a clear status).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

from corral.api.errors import NotFound
from corral.api.models import SandboxState
from corral.backends.base import LayerRef
from corral.edge.protocol import Edge
from corral.state.db import StateStore
from corral.state.records import SandboxRecord

__all__ = ["ACTIVE_STATES", "RECONCILE_EVERY_BEATS", "end_stale", "readopt"]

log = logging.getLogger(__name__)

ACTIVE_STATES = [SandboxState.CREATING.value, SandboxState.RUNNING.value, SandboxState.PAUSED.value]
RECONCILE_EVERY_BEATS = 10  # heartbeats between two ``end_stale`` rounds


async def readopt(
    edge: Edge, store: StateStore, layers_of: Callable[[Iterable[str]], Awaitable[tuple[LayerRef, ...]]]
) -> list[SandboxRecord]:
    """Adopt what the records say runs on ``edge``; update the records; return the adopted ones' records.

    ``layers_of`` turns a record's stack entries into layer files on this node (raising NotFound when a
    layer is gone, which makes the sandbox lost)."""
    records = store.list(states=ACTIVE_STATES, edge_id=edge.edge_id)
    specs = []
    for record in records:
        try:
            specs.append(record.to_spec(await layers_of(record.layers)))
        except NotFound:
            store.end(record.id, SandboxState.LOST, "lost", "its image layers are gone from this node")
    states = await edge.adopt(specs)
    starting = {record.id: record.state == SandboxState.CREATING.value for record in records}
    for sandbox_id, state in states.items():
        if state == SandboxState.PAUSED.value:
            store.update(sandbox_id, state=state)
        elif state is not None:
            store.update(sandbox_id, state=SandboxState.RUNNING.value)
        elif starting[sandbox_id]:
            store.end(sandbox_id, SandboxState.LOST, "lost", "a restart of its edge cut its create short")
        else:
            store.end(sandbox_id, SandboxState.LOST, "lost", "the sandbox did not survive a restart of its edge")
    adopted = [record for record in records if states.get(record.id) is not None]
    log.info("edge %s: re-adopted %d of %d sandboxes", edge.edge_id, len(adopted), len(states))
    return adopted


class _RunsSandboxes(Protocol):
    edge_id: str

    async def sandbox_ids(self) -> set[str]: ...

    async def destroy(self, sandbox_id: str) -> None: ...


async def end_stale(edge: _RunsSandboxes, store: StateStore) -> list[str]:
    """End what runs on ``edge`` but is no longer active in the records: killed by a gateway that could not
    reach the node, or marked lost while the node was cut off and now back. Returns their ids."""
    active = await asyncio.to_thread(store.active_ids, edge.edge_id)
    stale = sorted(await edge.sandbox_ids() - active)
    for sandbox_id in stale:
        log.warning("edge %s: ending %s, which its record says is no longer active", edge.edge_id, sandbox_id)
        await edge.destroy(sandbox_id)
    return stale
