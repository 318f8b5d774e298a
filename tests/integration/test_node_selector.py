"""Node labels and node selectors end to end: over simulated nodes (the service, scheduler, LocalEdges and state
store are real; the backend only keeps state, corral/testing/simulated.py), and through a real server, the SDK
and the CLI."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

import corral
from corral.api.models import ClusterNode, CreateSandboxRequest, ReplayRequest, SandboxInfo
from corral.bench import control_plane
from corral.embedded import EmbeddedServer
from corral.gateway.service import SandboxService
from corral.gateway.trajectory import Trajectories
from corral.sdk import InvalidRequest
from corral.state.db import StateStore
from corral.trajectory import TrajectoryLog

LABELS = [{"zone": "a"}, {"zone": "a", "disk": "ssd"}, {"zone": "b"}, {"zone": "b", "disk": "ssd"}, {}]
SSD_IN_B = {"zone": "b", "disk": "ssd"}


def _request(**fields: object) -> CreateSandboxRequest:
    return CreateSandboxRequest(image=control_plane.IMAGE, cpu=0.25, memory_mb=256, **fields)  # type: ignore[arg-type]


def _edges_of(infos: list[SandboxInfo]) -> set[str]:
    """The edges the sandboxes are on, by their ids (sb-<edge>-<hex>), checked against what the record says."""
    for info in infos:
        assert info.id.startswith(f"sb-{info.edge_id}-"), info.id
    return {info.edge_id for info in infos}


async def _cluster_nodes(service: SandboxService, count: int) -> list[ClusterNode]:
    """The shared state's nodes once every edge has sent its first heartbeat."""
    deadline = time.monotonic() + 10
    while len(nodes := await service.cluster_nodes()) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return nodes


async def test_a_node_selector_places_every_sandbox_on_a_matching_node(tmp_path: Path) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        async with control_plane.simulated_cluster(len(LABELS), store, tmp_path / "layers", labels=LABELS) as service:
            nodes = await _cluster_nodes(service, len(LABELS))
            assert {node.edge_id: node.load.labels for node in nodes} == {f"n{i}": LABELS[i] for i in range(5)}

            singles = await asyncio.gather(*(service.create(_request(node_selector={"zone": "a"})) for _ in range(20)))
            assert _edges_of(singles) <= {"n0", "n1"}  # both match; the layers' node is preferred (see placement)

            batch = [
                event.sandbox
                async for event in service.create_many(_request(node_selector=SSD_IN_B), 40, per_node=4)
                if event.sandbox is not None
            ]
            assert len(batch) == 40 and _edges_of(batch) == {"n3"}
            assert store.get(batch[0].id).node_selector == SSD_IN_B
            assert (await service.get(batch[0].id)).node_selector == SSD_IN_B

            like = (await service.record(batch[0].id)).to_request(labels={"copy": "1"})  # forks and replays
            assert like.node_selector == SSD_IN_B
            copies = await asyncio.gather(*(service.create(like) for _ in range(10)))
            assert _edges_of(copies) == {"n3"}
            trajectories = Trajectories(TrajectoryLog(store.engine), service, settled=lambda: asyncio.sleep(0))
            replayed = await trajectories.replay(batch[1].id, ReplayRequest())
            assert _edges_of([replayed.sandbox]) == {"n3"} and replayed.sandbox.node_selector == SSD_IN_B

            anywhere = await service.create(_request())
            assert anywhere.node_selector == {} and store.get(anywhere.id).node_selector == {}

            with pytest.raises(InvalidRequest, match="no node has labels zone=c; nodes have: .*disk=ssd,zone=b"):
                await service.create(_request(node_selector={"zone": "c"}))
            assert not store.list(states=["creating"])  # nothing recorded for a create no node could take
    finally:
        store.close()


def test_a_server_reports_its_labels_and_places_by_them(tmp_path: Path, test_env: dict[str, str]) -> None:
    """CORRAL_NODE_LABELS reaches the heartbeat, the nodes listing and the CLI; the SDK's selector reaches
    placement, single and batch, and a selector no node has comes back as InvalidRequest over HTTP."""
    env = {**test_env, "CORRAL_NODE_LABELS": '{"zone": "a", "disk": "ssd"}'}
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        deadline = time.monotonic() + 10
        while not client.cluster_nodes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [node.load.labels for node in client.cluster_nodes()] == [{"zone": "a", "disk": "ssd"}]
        cli = subprocess.run([sys.executable, "-m", "corral.cli.main", "nodes"], env=server.env(),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert cli.returncode == 0 and "zone=a" in cli.stdout, cli.stderr
        with client.create("busybox", ttl_s=120, node_selector={"zone": "a"}) as sandbox:
            assert sandbox.info.node_selector == {"zone": "a"}
            assert client.get(sandbox.id).info.node_selector == {"zone": "a"}
        batch = list(client.create_many(2, "busybox", ttl_s=120, node_selector={"disk": "ssd"}))
        assert [sb.info.node_selector for sb in batch] == [{"disk": "ssd"}] * 2
        for sb in batch:
            sb.kill()
        with pytest.raises(corral.InvalidRequest, match="no node has labels zone=b; nodes have: disk=ssd,zone=a"):
            client.create("busybox", node_selector={"zone": "b"})
