"""A silent cluster node whose edge Ray is restarting keeps its sandboxes for the restart grace; one that is not
restarting, or is past the grace, is marked lost with them. The Ray side (which actors restart on a live raylet)
is tests/cluster/test_cluster.py's edge-killed test; here the gateway's watcher over a real SQLite store."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from corral.api.models import EdgeLoad, SandboxState
from corral.cluster.ray_edge import restarting_edges
from corral.gateway.service import SandboxService
from corral.images.catalogue import Catalogue
from corral.images.store import LayerStore
from corral.state.db import StateStore
from corral.testing.records import sandbox_record

LOST_AFTER_S = 0.4
GRACE_S = 1.5


class _Directory:
    """The remote edges as the watcher sees them: ``restarting`` answers as Ray would for these edges."""

    def __init__(self, restarting: set[str]) -> None:
        self.restarting_now = restarting
        self.silent: dict[str, bool] = {}

    def get(self, edge_id: str) -> Any:
        raise AssertionError("the watcher calls no edge")

    def set_silent(self, edge_id: str, silent: bool) -> bool:
        self.silent[edge_id] = silent
        return not silent

    def restarting(self, last_seen: Mapping[str, float]) -> set[str]:
        assert all(seen > 0 for seen in last_seen.values())
        return self.restarting_now & set(last_seen)


def _state(store: StateStore, sandbox_id: str) -> str:
    record = store.get(sandbox_id)
    assert record is not None
    return record.state


async def test_a_restarting_node_keeps_its_sandboxes_for_the_grace_then_is_lost(tmp_path: Path) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    directory = _Directory({"restarting"})
    service = SandboxService(
        store=store, catalogue=Catalogue(store.engine, LayerStore(tmp_path / "layers")), edges={},
        default_runtime="crun", ttl_check_interval_s=3600, remote_edges=directory, heartbeat_s=0.05,
        node_lost_after_s=LOST_AFTER_S, node_restart_grace_s=GRACE_S,
    )  # fmt: skip
    silent_since = time.time()
    for edge_id in ("restarting", "stopped"):
        load = EdgeLoad(edge_id=edge_id, node_cpu=2, node_memory_mb=4096, sandboxes=1, cpu_committed=1,
                        cpu_capacity=2, memory_committed_mb=512, memory_capacity_mb=4096)  # fmt: skip
        store.heartbeat(edge_id, load.model_dump(), silent_since)
        store.insert(sandbox_record(f"sb-{edge_id}", edge_id, created_at=time.time()))
    await service.start()
    try:
        await asyncio.sleep(LOST_AFTER_S + 0.6)
        assert _state(store, "sb-stopped") == SandboxState.LOST
        assert _state(store, "sb-restarting") == SandboxState.RUNNING
        assert directory.silent == {"restarting": True, "stopped": True}  # neither is placed on meanwhile
        deadline = silent_since + LOST_AFTER_S + GRACE_S + 2
        while _state(store, "sb-restarting") != SandboxState.LOST:
            assert time.time() < deadline, "a restart that never ends kept its node's sandboxes past the grace"
            await asyncio.sleep(0.05)
        assert time.time() - silent_since >= LOST_AFTER_S + GRACE_S
    finally:
        await service.close()
        store.close()


def _actor(name: str, state: str, restarts: int, changed_s: float) -> dict[str, Any]:
    """An entry of Ray's GCS actor table, as ray._private.state gives it (the fields read)."""
    return {"Name": name, "State": state, "NumRestarts": restarts, "Timestamp": changed_s * 1000}


def test_which_edges_ray_is_restarting_from_its_actor_table() -> None:
    """Measured on the test cluster: after a SIGKILL the actor is RESTARTING until a worker is leased, then ALIVE
    with its Timestamp moved on, before the constructor (the re-adoption, the first heartbeat) has run."""
    nodes = [{"Alive": True, "Resources": {"corral_edge_e1": 1.0, "CPU": 2.0}},
             {"Alive": True, "Resources": {"corral_edge_e2": 1.0}},
             {"Alive": True, "Resources": {"corral_edge_e3": 1.0}},
             {"Alive": False, "Resources": {"corral_edge_e4": 1.0}}]  # fmt: skip
    actors = [
        _actor("edge-e1", "RESTARTING", 1, 90.0),  # the worker died: restarting
        _actor("edge-e2", "ALIVE", 1, 105.0),  # back after its last heartbeat (100), has not heartbeat yet
        _actor("edge-e3", "ALIVE", 0, 10.0),  # frozen or cut off: alive from long before its last heartbeat
        _actor("edge-e4", "RESTARTING", 1, 90.0),  # its machine is gone: Ray would restart it nowhere
        _actor("edge-e5", "DEAD", 1, 95.0), _actor("edge-e5", "ALIVE", 2, 105.0),  # joined again under its name
    ]  # fmt: skip
    nodes.append({"Alive": True, "Resources": {"corral_edge_e5": 1.0}})
    last_seen = {"e1": 100.0, "e2": 100.0, "e3": 100.0, "e4": 100.0, "e5": 100.0, "e6": 100.0}
    assert restarting_edges(actors, nodes, last_seen) == {"e1", "e2", "e5"}
    # Once the new edge heartbeat (after it came back), it is an edge like any other again.
    assert restarting_edges(actors, nodes, {"e2": 106.0}) == set()
