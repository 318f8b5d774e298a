"""Faults on the package's Ray cluster (tests/cluster/conftest.py), each checked for silent loss: every sandbox
record ends in a state that matches its node (a running record has its container, no container runs that no
active record knows), every step acknowledged to a client is still in the trajectory log, and nothing a client
was told exists is missing.

- PostgreSQL stopped and started again (scripts/postgres.sh, same data dir) during a burst of creates.
- A gateway replica SIGKILLed in the middle of a batch while the first gateway serves.
- A node's edge actor SIGKILLed while an exec stream and a long-poll on a background command are open.
- A node cut off from the gateway and the database, then back (its edge actor frozen with SIGSTOP: on one
  machine the nodes share one network namespace and reach PostgreSQL over its unix socket, so no network rule
  can isolate one of them; from the gateway's side and the database's, a frozen edge is a cut one).

The package's three nodes are left as found: the edge that is killed is restarted by Ray, the frozen one thawed.
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
from corral.cluster.local import LocalCluster
from corral.state.db import StateStore
from tests.cluster.conftest import CREATE_ORPHAN_AFTER_S, NODE_LOST_AFTER_S, NODES, edge_of

REPO = Path(__file__).resolve().parents[2]
STATES = [state.value for state in corral.SandboxState]
RECONCILE_S = 5.0  # a node's reconcile round: every 10 heartbeats of 0.5 s (edge/adoption.py)


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(0.25)


def _containers(cluster: LocalCluster) -> dict[str, set[str]]:
    """What each of the package's nodes runs, from crun itself."""
    state = cluster.state
    assert state is not None
    running = {}
    for edge_id in NODES:
        root = Path(state.nodes[edge_id].data_dir) / "run" / "crun"
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
        nodes = {node["edge_id"]: node["state"] for node in cluster.cluster_nodes()}
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
            with pytest.raises(corral.ServerUnavailable, match="lost the stream"):  # noqa: PT012 - the kill is inside
                for sb in replica.create_many(30, "busybox", per_node=10, ttl_s=600, labels=labels):
                    handed.append(sb.id)
                    creating = store.list(states=[corral.SandboxState.CREATING.value], labels=labels)
                    if killed is None and (creating or len(handed) == 5):  # creates in flight, or soon
                        os.kill(replica_pid, signal.SIGKILL)
                        killed = time.monotonic()
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
    """e2's edge frozen (no heartbeat, no answer): after the heartbeat timeout e2 and its sandboxes are lost
    (``SandboxGone`` naming it), creates go to e1; thawed, e2 heartbeats again, ends the sandboxes the records
    gave up on (their clients were told they are gone), and takes new ones."""
    labels = {"fault": f"cut-{secrets.token_hex(4)}"}
    store = StateStore(postgres_url)
    on_e2: list[corral.Sandbox] = []
    pid = cluster.edge_pid("e2")
    assert pid is not None
    frozen = False
    try:
        for _ in range(12):
            sb = client.create("busybox", ttl_s=600, labels=labels, node_selector={"zone": "a"})
            if edge_of(sb) == "e2":
                on_e2.append(sb)
                if len(on_e2) == 2:
                    break
        assert len(on_e2) == 2, "no create of 12 in zone a landed on e2"
        on_e2[0].exec("echo before > /mark")
        os.kill(pid, signal.SIGSTOP)
        frozen = True
        cut = time.monotonic()

        def lost() -> bool:
            return all(client.get(sb.id).info.state == corral.SandboxState.LOST for sb in on_e2)

        _wait_for("e2's sandboxes marked lost", lost, NODE_LOST_AFTER_S + 15)
        print(f"\ne2 and its sandboxes lost {time.monotonic() - cut:.1f} s after the cut")
        nodes = {node["edge_id"]: node["state"] for node in cluster.cluster_nodes()}
        assert nodes["e2"] == "lost" and nodes["e1"] == "up", nodes
        info = client.get(on_e2[0].id).info
        assert info.end_reason == "lost" and "e2" in (info.status_message or "")
        with pytest.raises(corral.SandboxGone, match="e2"):
            on_e2[0].exec("cat /mark")
        while_cut = client.create("busybox", ttl_s=600, labels=labels, node_selector={"zone": "a"})
        assert edge_of(while_cut) == "e1" and while_cut.exec("echo ok").stdout == "ok\n"
        os.kill(pid, signal.SIGCONT)
        frozen = False

        def up() -> bool:
            return {node["edge_id"]: node["state"] for node in cluster.cluster_nodes()}["e2"] == "up"

        _wait_for("e2 heartbeating again", up, 30)
        _assert_records_match_nodes(cluster, store, labels)  # e2 ended the two the records gave up on
        assert not {sb.id for sb in on_e2} & _containers(cluster)["e2"]
        for _ in range(12):
            sb = client.create("busybox", ttl_s=600, labels=labels, node_selector={"zone": "a"})
            if edge_of(sb) == "e2":
                assert sb.exec("echo usable").stdout == "usable\n"
                break
        else:
            pytest.fail("no create of 12 in zone a landed on e2 after it came back")
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        _kill_labelled(client, labels)
        store.close()
