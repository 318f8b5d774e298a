"""The one real Ray cluster the modules of this package share (three raylets with edge actors over real crun,
a gateway, PostgreSQL, all in a network namespace of the test's own), and the registry it pulls from.

One cluster for the package, not one per module: bringing a cluster up and down costs about 45 s, the
modules' tests leave the three first nodes as they found them (a test that removes or kills a node joins a
node of its own for it, or waits for Ray to bring the edge back), and it is down again before the next
package's tests run.

Settings: fast heartbeats, no swap for paused sandboxes, the gateway as the layer store in the test's node
dir, layers fetched on demand, and Debian's docker-registry on the host's 127.0.0.1 forwarded into the
cluster's namespace (``LocalCluster(forward_ports=...)``, cluster/network.py), spoken to in plain HTTP.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.bench.registry import Registry, start_registry
from corral.cluster.local import LocalCluster

NODE_LOST_AFTER_S = 8.0  # heartbeats every 0.5 s: room for a loaded machine before a false "lost"
CREATE_ORPHAN_AFTER_S = 5.0  # a record left creating by a gateway that died is ended by its node after this
NODES = {"e1": {"zone": "a"}, "e2": {"zone": "a"}, "e3": {"zone": "b"}}
"""The nodes every test may rely on, up, with these labels. Others join for a test (e4 by the CLI, e6)."""
FRESH_NODE = "e6"
FRESH_NODE_LABELS = {"zone": "new"}
FRESH_NODE_CACHE_BUDGET_MB = 6
FRESH_NODE_SETTINGS = {
    "CORRAL_LAYER_CACHE_BUDGET_MB": str(FRESH_NODE_CACHE_BUDGET_MB),
    "CORRAL_LAYER_IDLE_UNMOUNT_S": "0",
    "CORRAL_EDGE_CHANNEL": "false",
}
"""A machine that has never seen the package's images: joined once, by the first test that needs one (a join
costs ~15 s), while a burst runs or on its own (``join_fresh_node``). Its layer cache has a small budget and idle
layers unmount at once, for the eviction test; the others only need it fresh. Its edge has no channel, so its
tests reach it by Ray actor calls alone (the other nodes' by their channels)."""
CUT_NODE = "e7"
CUT_NODE_LABELS = {"zone": "isolated"}
"""A node in a network namespace of its own (``own_network``: as on another machine, the database over TCP),
whose link the network-cut fault test cuts and restores; it leaves at the end of that test."""


@contextlib.contextmanager
def local_test_cluster(
    directory: Path, postgres_url: str, test_env: dict[str, str], nodes: dict[str, dict[str, str]], *,
    node_settings: dict[str, str] | None = None, gateway_settings: dict[str, str] | None = None,
    forward_ports: list[int] | None = None,
) -> Iterator[LocalCluster]:  # fmt: skip
    """A LocalCluster over the test's PostgreSQL, with the tests' settings plus these, and ``nodes`` (edge id ->
    labels) joined; down again at the end."""
    local = LocalCluster(
        directory,
        database_url=postgres_url,
        node_settings={"CORRAL_NODE_HEARTBEAT_S": "0.5", "CORRAL_PAUSE_SWAP_MB": "0", **(node_settings or {})},
        gateway_settings={
            "CORRAL_NODE_DIR": test_env["CORRAL_NODE_DIR"],  # the gateway is the layer store
            "CORRAL_NODE_LOST_AFTER_S": str(NODE_LOST_AFTER_S),
            "CORRAL_NODE_HEARTBEAT_S": "0.5",
            **(gateway_settings or {}),
        },
        forward_ports=forward_ports,
    )
    local.up(0)
    try:
        local.add_nodes(nodes)
        yield local
    finally:
        local.down()


@pytest.fixture(scope="package")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
        pytest.skip("needs docker-registry and skopeo (apt)")
    registry = start_registry(tmp_path_factory.mktemp("cluster-registry") / "registry")
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture(scope="package")
def cluster(
    registry: Registry, tmp_path_factory: pytest.TempPathFactory, postgres_url: str, test_env: dict[str, str]
) -> Iterator[LocalCluster]:
    port = int(registry.address.rsplit(":", 1)[1])
    with local_test_cluster(
        tmp_path_factory.mktemp("cluster"), postgres_url, test_env, NODES,
        node_settings={"CORRAL_LAYER_FETCH": "on_demand", "CORRAL_CREATE_ORPHAN_AFTER_S": str(CREATE_ORPHAN_AFTER_S)},
        gateway_settings={"CORRAL_INSECURE_REGISTRIES": registry.address}, forward_ports=[port],
    ) as local:  # fmt: skip
        yield local


@pytest.fixture
def client(cluster: LocalCluster) -> Iterator[corral.Client]:
    state = cluster.state
    assert state is not None
    with corral.Client(state.gateway_url, state.api_key, timeout_s=300) as c:
        yield c


def join_fresh_node(cluster: LocalCluster) -> None:
    """The fresh node (``FRESH_NODE``), joined unless a test before joined it."""
    state = cluster.state
    assert state is not None
    if FRESH_NODE not in state.nodes:
        cluster.add_node(FRESH_NODE, labels=FRESH_NODE_LABELS, settings=FRESH_NODE_SETTINGS)


def edge_of(sandbox: corral.Sandbox) -> str:
    return sandbox.id.split("-")[1]
