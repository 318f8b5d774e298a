"""The settings every real-cluster test module runs its LocalCluster with (tests/integration/test_cluster*.py):
fast heartbeats, no swap for paused sandboxes, and the gateway as the layer store in the test's node dir."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from corral.cluster.local import LocalCluster

NODE_LOST_AFTER_S = 8.0  # heartbeats every 0.5 s: room for a loaded machine before a false "lost"


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
        for edge_id, labels in nodes.items():
            local.add_node(edge_id, labels=labels)
        yield local
    finally:
        local.down()
