"""`corral serve`: the embedded single-node default in one process, or a gateway of a Ray cluster.

Embedded: HTTP API + scheduler + one in-process edge over the real backends,
state in SQLite. Host setup (private mount namespace, subreaper, native
helpers) happens here, once, before the event loop and its threads start.
With ``engine=ray`` the same HTTP API and scheduler place sandboxes on the
cluster's edge actors (corral/cluster), state in the shared database.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import secrets
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import uvicorn

from corral import tracing
from corral.config import Settings
from corral.edge.protocol import Edge
from corral.gateway.app import create_app
from corral.gateway.auth import JobTokens
from corral.gateway.fncall import FnCallService
from corral.gateway.grading import Grader
from corral.gateway.http_protocol import ResettableHttpToolsProtocol
from corral.gateway.images import ImageService
from corral.gateway.operations import Operations
from corral.gateway.service import SandboxService
from corral.gateway.services import Services
from corral.gateway.trajectory import Trajectories
from corral.gateway.warm_pool import WarmPools
from corral.guard.audit import AuditLog
from corral.images.builders import LayerBuilder
from corral.images.catalogue import Catalogue
from corral.images.fetch import layer_fetcher
from corral.images.pull import ImagePuller
from corral.images.registry import RegistryConfig, load_auth_file, registry_trust
from corral.images.store import LayerStore
from corral.logs import configure_logging
from corral.node import build_edge, prepare_host

if TYPE_CHECKING:
    from corral.cluster.ray_edge import RayEdges
from corral.state.db import StateStore
from corral.trajectory import TrajectoryLog

__all__ = ["serve", "load_or_create_api_key", "tune_gc"]

log = logging.getLogger("corral")
# Young objects allocated before the cyclic GC runs (Python's default: 700). A burst of creates makes hundreds
# of thousands of long-lived objects (records, specs, tasks); at the default the collector took about half of
# a 32,000 burst's time (docs/spec.md, Control plane).
GC_THRESHOLDS = (50_000, 20, 100)


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


def load_or_create_api_key(settings: Settings) -> str:
    """The server's API key: the configured one, else generated on first start and kept in the data dir."""
    if settings.api_key:
        return settings.api_key
    key_file = settings.data_dir / "api_key"
    if key_file.exists():
        return key_file.read_text().strip()
    key = f"ck_{secrets.token_hex(24)}"
    _write_private(key_file, key + "\n")
    return key


def tune_gc() -> None:
    """The server's collector settings (the control-plane bench applies the same)."""
    gc.set_threshold(*GC_THRESHOLDS)


def join_ray(address: str | None) -> None:
    """Connect this gateway to the Ray cluster as a driver (it finds the edge actors by name)."""
    import ray

    from corral.cluster.edge_actor import ACTOR_NAMESPACE

    ray.init(address=address or "auto", namespace=ACTOR_NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)


def _layers_left_running(store: StateStore, edges: dict[str, Edge]) -> set[str] | None:
    """The layers of this server's sandboxes that outlive it; when the records cannot say (the database is
    down), None: every helper is let go; one of an unused layer mounted here ends by itself, one an earlier
    server left in another mount namespace waits out CORRAL_LAYER_HELPER_ORPHAN_S (lazy.py)."""
    try:
        return store.layers_in_use(edges)
    except Exception:
        log.warning("could not read which sandboxes are left running; keeping every layer helper", exc_info=True)
        return None


_ENDING: set[asyncio.Task[None]] = set()


def _end_with_caller(pid: int, service: SandboxService, pools: WarmPools) -> Callable[[], None]:
    """Settings.stop_with_pid: once process ``pid`` has ended (a pidfd turns readable; SIGKILL included), kill every
    sandbox this server runs and stop it as SIGTERM does. Returns what stops the watch."""
    loop = asyncio.get_running_loop()

    async def end() -> None:
        log.warning("the process that started this server (pid %d) ended: killing its sandboxes and stopping", pid)
        await pools.close()  # no refill starts meanwhile
        killed = await service.kill_everything()
        log.warning("killed %d sandboxes; stopping", killed)
        os.kill(os.getpid(), signal.SIGTERM)

    def caller_ended() -> None:
        if fd is not None:
            loop.remove_reader(fd)
        task = loop.create_task(end())
        _ENDING.add(task)  # held until done: the loop keeps only a weak reference
        task.add_done_callback(_ENDING.discard)

    fd: int | None = None
    try:
        fd = os.pidfd_open(pid)
        loop.add_reader(fd, caller_ended)
    except ProcessLookupError:  # gone before the server was up
        loop.call_soon(caller_ended)

    def unwatch() -> None:
        if fd is not None:
            loop.remove_reader(fd)
            os.close(fd)

    return unwatch


def _ray_edges() -> RayEdges:
    from corral.cluster.ray_edge import RayEdges  # ray is imported only by cluster gateways

    return RayEdges()


def registry_config(settings: Settings) -> RegistryConfig:
    """How this server reaches registries: plain-HTTP ones, trusted CAs, and credentials (the setting's over the
    file's)."""
    credentials = load_auth_file(settings.registry_auth_file) if settings.registry_auth_file else {}
    for registry, pair in settings.registry_credentials.items():
        user, _, password = pair.partition(":")
        credentials[registry] = (user, password)
    return RegistryConfig(
        insecure=frozenset(settings.insecure_registries),
        credentials=credentials,
        trust=registry_trust(settings.registry_ca_file),
    )


