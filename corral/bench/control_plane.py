"""`corral bench control-plane`: the control plane alone, at cluster scale, against simulated nodes.

The real ``SandboxService`` (validation, image resolution through the real
catalogue, the ``Scheduler``, records in the real state store, SQLite or
PostgreSQL) drives N real ``LocalEdge``s (admission with the overcommit
factors, commitments, housekeeping) whose backend is ``SimulatedBackend``:
it isolates nothing and only keeps state, so what is measured is everything
but starting containers. Each simulated node has a realistic capacity (96
cores, 768 GiB) with the configured overcommit. Measured:

1. sustained creations per second with 10, 40 and 160 nodes: many concurrent
   single creates (rollout workers calling ``create``), and the spread of
   sandboxes over the nodes;
2. a 32,000 burst as one batch (``create_many``, the path behind
   ``POST /v1/sandboxes/batch``): time until every sandbox is placed and running;
   then the same burst through the real HTTP app (uvicorn in this process) and
   the async SDK's ``create_many``, until the client holds every handle;
3. the burst's floor: its own pieces (placement, record, insert, the edge's
   create, the running mark, the client's info) batched with no task, future
   or queue per sandbox, timed apiece: what a fully batched path would cost at
   best, and the rate the gateway's pieces alone allow (the edge's create runs
   on each node in a real cluster);
4. 400,000 live sandboxes tracked: the cluster filled with batches (one job
   label each), then ``get`` of random ids and ``list`` of one job;
5. the database write per create, as a same-run baseline: one transaction per
   record (what every create paid before) against the batched writes; and the
   same for the trajectory steps every exec logs;
6. on PostgreSQL, a read of one record on the state store's engine (a pooled
   connection pinged only when it sat idle a second: ``PING_IDLE_S``) against
   one that pings every checkout (SQLAlchemy's ``pool_pre_ping``).

Everything runs in this one process on this machine's cores, so the gateway,
160 edges and the database share them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import uvicorn
import uvloop
from rich.console import Console
from rich.table import Table
from sqlalchemy import and_, create_engine, or_, select
from sqlalchemy.engine import Engine

from corral.api.models import CreateSandboxRequest, ExecRequest, SandboxState
from corral.backends.router import BackendRouter
from corral.bench.containers import percentile
from corral.bench.harness import emit, throwaway_postgres
from corral.config import Settings
from corral.edge.host_readings import HostReadings, read_host
from corral.edge.local import LocalEdge, NodeCapacity
from corral.edge.protocol import new_sandbox_id
from corral.embedded import free_port
from corral.gateway.app import create_app
from corral.gateway.auth import JobTokens
from corral.gateway.fncall import FnCallService
from corral.gateway.grading import Grader
from corral.gateway.images import ImageService
from corral.gateway.operations import Operations
from corral.gateway.service import SandboxService
from corral.gateway.services import Services
from corral.gateway.trajectory import Trajectories
from corral.images.builders import LayerBuilder
from corral.images.catalogue import Catalogue
from corral.images.store import LayerStore
from corral.sdk import AsyncClient
from corral.server import tune_gc
from corral.state.db import StateStore, sandboxes
from corral.state.records import SandboxRecord
from corral.testing.simulated import SimulatedBackend
from corral.trajectory import TrajectoryLog

__all__ = ["run_control_plane_benchmark", "simulated_cluster"]

NODE_CPU, NODE_MEMORY_MB = 96.0, 768 * 1024
SANDBOX_CPU, SANDBOX_MEMORY_MB = 0.25, 256  # a small RL rollout sandbox
IMAGE = "sim-base"
WORKERS = 256  # concurrent single creates in the sustained phase
TARGET_RATE, TARGET_BURST_S, TARGET_LIVE = 5_000.0, 5.0, 400_000
NEXT_RATE = 20_000.0  # issue 22's sustained creations per second for one gateway
LIVE_BATCH = 4_000  # sandboxes per job while filling to the live count
LOOKUPS = 200
LONG_TRAJECTORY = 20_000  # steps a long-lived sandbox's log holds when one more is appended (vs an empty log)
SHARED_READING_MAX_AGE_S = 0.5


@contextlib.asynccontextmanager
async def simulated_cluster(
    nodes: int, store: StateStore, layer_dir: Path, *, labels: Sequence[dict[str, str]] = ()
) -> AsyncIterator[SandboxService]:
    """A started SandboxService over ``nodes`` LocalEdges n0, n1, ... with the simulated backend (standing in
    for the container backend, under its name), a real catalogue holding one small image, and the given store;
    ``labels[i]``, if given, are node i's labels."""
    settings = Settings()
    layer_dir.mkdir(parents=True, exist_ok=True)
    catalogue = Catalogue(store.engine, LayerStore(layer_dir))
    layer_file = layer_dir / "sim-base.layer"
    layer_file.write_bytes(b"simulated base layer: never mounted\n")
    record = catalogue.store.import_layer(layer_file, kind="base")
    catalogue.add_layer(record, parents=(), source={"builder": "bench-control-plane"})
    catalogue.tag(IMAGE, [record.digest])
    capacity = NodeCapacity(
        NODE_CPU, NODE_MEMORY_MB, settings.cpu_overcommit, settings.memory_overcommit, settings.max_file_bytes,
        memory_reserve_mb=settings.memory_reserve_mb, memory_full_pressure_pct=settings.memory_full_pressure_pct,
    )  # fmt: skip
    edges: dict[str, Any] = {}
    host_reader = _shared_host_reader()
    service = SandboxService(store=store, catalogue=catalogue, edges=edges, default_runtime=settings.runtime,
                             ttl_check_interval_s=3600)  # fmt: skip
    for index in range(nodes):
        edge_id = f"n{index}"
        backend = BackendRouter([SimulatedBackend()])
        node = dataclasses.replace(capacity, labels=labels[index]) if index < len(labels) else capacity
        edges[edge_id] = LocalEdge(edge_id, backend, node, service, host_reader=host_reader)
    await service.start()
    try:
        yield service
    finally:
        await service.close()


