"""Per-edge metrics on the package's Ray cluster (issue 21): what an edge actor does on its own (an idle pause, a
resume when an exec reaches a paused sandbox, its starts) is counted in the actor's own registry, and the
gateway's /metrics serves every live edge's samples, labelled by edge_id, beside its own."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

import corral
from corral.cluster.local import LocalCluster
from tests.cluster.conftest import FRESH_NODE, FRESH_NODE_LABELS, NODES, edge_of, join_fresh_node

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _scrape(cluster: LocalCluster) -> tuple[Samples, dict[str, int]]:
    """The gateway's samples, and how many times each family is declared (once, however many edges report it)."""
    state = cluster.state
    assert state is not None
    response = httpx.get(f"{state.gateway_url}/metrics", headers={"Authorization": f"Bearer {state.api_key}"},
                         timeout=30)  # fmt: skip
    assert response.status_code == 200, response.text
    declared: dict[str, int] = {}
    for line in response.text.splitlines():
        if line.startswith("# TYPE "):
            declared[line.split()[2]] = declared.get(line.split()[2], 0) + 1
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples, declared


def _value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_each_edge_actor_reports_its_own_counts_through_the_gateway(
    cluster: LocalCluster, client: corral.Client
) -> None:
    operations = "corral_edge_sandbox_operations_total"
    starts = "corral_edge_sandbox_start_duration_seconds_count"
    before, _ = _scrape(cluster)
    sandbox = client.create("busybox", memory_mb=64, ttl_s=600, idle_pause_s=1, node_selector={"zone": "b"})
    try:
        assert edge_of(sandbox) == "e3"
        deadline = time.monotonic() + 30
        while client.get(sandbox.id).info.state != corral.SandboxState.PAUSED:  # the node's own idle pause
            assert time.monotonic() < deadline, "the idle sandbox was not paused by its node"
            time.sleep(0.2)
        assert sandbox.exec("echo back").stdout == "back\n"  # its node resumes it first
        after, declared = _scrape(cluster)
    finally:
        sandbox.kill()

    for operation in ("paused", "resumed"):
        moved = _value(after, operations, edge_id="e3", operation=operation)
        assert moved == _value(before, operations, edge_id="e3", operation=operation) + 1, operation
        # the gateway saw neither happen: its own counter (without edge_id) stays where it was
        gateway = "corral_sandbox_operations_total"
        assert _value(after, gateway, operation=operation) == _value(before, gateway, operation=operation)
    assert (
        _value(after, starts, edge_id="e3", backend="container")
        >= _value(before, starts, edge_id="e3", backend="container") + 1
    )
    for edge_id in NODES:  # every live edge is in the scrape, under its own label
        assert (operations, frozenset({("edge_id", edge_id), ("operation", "paused")})) in after, edge_id
    assert declared["corral_edge_sandbox_operations_total"] == 1  # several edges' samples in one family
    assert declared["corral_edge_sandbox_start_duration_seconds"] == 1


def _calls(samples: Samples, edge_id: str) -> dict[str, float]:
    return {
        via: _value(samples, "corral_edge_gateway_calls_total", edge_id=edge_id, via=via) for via in ("channel", "ray")
    }


def test_a_gateways_calls_to_an_edge_go_over_its_channel(cluster: LocalCluster, client: corral.Client) -> None:
    sandbox = client.create("busybox", memory_mb=64, ttl_s=600, node_selector={"zone": "b"})
    try:
        assert edge_of(sandbox) == "e3"
        for _ in range(5):  # the gateway connects in the background on its first call to the edge (through Ray)
            sandbox.exec("true")
        before = _calls(_scrape(cluster)[0], "e3")
        for i in range(20):
            assert sandbox.exec(f"echo {i}").stdout == f"{i}\n"
        events = list(sandbox.exec_stream("echo streamed", step_id="channel-stream"))
        assert [(event.type, event.data) for event in events if event.type == "stdout"] == [("stdout", "streamed\n")]
        after = _calls(_scrape(cluster)[0], "e3")
    finally:
        sandbox.kill()
    assert after["channel"] - before["channel"] >= 21  # the execs, the stream, the first scrape's own call
    assert after["ray"] == before["ray"]  # no Ray actor call in between


def test_an_edge_without_a_channel_is_called_through_ray(cluster: LocalCluster, client: corral.Client) -> None:
    join_fresh_node(cluster)  # its edge runs with CORRAL_EDGE_CHANNEL=false
    sandbox = client.create("busybox", memory_mb=64, ttl_s=600, node_selector=FRESH_NODE_LABELS)
    try:
        assert edge_of(sandbox) == FRESH_NODE
        before = _calls(_scrape(cluster)[0], FRESH_NODE)
        for i in range(5):
            assert sandbox.exec(f"echo {i}").stdout == f"{i}\n"
        events = list(sandbox.exec_stream("echo streamed"))
        assert [(event.type, event.data) for event in events if event.type == "stdout"] == [("stdout", "streamed\n")]
        after = _calls(_scrape(cluster)[0], FRESH_NODE)
    finally:
        sandbox.kill()
    assert after["ray"] - before["ray"] >= 6
    assert after["channel"] == before["channel"] == 0
