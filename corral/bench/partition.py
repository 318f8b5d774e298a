"""`corral bench partition`: how long a cluster node cut off from the cluster takes to be lost, heard again and
placed on again, with the state database's TCP timeouts (``POSTGRES_TCP_TIMEOUTS``) against without, same run.

A ``LocalCluster`` with two nodes, each in a network namespace of its own (``own_network``: PostgreSQL over
TCP through a relay of its socket). One opens the database as Corral does; the other, the baseline, with
libpq's TCP settings at libpq's and the kernel's defaults (on its database URL). Each round runs one sandbox
on each, cuts both links at once (``LocalCluster.cut_node``: blackhole routes both ways), waits ``cut_s``,
restores both, and times for each node, from the cut: when the gateways marked it lost; from the restore:
when it heartbeat again, and when a create pinned to it was placed there and answered.

Keep ``cut_s`` under Ray's own health checks (about a minute: 5 failed checks of 3 s with a 10 s timeout),
past which Ray declares the node dead and its raylet exits when the link returns.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from corral.bench.harness import bench_session, emit
from corral.cluster.local import LocalCluster
from corral.sdk import CapacityExhausted, Client, SandboxState
from corral.state.db import POSTGRES_TCP_TIMEOUTS

__all__ = ["run_partition_benchmark"]

NODES = {"timeouts": "p1", "baseline": "p2"}
LOST_AFTER_S = 8.0
HEARTBEAT_S = 0.5
_POLL_S = 0.2
_WAIT_S = 120.0
_KERNEL_DEFAULTS = "connect_timeout=0&tcp_user_timeout=0&keepalives_idle=7200&keepalives_interval=75&keepalives_count=9"
"""libpq's TCP settings as libpq and Linux leave them (connect_timeout 0: wait for ever; Linux refuses a keepalive
idle time of 0, so its defaults are spelled out)."""
assert set(POSTGRES_TCP_TIMEOUTS) - {"options"} == {pair.split("=")[0] for pair in _KERNEL_DEFAULTS.split("&")}


def _labels(side: str) -> dict[str, str]:
    return {"partition": side}


def _node_states(cluster: LocalCluster) -> dict[str, str]:
    return {node["edge_id"]: node["state"] for node in cluster.cluster_nodes()}


def _round(cluster: LocalCluster, client: Client, cut_s: float) -> dict[str, dict[str, float]]:
    """One cut of both nodes: per side, lost_s (from the cut), heard_s and placed_s (from the restore)."""
    sandboxes = [client.create("busybox", ttl_s=600, node_selector=_labels(side)) for side in NODES]
    times: dict[str, dict[str, float]] = {side: {} for side in NODES}
    try:
        for edge_id in NODES.values():
            cluster.cut_node(edge_id)
        cut_at = time.monotonic()
        while time.monotonic() - cut_at < cut_s:
            states = _node_states(cluster)
            for side, edge_id in NODES.items():
                if states[edge_id] == "lost" and "lost_s" not in times[side]:
                    times[side]["lost_s"] = time.monotonic() - cut_at
            time.sleep(_POLL_S)
    finally:
        for edge_id in NODES.values():
            cluster.restore_node(edge_id)
    restored_at = time.monotonic()
    for side in NODES:
        if "lost_s" not in times[side]:
            raise RuntimeError(f"the {side} node was not marked lost within a {cut_s:g} s cut: cut longer")
    waiting = set(NODES)
    while waiting:
        if time.monotonic() - restored_at > _WAIT_S:
            raise RuntimeError(f"{sorted(waiting)} not placed on within {_WAIT_S:.0f} s of the restore")
        states = _node_states(cluster)
        for side in sorted(waiting):
            if states[NODES[side]] == "up":
                times[side].setdefault("heard_s", time.monotonic() - restored_at)
            try:
                sandbox = client.create("busybox", ttl_s=600, node_selector=_labels(side))
            except CapacityExhausted:
                continue
            sandbox.exec("true")
            times[side]["placed_s"] = time.monotonic() - restored_at
            times[side].setdefault("heard_s", times[side]["placed_s"])
            sandboxes.append(sandbox)
            waiting.discard(side)
        time.sleep(_POLL_S)
    for sandbox in sandboxes:
        if sandbox.info.state != SandboxState.LOST:
            sandbox.kill()
    return times


def run_partition_benchmark(*, cut_s: float, rounds: int, as_json: bool, console: Console) -> dict[str, Any]:
    report: dict[str, Any] = {"cut_s": cut_s, "rounds": rounds, "lost_after_s": LOST_AFTER_S}
    measured: dict[str, list[dict[str, float]]] = {side: [] for side in NODES}
    with bench_session("bench-partition", as_json=as_json, console=console) as (scratch, progress):
        task = progress.add_task("starting the cluster", total=rounds)
        cluster = LocalCluster(
            scratch / "cluster",
            node_settings={"CORRAL_NODE_HEARTBEAT_S": str(HEARTBEAT_S), "CORRAL_PAUSE_SWAP_MB": "0"},
            gateway_settings={"CORRAL_NODE_HEARTBEAT_S": str(HEARTBEAT_S),
                              "CORRAL_NODE_LOST_AFTER_S": str(LOST_AFTER_S)},
        )  # fmt: skip
        try:
            state = cluster.up(0, progress=lambda what: progress.update(task, description=what))
            progress.update(task, description="joining two nodes of their own network")
            cluster.add_node(NODES["timeouts"], labels=_labels("timeouts"), own_network=True)
            baseline_url = f"{state.database_relay_url}?{_KERNEL_DEFAULTS}"
            cluster.add_node(NODES["baseline"], labels=_labels("baseline"), own_network=True,
                             settings={"CORRAL_DATABASE_URL": baseline_url})  # fmt: skip
            with Client(state.gateway_url, state.api_key, timeout_s=120) as client:
                for side in NODES:  # warm: the image's layer fetched on each node
                    client.create("busybox", ttl_s=600, node_selector=_labels(side)).kill()
                for index in range(rounds):
                    progress.update(task, description=f"round {index + 1}/{rounds}: both nodes cut {cut_s:g} s")
                    for side, times in _round(cluster, client, cut_s).items():
                        measured[side].append(times)
                    progress.advance(task)
        finally:
            if cluster.state is not None:
                cluster.down()
    for side, runs in measured.items():
        report[side] = {key: statistics.median(run[key] for run in runs) for key in ("lost_s", "heard_s", "placed_s")}
        report[side]["runs"] = runs
    emit(report, _table, as_json=as_json, console=console)
    return report


def _table(report: dict[str, Any]) -> Table:
    table = Table(
        "metric", "with the TCP timeouts", "without (kernel defaults), same run", "ratio",
        title=f"A cluster node cut off for {report['cut_s']:g} s, then restored",
        caption=f"{report['rounds']} rounds (both nodes cut at once), medians; a node is lost after "
        f"{report['lost_after_s']:g} s without a heartbeat. Each node in a network namespace of its own, "
        "PostgreSQL over TCP.",
    )  # fmt: skip
    with_, without = report["timeouts"], report["baseline"]
    for key, label in (("lost_s", "marked lost, from the cut"), ("heard_s", "heartbeating again, from the restore"),
                       ("placed_s", "a create placed there and answered, from the restore")):  # fmt: skip
        ratio = with_[key] / without[key] if without[key] else float("nan")
        table.add_row(label, f"{with_[key]:.1f} s", f"{without[key]:.1f} s", f"{ratio:.2f}×")
    return table
