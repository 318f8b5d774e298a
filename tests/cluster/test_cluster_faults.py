"""Faults on the package's Ray cluster (tests/cluster/conftest.py), each checked for silent loss: every sandbox
record ends in a state that matches its node (a running record has its container, no container runs that no
active record knows), every step acknowledged to a client is still in the trajectory log, and nothing a client
was told exists is missing.

- PostgreSQL stopped and started again (scripts/postgres.sh, same data dir) during a burst of creates.
- A gateway replica SIGKILLed in the middle of a batch while the first gateway serves.
- A node's edge actor SIGKILLed while an exec stream and a long-poll on a background command are open.
- A node's network cut off from the gateway, the other nodes and the database, then restored: a node of its
  own network namespace (``CUT_NODE``, joined for it: as on another machine, PostgreSQL over TCP), whose link
  drops every packet both ways for the cut (cluster/network.py, ``NodeNetwork.cut``).

The package's three nodes are left as found: the edge that is killed is restarted by Ray.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.backends.common.host import runtime_state_root
from corral.cluster.local import LocalCluster
from corral.state.db import StateStore
from tests.cluster.conftest import (
    CREATE_ORPHAN_AFTER_S,
    CUT_NODE,
    CUT_NODE_LABELS,
    NODE_LOST_AFTER_S,
    NODES,
    edge_of,
)  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
STATES = [state.value for state in corral.SandboxState]
RECONCILE_S = 5.0  # a node's reconcile round: every 10 heartbeats of 0.5 s (edge/adoption.py)


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(0.25)


def _containers(cluster: LocalCluster) -> dict[str, set[str]]:
    """What each node of the cluster runs (the package's and those joined since), from crun itself."""
    state = cluster.state
    assert state is not None
    running = {}
    for edge_id, node in state.nodes.items():
        root = runtime_state_root(Path(node.data_dir), "crun")
        if not root.is_dir():
            continue
        listing = subprocess.run(["crun", "--root", str(root), "list"], capture_output=True, text=True, check=True)
        running[edge_id] = {line.split()[0] for line in listing.stdout.splitlines()[1:] if line.strip()}
    return running


def _mismatches(cluster: LocalCluster, store: StateStore, labels: dict[str, str]) -> list[str]:
    """Where the records and the nodes disagree: a container no active record knows (on any node), or one of
    ``labels``' sandboxes whose record says running without its container, or ended with it still there."""
    running = _containers(cluster)
    problems = []
    for edge_id, ids in running.items():
        active = store.active_ids(edge_id)
        problems += [f"{sandbox_id} runs on {edge_id} with no active record" for sandbox_id in ids - active]
    for record in store.list(labels=labels):
        on_node = record.id in running.get(record.edge_id, set())
        if record.state == corral.SandboxState.RUNNING.value and not on_node:
            problems.append(f"{record.id} is running in the records but not on {record.edge_id}")
        if record.state in ("ended", "lost") and on_node:
            problems.append(f"{record.id} is {record.state} in the records but runs on {record.edge_id}")
        if record.state == corral.SandboxState.CREATING.value:
            problems.append(f"{record.id} is still creating")
    return problems


def _assert_records_match_nodes(cluster: LocalCluster, store: StateStore, labels: dict[str, str]) -> None:
    """Reality and the records agree, allowing the nodes one reconcile round (and an orphan's grace) for it."""
    problems: list[str] = []

    def agree() -> bool:
        nonlocal problems
        problems = _mismatches(cluster, store, labels)
        return not problems

    _wait_for("records and nodes agree", agree, CREATE_ORPHAN_AFTER_S + 3 * RECONCILE_S)
    assert not problems


def _kill_labelled(client: corral.Client, labels: dict[str, str]) -> None:
    for info in client.list(labels=labels):
        if info.state in (corral.SandboxState.RUNNING, corral.SandboxState.PAUSED, corral.SandboxState.CREATING):
            client.kill(info.id)


def _postgres(action: str, url: str) -> None:
    directory = url.rsplit("host=", 1)[1]
    subprocess.run(["bash", str(REPO / "scripts" / "postgres.sh"), action, directory], check=True,
                   capture_output=True, timeout=60)  # fmt: skip


def test_a_postgres_restart_during_a_burst_loses_nothing(
    cluster: LocalCluster, client: corral.Client, postgres_url: str
) -> None:
    """Creates meeting the restart succeed (the record writes wait it out) or fail with a retryable
    ``ServerUnavailable`` naming the database, never a 500 or a hang; retried after it, they all succeed."""
    state = cluster.state
    assert state is not None
    labels = {"fault": f"pg-{secrets.token_hex(4)}"}
    store = StateStore(postgres_url)
    outcomes: list[corral.Sandbox | corral.CorralError] = []
    acked: dict[str, str] = {}  # step id -> the output the client was given
    restarted = threading.Event()
    try:
        sandbox = client.create("busybox", ttl_s=600, labels=labels)
        with corral.Client(state.gateway_url, state.api_key, timeout_s=30) as burst:

            def create() -> None:
                while not restarted.is_set() and len(outcomes) < 40:
                    started = time.monotonic()
                    try:
                        outcomes.append(burst.create("busybox", ttl_s=600, labels=labels))
                    except corral.CorralError as exc:
                        outcomes.append(exc)
                        time.sleep(0.2)  # a client backs off before it retries
                    assert time.monotonic() - started < 25, "a create hung through the restart"

            def step(index: int) -> None:
                step_id = f"{labels['fault']}-{index}"
                try:
                    acked[step_id] = sandbox.exec(f"echo step-{index} >> /steps; echo {index}", step_id=step_id).stdout
                except corral.ServerUnavailable:
                    pass  # not acknowledged: the client may send it again

            with ThreadPoolExecutor(4) as pool:
                workers = [pool.submit(create) for _ in range(3)]
                _wait_for("the burst got going", lambda: len(outcomes) >= 4, 30)
                step(0)
                _postgres("stop", postgres_url)
                step(1)  # the database is down: the step cannot be logged, so it is refused, not run unlogged
                _postgres("start", postgres_url)
                time.sleep(0.5)  # creates go on after the restart too
                restarted.set()
                for worker in workers:
                    worker.result()
            step(2)

        failures = [outcome for outcome in outcomes if isinstance(outcome, corral.CorralError)]
        created = [outcome for outcome in outcomes if isinstance(outcome, corral.Sandbox)]
        assert all(isinstance(failure, corral.ServerUnavailable) for failure in failures), failures
        assert all("database" in failure.message for failure in failures), failures
        for _ in failures:  # the client retries what failed: the gateway reconnected on its own
            created.append(client.create("busybox", ttl_s=600, labels=labels))
        print(f"\n{len(outcomes)} creates met the restart: {len(failures)} failed retryably, all retried")
        records = {record.id: record for record in store.list(labels=labels)}
        for sb in created:
            assert records[sb.id].state == corral.SandboxState.RUNNING.value
        for sb in created[:: max(1, len(created) // 6)]:
            assert client.get(sb.id).exec("echo $((6 * 7))").stdout == "42\n"
        logged = {step.step_id: step for step in sandbox.trajectory()}
        assert {"0", "2"} <= {acked.get(f"{labels['fault']}-{i}", "").strip() for i in range(3)}
        for step_id, stdout in acked.items():
            assert logged[step_id].state == "done" and logged[step_id].result is not None
            assert logged[step_id].result["stdout"] == stdout
        ran = sandbox.exec("cat /steps").stdout.split()
        assert sorted(ran) == sorted(f"step-{step_id.rsplit('-', 1)[1]}" for step_id in acked)  # none ran unlogged
        nodes = _node_states(cluster)
        assert all(nodes[edge_id] == "up" for edge_id in NODES), nodes
        _assert_records_match_nodes(cluster, store, labels)
    finally:
        _kill_labelled(client, labels)
        store.close()


def test_a_gateway_killed_mid_batch_leaves_every_sandbox_accounted_for(
    cluster: LocalCluster, client: corral.Client, postgres_url: str
) -> None:
    """A replica is SIGKILLed after handing over 5 sandboxes of a 30-sandbox batch; the client goes to the first
    gateway: the 5 run, every other sandbox of the batch is running or ended with a reason (a create the dead
    gateway never answered is ended by its node), none stays creating, and nothing runs that no record knows."""
    state = cluster.state
    assert state is not None
    labels = {"fault": f"gw-{secrets.token_hex(4)}"}
    store = StateStore(postgres_url)
    started = time.monotonic()
    replica_url = cluster.add_gateway()
    replica_pid = state.replicas[-1]
    print(f"\nreplica up in {time.monotonic() - started:.1f} s")
    handed: list[str] = []
    killed: float | None = None
    try:
        with corral.Client(replica_url, state.api_key, timeout_s=60) as replica:
            try:
                for sb in replica.create_many(30, "busybox", per_node=10, ttl_s=600, labels=labels):
                    handed.append(sb.id)
                    creating = store.list(states=[corral.SandboxState.CREATING.value], labels=labels)
                    if killed is None and (creating or len(handed) == 5):  # creates in flight, or soon
                        os.kill(replica_pid, signal.SIGKILL)
                        killed = time.monotonic()
            except corral.ServerUnavailable as exc:
                assert "lost the stream" in str(exc)
            else:  # the batch outran the kill: every answer was on the wire before the replica died (seen once)
                assert len(handed) == 30
        state.replicas.remove(replica_pid)
        state.save()
        assert killed is not None

        def settled() -> bool:
            return all(info.state != corral.SandboxState.CREATING for info in client.list(state=STATES, labels=labels))

        _wait_for("no sandbox of the batch left creating", settled, CREATE_ORPHAN_AFTER_S + 3 * RECONCILE_S)
        print(f"settled {time.monotonic() - killed:.1f} s after the kill")
        infos = {info.id: info for info in client.list(state=STATES, labels=labels)}
        assert set(handed) <= set(infos)
        assert all(infos[sandbox_id].state == corral.SandboxState.RUNNING for sandbox_id in handed)
        ended = [info for info in infos.values() if info.state != corral.SandboxState.RUNNING]
        assert all(info.end_reason and info.status_message for info in ended), ended
        running = [info for info in infos.values() if info.state == corral.SandboxState.RUNNING]
        reasons = sorted({info.end_reason or "" for info in ended})
        print(f"\nbatch of 30 cut after {len(handed)}: {len(infos)} recorded, {len(running)} running, "
              f"{len(ended)} ended {reasons}")  # fmt: skip
        _assert_records_match_nodes(cluster, store, labels)
        missing = 30 - len(running)  # 0 when the batch outran the kill (its answers were already on the wire)
        if missing:
            again = list(client.create_many(missing, "busybox", ttl_s=600, labels=labels))
            assert len(again) == missing
        assert client.get(handed[0]).exec("echo kept").stdout == "kept\n"
    finally:
        if replica_pid in state.replicas:
            os.kill(replica_pid, signal.SIGKILL)
            state.replicas.remove(replica_pid)
            state.save()
        _kill_labelled(client, labels)
        store.close()


def test_an_edge_killed_ends_its_open_streams_with_a_clear_error(cluster: LocalCluster, client: corral.Client) -> None:
    """An exec stream and a long-poll on a background command, both open on e3 when its edge actor is SIGKILLed,
    end within seconds with ``ServerUnavailable`` naming the edge; Ray brings the edge back and it re-adopts the
    sandbox (the background command's process still runs)."""
    outcomes: dict[str, Any] = {}
    first_line = threading.Event()
    with client.create("busybox", ttl_s=600, node_selector={"zone": "b"}) as sandbox:
        background = sandbox.start("echo kept > /mark; exec sleep 600", timeout_s=900)
        _wait_for("the background command started", lambda: sandbox.exec("cat /mark").stdout == "kept\n", 10)
        sleeper = sandbox.exec("pidof sleep").stdout.strip()

        def stream() -> None:
            try:
                for event in sandbox.exec_stream("while true; do echo tick; sleep 0.2; done", timeout_s=120):
                    if event.type == "stdout":
                        first_line.set()
                outcomes["stream"] = "ended without an error"
            except corral.CorralError as exc:
                outcomes["stream"] = exc

        def long_poll() -> None:
            try:
                outcomes["poll"] = sandbox.command(background.command_id, wait_s=60)
            except corral.CorralError as exc:
                outcomes["poll"] = exc

        threads = [threading.Thread(target=stream), threading.Thread(target=long_poll)]
        for thread in threads:
            thread.start()
        assert first_line.wait(30), "the stream gave no output"
        time.sleep(0.3)  # the long-poll is waiting on the edge
        old_pid = cluster.edge_pid("e3")
        assert old_pid is not None
        os.kill(old_pid, signal.SIGKILL)
        killed = time.monotonic()
        for thread in threads:
            thread.join(timeout=20)
        took_s = time.monotonic() - killed
        assert not any(thread.is_alive() for thread in threads), f"a stream hung: {outcomes}"
        print(f"\nopen streams ended {took_s:.2f} s after the edge was killed: {outcomes}")
        for name in ("stream", "poll"):
            assert isinstance(outcomes[name], corral.ServerUnavailable), (name, outcomes[name])
            assert "edge e3" in outcomes[name].message, (name, outcomes[name].message)

        def back() -> bool:
            try:
                return sandbox.exec("echo back").stdout == "back\n"
            except corral.ServerUnavailable:
                return False

        def restarted() -> bool:
            return cluster.edge_pid("e3") not in (None, old_pid)

        _wait_for("Ray restarted the edge", restarted, 120)
        print(f"a new edge process {time.monotonic() - killed:.1f} s after the kill")
        _wait_for("the edge came back", back, 120)
        print(f"the edge answered again {time.monotonic() - killed:.1f} s after it was killed")
        assert cluster.edge_pid("e3") not in (None, old_pid)
        assert client.get(sandbox.id).info.state == corral.SandboxState.RUNNING
        assert sandbox.exec(f"kill -0 {sleeper} && cat /mark").stdout == "kept\n"
        ps = sandbox.exec("ps")  # pages never read before the kill: served by the layer's reattached helper
        assert ps.exit_code == 0 and "sleep" in ps.stdout, ps


def test_a_node_cut_off_is_marked_lost_then_comes_back_reconciled(
    cluster: LocalCluster, client: corral.Client, postgres_url: str
) -> None:
    """The cut node's link drops every packet (no heartbeat reaches the database, no call the edge): after the
    heartbeat timeout it and its sandboxes are lost (``SandboxGone`` naming it), a create pinned to its labels
    is refused as retryable, others go on elsewhere; restored, it heartbeats again, ends the sandboxes the
    records gave up on (their clients were told they are gone), and takes new ones at once (the gateway places
    on it once its edge answers a probe)."""
    labels = {"fault": f"cut-{secrets.token_hex(4)}"}
    cluster.add_node(CUT_NODE, labels=CUT_NODE_LABELS, own_network=True)
    store = StateStore(postgres_url)
    cut = False
    try:
        on_node = [client.create("busybox", ttl_s=600, labels=labels, node_selector=CUT_NODE_LABELS) for _ in range(2)]
        assert {edge_of(sb) for sb in on_node} == {CUT_NODE}
        on_node[0].exec("echo before > /mark")
        sleeper = on_node[1].start("exec sleep 600", timeout_s=900)
        cluster.cut_node(CUT_NODE)
        cut = True
        cut_at = time.monotonic()

        def lost() -> bool:
            return all(client.get(sb.id).info.state == corral.SandboxState.LOST for sb in on_node)

        _wait_for("the cut node's sandboxes marked lost", lost, NODE_LOST_AFTER_S + 15)
        print(f"\n{CUT_NODE} and its sandboxes lost {time.monotonic() - cut_at:.1f} s after the cut")
        nodes = _node_states(cluster)
        assert nodes[CUT_NODE] == "lost" and all(nodes[edge_id] == "up" for edge_id in NODES), nodes
        info = client.get(on_node[0].id).info
        assert info.end_reason == "lost" and CUT_NODE in (info.status_message or "")
        with pytest.raises(corral.SandboxGone, match=CUT_NODE):
            on_node[0].exec("cat /mark")
        with pytest.raises(corral.CapacityExhausted, match=f"{CUT_NODE}.*not reachable now"):
            client.create("busybox", ttl_s=600, labels=labels, node_selector=CUT_NODE_LABELS)
        while_cut = client.create("busybox", ttl_s=600, labels=labels, node_selector={"zone": "a"})
        assert while_cut.exec("echo ok").stdout == "ok\n"
        assert cluster.edge_pid(CUT_NODE) is not None  # the node's processes ran on through the cut
        cluster.restore_node(CUT_NODE)
        cut = False
        restored_at = time.monotonic()

        _wait_for("the cut node heartbeating again", lambda: _node_state(cluster, CUT_NODE) == "up", 30)
        heard_s = time.monotonic() - restored_at
        refused: list[str] = []  # creates there until its edge has answered the gateway's probe: retryable
        deadline = time.monotonic() + 20
        while True:
            try:
                again = client.create("busybox", ttl_s=600, labels=labels, node_selector=CUT_NODE_LABELS)
                break
            except corral.CapacityExhausted as exc:
                assert "not reachable now" in exc.message and time.monotonic() < deadline, exc.message
                refused.append(exc.message)
                time.sleep(0.25)
        assert edge_of(again) == CUT_NODE and again.exec("echo usable").stdout == "usable\n"
        print(f"heard again {heard_s:.1f} s after the link was restored, a create there after "
              f"{time.monotonic() - restored_at:.1f} s ({len(refused)} refused as retryable before)")  # fmt: skip
        _assert_records_match_nodes(cluster, store, labels)  # the node ended the two the records gave up on
        assert not {sb.id for sb in on_node} & _containers(cluster)[CUT_NODE]
        with pytest.raises(corral.SandboxGone):
            on_node[1].command(sleeper.command_id)
    finally:
        if cut:
            cluster.restore_node(CUT_NODE)
        _kill_labelled(client, labels)
        store.close()
        cluster.remove_node(CUT_NODE)  # the package's later tests count on their three nodes only
        _wait_for("the cut node marked lost once it left", lambda: _node_state(cluster, CUT_NODE) == "lost",
                  NODE_LOST_AFTER_S + 15)  # fmt: skip


def _node_states(cluster: LocalCluster) -> dict[str, str]:
    return {str(node["edge_id"]): str(node["state"]) for node in cluster.cluster_nodes()}


def _node_state(cluster: LocalCluster, edge_id: str) -> str:
    return _node_states(cluster)[edge_id]