def _shared_host_reader() -> Callable[[], HostReadings]:
    """The simulated nodes all live on this host: one reading of /proc serves them all for a while (each
    real node reads its own; 160 edges each reading /proc here would measure this host's procfs)."""
    cached: list[tuple[float, HostReadings]] = []

    def reading() -> HostReadings:
        now = time.monotonic()
        if not cached or now - cached[0][0] > SHARED_READING_MAX_AGE_S:
            cached[:] = [(now, read_host())]
        return cached[0][1]

    return reading


def _request(job: str) -> CreateSandboxRequest:
    return CreateSandboxRequest(image=IMAGE, cpu=SANDBOX_CPU, memory_mb=SANDBOX_MEMORY_MB, ttl_s=None,
                                labels={"job": job})  # fmt: skip


def _ms(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p95 in ms, interpolated between ranks (the p95 of a few samples was their minimum before)."""
    return {"p50": percentile(samples, 50) * 1000, "p95": percentile(samples, 95) * 1000}


async def _sustained(service: SandboxService, creates: int) -> dict[str, Any]:
    remaining = iter(range(creates))

    async def worker() -> None:
        for _ in remaining:
            await service.create(_request("sustained"))

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(WORKERS):
            group.create_task(worker())
    elapsed_s = time.perf_counter() - started
    per_node = [node.sandboxes for node in service.scheduler.nodes.values()]
    return {"creates": creates, "elapsed_s": elapsed_s, "per_s": creates / elapsed_s,
            "per_node_min": min(per_node), "per_node_max": max(per_node)}  # fmt: skip


async def _batch(service: SandboxService, count: int, job: str) -> tuple[float, list[str]]:
    """Seconds until the batch is done, and the ids it created."""
    started = time.perf_counter()
    created = []
    async for event in service.create_many(_request(job), count):
        if event.sandbox is not None:
            created.append(event.sandbox.id)
    return time.perf_counter() - started, created


FLOOR_CHUNK = 512  # sandboxes per step of the floor's batches (the batch's concurrency)
GATEWAY_PIECES = ("place", "record", "insert", "mark_running", "info")  # the edge's create runs on its node


async def _pieces_floor(service: SandboxService, count: int) -> dict[str, Any]:
    """The burst's own pieces with nothing around them: chunks of ``FLOOR_CHUNK`` placed, given their record and
    spec, inserted in one transaction, created on their edges one after another, marked running in one
    transaction and turned into the infos a client gets; no task, future or queue per sandbox. What a fully
    batched create path would cost at best: microseconds per sandbox for each piece, and the rate the gateway's
    own pieces (all but the edge's create, which runs on each node) allow."""
    request, image_name, layers = await service._prepare(_request("floor"))  # noqa: SLF001 - as a create does
    db, store = service._db, service._store  # noqa: SLF001 - the writes a create makes, called directly
    digests = [layer.digest for layer in layers]
    runtime = request.runtime or service.default_runtime
    spent = dict.fromkeys(("place", "record", "insert", "edge_create", "mark_running", "info"), 0.0)
    created = 0
    started = time.perf_counter()
    for offset in range(0, count, FLOOR_CHUNK):
        placed = []
        for _ in range(min(FLOOR_CHUNK, count - offset)):
            begun = time.perf_counter()
            edge_id = service.scheduler.place(
                cpu=request.cpu, memory_mb=request.memory_mb, backend=request.backend, runtime=runtime,
                layers=digests, selector=request.node_selector,
            )  # fmt: skip
            chosen = time.perf_counter()
            spec, record = service.spec_and_record(request, image_name, layers, new_sandbox_id(edge_id))
            service.scheduler.reserve(spec.sandbox_id, edge_id, cpu=spec.cpu, memory_mb=spec.memory_mb, layers=digests)
            spent["place"] += chosen - begun
            spent["record"] += time.perf_counter() - chosen
            placed.append((spec, record))
        begun = time.perf_counter()
        await db.run(store.insert_many, [record for _, record in placed])
        inserted = time.perf_counter()
        notes = {}
        for spec, _ in placed:
            notes[spec.sandbox_id] = await service.edge(spec.sandbox_id).create(spec)
            service.scheduler.started(spec.sandbox_id)
        edges_done = time.perf_counter()
        marked = await db.run(store.mark_running_many, notes)
        marked_at = time.perf_counter()
        infos = [record.to_info(state=SandboxState.RUNNING.value, status_message=notes[record.id])
                 for _, record in placed if record.id in marked]  # fmt: skip
        created += len(infos)
        spent["insert"] += inserted - begun
        spent["edge_create"] += edges_done - inserted
        spent["mark_running"] += marked_at - edges_done
        spent["info"] += time.perf_counter() - marked_at
    elapsed_s = time.perf_counter() - started
    per_sandbox_us = {piece: seconds / count * 1e6 for piece, seconds in spent.items()}
    gateway_us = sum(per_sandbox_us[piece] for piece in GATEWAY_PIECES)
    return {"count": count, "created": created, "elapsed_s": elapsed_s, "per_sandbox_us": per_sandbox_us,
            "gateway_us": gateway_us, "gateway_cap_per_s": 1e6 / gateway_us}  # fmt: skip


@contextlib.asynccontextmanager
async def simulated_services(nodes: int, store: StateStore, scratch: Path, api_key: str) -> AsyncIterator[Services]:
    """What the HTTP app serves, over ``simulated_cluster``: the real services (operations, trajectories, job
    tokens, images) on ``nodes`` simulated nodes, for ``create_app``."""
    async with simulated_cluster(nodes, store, scratch / "layers") as service:
        catalogue = service._catalogue  # noqa: SLF001 - the same catalogue the cluster resolves images in
        images = ImageService(catalogue, LayerBuilder(catalogue, scratch / "build", 1 << 20), service)
        steps = TrajectoryLog(store.engine)
        operations = Operations(steps, service, images, max_logged_file_bytes=0)
        yield Services(
            sandboxes=service, images=images, operations=operations,
            trajectories=Trajectories(steps, service, operations.settled),
            tokens=JobTokens(store.engine, api_key), grader=Grader(images, service),
            fncall=FnCallService(service, warm_budget=0, min_warm=0, max_per_pool=0),
        )  # fmt: skip


async def _http_burst(nodes: int, store: StateStore, scratch: Path, count: int) -> dict[str, Any]:
    """The burst through the real HTTP app (FastAPI on uvicorn, in this process) and the async SDK's
    ``create_many``: seconds until the last sandbox's line reached the client."""
    api_key = "ck_bench"
    port = free_port()
    app = create_app(lambda: simulated_services(nodes, store, scratch, api_key), 1 << 20, scratch / "uploads")
    keepalive_s = Settings.model_fields["http_keepalive_s"].default
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, loop="none", log_level="warning", timeout_keep_alive=keepalive_s
    )
    server = uvicorn.Server(config)
    async with asyncio.TaskGroup() as group:
        serving = group.create_task(server.serve())
        while not server.started:
            if serving.done():
                raise RuntimeError("the bench's HTTP server did not start")
            await asyncio.sleep(0.05)
        try:
            async with AsyncClient(f"http://127.0.0.1:{port}", api_key) as client:
                started = time.perf_counter()
                created = 0
                async for _ in client.create_many(count, IMAGE, cpu=SANDBOX_CPU, memory_mb=SANDBOX_MEMORY_MB,
                                                  ttl_s=None, labels={"job": "http-burst"}):  # fmt: skip
                    created += 1
                elapsed_s = time.perf_counter() - started
        finally:
            server.should_exit = True
    return {"nodes": nodes, "count": count, "created": created, "elapsed_s": elapsed_s}


def _db_write_baseline(database_url: str, records: int) -> dict[str, float]:
    """Seconds per record: one transaction each (insert, then mark running) vs the batched writes."""
    store = StateStore(database_url)
    try:
        now = time.time()

        def record(index: int) -> SandboxRecord:
            request = CreateSandboxRequest(image=IMAGE, cpu=SANDBOX_CPU, memory_mb=SANDBOX_MEMORY_MB, user="root",
                                           cwd="/", labels={"job": "baseline", "i": str(index)})  # fmt: skip
            sandbox_id = f"sb-base-{uuid.uuid4().hex[:16]}"
            return SandboxRecord.of_create(request, sandbox_id=sandbox_id, edge_id="base", image=IMAGE,
                                           runtime="crun", layers=["sha256:" + "0" * 64], now=now)  # fmt: skip

        single = [record(i) for i in range(records)]
        started = time.perf_counter()
        for item in single:
            store.insert(item)
            store.mark_running(item.id)
        one_by_one = (time.perf_counter() - started) / records
        batched_records = [record(i) for i in range(records)]
        started = time.perf_counter()
        for start in range(0, records, 256):
            chunk = batched_records[start : start + 256]
            store.insert_many(chunk)
            store.mark_running_many({item.id: None for item in chunk})
        batched = (time.perf_counter() - started) / records
        ends = _end_writes(store, [item.id for item in single], [item.id for item in batched_records])
        steps = _trajectory_appends(store, records)
        return {"one_transaction_each_ms": one_by_one * 1000, "batched_ms": batched * 1000, **ends, **steps}
    finally:
        store.close()


def _end_writes(store: StateStore, one_by_one: list[str], batched: list[str]) -> dict[str, float]:
    """Milliseconds per kill's record writes: its end in a transaction of its own and its record read again for
    the answer (what a kill did before 2026-12-07) vs the ends of concurrent kills in one ``end_many`` per 256,
    each answered from the records it gives back."""
    started = time.perf_counter()
    for sandbox_id in one_by_one:
        store.end(sandbox_id, SandboxState.ENDED, "killed")
        store.get(sandbox_id)
    each = (time.perf_counter() - started) / len(one_by_one)
    started = time.perf_counter()
    for start in range(0, len(batched), 256):
        store.end_many(dict.fromkeys(batched[start : start + 256], (SandboxState.ENDED, "killed", None)))
    together = (time.perf_counter() - started) / len(batched)
    return {"end_each_ms": each * 1000, "end_batched_ms": together * 1000}


TTL_CHECKS = 20


def _ttl_checks(store: StateStore) -> dict[str, dict[str, float]]:
    """The TTL check (what the gateway runs every second) with every record live, in turns with the same question
    asked as it was before 2026-12-07: no partial index, the planner left to choose (SQLite took the state index)."""
    counting = or_(
        sandboxes.c.state.in_([SandboxState.CREATING.value, SandboxState.RUNNING.value]),
        and_(sandboxes.c.state == SandboxState.PAUSED.value, sandboxes.c.ttl_counts_paused.is_(True)),
    )
    checks: list[float] = []
    before: list[float] = []
    for _ in range(TTL_CHECKS):
        now = time.time()
        started = time.perf_counter()
        store.expired(now)
        checks.append(time.perf_counter() - started)
        with store.engine.connect() as conn:
            started = time.perf_counter()
            conn.execute(select(sandboxes.c.id).where(counting, sandboxes.c.expires_at <= now)).all()
            before.append(time.perf_counter() - started)
    return {"ttl_check": _ms(checks), "ttl_check_before": _ms(before)}


async def _bulk_kill(service: SandboxService, ids: list[str]) -> dict[str, Any]:
    """Every one of ``ids`` killed through the service, ``WORKERS`` at once (a job's sandboxes killed together)."""
    remaining = iter(ids)
    ended = 0

    async def worker() -> None:
        nonlocal ended
        for sandbox_id in remaining:
            info = await service.kill(sandbox_id)  # awaited first: ``ended`` is read after it, not before
            ended += info.state == SandboxState.ENDED

    started = time.perf_counter()
    async with asyncio.TaskGroup() as group:
        for _ in range(WORKERS):
            group.create_task(worker())
    elapsed_s = time.perf_counter() - started
    return {"count": len(ids), "ended": ended, "elapsed_s": elapsed_s, "per_s": len(ids) / elapsed_s}


def _trajectory_appends(store: StateStore, steps: int) -> dict[str, float]:
    """Milliseconds per trajectory step without a client id (what every exec logs): one transaction each (a
    flush that found one step pending) vs the batch a flush writes under load (50 steps over 10 sandboxes); and
    one step onto a log of ``LONG_TRAJECTORY`` steps vs onto an empty one (medians), which should cost the same:
    the append's seq lookup once read every step logged."""
    log = TrajectoryLog(store.engine)
    request = ExecRequest(cmd="true").model_dump(mode="json")
    result = {"command_id": "c", "exit_code": 0, "stdout": "", "stderr": "", "duration_ms": 1.0}
    entries = [(f"sb-log-{k % 10}", f"auto-{uuid.uuid4().hex[:16]}", "exec", request, result) for k in range(steps)]
    started = time.perf_counter()
    for entry in entries[: steps // 2]:
        log.append_many([entry])
    one_each = (time.perf_counter() - started) / (steps // 2)
    rest = entries[steps // 2 :]
    started = time.perf_counter()
    for start in range(0, len(rest), 50):
        log.append_many(rest[start : start + 50])
    in_batches = (time.perf_counter() - started) / len(rest)
    filler = [("sb-log-long", f"fill-{k}", "exec", request, result) for k in range(LONG_TRAJECTORY)]
    log.append_many(filler)
    appends: dict[str, list[float]] = {"long": [], "empty": []}
    for k in range(LOOKUPS):  # alternating: one step onto the long log, one onto a log of its own
        for which, sandbox_id in (("long", "sb-log-long"), ("empty", f"sb-log-new-{k}")):
            started = time.perf_counter()
            log.append_many([(sandbox_id, f"next-{k}", "exec", request, result)])
            appends[which].append(time.perf_counter() - started)
    return {
        "step_each_ms": one_each * 1000,
        "step_batched_ms": in_batches * 1000,
        "step_on_long_ms": statistics.median(appends["long"]) * 1000,
        "step_on_empty_ms": statistics.median(appends["empty"]) * 1000,
    }


def _pre_ping_cost(database_url: str, reads: int) -> dict[str, float]:
    """PostgreSQL: a read of one record on the state store's engine (a connection is tested as it is checked out
    only when it sat idle ``PING_IDLE_S``, so one that a database restart broke is replaced, not handed to a
    request) against the same read on an engine that tests every checkout (``pool_pre_ping``, what the store
    did before); alternating blocks of reads, median ms per read."""
    every_checkout = create_engine(database_url, pool_pre_ping=True)
    store = StateStore(database_url)  # its tables, and its engine
    try:
        query = select(sandboxes.c.id).where(sandboxes.c.id == "sb-none")
        times: dict[Engine, list[float]] = {every_checkout: [], store.engine: []}
        for _ in range(reads // 100):
            for engine in (every_checkout, store.engine):
                for _ in range(100):
                    begun = time.perf_counter()
                    with engine.connect() as conn:
                        conn.execute(query).first()
                    times[engine].append(time.perf_counter() - begun)
        return {"pre_ping_ms": statistics.median(times[every_checkout]) * 1000,
                "store_ms": statistics.median(times[store.engine]) * 1000}  # fmt: skip
    finally:
        store.close()
        every_checkout.dispose()


@contextlib.contextmanager
def _store(database_url: str) -> Any:  # noqa: ANN401
    """The state store for one phase, empty (a shared PostgreSQL keeps its rows between phases)."""
    store = StateStore(database_url)
    with store.engine.begin() as conn:
        conn.exec_driver_sql("DELETE FROM sandboxes")
    try:
        yield store
    finally:
        store.close()


async def _measure(nodes: list[int], creates: int, burst: int, live: int, database_url: str, scratch: Path,
                   log: Any, http: bool) -> dict[str, Any]:  # fmt: skip
    url = database_url or f"sqlite:///{scratch / 'state.db'}"
    report: dict[str, Any] = {"scaling": []}
    for count in nodes:
        with _store(url) as store:
            async with simulated_cluster(count, store, scratch / "layers") as service:
                log(f"sustained: {creates:,} creates on {count} nodes")
                report["scaling"].append({"nodes": count, **await _sustained(service, creates)})
    biggest = max(nodes)
    with _store(url) as store:
        async with simulated_cluster(biggest, store, scratch / "layers") as service:
            log(f"burst: {burst:,} sandboxes as one batch on {biggest} nodes")
            burst_s, ids = await _batch(service, burst, "burst")
            report["burst"] = {"nodes": biggest, "count": burst, "created": len(ids), "elapsed_s": burst_s}
            started, jobs = time.perf_counter(), 0
            while len(ids) < live:
                jobs += 1
                if jobs % 10 == 1:
                    log(f"filling: {len(ids):,} of {live:,} live")
                _, created = await _batch(service, min(LIVE_BATCH, live - len(ids)), f"job-{jobs}")
                ids += created
            fill_s = time.perf_counter() - started
            gets = []
            for sandbox_id in random.Random(1).sample(ids, min(LOOKUPS, len(ids))):
                begun = time.perf_counter()
                await service.get(sandbox_id)
                gets.append(time.perf_counter() - begun)
            lists, listed = [], []
            for job in random.Random(2).sample(range(1, jobs + 1), min(20, jobs)):
                begun = time.perf_counter()
                listed = await service.list(states=None, labels={"job": f"job-{job}"})
                lists.append(time.perf_counter() - begun)
            report["live"] = {
                "nodes": biggest, "tracked": len(ids), "fill_per_s": (len(ids) - burst) / fill_s if jobs else 0.0,
                "get": _ms(gets), "list_job": _ms(lists or [0.0]), "list_job_size": len(listed),
                **_ttl_checks(store),
            }  # fmt: skip
            log(f"bulk kill: the burst's {burst:,} sandboxes, {WORKERS} at once")
            report["bulk_kill"] = {"nodes": biggest, **await _bulk_kill(service, ids[:burst])}
    with _store(url) as store:
        async with simulated_cluster(biggest, store, scratch / "layers") as service:
            log(f"floor: the burst's pieces for {burst:,} sandboxes, batched, on {biggest} nodes")
            report["floor"] = {"nodes": biggest, **await _pieces_floor(service, burst)}
    if http:
        with _store(url) as store:
            log(f"burst over HTTP: {burst:,} sandboxes through POST /v1/sandboxes/batch on {biggest} nodes")
            report["burst_http"] = await _http_burst(biggest, store, scratch, burst)
    report["db_write"] = _db_write_baseline(database_url or f"sqlite:///{scratch / 'baseline.db'}", 2_000)
    if database_url:
        report["pre_ping"] = _pre_ping_cost(database_url, 2_000)
    return report


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    biggest = max(report["scaling"], key=lambda row: row["nodes"])
    burst = report["burst"]
    return [
        {"metric": "sustained", "target": f"≥ {TARGET_RATE:,.0f}/s ({biggest['nodes']} nodes)",
         "ok": biggest["per_s"] >= TARGET_RATE},
        {"metric": "burst", "target": f"≤ {TARGET_BURST_S:g} s",
         "ok": burst["elapsed_s"] <= TARGET_BURST_S and burst["created"] == burst["count"]},
        {"metric": "live", "target": f"{TARGET_LIVE:,} tracked", "ok": report["live"]["tracked"] >= TARGET_LIVE},
    ]  # fmt: skip


def run(*, nodes: list[int], creates: int, burst: int, live: int, postgres: bool, scratch: Path, http: bool = True,
        log: Any = lambda message: None) -> dict[str, Any]:  # fmt: skip
    """The measurements as a report (also what the test runs, with small sizes)."""
    tune_gc()  # as the server does
    with contextlib.ExitStack() as stack:
        database_url = stack.enter_context(throwaway_postgres()) if postgres else ""
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the gateway's loop (corral/server.py)
            report = runner.run(_measure(nodes, creates, burst, live, database_url, scratch, log, http))
    report["database"] = "postgresql" if postgres else "sqlite"
    report["checks"] = checks(report)
    return report


def _table(report: dict[str, Any]) -> Table:
    verdicts = {check["metric"]: check for check in report["checks"]}

    def verdict(metric: str) -> str:
        return "[green]ok[/green]" if verdicts[metric]["ok"] else "[red]missed[/red]"

    table = Table("what", "measured", "target", "verdict",
                  title=f"control plane on simulated nodes ({report['database']})",
                  caption="one process on this machine: the service, scheduler, every edge, the database")  # fmt: skip
    for row in report["scaling"]:
        is_biggest = row["nodes"] == max(r["nodes"] for r in report["scaling"])
        table.add_row(f"sustained creates, {row['nodes']} nodes",
                      f"{row['per_s']:,.0f}/s ({row['creates']:,} in {row['elapsed_s']:.1f} s; "
                      f"{row['per_node_min']}–{row['per_node_max']} per node)",
                      verdicts["sustained"]["target"] if is_biggest else "-",
                      verdict("sustained") if is_biggest else "-")  # fmt: skip
    burst = report["burst"]
    table.add_row(f"burst of {burst['count']:,} as one batch, {burst['nodes']} nodes",
                  f"{burst['elapsed_s']:.2f} s ({burst['created']:,} placed and running)",
                  verdicts["burst"]["target"], verdict("burst"))  # fmt: skip
    if "burst_http" in report:
        over_http = report["burst_http"]
        table.add_row(f"the same burst through the HTTP API and SDK create_many, {over_http['nodes']} nodes",
                      f"{over_http['elapsed_s']:.2f} s ({over_http['created']:,} handed to the client)",
                      "-", "-")  # fmt: skip
    floor = report["floor"]
    pieces = ", ".join(f"{piece.replace('_', ' ')} {us:.1f}" for piece, us in floor["per_sandbox_us"].items())
    table.add_row(f"the burst's pieces batched, no task per sandbox (floor), {floor['nodes']} nodes",
                  f"{floor['elapsed_s']:.2f} s; µs per sandbox: {pieces}", "-", "-")  # fmt: skip
    room = "[green]room[/green]" if floor["gateway_cap_per_s"] >= NEXT_RATE else "[red]caps below[/red]"
    table.add_row("what the gateway's own pieces allow (all but the edge's create, which runs on its node)",
                  f"{floor['gateway_cap_per_s']:,.0f}/s ({floor['gateway_us']:.1f} µs a create)",
                  f"≥ {NEXT_RATE:,.0f}/s (issue 22)",
                  room)  # fmt: skip
    live = report["live"]
    table.add_row("live sandboxes tracked", f"{live['tracked']:,} (filled at {live['fill_per_s']:,.0f}/s)",
                  verdicts["live"]["target"], verdict("live"))  # fmt: skip
    get = live["get"]
    table.add_row(f"get at {live['tracked']:,} live", f"p50 {get['p50']:.2f} ms, p95 {get['p95']:.2f} ms", "-", "-")
    table.add_row(f"the TTL check at {live['tracked']:,} live (baseline: the same question as before, unindexed)",
                  f"p50 {live['ttl_check']['p50']:.2f} ms vs {live['ttl_check_before']['p50']:.2f} ms",
                  "-", "-")  # fmt: skip
    table.add_row(f"list one job ({live['list_job_size']:,}) at {live['tracked']:,} live",
                  f"p50 {live['list_job']['p50']:.1f} ms, p95 {live['list_job']['p95']:.1f} ms", "-", "-")  # fmt: skip
    db = report["db_write"]
    table.add_row("record writes per create (baseline: a transaction each)",
                  f"batched {db['batched_ms']:.3f} ms vs {db['one_transaction_each_ms']:.3f} ms", "-", "-")  # fmt: skip
    kill = report["bulk_kill"]
    table.add_row(f"bulk kill of the burst's {kill['count']:,}, {WORKERS} at once, {kill['nodes']} nodes",
                  f"{kill['per_s']:,.0f}/s ({kill['ended']:,} ended in {kill['elapsed_s']:.2f} s)",
                  "-", "-")  # fmt: skip
    table.add_row("a kill's record writes, kills ending together (baseline: an end's transaction and a read each)",
                  f"batched {db['end_batched_ms']:.3f} ms vs {db['end_each_ms']:.3f} ms", "-", "-")  # fmt: skip
    table.add_row("trajectory steps without a client id (baseline: a transaction each)",
                  f"batched {db['step_batched_ms']:.3f} ms vs {db['step_each_ms']:.3f} ms", "-", "-")  # fmt: skip
    table.add_row(f"a step appended to a {LONG_TRAJECTORY:,}-step trajectory (baseline: to an empty one)",
                  f"p50 {db['step_on_long_ms']:.3f} ms vs {db['step_on_empty_ms']:.3f} ms", "-", "-")  # fmt: skip
    if "pre_ping" in report:
        ping = report["pre_ping"]
        table.add_row("a read of one record, idle connections pinged (baseline: every checkout pinged)",
                      f"p50 {ping['store_ms']:.3f} ms vs {ping['pre_ping_ms']:.3f} ms", "-", "-")  # fmt: skip
    return table


def run_control_plane_benchmark(*, nodes: list[int], creates: int, burst: int, live: int, postgres: bool, http: bool,
                                as_json: bool, console: Console) -> None:  # fmt: skip
    status = Console(stderr=True) if as_json else console
    with tempfile.TemporaryDirectory(prefix="corral-bench-cp.") as scratch:
        report = run(nodes=nodes, creates=creates, burst=burst, live=live, postgres=postgres, scratch=Path(scratch),
                     http=http, log=lambda message: status.log(message))  # fmt: skip
    emit(report, _table, as_json=as_json, console=console)