def serve(settings: Settings) -> None:
    tune_gc()
    configure_logging(settings.log_format, settings.log_level, settings.edge_id)
    tracing.configure(settings.otel_traces)
    if settings.engine == "ray":
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        host = None
        join_ray(settings.ray_address)
    else:
        host = prepare_host(settings)
    api_key = load_or_create_api_key(settings)
    url = f"http://{settings.host}:{settings.port}"
    _write_private(settings.config_file, json.dumps({"url": url, "api_key": api_key}, indent=2) + "\n")
    where = f"cgroup layout {host.layout.value}" if host else f"gateway of the Ray cluster at {settings.ray_address}"
    log.info("%s; data in %s; client config in %s", where, settings.data_dir, settings.config_file)

    @asynccontextmanager
    async def service_factory() -> AsyncIterator[Services]:
        store = StateStore(settings.database)
        catalogue = Catalogue(store.engine, LayerStore(settings.layer_dir))
        catalogue.sync_from_store()
        audit_log = AuditLog(store.engine)
        fetcher = layer_fetcher(settings, catalogue.store, api_key, audit=audit_log.record)
        edges: dict[str, Edge] = {}
        builder = LayerBuilder(catalogue, settings.data_dir / "build", settings.max_file_bytes)
        puller = ImagePuller(
            catalogue, builder, registry_config(settings), max_layer_bytes=settings.pull_max_layer_bytes
        )
        service = SandboxService(
            store=store,
            catalogue=catalogue,
            edges=edges,
            default_runtime=settings.runtime,
            ttl_check_interval_s=settings.ttl_check_interval_s,
            default_idle_pause_s=settings.idle_pause_s,
            audit_log=audit_log,
            heartbeat_s=settings.node_heartbeat_s,
            node_lost_after_s=settings.node_lost_after_s,
            node_restart_grace_s=settings.node_restart_grace_s,
            layer_fetcher=fetcher,
            remote_edges=_ray_edges() if host is None else None,
            puller=puller,
            events_retention_s=settings.events_retention_s,
            layer_disk_budget_mb=settings.layer_disk_budget_mb,
        )
        if host is not None:
            edges[settings.edge_id] = build_edge(settings, host, service)
        try:
            await service.start()  # inside: edges that started are closed again if a later one fails
            log.info("serving on %s (%d images)", url, len(catalogue.images()))
            images = ImageService(catalogue, builder, service, puller=puller)
            log_of_steps = TrajectoryLog(store.engine)
            operations = Operations(log_of_steps, service, images, max_logged_file_bytes=settings.max_logged_file_bytes)
            trajectories = Trajectories(log_of_steps, service, operations.settled)
            lost = trajectories.mark_lost()
            if lost:
                log.warning("%d trajectory steps were running when the server stopped: marked lost", lost)
            tokens = JobTokens(store.engine, api_key)
            fncall = FnCallService(
                service,
                warm_budget=settings.fncall_warm_budget,
                min_warm=settings.fncall_min_warm,
                max_per_pool=settings.fncall_max_per_pool,
            )
            await fncall.start()
            warm_pools = WarmPools(
                service, memory_budget_mb=settings.warm_pool_memory_mb, window_s=settings.warm_pool_window_s
            )
            await warm_pools.start()
            service.warm_pools = warm_pools
            unwatch = _end_with_caller(settings.stop_with_pid, service, warm_pools) if settings.stop_with_pid else None
            try:
                yield Services(
                    sandboxes=service, images=images, operations=operations, trajectories=trajectories,
                    tokens=tokens, fncall=fncall, grader=Grader(images, service),
                )  # fmt: skip
            finally:
                if unwatch is not None:
                    unwatch()
                service.warm_pools = None
                await warm_pools.close()
                await fncall.close()
                await puller.aclose()
                operations.flush()
        finally:
            await service.close()
            if fetcher is not None:  # the layers of the sandboxes left running (re-adopted by the next start)
                await asyncio.to_thread(fetcher.close, await asyncio.to_thread(_layers_left_running, store, edges))
            store.close()

    upload_dir = settings.data_dir / "uploads"
    upload_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(
        service_factory, settings.max_file_bytes, upload_dir, internet_egress=settings.internet_egress,
        sandbox_fusion_open=settings.sandbox_fusion_open, sandbox_fusion_image=settings.sandbox_fusion_image,
    )  # fmt: skip
    # uvloop: its HTTP handling and loop cost less (docs/spec.md, Load); it starts processes with libuv's fork of the
    # whole server, so the runtime's and QEMU's are started by backends/common/spawn.py instead.
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        loop="uvloop",
        http=ResettableHttpToolsProtocol,  # httptools, and responses can reset their connection
        log_level="warning",
        log_config=None,  # its lines go through configure_logging's handler (text or JSON)
        timeout_keep_alive=settings.http_keepalive_s,
    )
    tracing.shutdown()  # the spans of the last requests
