"""Batch creation and placement at scale: real containers over HTTP (small N), simulated nodes in process (large N).

The simulated backend (corral/testing/simulated.py) isolates nothing and only keeps state; everything
else here is real: the SandboxService, the scheduler, LocalEdge admission, the state store (SQLite or
PostgreSQL).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import json
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event, select
from starlette.testclient import TestClient

import corral
from corral.api.models import (
    BatchEvent,
    CreateSandboxRequest,
    ExecRequest,
    NetworkPolicy,
    NetworkRule,
    SandboxState,
)
from corral.backends.common.network import DeniedCounts
from corral.backends.router import BackendRouter
from corral.bench import control_plane
from corral.config import Settings
from corral.edge import local
from corral.edge.local import LocalEdge, NodeCapacity
from corral.gateway.app import create_app
from corral.gateway.service import SandboxService
from corral.gateway.services import Services
from corral.images.catalogue import Catalogue
from corral.images.store import LayerStore
from corral.state.db import StateStore, events
from corral.state.records import SandboxRecord
from corral.testing.simulated import SimulatedBackend


def test_batch_of_real_containers_over_http(client: corral.Client) -> None:
    job = f"batch-{uuid.uuid4().hex[:8]}"
    events: list[BatchEvent] = []
    sandboxes = list(client.create_many(20, "busybox", per_node=4, ttl_s=300, labels={"job": job},
                                        on_progress=events.append))  # fmt: skip
    try:
        assert len({sb.id for sb in sandboxes}) == 20
        assert all(sb.exec("echo $((6*7))").stdout == "42\n" for sb in sandboxes)
        assert [(e.type, e.created, e.failed, e.total) for e in events] == [("done", 20, 0, 20)]
        listed = client.list(labels={"job": job})
        assert {info.id for info in listed} == {sb.id for sb in sandboxes}
        assert {info.state for info in listed} == {"running"}
    finally:
        assert len(client.bulk({"job": job}, "kill").done) == 20


async def test_batch_that_cannot_start_fails_with_its_status(aclient: corral.AsyncClient) -> None:
    with pytest.raises(corral.NotFound, match="no-such-image"):
        async for _ in aclient.create_many(5, "no-such-image:1"):
            pass
    with pytest.raises(corral.InvalidRequest):
        async for _ in aclient.create_many(32_001):
            pass


def _request(job: str) -> CreateSandboxRequest:
    return CreateSandboxRequest(image=control_plane.IMAGE, cpu=0.25, memory_mb=256, labels={"job": job})


async def _batch_on(store: StateStore, tmp_path: Path, *, nodes: int, count: int, per_node: int) -> None:
    async with control_plane.simulated_cluster(nodes, store, tmp_path / "layers") as service:
        seen_in_flight = 0
        indexes: list[int] = []
        progress: list[BatchEvent] = []
        async for event in service.create_many(_request("big"), count, concurrency=256, per_node=per_node):
            seen_in_flight = max(seen_in_flight, *(node.in_flight for node in service.scheduler.nodes.values()))
            if event.type == "sandbox":
                assert event.sandbox is not None and event.sandbox.state == "running"
                indexes.append(event.index)  # type: ignore[arg-type]
            elif event.type == "error":
                raise AssertionError(event.error)
            else:
                progress.append(event)
        assert sorted(indexes) == list(range(count))
        assert 0 < seen_in_flight <= per_node  # back-pressure: never more than per_node starting on one node
        assert [p.created for p in progress] == [*range(1000, count, 1000), count]
        assert progress[-1].type == "done" and progress[-1].failed == 0
        per_node_counts = [node.sandboxes for node in service.scheduler.nodes.values()]
        assert sum(per_node_counts) == count and max(per_node_counts) - min(per_node_counts) <= count // nodes
        assert len(await service.list(states=["running"], labels={"job": "big"})) == count
        assert len(store.list(states=["running"])) == count


async def test_a_batch_hands_on_the_events_ready_together(tmp_path: Path) -> None:
    """The HTTP stream writes a group of ready events at once: a burst comes in far fewer groups than sandboxes,
    every index once, progress after every thousandth and the done line last."""
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        async with control_plane.simulated_cluster(16, store, tmp_path / "layers") as service:
            groups = [group async for group in service.create_many_grouped(_request("grouped"), 3000)]
    finally:
        store.close()
    events = [event for group in groups for event in group]
    assert all(groups) and len(groups) < 3000 // 10
    assert sorted(event.index for event in events if event.type == "sandbox") == list(range(3000))  # type: ignore[type-var]
    assert [(e.type, e.created) for e in events if e.type in ("progress", "done")] == [
        ("progress", 1000), ("progress", 2000), ("done", 3000)
    ]  # fmt: skip
    assert events[-1].type == "done" and events[-1].failed == 0


def _counted(method: Any, calls: list[str]) -> Any:  # noqa: ANN401 - a bound method, and its stand-in
    """``method`` (a coroutine or an async generator of the service's) noting the sandbox id of each call."""
    if inspect.isasyncgenfunction(method):

        async def streamed(sandbox_id: str, *args: Any) -> AsyncIterator[Any]:
            calls.append(sandbox_id)
            async for item in method(sandbox_id, *args):
                yield item

        return streamed

    async def counted(sandbox_id: str, *args: Any) -> Any:  # noqa: ANN401 - what the call returns
        calls.append(sandbox_id)
        return await method(sandbox_id, *args)

    return counted


@contextlib.contextmanager
def _app_counting(
    tmp_path: Path, methods: str | tuple[str, ...], store: StateStore | None = None
) -> Iterator[tuple[TestClient, list[str]]]:
    """The HTTP app on two simulated nodes (SQLite unless ``store`` is given, server key ``ck_test``) and the
    sandbox ids its service's ``methods`` (reads of the state store, or ``call`` and ``stream``: calls to the
    sandbox's node) were called with, in order."""
    store = store or StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    reads: list[str] = []

    @contextlib.asynccontextmanager
    async def services() -> AsyncIterator[Services]:
        async with control_plane.simulated_services(2, store, tmp_path, "ck_test") as served:
            for method in (methods,) if isinstance(methods, str) else methods:
                setattr(served.sandboxes, method, _counted(getattr(served.sandboxes, method), reads))
            yield served

    try:
        with TestClient(create_app(services, 1 << 20, tmp_path / "uploads")) as http:
            yield http, reads
    finally:
        store.close()


def test_a_job_tokens_hold_on_a_sandbox_is_read_once(tmp_path: Path) -> None:
    """A job token's requests on its sandbox read the record once (it was once per request: +1.0 ms an exec on
    PostgreSQL); another job's sandbox is refused every time, and a revoke forgets what was found."""
    admin = {"Authorization": "Bearer ck_test"}
    shape = {"image": control_plane.IMAGE, "cpu": 0.25, "memory_mb": 256}
    with _app_counting(tmp_path, "record") as (http, reads):
        token = http.post("/v1/jobs/trainer/token", headers=admin).json()["token"]
        trainer = {"Authorization": f"Bearer {token}"}
        mine = http.post("/v1/sandboxes", json=shape, headers=trainer).json()["id"]
        other = http.post("/v1/sandboxes", json={**shape, "labels": {"job": "other"}}, headers=admin).json()["id"]
        assert [http.get(f"/v1/sandboxes/{mine}", headers=trainer).status_code for _ in range(3)] == [200] * 3
        assert [http.get(f"/v1/sandboxes/{other}", headers=trainer).status_code for _ in range(2)] == [403] * 2
        assert (reads.count(mine), reads.count(other)) == (1, 2)
        assert http.delete("/v1/jobs/trainer/token", headers=admin).status_code == 200
        assert http.get(f"/v1/sandboxes/{mine}", headers=trainer).status_code == 401
        again = {"Authorization": f"Bearer {http.post('/v1/jobs/trainer/token', headers=admin).json()['token']}"}
        assert http.get(f"/v1/sandboxes/{mine}", headers=again).status_code == 200
        assert reads.count(mine) == 2  # read again after the revoke


def test_steps_with_step_ids_read_their_sandbox_once(tmp_path: Path) -> None:
    """Every step with a step id checks that its sandbox exists (unknown ones get no log entries): one read per
    sandbox, not per step; an unknown sandbox is still refused every time."""
    key = {"Authorization": "Bearer ck_test"}
    shape = {"image": control_plane.IMAGE, "cpu": 0.25, "memory_mb": 256}
    with _app_counting(tmp_path, "get") as (http, reads):
        sandbox_id = http.post("/v1/sandboxes", json=shape, headers=key).json()["id"]
        for step in range(3):
            answer = http.post(f"/v1/sandboxes/{sandbox_id}/exec", json={"cmd": "true", "step_id": f"s{step}"},
                               headers=key)  # fmt: skip
            assert answer.status_code == 200 and answer.json()["exit_code"] == 0, answer.text
        steps = http.get(f"/v1/sandboxes/{sandbox_id}/trajectory", headers=key).json()
        assert [step["step_id"] for step in steps] == ["s0", "s1", "s2"], steps
        assert reads.count(sandbox_id) == 1
        unknown = "sb-n1-0000000000000000"
        for _ in range(2):
            answer = http.post(f"/v1/sandboxes/{unknown}/exec", json={"cmd": "true", "step_id": "s0"}, headers=key)
            assert answer.status_code == 404, answer.text
        assert reads.count(unknown) == 2


def test_a_step_with_a_step_id_is_one_call_to_its_node(tmp_path: Path) -> None:
    """An exec with a step id takes the filesystem's clock, runs, and looks up the files it changed in one call to
    the sandbox's node (on a Ray cluster, one actor call where it made three), as an exec without one does."""
    key = {"Authorization": "Bearer ck_test"}
    shape = {"image": control_plane.IMAGE, "cpu": 0.25, "memory_mb": 256}
    with _app_counting(tmp_path, "call") as (http, calls):
        sandbox_id = http.post("/v1/sandboxes", json=shape, headers=key).json()["id"]
        for body in ({"cmd": "true", "step_id": "s0"}, {"cmd": "true"}, {"cmd": "true", "step_id": "s1"}):
            before = calls.count(sandbox_id)
            answer = http.post(f"/v1/sandboxes/{sandbox_id}/exec", json=body, headers=key)
            assert answer.status_code == 200 and answer.json()["exit_code"] == 0, answer.text
            assert calls.count(sandbox_id) - before == 1, body
        steps = http.get(f"/v1/sandboxes/{sandbox_id}/trajectory", headers=key).json()
        logged = {step["step_id"]: step["files"] for step in steps if not step["step_id"].startswith("auto")}
        assert logged == {"s0": [], "s1": []}  # looked up (none changed), not left unknown (None)


def test_a_streamed_step_is_one_call_to_its_node(tmp_path: Path) -> None:
    """A streamed exec, with a step id or without, is one call to the sandbox's node: its exit comes with the
    audit's findings and (with a step id) the files it changed, where it took four calls (the clock, the stream,
    the files, the findings) and two without."""
    key = {"Authorization": "Bearer ck_test"}
    shape = {"image": control_plane.IMAGE, "cpu": 0.25, "memory_mb": 256}
    with _app_counting(tmp_path, ("call", "stream")) as (http, calls):
        sandbox_id = http.post("/v1/sandboxes", json=shape, headers=key).json()["id"]
        for body in ({"cmd": "true", "step_id": "s0"}, {"cmd": "true"}, {"cmd": "true", "step_id": "s1"}):
            before = calls.count(sandbox_id)
            answer = http.post(f"/v1/sandboxes/{sandbox_id}/exec/stream", json=body, headers=key)
            assert answer.status_code == 200, answer.text
            events = [json.loads(line) for line in answer.text.splitlines()]
            assert events[-1]["type"] == "exit" and events[-1]["result"]["exit_code"] == 0, events
            assert calls.count(sandbox_id) - before == 1, body
        again = http.post(f"/v1/sandboxes/{sandbox_id}/exec/stream", json={"cmd": "true", "step_id": "s0"},
                          headers=key)  # fmt: skip
        assert json.loads(again.text.splitlines()[-1])["result"]["replayed"] is True
        steps = http.get(f"/v1/sandboxes/{sandbox_id}/trajectory", headers=key).json()
        logged = {step["step_id"]: step["files"] for step in steps if not step["step_id"].startswith("auto")}
        assert logged == {"s0": [], "s1": []}  # looked up (none changed), not left unknown (None)


def _transactions(engine: Engine) -> tuple[list[str], Callable[[], None]]:
    """Notes each transaction ``engine`` commits, and each write PostgreSQL runs in autocommit (a transaction of
    its own); returns the notes and what stops the noting."""
    noted: list[str] = []

    def committed(_conn: Any) -> None:  # noqa: ANN401 - SQLAlchemy's event
        noted.append("commit")

    def statement(conn: Any, _cursor: Any, sql: str, *_: Any) -> None:  # noqa: ANN401 - SQLAlchemy's event
        if sql.split()[0].upper() in ("INSERT", "UPDATE") and getattr(conn.connection.driver_connection,
                                                                       "autocommit", False):  # fmt: skip
            noted.append("autocommit")

    event.listen(engine, "commit", committed)
    event.listen(engine, "before_cursor_execute", statement)

    def stop() -> None:
        event.remove(engine, "commit", committed)
        event.remove(engine, "before_cursor_execute", statement)

    return noted, stop


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_concurrent_steps_share_transactions_and_keep_their_order(
    tmp_path: Path, database: str, request: pytest.FixtureRequest
) -> None:
    """Steps with step ids in flight together are written in shared transactions (the group commit,
    gateway/operations.py: on SQLite per turn of the event loop, on PostgreSQL those asked for while the last
    one ran); each sandbox's steps still get their seqs in the order sent, with their results."""
    key = {"Authorization": "Bearer ck_test"}
    shape = {"image": control_plane.IMAGE, "cpu": 0.25, "memory_mb": 256}
    url = f"sqlite:///{tmp_path / 'state.db'}" if database == "sqlite" else request.getfixturevalue("postgres_url")
    store = StateStore(url)
    if database == "postgresql":
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes")
    with _app_counting(tmp_path, "record", store) as (http, _), ThreadPoolExecutor(16) as pool:
        sandboxes = [http.post("/v1/sandboxes", json=shape, headers=key).json()["id"] for _ in range(16)]
        transactions, stop = _transactions(store.engine)

        def trajectory(sandbox_id: str) -> None:
            for k in range(4):
                body = {"cmd": "sleep 0.01", "step_id": f"s{k}"}  # in flight together
                answer = http.post(f"/v1/sandboxes/{sandbox_id}/exec", json=body, headers=key)
                assert answer.status_code == 200, answer.text

        list(pool.map(trajectory, sandboxes))
        stop()
        assert "commit" in transactions  # some shared
        assert len(transactions) < 16 * 4 * 2  # a begin and a result each, had every write its own transaction
        for sandbox_id in sandboxes:
            steps = http.get(f"/v1/sandboxes/{sandbox_id}/trajectory", headers=key).json()
            mine = [step for step in steps if not step["step_id"].startswith("auto")]
            assert [(step["step_id"], step["state"]) for step in mine] == [(f"s{k}", "done") for k in range(4)]
            assert [step["seq"] for step in mine] == sorted(step["seq"] for step in mine)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_a_read_of_the_log_waits_for_the_step_writes_in_flight(
    tmp_path: Path, database: str, request: pytest.FixtureRequest
) -> None:
    """A step without a step id, answered while other steps are open, is written with their next transaction;
    a read of the log right after its answer still has it (the read waits for the writes being committed)."""
    url = f"sqlite:///{tmp_path / 'state.db'}" if database == "sqlite" else request.getfixturevalue("postgres_url")
    store = StateStore(url)
    try:
        async with control_plane.simulated_services(2, store, tmp_path, "ck_test") as served:
            ops, logs = served.operations, served.trajectories
            shape = CreateSandboxRequest(image=control_plane.IMAGE, cpu=0.25, memory_mb=256)
            plain, first, second = [(await served.sandboxes.create(shape)).id for _ in range(3)]
            running = asyncio.ensure_future(ops.exec(first, ExecRequest(cmd="sleep 0.3", step_id="long")))
            await asyncio.sleep(0.1)  # begun, and running on its node
            await ops.exec(plain, ExecRequest(cmd="true"))  # answered; its log entry waits for the next write
            joining = asyncio.ensure_future(ops.exec(second, ExecRequest(cmd="true", step_id="s")))
            await asyncio.sleep(0)  # its begin takes the waiting entry into its transaction
            logged = await logs.steps(plain, after_seq=0, limit=None)
            assert [(step.kind, step.request["cmd"]) for step in logged] == [("exec", "true")]
            assert (await joining).exit_code == 0 and (await running).exit_code == 0
    finally:
        store.close()


async def test_large_batch_on_simulated_nodes_sqlite(tmp_path: Path) -> None:
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    try:
        await _batch_on(store, tmp_path, nodes=16, count=5000, per_node=8)
    finally:
        store.close()


async def test_concurrent_creates_read_their_image_once_on_postgres(tmp_path: Path, postgres_url: str) -> None:
    """256 single creates that miss the image cache together share one catalogue read. Each reading for itself,
    on the one database thread at ~4 ms a read, outlasted the cache's second, so it never served: 219 creates/s."""
    store = StateStore(postgres_url)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes")
        async with control_plane.simulated_cluster(4, store, tmp_path / "layers") as service:
            resolve = service._resolve_root  # noqa: SLF001 - counted where the catalogue is read
            reads: list[str] = []

            def counted(request: CreateSandboxRequest) -> Any:  # noqa: ANN401 - resolve's own result
                reads.append(request.image)
                return resolve(request)

            service._resolve_root = counted  # type: ignore[method-assign]  # noqa: SLF001
            infos = await asyncio.gather(*(service.create(_request("one-read")) for _ in range(256)))
            assert len({info.id for info in infos}) == 256 and {info.state for info in infos} == {"running"}
            assert reads == [control_plane.IMAGE]
            missing = CreateSandboxRequest(image="no-such-image:1", cpu=0.25, memory_mb=256)
            failed = await asyncio.gather(*(service.create(missing) for _ in range(3)), return_exceptions=True)
            assert [type(error) for error in failed] == [corral.NotFound] * 3  # the shared read's error, to each
            assert reads == [control_plane.IMAGE, "no-such-image:1"]
    finally:
        store.close()


async def test_large_batch_on_simulated_nodes_postgres(tmp_path: Path, postgres_url: str) -> None:
    store = StateStore(postgres_url)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes")
        await _batch_on(store, tmp_path, nodes=16, count=3000, per_node=8)
    finally:
        store.close()


def _store_with_the_image(tmp_path: Path) -> tuple[StateStore, Catalogue]:
    """A SQLite store whose catalogue holds the bench's image (one layer), for a service over simulated nodes."""
    store = StateStore(f"sqlite:///{tmp_path / 'state.db'}")
    catalogue = Catalogue(store.engine, LayerStore(tmp_path / "layers"))
    layer_file = tmp_path / "layer"
    layer_file.write_bytes(b"x")
    record = catalogue.store.import_layer(layer_file, kind="base")
    catalogue.add_layer(record, parents=(), source={})
    catalogue.tag(control_plane.IMAGE, [record.digest])
    return store, catalogue


async def test_a_refusing_node_is_skipped_and_ended_sandboxes_give_back_room(tmp_path: Path) -> None:
    """n0 refuses everything (its memory reserve is more than any host has): every create lands on n1,
    each refusal is recorded, and killing sandboxes frees their room in the scheduler's view."""
    settings = Settings()
    store, catalogue = _store_with_the_image(tmp_path)
    edges: dict[str, Any] = {}
    service = SandboxService(store=store, catalogue=catalogue, edges=edges, default_runtime="crun",
                             ttl_check_interval_s=3600)  # fmt: skip
    for edge_id, reserve_mb in (("n0", 1 << 40), ("n1", 0)):
        capacity = NodeCapacity(8, 16384, 4, 1, settings.max_file_bytes, memory_reserve_mb=reserve_mb)
        edges[edge_id] = LocalEdge(edge_id, BackendRouter([SimulatedBackend()]), capacity, service)
    await service.start()
    try:
        infos = await asyncio.gather(*(service.create(_request("r")) for _ in range(20)))
        assert {info.edge_id for info in infos} == {"n1"}
        refused = [r for r in store.list(states=["ended"]) if r.end_reason == "refused"]
        assert refused and all("memory is short" in (r.status_message or "") for r in refused)
        assert service.scheduler.nodes["n1"].sandboxes == 20
        result = await service.edge(infos[0].id).exec(infos[0].id, ExecRequest(cmd="true"))
        assert (result.exit_code, result.stdout, result.stderr) == (0, "", "")
        for info in infos:
            await service.kill(info.id)
        node = service.scheduler.nodes["n1"]
        assert (node.sandboxes, node.cpu_committed, node.memory_committed_mb) == (0, 0, 0)
    finally:
        await service.close()
        store.close()


async def test_a_node_refuses_what_its_commitments_leave_no_room_for(tmp_path: Path) -> None:
    """The edge's own admission (the last check: a scheduler's view may be stale, another gateway may place on the
    same node) counts what it committed against capacity × overcommit and names both when it refuses."""
    settings = Settings()
    store, catalogue = _store_with_the_image(tmp_path)
    edge_capacity = NodeCapacity(4, 4096, 1, 1, settings.max_file_bytes, memory_reserve_mb=0)
    edges: dict[str, Any] = {}
    service = SandboxService(store=store, catalogue=catalogue, edges=edges, default_runtime="crun",
                             ttl_check_interval_s=3600)  # fmt: skip
    edge = edges["n0"] = LocalEdge("n0", BackendRouter([SimulatedBackend()]), edge_capacity, service)
    await service.start()
    try:
        request = CreateSandboxRequest(image=control_plane.IMAGE, cpu=3, memory_mb=1024)
        first = await service.create(request)
        spec = edge._sandboxes[first.id].spec  # what the gateway sent: sent again under another id
        with pytest.raises(corral.CapacityExhausted) as refused:
            await edge.create(dataclasses.replace(spec, sandbox_id=f"sb-n0-{uuid.uuid4().hex[:16]}"))
        assert "node n0 is full (1 sandboxes, 3/4 cpu, 1024/4096 MiB committed)" in refused.value.message
        small = dataclasses.replace(spec, sandbox_id=f"sb-n0-{uuid.uuid4().hex[:16]}", cpu=1, memory_mb=3072)
        await edge.create(small)  # fits exactly: 4/4 cpu, 4096/4096 MiB
        load = await edge.load()
        assert (load.sandboxes, load.cpu_committed, load.memory_committed_mb) == (2, 4, 4096)
    finally:
        await service.close()
        store.close()


async def test_the_network_audit_looks_at_each_sandbox_once_in_its_rounds_and_caps_its_listings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each housekeeping round reads the denied-packet counters of the next fifth of the sandboxes, never more
    than _NETWORK_AUDIT_LISTINGS networked ones: at thousands of networked sandboxes the listings (~0.6 ms of CPU
    each) would otherwise take cores."""
    monkeypatch.setattr(local, "_HOUSEKEEPING_INTERVAL_S", 3600.0)  # the rounds below are the test's own
    store, catalogue = _store_with_the_image(tmp_path)
    backend = SimulatedBackend()
    looked_at: list[str] = []
    network_status = backend.network_status

    failing: set[str] = set()

    async def counted(sandbox_id: str) -> tuple[str | None, DeniedCounts | None]:
        looked_at.append(sandbox_id)
        if sandbox_id in failing:
            raise corral.InternalError("nft in /proc/1/ns/net: cannot enter the namespace")
        return await network_status(sandbox_id)

    monkeypatch.setattr(backend, "network_status", counted)
    edges: dict[str, Any] = {}
    service = SandboxService(store=store, catalogue=catalogue, edges=edges, default_runtime="crun",
                             ttl_check_interval_s=3600)  # fmt: skip
    edge = edges["n0"] = LocalEdge("n0", BackendRouter([backend]), NodeCapacity(64, 65536, 4, 1, 1 << 20), service)
    await service.start()
    try:
        policy = NetworkPolicy(allow=[NetworkRule(cidr="192.0.2.0/24")])
        networked = [(await service.create(_request("n").model_copy(update={"network": policy}))).id
                     for _ in range(12)]  # fmt: skip
        loopback = [(await service.create(_request("l"))).id for _ in range(8)]
        failing.add(networked[0])  # its listing fails every time: the others are looked at all the same
        for _ in range(local._NETWORK_AUDIT_EVERY):
            await edge._audit_network()
        assert sorted(looked_at) == sorted(networked + loopback)  # each once in five rounds, 4 a round
        looked_at.clear()
        monkeypatch.setattr(local, "_NETWORK_AUDIT_LISTINGS", 2)
        for _ in range(6):
            before = len(looked_at)
            await edge._audit_network()
            assert sum(sandbox_id in networked for sandbox_id in looked_at[before:]) <= 2
        assert set(networked) <= set(looked_at)  # fewer a round, so each less often: none left out
    finally:
        await service.close()
        store.close()


def test_control_plane_bench_runs(tmp_path: Path) -> None:
    report = control_plane.run(nodes=[2, 4], creates=300, burst=500, live=1200, postgres=False, scratch=tmp_path)
    assert [row["nodes"] for row in report["scaling"]] == [2, 4]
    assert all(row["per_s"] > 0 and row["per_node_min"] > 0 for row in report["scaling"])
    assert report["burst"]["created"] == 500
    assert report["live"]["tracked"] == 1200 and report["live"]["list_job_size"] > 0
    assert report["live"]["ttl_check"]["p50"] > 0 and report["live"]["ttl_check_before"]["p50"] > 0
    floor = report["floor"]
    assert floor["created"] == 500 and floor["nodes"] == 4
    assert set(floor["per_sandbox_us"]) == {"place", "record", "insert", "edge_create", "mark_running", "info"}
    assert all(us > 0 for us in floor["per_sandbox_us"].values())
    assert floor["gateway_us"] < sum(floor["per_sandbox_us"].values())  # the edge's create is not the gateway's
    assert report["db_write"]["batched_ms"] > 0 and report["db_write"]["one_transaction_each_ms"] > 0
    assert report["db_write"]["step_on_long_ms"] > 0 and report["db_write"]["step_on_empty_ms"] > 0
    assert report["db_write"]["end_batched_ms"] > 0 and report["db_write"]["end_each_ms"] > 0
    assert (report["bulk_kill"]["count"], report["bulk_kill"]["ended"]) == (500, 500)
    assert {check["metric"] for check in report["checks"]} == {"sustained", "burst", "live"}


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_concurrent_kills_end_their_records_together_and_answer_from_them(
    tmp_path: Path, database: str, request: pytest.FixtureRequest
) -> None:
    """Kills that reach their record's end together share a transaction (StateStore.end_many), and each answers
    with the record that transaction gave back: its record is read once, before the destroy, not again after. A
    kill of a sandbox that had ended answers with its record as it was, and writes nothing."""
    url = f"sqlite:///{tmp_path / 'state.db'}" if database == "sqlite" else request.getfixturevalue("postgres_url")
    store = StateStore(url)
    try:
        if database != "sqlite":
            with store.engine.begin() as conn:
                conn.exec_driver_sql("DELETE FROM sandboxes")
        async with control_plane.simulated_cluster(4, store, tmp_path / "layers") as service:
            infos = await asyncio.gather(*(service.create(_request("kills")) for _ in range(40)))
            gone, *live = [info.id for info in infos]
            first_end = await service.kill(gone)
            end_many, get = store.end_many, store.get
            ends: list[list[str]] = []
            reads: list[str] = []

            def counted_end_many(batch: dict[str, Any]) -> Any:  # noqa: ANN401 - end_many's own result
                ends.append(sorted(batch))
                return end_many(batch)

            def counted_get(sandbox_id: str) -> Any:  # noqa: ANN401 - get's own result
                reads.append(sandbox_id)
                return get(sandbox_id)

            def counted_get_many(sandbox_ids: list[str]) -> Any:  # noqa: ANN401 - PostgreSQL's reads, grouped
                reads.extend(sandbox_ids)
                return get_many(sandbox_ids)

            get_many = store.get_many
            store.end_many = counted_end_many  # type: ignore[method-assign]
            store.get, store.get_many = counted_get, counted_get_many  # type: ignore[method-assign]
            killed = await asyncio.gather(*(service.kill(sandbox_id) for sandbox_id in [gone, *live]))
            store.end_many, store.get, store.get_many = end_many, get, get_many  # type: ignore[method-assign]

            assert sorted(sandbox_id for batch in ends for sandbox_id in batch) == sorted(live)
            assert len(ends) <= 3, f"39 kills ended in {len(ends)} transactions"  # one each before end_many
            assert sorted(reads) == sorted([gone, gone, *live])  # the ended one: read, and read for its answer
            assert killed[0] == first_end and first_end.state == "ended"
            for info in killed[1:]:
                assert (info.state, info.end_reason, info.ended_at is not None) == ("ended", "killed", True)
                assert info == await service.get(info.id)  # the record the end gave back is the stored one
            with store.engine.connect() as conn:
                ended_events = conn.execute(
                    select(events.c.sandbox_id, events.c.detail).where(
                        events.c.kind == "sandbox.ended", events.c.sandbox_id.in_([gone, *live])
                    )
                ).all()
            assert sorted(sandbox_id for sandbox_id, _ in ended_events) == sorted([gone, *live])
            assert {(detail["state"], detail["reason"]) for _, detail in ended_events} == {("ended", "killed")}
    finally:
        store.close()


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_end_many_ends_each_active_sandbox_once_with_its_own_reason(
    tmp_path: Path, database: str, request: pytest.FixtureRequest
) -> None:
    """``end_many`` ends the active sandboxes it is given, each with its own state, reason and message, and gives
    their records back as ended; an ended or unknown id is left out and gets no event."""
    url = f"sqlite:///{tmp_path / 'state.db'}" if database == "sqlite" else request.getfixturevalue("postgres_url")
    store = StateStore(url)
    try:
        shape = _request("end-many").model_copy(update={"cwd": "/", "user": "root"})
        record = SandboxRecord.of_create(shape, sandbox_id="sb-e0-endmany-0", edge_id="e0", image="busybox",
                                         runtime="crun", layers=[], now=time.time())  # fmt: skip
        ids = [f"sb-e0-endmany-{uuid.uuid4().hex[:8]}-{k}" for k in range(4)]
        store.insert_many([dataclasses.replace(record, id=sandbox_id) for sandbox_id in ids])
        assert store.mark_running_many(dict.fromkeys(ids[:3])) == set(ids[:3])  # the fourth stays creating
        assert store.end(ids[2], SandboxState.ENDED, "killed")
        ended = store.end_many({
            ids[0]: (SandboxState.ENDED, "killed", None), ids[1]: (SandboxState.LOST, "lost", "its node went"),
            ids[2]: (SandboxState.ENDED, "shutdown", None), ids[3]: (SandboxState.ENDED, "killed", None),
            "sb-e0-endmany-absent": (SandboxState.ENDED, "killed", None),
        })  # fmt: skip
        assert sorted(ended) == sorted([ids[0], ids[1], ids[3]])
        assert [(ended[i].state, ended[i].end_reason, ended[i].status_message) for i in (ids[0], ids[1], ids[3])] == [
            ("ended", "killed", None), ("lost", "lost", "its node went"), ("ended", "killed", None),
        ]  # fmt: skip
        for sandbox_id, got in ended.items():
            assert got == store.get(sandbox_id) and got.ended_at is not None
        assert store.get(ids[2]).end_reason == "killed"  # type: ignore[union-attr]  # not ended again
        with store.engine.connect() as conn:
            named = [*ids, "sb-e0-endmany-absent"]
            rows = conn.execute(
                select(events.c.sandbox_id).where(events.c.kind == "sandbox.ended", events.c.sandbox_id.in_(named))
            ).all()
        assert sorted(row[0] for row in rows) == sorted(ids)  # one each: ids[2]'s from its first end
    finally:
        store.close()


async def test_kills_whose_end_meets_a_postgres_restart_wait_it_out(
    tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kills whose records' end meets a PostgreSQL restart wait it out (their shared write is tried again every half
    second) and answer once the database is back: each with its record ended, none with an error, none left live in
    the store. Before kills shared a write, such a kill failed at once, its sandbox destroyed under a live record."""
    store = StateStore(postgres_url)
    scripts = Path(__file__).resolve().parents[2] / "scripts" / "postgres.sh"
    directory = postgres_url.rsplit("host=", 1)[1]
    destroyed: list[str] = []
    database_down = asyncio.Event()
    destroy = SimulatedBackend.destroy

    async def destroy_then_meet_the_outage(self: SimulatedBackend, sandbox_id: str) -> None:
        await destroy(self, sandbox_id)
        destroyed.append(sandbox_id)
        await database_down.wait()  # the kill goes on to its record's end with the database stopped

    async def postgres(action: str) -> None:
        command = ["bash", str(scripts), action, directory]
        await asyncio.to_thread(subprocess.run, command, check=True, capture_output=True, timeout=60)

    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM sandboxes")
        async with control_plane.simulated_cluster(2, store, tmp_path / "layers") as service:
            ids = [info.id for info in await asyncio.gather(*(service.create(_request("outage")) for _ in range(8)))]
            monkeypatch.setattr(SimulatedBackend, "destroy", destroy_then_meet_the_outage)
            kills = [asyncio.ensure_future(service.kill(sandbox_id)) for sandbox_id in ids]
            while len(destroyed) < len(ids):
                await asyncio.sleep(0.01)
            await postgres("stop")
            try:
                database_down.set()
                await asyncio.sleep(1.5)  # three tries at least
                assert not any(kill.done() for kill in kills), [kill.exception() for kill in kills if kill.done()]
            finally:
                await postgres("start")
            answers = await asyncio.wait_for(asyncio.gather(*kills), 30)
            assert {(info.state, info.end_reason) for info in answers} == {("ended", "killed")}
            assert {
                record.id: record.state for record in store.list(states=None, labels={"job": "outage"})
            } == dict.fromkeys(ids, "ended")
    finally:
        store.close()


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_reads_that_arrive_together_share_one_statement_on_postgres(
    tmp_path: Path, database: str, request: pytest.FixtureRequest
) -> None:
    """On PostgreSQL, gets of records that arrive while one runs (a bulk kill's, many clients' GETs) go next as one
    statement on the database thread (``get_many``), each answered with its own record, an unknown id with NotFound,
    a failure of that statement with its error; the first runs alone, as a lone get does. On SQLite each get runs
    inline, alone, as before."""
    url = f"sqlite:///{tmp_path / 'state.db'}" if database == "sqlite" else request.getfixturevalue("postgres_url")
    store = StateStore(url)
    try:
        async with control_plane.simulated_cluster(2, store, tmp_path / "layers") as service:
            ids = [info.id for info in await asyncio.gather(*(service.create(_request("reads")) for _ in range(30)))]
            get, get_many = store.get, store.get_many
            alone: list[str] = []
            statements: list[list[str]] = []

            def counted_get(sandbox_id: str) -> Any:  # noqa: ANN401 - get's own result
                alone.append(sandbox_id)
                return get(sandbox_id)

            def counted(sandbox_ids: list[str]) -> Any:  # noqa: ANN401 - get_many's own result
                statements.append(sorted(sandbox_ids))
                return get_many(sandbox_ids)

            store.get, store.get_many = counted_get, counted  # type: ignore[method-assign]
            asked = [*ids, ids[0], "sb-n0-0000000000000000"]  # one id twice, one that never existed
            answers = await asyncio.gather(*(service.get(sandbox_id) for sandbox_id in asked), return_exceptions=True)
            assert [info.id for info in answers[:-1]] == asked[:-1]  # type: ignore[union-attr]
            assert {info.state for info in answers[:-1]} == {"running"}  # type: ignore[union-attr]
            assert isinstance(answers[-1], corral.NotFound)
            if database == "sqlite":
                assert statements == [] and alone == asked
            else:
                assert alone == asked[:1] and statements == [sorted(set(asked[1:]))], (alone, statements)

                def failing(sandbox_ids: Any) -> Any:  # noqa: ANN401 - a lone id or a group's
                    raise OSError("the database went away")

                store.get, store.get_many = failing, failing  # type: ignore[method-assign]
                failed = await asyncio.gather(
                    *(service.get(sandbox_id) for sandbox_id in ids[:3]), return_exceptions=True
                )
                assert [str(error) for error in failed] == ["the database went away"] * 3
            store.get, store.get_many = get, get_many  # type: ignore[method-assign]
    finally:
        store.close()
