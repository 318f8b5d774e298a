"""The control plane behind the HTTP API: sandbox records, placement, routing.

It turns API requests into edge calls: resolves images to layers, asks the
scheduler for an edge, records every sandbox in the state store before and
after its edge acts, routes later requests by the edge id inside the sandbox
id, destroys sandboxes whose TTL passed, and after a restart re-adopts what
its edges still run (or marks it lost, never forgets it).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import operator
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol, TypeVar

from prometheus_client.core import Metric

from corral import tracing
from corral.api.errors import (
    CapacityExhausted,
    CorralError,
    InternalError,
    InvalidRequest,
    NotFound,
    SandboxGone,
    ServerUnavailable,
)
from corral.api.models import (
    BatchEvent,
    CheckpointInfo,
    ClusterNode,
    CreateSandboxRequest,
    EdgeLoad,
    NetworkPolicy,
    NetworkStatus,
    NodeStats,
    PauseResult,
    SandboxInfo,
    SandboxState,
    is_registry_reference,
)
from corral.backends.base import WARM_LABEL, Capability, LayerRef, SandboxSpec, offer_key
from corral.edge.adoption import end_stale, readopt
from corral.edge.protocol import Edge, EdgeDirectory, edge_of, new_sandbox_id
from corral.gateway.metrics import GatewayMetrics
from corral.guard.audit import AuditLog
from corral.images.catalogue import Catalogue
from corral.images.fetch import LayerFetcher
from corral.images.image_config import ImageConfig, sandbox_defaults
from corral.images.image_config import merge as merge_configs
from corral.images.pull import ImagePuller
from corral.scheduler.placement import NodesBusy, Scheduler
from corral.state.db import StateStore, database_unreachable, unreachable_error
from corral.state.events import EventLog
from corral.state.records import SandboxRecord
from corral.state.thread import DatabaseThread

__all__ = ["WARM_LABEL", "SandboxService", "WarmPoolsLike"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_ACTIVE = [SandboxState.CREATING.value, SandboxState.RUNNING.value, SandboxState.PAUSED.value]
_LIVE = (SandboxState.CREATING, SandboxState.RUNNING, SandboxState.PAUSED)
_POOL_LABEL = "corral.fncall"  # the fncall pools' own sandboxes (corral/gateway/fncall.py)
MAX_BATCH = 32_000  # sandboxes per batch request (a training step's burst)
DEFAULT_BATCH_CONCURRENCY = 512  # creates of one batch running at once
DEFAULT_BATCH_PER_NODE = 32  # ... and at most this many on one node (containers: the backend's own limit applies)
_GROUP_MAX = 1024  # a batch's events handed on together at most (one write of the HTTP stream)
_EXISTING_KEPT = 100_000  # sandbox ids remembered as existing (check_exists)
_ROOT_CACHE_S = 1.0  # an image's resolution is reused this long (a tag moved by another gateway: seen within it)
_ROOTS_CACHED = 1024
_TOUCH_EVERY_S = 60.0  # a layer's last use (LRU eviction order) is recorded at most this often
_PROGRESS_EVERY = 1000  # a progress line per this many results
_EVENTS_PRUNE_EVERY_S = 300.0  # events older than the retention are deleted this often
_DB_RETRY_S = 15.0  # record writes of creates wait out a database outage this long (a restart takes 1-3 s)
_DB_RETRY_EVERY_S = 0.5
_EDGE_SCRAPE_TIMEOUT_S = 5.0  # a scrape leaves out a remote edge's metrics that take longer (Prometheus waits 10 s)


class _GroupCommit:
    """The record writes of concurrent creates, committed together: one transaction for all that arrived while
    the previous one ran (on the database thread).

    A create still awaits its own record being written before its edge acts (and its running mark before it
    answers); a burst of creates just shares the transactions, so the database is not the bottleneck.
    A write the database could not take because it went away (a restart) is tried again every
    ``_DB_RETRY_EVERY_S`` for up to ``_DB_RETRY_S`` of the outage, then fails with ``ServerUnavailable``: a burst
    that meets a PostgreSQL restart waits it out instead of leaving sandboxes running under records that
    still say creating.
    """

    def __init__(self, store: StateStore, db: DatabaseThread) -> None:
        self._store = store
        self._db = db
        self._inserts: list[tuple[SandboxRecord, asyncio.Future[None]]] = []
        self._running: list[tuple[str, Any, asyncio.Future[bool]]] = []  # (id, status note, future)
        self._claims: list[tuple[str, Any, asyncio.Future[bool]]] = []  # (id, the client's values, future)
        self._ends: list[tuple[str, Any, asyncio.Future[SandboxRecord | None]]] = []  # (id, (state, reason, message))
        self._flushing: asyncio.Task[None] | None = None
        self._outage_since: float | None = None  # monotonic time the database first failed, while it fails

    async def insert(self, record: SandboxRecord) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._inserts.append((record, future))
        self._schedule()
        await future

    async def mark_running(self, sandbox_id: str, note: str | None) -> bool:
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._running.append((sandbox_id, note, future))
        self._schedule()
        return await future

    async def claim(self, sandbox_id: str, values: dict[str, Any]) -> bool:
        """A warm-pool sandbox's record becomes its client's (StateStore.claim_many); False if it ended."""
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._claims.append((sandbox_id, values, future))
        self._schedule()
        return await future

    async def end(self, sandbox_id: str, state: SandboxState, reason: str, message: str | None) -> SandboxRecord | None:
        """An active sandbox's record marked ended (StateStore.end_many): the record as it now is, None if it had
        ended already."""
        future: asyncio.Future[SandboxRecord | None] = asyncio.get_running_loop().create_future()
        self._ends.append((sandbox_id, (state, reason, message), future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush())

    def _retrying(self, exc: Exception) -> Exception | None:
        """None if a failed write is to be tried again (the batch goes back); else the error to settle with."""
        if not database_unreachable(exc):
            return exc
        now = time.monotonic()
        self._outage_since = self._outage_since or now
        if now - self._outage_since > _DB_RETRY_S:
            return unreachable_error(exc)
        return None

    async def _flush(self) -> None:
        try:
            await asyncio.sleep(0)  # the writes of this event-loop turn join the first transaction
            while self._inserts or self._running or self._claims or self._ends:
                inserts, self._inserts = self._inserts, []
                running, self._running = self._running, []
                claims, self._claims = self._claims, []
                ends, self._ends = self._ends, []
                if inserts:
                    try:
                        await self._db.run(self._store.insert_many, [record for record, _ in inserts])
                    except Exception as exc:
                        if (error := self._retrying(exc)) is None:
                            self._inserts[:0] = inserts
                        else:
                            _settle([future for _, future in inserts], error=error)
                    else:
                        self._outage_since = None
                        _settle([future for _, future in inserts])
                self._running[:0] = await self._answer_each(running, self._store.mark_running_many)
                claim_many = functools.partial(self._store.claim_many, pool_label=WARM_LABEL)
                self._claims[:0] = await self._answer_each(claims, claim_many)
                self._ends[:0] = await self._answer_each(ends, self._store.end_many, answer=dict.get)
                if self._outage_since is not None:
                    await asyncio.sleep(_DB_RETRY_EVERY_S)  # the database is away: the batch goes again soon
        finally:
            self._flushing = None

    async def _answer_each(
        self,
        pending: list[tuple[str, Any, asyncio.Future[Any]]],
        write: Callable[[dict[str, Any]], Any],
        answer: Callable[[Any, str], Any] = operator.contains,
    ) -> list[tuple[str, Any, asyncio.Future[Any]]]:
        """One write for every pending (sandbox id, value); each future learns ``answer(what the write returned,
        its id)``: by default whether its id was among those done. Returns the ones to try again (the database
        went away)."""
        if not pending:
            return []
        try:
            done = await self._db.run(write, {sandbox_id: value for sandbox_id, value, _ in pending})
        except Exception as exc:
            if (error := self._retrying(exc)) is None:
                return pending
            _settle([future for _, _, future in pending], error=error)
            return []
        self._outage_since = None
        for sandbox_id, _, future in pending:
            if not future.done():
                future.set_result(answer(done, sandbox_id))
        return []


class _GroupRead:
    """Reads of records that arrive while one runs, answered together by one statement (``StateStore.get_many``): on
    PostgreSQL every read is a turn of the one database thread and a round trip, so concurrent reads (a bulk kill's,
    many clients' GETs) had queued behind one another. A read that finds none running runs at once, alone, as before
    (a lone GET pays nothing more); those that come meanwhile wait for it and go next, together. On SQLite (inline, no
    round trip) each read runs at once."""

    def __init__(self, store: StateStore, db: DatabaseThread) -> None:
        self._store = store
        self._db = db
        self._pending: dict[str, list[asyncio.Future[SandboxRecord | None]]] = {}
        self._busy = False
        self._group: asyncio.Task[None] | None = None  # the group being read: held, so the task is not collected

    async def get(self, sandbox_id: str) -> SandboxRecord | None:
        if self._db.inline:
            return self._store.get(sandbox_id)
        if not self._busy:
            self._busy = True
            try:
                return await self._db.run(self._store.get, sandbox_id)
            finally:
                self._busy = False
                self._next_group()
        future: asyncio.Future[SandboxRecord | None] = asyncio.get_running_loop().create_future()
        self._pending.setdefault(sandbox_id, []).append(future)
        return await future

    def _next_group(self) -> None:
        if self._pending and not self._busy:
            self._busy = True
            self._group = asyncio.get_running_loop().create_task(self._read_groups())

    async def _read_groups(self) -> None:
        try:
            while self._pending:
                pending, self._pending = self._pending, {}
                waiting = [future for futures in pending.values() for future in futures]
                try:
                    records = await self._db.run(self._store.get_many, list(pending))
                except asyncio.CancelledError:  # the loop is closing: so are the reads that waited for this one
                    for future in waiting:
                        future.cancel()
                    raise
                except Exception as exc:  # each read learns why, as its own statement would have told it
                    _settle(waiting, error=exc)
                    continue
                for sandbox_id, futures in pending.items():
                    for future in futures:
                        if not future.done():
                            future.set_result(records.get(sandbox_id))
        finally:
            self._busy = False
            self._group = None


def _settle(futures: list[asyncio.Future[Any]], error: Exception | None = None) -> None:
    for future in futures:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(None)


class WarmPoolsLike(Protocol):
    """What a create asks of the warm pools (corral/gateway/warm_pool.py): a pre-started sandbox made the client's,
    or None (no warm one of that shape: the create starts one cold)."""

    async def claim(
        self, request: CreateSandboxRequest, image_name: str, layers: tuple[LayerRef, ...]
    ) -> SandboxInfo | None: ...


class SandboxService:
    def __init__(
        self,
        *,
        store: StateStore,
        catalogue: Catalogue,
        edges: dict[str, Edge],
        default_runtime: str,
        ttl_check_interval_s: float,
        default_idle_pause_s: float | None = None,
        audit_log: AuditLog | None = None,
        layer_fetcher: LayerFetcher | None = None,
        remote_edges: EdgeDirectory | None = None,
        heartbeat_s: float = 1.0,
        node_lost_after_s: float = 15.0,
        node_restart_grace_s: float = 120.0,
        puller: ImagePuller | None = None,
        events_retention_s: float = 7 * 86400.0,
        layer_disk_budget_mb: int | None = None,
    ) -> None:
        """``layer_disk_budget_mb``: the catalogue's layers are kept under it after builds, pulls (those creates
        start too) and snapshots (``enforce_layer_budget``); the node's fetched copies have their own budget, in
        ``layer_fetcher``'s cache."""
        self.metrics = GatewayMetrics()
        self.events = EventLog(store.engine)
        self._events_retention_s = events_retention_s
        self._events_pruned_at = 0.0
        self._layer_disk_budget_mb = layer_disk_budget_mb
        self._heartbeat_s = heartbeat_s
        self._puller = puller  # registry images a create names are pulled on first use
        self._node_lost_after_s = node_lost_after_s
        self._node_restart_grace_s = node_restart_grace_s
        self._restarting: set[str] = set()  # silent nodes whose edge Ray is restarting: not lost yet
        self._watcher: asyncio.Task[None] | None = None
        self._store = store
        self._layer_fetcher = layer_fetcher
        self.audit_log = audit_log
        self._default_idle_pause_s = default_idle_pause_s
        self._catalogue = catalogue
        self._edges = edges  # this process's own edges: it adopts their sandboxes and heartbeats for them
        self._remote = remote_edges  # edges on other nodes (a Ray cluster's actors), known from their heartbeats
        self._default_runtime = default_runtime
        self._ttl_interval_s = ttl_check_interval_s
        self._reaper: asyncio.Task[None] | None = None
        self.scheduler = Scheduler()
        # Every store call (and the trajectory log's, gateway/operations.py): the event loop never waits on a
        # database server (SQLite: inline, state/thread.py says why).
        self.database = self._db = DatabaseThread(inline=store.engine.dialect.name == "sqlite")
        self._writes = _GroupCommit(store, self._db)
        self._reads = _GroupRead(store, self._db)
        # create's root → (until, stack, name, image config)
        self._roots: dict[tuple[Any, ...], tuple[float, list[str], str, ImageConfig]] = {}
        self._root_reads: dict[tuple[Any, ...], asyncio.Task[tuple[list[str], str, ImageConfig]]] = {}
        self._existing: set[str] = set()  # sandbox ids found to exist (check_exists)
        self._touched: dict[str, float] = {}  # layer digest → when its last use was recorded (monotonic)
        self._create_finished = asyncio.Event()  # a create returned: a node may have a slot for a batch
        self.warm_pools: WarmPoolsLike | None = None  # creates claim pre-started sandboxes from it (warm_pool.py)

    # -- startup and shutdown -----------------------------------------------

    async def start(self) -> None:
        for edge_id, edge in self._edges.items():
            await edge.start()
            self.scheduler.add_node(await edge.load())
            for record in await readopt(edge, self._store, self._layers_on_node):
                self.scheduler.reserve(record.id, edge_id, cpu=record.cpu, memory_mb=record.memory_mb,
                                       layers=record.layers, starting=False)  # fmt: skip
        if self._remote is not None:
            self._sync_remote_nodes(time.time() - self._node_lost_after_s, await self._db.run(self._store.nodes))
        self._reaper = asyncio.get_running_loop().create_task(self._reap_expired())
        self._watcher = asyncio.get_running_loop().create_task(self._watch_nodes())

    async def _layers_on_node(self, entries: Iterable[str]) -> tuple[LayerRef, ...]:
        """What a re-adopted sandbox's stack entries are on this node: a layer that was still filling on demand
        is opened again (its helper started, or reattached, by this server)."""
        if self._layer_fetcher is None:
            return self.layer_refs(list(entries))
        refs = []
        for entry in entries:
            digest, _, alias = entry.partition("#")
            try:
                path = await self._layer_fetcher.ensure(digest)
            except ServerUnavailable:  # the layer source is down: only what is on this node already
                path = self._layer_fetcher.path(digest)
            refs.append(LayerRef(digest=digest, path=path, alias=alias))
        return tuple(refs)

    async def _watch_nodes(self) -> None:
        """Heartbeat this gateway's edges into the shared store, and mark nodes that went silent lost,
        with their sandboxes: a node is lost after ``node_lost_after_s`` without a heartbeat."""
        while True:
            try:
                now = time.time()
                loads = {edge_id: (await edge.load()).model_dump() for edge_id, edge in self._edges.items()}
                for edge_id in await self._db.run(self._store.heartbeat_many, loads, now):
                    log.warning("node %s is back after it was marked lost", edge_id)
                    for sandbox_id in await end_stale(self._edges[edge_id], self._store):
                        self.scheduler.release(sandbox_id)
                before = now - self._node_lost_after_s
                for edge_id in await self._silent_nodes_lost(before):
                    message = (f"its node {edge_id} went silent: no heartbeat for {self._node_lost_after_s:g}s "
                               "(the machine, its server or its network stopped)")  # fmt: skip
                    lost = await self._db.run(self._store.mark_node_lost, edge_id, before, message)
                    self.metrics.ended.labels("lost").inc(lost)
                    log.warning("node %s marked lost after %.0fs of silence; %d sandboxes lost", edge_id,
                                self._node_lost_after_s, lost)  # fmt: skip
                if self._remote is not None:
                    self._sync_remote_nodes(before, await self._db.run(self._store.nodes))
                if now - self._events_pruned_at > _EVENTS_PRUNE_EVERY_S:
                    self._events_pruned_at = now
                    await asyncio.to_thread(self.events.prune, self._events_retention_s)
            except Exception:
                log.exception("node watcher failed; retrying")
            await asyncio.sleep(self._heartbeat_s)

    async def _silent_nodes_lost(self, before: float) -> builtins.list[str]:
        """The nodes silent since ``before`` to mark lost: all but those whose edge Ray is restarting on a live
        machine (its re-adoption keeps their sandboxes), which get ``node_restart_grace_s`` more."""
        silent = await self._db.run(self._store.silent_nodes, before, exclude=set(self._edges))
        if self._remote is None or not silent:
            self._restarting.clear()
            return silent
        last_seen = {row["edge_id"]: row["last_seen"] for row in await self._db.run(self._store.nodes)
                     if row["edge_id"] in silent}  # fmt: skip
        restarting = await asyncio.to_thread(self._remote.restarting, last_seen)
        past_grace = before - self._node_restart_grace_s  # silent since before this: the grace is over
        restarting = {edge_id for edge_id in restarting if last_seen[edge_id] >= past_grace}
        for edge_id in restarting - self._restarting:
            log.warning("node %s is silent while Ray restarts its edge: its sandboxes are kept for up to %gs more",
                        edge_id, self._node_restart_grace_s)  # fmt: skip
        self._restarting = restarting
        return [edge_id for edge_id in silent if edge_id not in restarting]

    def _sync_remote_nodes(self, before: float, nodes: builtins.list[dict[str, Any]]) -> None:
        """Place on the remote nodes that heartbeat (``nodes``: the store's rows), by the loads they report; stop
        placing on silent ones."""
        for row in nodes:
            edge_id = row["edge_id"]
            if edge_id in self._edges:
                continue
            heard = row["state"] == "up" and row["last_seen"] >= before
            assert self._remote is not None
            if self._remote.set_silent(edge_id, not heard):
                self.scheduler.refresh(EdgeLoad.model_validate(row["load"]))
            else:
                self.scheduler.remove_node(edge_id)

    async def close(self) -> None:
        for task in (self._reaper, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for edge in self._edges.values():
            await edge.close()
        await asyncio.to_thread(self._db.close)  # what the edges reported while closing is written

    # -- what edges report (EdgeEvents) -------------------------------------

    def ended(self, sandbox_id: str, reason: str, message: str) -> None:
        self.scheduler.release(sandbox_id)
        self._db.submit(self._store.end, sandbox_id, SandboxState.ENDED, reason, message)
        self.metrics.ended.labels(reason).inc()
        log.info("ended: %s: %s", reason, message, extra={"sandbox_id": sandbox_id})

    def paused(self, sandbox_id: str, at: float) -> None:
        self._db.submit(self._store.mark_paused, sandbox_id, at)
        self.metrics.operations.labels("paused").inc()

    def resumed(self, sandbox_id: str, at: float) -> None:
        self._db.submit(self._store.mark_resumed, sandbox_id, at)
        self.metrics.operations.labels("resumed").inc()

    def audit(self, sandbox_id: str, kind: str, severity: str, detail: dict[str, Any]) -> None:
        self.metrics.audit.labels(kind, severity).inc()
        if self.audit_log is not None:
            self._db.submit(self.audit_log.record, sandbox_id, kind, severity, detail)

    async def _reap_expired(self) -> None:
        while True:
            await asyncio.sleep(self._ttl_interval_s)
            try:
                for sandbox_id in await self._db.run(self._store.expired, time.time()):
                    if edge_of(sandbox_id) not in self._edges and self._remote is None:
                        continue  # another server's node: its own gateway destroys it there
                    log.info("sandbox %s reached its TTL", sandbox_id)
                    await self._destroy(sandbox_id, "ttl_expired")
            except Exception:
                log.exception("TTL reaper round failed; retrying")

    # -- sandboxes -----------------------------------------------------------

    def layer_refs(self, entries: list[str]) -> tuple[LayerRef, ...]:
        """Stack entries (``digest`` or ``digest#alias``) to the layer files on this node."""
        refs = []
        for entry in entries:
            digest, _, alias = entry.partition("#")
            path = self._layer_fetcher.path(digest) if self._layer_fetcher else self._catalogue.store.layer_path(digest)
            refs.append(LayerRef(digest=digest, path=path, alias=alias))
        return tuple(refs)

    def stack(self, refs: list[str]) -> list[str]:
        """Image refs and layer digests to one bottom-first stack of digests.

        An image is a complete stack from whatever it was built on, so a layer
        that is already lower in the stack is not repeated: {base, tools}
        where tools was built on base stacks base once, then the tools diff.
        """
        stack: list[str] = []
        for ref in refs:
            digests = [ref] if ref.startswith("sha256:") else list(self._catalogue.resolve(ref).layers)
            for digest in digests:
                self._catalogue.layer(digest.partition("#")[0])
                if digest not in stack:
                    stack.append(digest)
        return stack

    @staticmethod
    def _image_refs(request: CreateSandboxRequest) -> list[str]:
        """The image refs a create stacks, bottom first (none when it names layers)."""
        if request.layers:
            return []
        if request.environment is not None:
            env = request.environment
            return [env.base, *(p for p in (env.workspace, env.tools) if p), *env.extra]
        return [request.image]

    def _resolve_root(self, request: CreateSandboxRequest) -> tuple[list[str], str, ImageConfig]:
        """The sandbox's layers (bottom first), the name it is listed under, and the image config it starts
        with (an environment's images merged in order; none for bare layers)."""
        if request.layers:
            return self.stack(request.layers), "+".join(d.split(":")[-1][:12] for d in request.layers), ImageConfig()
        refs = self._image_refs(request)
        if request.environment is not None:
            config = merge_configs(self._catalogue.resolve(p).config for p in refs if not p.startswith("sha256:"))
            return self.stack(refs), "+".join(refs), config
        image = self._catalogue.resolve(request.image)
        return self.stack(refs), image.ref, image.config

    async def _root(self, request: CreateSandboxRequest) -> tuple[list[str], str, ImageConfig]:
        """``_resolve_root``, read from the catalogue on the database thread once a second per image
        (``_ROOT_CACHE_S``): a create resolves its image twice (its layers fetched, then prepared)."""
        now = time.monotonic()
        key = (request.image, request.environment.model_dump_json() if request.environment else None,
               tuple(request.layers or ()), self._catalogue.generation)  # fmt: skip
        cached = self._roots.get(key)
        if cached is not None and cached[0] > now:
            return cached[1], cached[2], cached[3]
        # One read per image at a time: the creates that miss together wait for it. Each reading for itself,
        # 256 concurrent creates on PostgreSQL (4.4 ms a read, one database thread) took longer than the cache
        # lasts, so it never served: 5,000 reads for 5,000 creates, 219 creates/s (`corral bench control-plane`).
        reading = self._root_reads.get(key)
        if reading is None:
            reading = asyncio.get_running_loop().create_task(self._read_root(key, request, now))
            reading.add_done_callback(lambda task: task.cancelled() or task.exception())  # retrieved if none waits
            self._root_reads[key] = reading
        return await asyncio.shield(reading)  # a waiter cancelled leaves the read to the others

    async def _read_root(
        self, key: tuple[Any, ...], request: CreateSandboxRequest, now: float
    ) -> tuple[list[str], str, ImageConfig]:
        try:
            digests, image_name, config = await self._db.run(self._resolve_root, request)
        finally:
            self._root_reads.pop(key, None)
        if len(self._roots) >= _ROOTS_CACHED:
            self._roots.clear()
        self._roots[key] = (now + _ROOT_CACHE_S, digests, image_name, config)
        return digests, image_name, config

    async def _pull_missing(self, request: CreateSandboxRequest) -> None:
        """Registry images the create names that are not here yet: pulled, once per gateway however many wait;
        then the layer store is kept under its disk budget, as after a build."""
        if self._puller is None:
            return
        generation = self._catalogue.generation
        for ref in self._image_refs(request):
            if is_registry_reference(ref):
                await self._puller.ensure(ref)
        if self._catalogue.generation != generation:  # a pull tagged something (this create's or another's)
            await self._db.run(self.enforce_layer_budget)

    def enforce_layer_budget(self, progress: Callable[[str], None] | None = None,
                             keep: frozenset[str] = frozenset()) -> None:  # fmt: skip
        """After the store grew: drop untagged layers no sandbox uses, least recently used first, to fit the disk
        budget (``keep``: layers to spare, an untagged snapshot just made)."""
        budget_mb = self._layer_disk_budget_mb
        if budget_mb is None:
            return
        for digest in self._catalogue.evict(budget_mb << 20, in_use=self.layers_in_use() | keep):
            log.info("evicted layer %s (over CORRAL_LAYER_DISK_BUDGET_MB)", digest)
            if progress is not None:
                progress(f"evicted unused layer {digest[:19]}… to stay under {budget_mb} MB")

    async def record(self, sandbox_id: str) -> SandboxRecord:
        record = await self._db.run(self._store.get, sandbox_id)
        if record is None:
            raise NotFound(f"no sandbox {sandbox_id}")
        return record

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy) -> NetworkStatus:
        """Replace a running sandbox's egress allowlist (e.g. open the mirror for setup, close it for the task)."""
        self._raise_if_ended(await self.get(sandbox_id))
        address, egress, ingress = await self.call(sandbox_id, lambda edge: edge.set_network(sandbox_id, policy.allow))
        await self._db.run(self._store.update, sandbox_id, network=policy.model_dump())
        return NetworkStatus(
            address=address, allow=policy.allow, denied_egress_packets=egress, denied_ingress_packets=ingress
        )

    async def attach_network_peer(self, name: str, netns_path: str, address: str) -> None:
        """Plug a namespace of this machine into its node's sandbox network (embedded servers only: the path
        names a namespace here, which a cluster's other nodes cannot reach)."""
        if not self._edges:
            raise InvalidRequest(
                "network peers attach to a node's own sandbox network: call the node's server, not a cluster gateway"
            )
        for edge in self._edges.values():
            await edge.attach_network_peer(name, netns_path, address)

    async def network_status(self, sandbox_id: str) -> NetworkStatus:
        record = await self.record(sandbox_id)
        address, egress, ingress = await self.call(sandbox_id, lambda edge: edge.network_status(sandbox_id))
        policy = NetworkPolicy.model_validate(record.network) if record.network is not None else None
        return NetworkStatus(
            address=address,
            allow=policy.allow if policy else None,
            denied_egress_packets=egress,
            denied_ingress_packets=ingress,
        )

    def has_capability(self, record: SandboxRecord, capability: Capability) -> bool:
        """Whether a recorded sandbox's kind (backend and runtime) has ``capability``, as its nodes declare it."""
        return capability in (self.scheduler.capabilities(record.backend, record.runtime) or ())

    async def layers_of(self, sandbox_id: str) -> list[str]:
        return list((await self.record(sandbox_id)).layers)

    def layers_in_use(self) -> set[str]:
        return self._store.layers_in_use()

    def node_layers_in_use(self) -> set[str]:
        """The layers this server's own edges run sandboxes on (what its node's layer cache must keep, and its
        layer helpers go on serving after it stopped)."""
        return self._store.layers_in_use(self._edges)

    async def _prepare(self, request: CreateSandboxRequest) -> tuple[CreateSandboxRequest, str, tuple[LayerRef, ...]]:
        """Validate a create and resolve its layers: (request with defaults, listed image name, layers). The
        catalogue is read on the database thread, once a second per image (``_ROOT_CACHE_S``)."""
        for name in request.env:
            if not name or "=" in name or "\0" in name:
                raise InvalidRequest(f"invalid environment variable name {name!r}")
        runtime = request.runtime or self._default_runtime
        capabilities = self.scheduler.capabilities(request.backend, runtime)
        if request.qos != "latency" and capabilities is not None and Capability.CPU_CLASSES not in capabilities:
            raise InvalidRequest(
                f"qos {request.qos!r} needs a backend with CPU classes (container): "
                f"{offer_key(request.backend, runtime)} sandboxes have none yet"
            )
        if request.idle_pause_s is None and self._default_idle_pause_s is not None:
            request = request.model_copy(update={"idle_pause_s": self._default_idle_pause_s})
        now = time.monotonic()
        digests, image_name, config = await self._root(request)
        env, cwd, user = sandbox_defaults(config, env=request.env, cwd=request.cwd, user=request.user)
        if not cwd.startswith("/"):
            raise InvalidRequest(f"cwd must be an absolute path, got {cwd!r}")
        request = request.model_copy(update={"env": env, "cwd": cwd, "user": user})
        layers = self.layer_refs(digests)  # a stat per layer file: a layer removed since is still noticed
        plain = {d.partition("#")[0] for d in digests}  # an alias is a second mount of the same layer
        stale = [d for d in plain if self._touched.get(d, -_TOUCH_EVERY_S) < now - _TOUCH_EVERY_S]
        if stale:
            self._db.submit(self._catalogue.touch, stale)
            self._touched.update((digest, now) for digest in stale)
        return request, image_name, layers

    async def create(
        self, request: CreateSandboxRequest, *, restore_from: str | None = None, on_edge: str | None = None
    ) -> SandboxInfo:
        """``restore_from``: a checkpoint directory on edge ``on_edge``'s node (a fork of a VM or gVisor sandbox:
        memory, processes, disk), so the sandbox starts there."""
        with tracing.span("corral.sandbox.create", backend=request.backend) as span:
            async with contextlib.AsyncExitStack() as layers_held:
                with tracing.span("corral.sandbox.create.image"):  # pulled, fetched, resolved to layer files
                    await self._pull_missing(request)
                    await layers_held.enter_async_context(self._layers_here(request))
                    request, image_name, layers = await self._prepare(request)
                info = await self._create_placed(
                    request, image_name, layers, restore_from=restore_from, on_edge=on_edge
                )
            span.set("sandbox_id", info.id)
            span.set("edge_id", info.edge_id)
            return info

    @contextlib.asynccontextmanager
    async def _layers_here(self, request: CreateSandboxRequest) -> AsyncIterator[None]:
        """Layers this node lacks come from the shared layer store, once (when one is configured), and the node's
        layer cache is kept under its budget; it keeps these layers until the body (which records the sandboxes
        made on them) ends."""
        fetcher = self._layer_fetcher
        if fetcher is None:
            yield
            return
        digests = [entry.partition("#")[0] for entry in (await self._root(request))[0]]
        with fetcher.hold(digests):
            for digest in digests:
                await fetcher.ensure(digest)
            await fetcher.enforce_cache_budget(self.node_layers_in_use)
            yield

    def spec_and_record(
        self,
        request: CreateSandboxRequest,
        image_name: str,
        layers: tuple[LayerRef, ...],
        sandbox_id: str,
        *,
        restore_from: str | None = None,
    ) -> tuple[SandboxSpec, SandboxRecord]:
        """What the edge starts (or a warm sandbox becomes) and what the store records, for a prepared create."""
        record = SandboxRecord.of_create(
            request, sandbox_id=sandbox_id, edge_id=edge_of(sandbox_id), image=image_name,
            runtime=request.runtime or self._default_runtime, layers=[layer.mount_key for layer in layers],
            now=time.time(),
        )  # fmt: skip
        return record.to_spec(layers, restore_from=restore_from), record

    async def _create_placed(
        self,
        request: CreateSandboxRequest,
        image_name: str,
        layers: tuple[LayerRef, ...],
        *,
        restore_from: str | None = None,
        max_in_flight: int | None = None,
        on_edge: str | None = None,
    ) -> SandboxInfo:
        """Place, record, start; a node that refuses is excluded and the next choice tried.
        ``max_in_flight``: wait while every fitting node already has that many creates running (batches).
        ``on_edge``: only that edge (a restore from a checkpoint that lives on its node); its refusal is final."""
        if self.warm_pools is not None and restore_from is None and on_edge is None:
            claimed = await self.warm_pools.claim(request, image_name, layers)
            if claimed is not None:
                return claimed
        digests = [layer.digest for layer in layers]
        refused: dict[str, str] = {}  # edge id -> why it refused
        while True:
            try:
                with tracing.span("corral.sandbox.create.placement") as placement:
                    edge_id = on_edge or self.scheduler.place(
                        cpu=request.cpu, memory_mb=request.memory_mb, backend=request.backend,
                        runtime=request.runtime or self._default_runtime,
                        layers=digests, selector=request.node_selector, exclude=frozenset(refused),
                        max_in_flight=max_in_flight,
                    )  # fmt: skip
                    placement.set("edge_id", edge_id)
            except NodesBusy:
                self._create_finished.clear()
                await self._create_finished.wait()
                continue
            except CapacityExhausted as exc:
                self.metrics.creates.labels(request.backend, "refused").inc()
                if not refused:
                    raise
                why = "; ".join(f"{edge}: {reason}" for edge, reason in refused.items())
                raise CapacityExhausted(f"{exc.message} ({why})") from None
            spec, record = self.spec_and_record(request, image_name, layers, new_sandbox_id(edge_id),
                                                restore_from=restore_from)  # fmt: skip
            self.scheduler.reserve(spec.sandbox_id, edge_id, cpu=spec.cpu, memory_mb=spec.memory_mb, layers=digests)
            started_s = time.perf_counter()
            try:
                await self._writes.insert(record)
                try:
                    with tracing.span("corral.sandbox.create.start", sandbox_id=spec.sandbox_id, edge_id=edge_id,
                                      backend=request.backend):  # fmt: skip
                        note = await self.edge(spec.sandbox_id).create(spec)
                finally:
                    self.scheduler.started(spec.sandbox_id)
                    self._create_finished.set()
            except (CapacityExhausted, ServerUnavailable) as exc:  # refused, or its node is unreachable
                self.scheduler.release(spec.sandbox_id)
                await self._db.run(self._store.end, spec.sandbox_id, SandboxState.ENDED, "refused", exc.message)
                refused[edge_id] = exc.message
                self.metrics.refusals.labels(edge_id, exc.code).inc()
                if on_edge is not None:
                    raise CapacityExhausted(
                        f"node {on_edge}, which holds the checkpoint, refused: {exc.message}"
                    ) from None
                continue
            except BaseException as exc:
                self.scheduler.release(spec.sandbox_id)
                self._db.submit(
                    self._store.end, spec.sandbox_id, SandboxState.ENDED, "error", str(exc) or type(exc).__name__
                )
                self.metrics.creates.labels(request.backend, "failed").inc()
                raise
            if not await self._writes.mark_running(spec.sandbox_id, note):
                await self.edge(spec.sandbox_id).destroy(spec.sandbox_id)  # killed while it was starting
                self.scheduler.release(spec.sandbox_id)
                self._raise_if_ended(await self.get(spec.sandbox_id))
            if edge_id not in self._edges:
                self.scheduler.forget(spec.sandbox_id)  # its node's heartbeat counts it from now on
            took_s = time.perf_counter() - started_s
            self.metrics.created(request.backend, took_s)
            log.info("created on %s in %.0f ms: %s (%s)", edge_id, took_s * 1000, spec.image, request.backend,
                     extra={"sandbox_id": spec.sandbox_id})  # fmt: skip
            return record.to_info(state=SandboxState.RUNNING.value, status_message=note)

    async def create_prepared(
        self, request: CreateSandboxRequest, image_name: str, layers: tuple[LayerRef, ...]
    ) -> SandboxInfo:
        """A create of a request ``_prepare`` already resolved (a warm pool's refills: its template, its layers)."""
        return await self._create_placed(request, image_name, layers)

    async def claim_record(self, sandbox_id: str, values: dict[str, Any]) -> bool:
        """A running warm-pool sandbox's record takes its client's values (committed with the burst's other
        writes); False if it ended meanwhile."""
        return await self._writes.claim(sandbox_id, values)

    def records_labelled(self, key: str) -> builtins.list[SandboxRecord]:
        """Active records that carry label ``key`` (whatever its value) on the edges this service places on (its
        own; on a Ray cluster, every node's): a pool's sandboxes after a restart."""
        return [record for record in self._store.list(states=_ACTIVE) if key in record.labels
                and (self._remote is not None or record.edge_id in self._edges)]  # fmt: skip

    @property
    def default_runtime(self) -> str:
        return self._default_runtime

    async def create_many(
        self,
        request: CreateSandboxRequest,
        count: int,
        *,
        concurrency: int = DEFAULT_BATCH_CONCURRENCY,
        per_node: int = DEFAULT_BATCH_PER_NODE,
    ) -> AsyncIterator[BatchEvent]:
        """``count`` sandboxes like ``request``, each reported as it becomes ready (or fails), with progress.

        Back-pressure: at most ``concurrency`` creates run at once, and at most ``per_node`` on any one node
        (a node at its limit is skipped; when every fitting node is, the batch waits for a create to finish).
        The request is validated and its layers resolved once, before anything starts.
        """
        async for group in self.create_many_grouped(request, count, concurrency=concurrency, per_node=per_node):
            for event in group:
                yield event

    async def create_many_grouped(
        self,
        request: CreateSandboxRequest,
        count: int,
        *,
        concurrency: int = DEFAULT_BATCH_CONCURRENCY,
        per_node: int = DEFAULT_BATCH_PER_NODE,
    ) -> AsyncIterator[list[BatchEvent]]:
        """``create_many``'s events, those ready at the same time together, in order: the HTTP stream writes each
        group at once: 63 writes for a 32,000 burst where a write per line made 32,032 (~5% of the burst in one
        process with its client; a small segment each to a client elsewhere). Waits for nothing that is not
        ready."""
        if not 1 <= count <= MAX_BATCH:
            raise InvalidRequest(f"count must be between 1 and {MAX_BATCH}, got {count}")
        await self._pull_missing(request)
        async with self._layers_here(request):
            async for group in self._create_batch(request, count, concurrency=concurrency, per_node=per_node):
                yield group

    async def _create_batch(self, request: CreateSandboxRequest, count: int, *, concurrency: int,
                            per_node: int) -> AsyncIterator[list[BatchEvent]]:  # fmt: skip
        request, image_name, layers = await self._prepare(request)
        started = time.perf_counter()
        queue: asyncio.Queue[BatchEvent] = asyncio.Queue()
        next_index = iter(range(count))

        async def worker() -> None:
            for index in next_index:
                try:
                    info = await self._create_placed(request, image_name, layers, max_in_flight=per_node)
                except CorralError as exc:
                    await queue.put(BatchEvent(type="error", index=index, error=exc.to_body()["error"]))
                except Exception as exc:  # reported per sandbox, like the bulk actions; the batch goes on
                    if database_unreachable(exc):
                        body = unreachable_error(exc).to_body()["error"]
                        await queue.put(BatchEvent(type="error", index=index, error=body))
                        continue
                    log.exception("batch create %d failed", index)
                    body = InternalError(str(exc) or type(exc).__name__).to_body()["error"]
                    await queue.put(BatchEvent(type="error", index=index, error=body))
                else:
                    await queue.put(BatchEvent(type="sandbox", index=index, sandbox=info))

        workers = min(concurrency, count)
        async with asyncio.TaskGroup() as group:
            for _ in range(workers):
                group.create_task(worker())
            created = failed = done = 0
            while done < count:
                ready = [await queue.get()]
                while not queue.empty() and len(ready) < _GROUP_MAX:
                    ready.append(queue.get_nowait())
                handed: list[BatchEvent] = []
                for event in ready:
                    done += 1
                    created += event.type == "sandbox"
                    failed += event.type == "error"
                    handed.append(event)
                    if done % _PROGRESS_EVERY == 0 or done == count:
                        elapsed_s = time.perf_counter() - started
                        handed.append(BatchEvent(type="progress" if done < count else "done", created=created,
                                                 failed=failed, total=count, elapsed_s=elapsed_s))  # fmt: skip
                yield handed

    @property
    def audit_trail(self) -> AuditLog:
        """The audit log, which a service that serves the API has (the control-plane bench places without one)."""
        if self.audit_log is None:
            raise InternalError("this server keeps no audit log")
        return self.audit_log

    async def get(self, sandbox_id: str) -> SandboxInfo:
        record = await self._reads.get(sandbox_id)
        if record is None:
            edge_of(sandbox_id)  # a malformed id gets the more useful message
            raise NotFound(f"no sandbox {sandbox_id}: it never existed here (check the id, or CORRAL_URL)")
        return record.to_info()

    async def check_exists(self, sandbox_id: str) -> None:
        """NotFound (as ``get``) unless the sandbox exists or existed here. An id once found is remembered: ids
        are never reused, so it stays valid. Every step with a step id asks, and a read each cost an RL step
        ~0.2 ms on SQLite and ~1 ms on PostgreSQL (docs/spec.md, RL lifecycle)."""
        if sandbox_id in self._existing:
            return
        await self.get(sandbox_id)
        if len(self._existing) >= _EXISTING_KEPT:
            self._existing.clear()  # read again when next asked: bounded memory
        self._existing.add(sandbox_id)

    async def list(self, *, states: list[str] | None, labels: dict[str, str]) -> list[SandboxInfo]:
        """Sandboxes by state and labels; fncall and warm pool sandboxes only when asked for by their label."""
        records = await self._db.run(self._store.list, states=states or _ACTIVE, labels=labels)
        for pool_label in (_POOL_LABEL, WARM_LABEL):
            if pool_label not in labels:
                records = [r for r in records if pool_label not in r.labels]
        return [r.to_info() for r in records]

    async def kill_everything(self) -> int:
        """Kill every sandbox live on this process's edges, pools' and fncall's too (a throwaway server whose caller
        went: Settings.stop_with_pid); how many. All at once, as a bulk kill: the backends bound their teardowns."""
        records = await self._db.run(self._store.list, states=_ACTIVE, labels={})
        ids = [record.id for record in records if record.edge_id in self._edges]
        outcomes = await asyncio.gather(*(self.kill(sandbox_id) for sandbox_id in ids), return_exceptions=True)
        for sandbox_id, outcome in zip(ids, outcomes, strict=True):
            if isinstance(outcome, Exception):
                log.warning("could not kill sandbox %s: %s", sandbox_id, outcome)
        return len(ids)

    async def kill(self, sandbox_id: str) -> SandboxInfo:
        info = await self.get(sandbox_id)
        if info.state in _LIVE and (ended := await self._destroy(sandbox_id, "killed")) is not None:
            return ended.to_info()
        return await self.get(sandbox_id)  # it had ended (or ends) by another way: as that left it

    async def cluster_nodes(self) -> builtins.list[ClusterNode]:
        return [ClusterNode.model_validate(row) for row in await self._db.run(self._store.nodes)]

    def _remote_up(self) -> builtins.list[Edge]:
        """The remote nodes placement uses now (up, heartbeating)."""
        if self._remote is None:
            return []
        return [self._remote.get(edge_id) for edge_id in self.scheduler.nodes if edge_id not in self._edges]

    async def node_stats(self) -> builtins.list[NodeStats]:
        """Stats of this process's edges, and of every remote node that is up and answers."""
        stats = [await edge.stats() for edge in self._edges.values()]
        if self._layer_fetcher is not None:  # this node caches layers fetched from a layer source
            cached = await asyncio.to_thread(self._layer_fetcher.cache_bytes)
            stats = [node.model_copy(update={"layer_cache_bytes": cached}) for node in stats]
        answers = await asyncio.gather(*(edge.stats() for edge in self._remote_up()), return_exceptions=True)
        return stats + [answer for answer in answers if isinstance(answer, NodeStats)]

    async def edge_metric_families(self) -> builtins.list[Metric]:
        """Every edge's own counters and histograms (edge/metrics.py): this process's, and those of the remote
        nodes that are up and answer within ``_EDGE_SCRAPE_TIMEOUT_S`` (one call each, all at once)."""
        families = [family for edge in self._edges.values() for family in await edge.metric_families()]
        asked = [asyncio.wait_for(edge.metric_families(), _EDGE_SCRAPE_TIMEOUT_S) for edge in self._remote_up()]
        for answer in await asyncio.gather(*asked, return_exceptions=True):
            if isinstance(answer, BaseException):
                log.warning("an edge's metrics did not come: %s", answer)
            else:
                families += answer
        return families

    async def save_checkpoint(self, sandbox_id: str) -> CheckpointInfo:
        self._raise_if_ended(await self.get(sandbox_id))
        saved = await self.call(sandbox_id, lambda edge: edge.save_checkpoint(sandbox_id))
        return CheckpointInfo.model_validate(saved)

    async def list_checkpoints(self, sandbox_id: str) -> builtins.list[CheckpointInfo]:
        self._raise_if_ended(await self.get(sandbox_id))
        found = await self.call(sandbox_id, lambda edge: edge.list_checkpoints(sandbox_id))
        return [CheckpointInfo.model_validate(item) for item in found]

    async def restore_checkpoint(self, sandbox_id: str, checkpoint_id: str) -> SandboxInfo:
        """Rewind the sandbox to one of its checkpoints (memory, processes, disk); it runs afterwards."""
        self._raise_if_ended(await self.get(sandbox_id))
        await self.call(sandbox_id, lambda edge: edge.rewind(sandbox_id, checkpoint_id))  # resumes it first
        return await self.get(sandbox_id)

    async def shutdown(self, sandbox_id: str, timeout_s: float) -> SandboxInfo:
        if not 0 <= timeout_s <= 600:
            raise InvalidRequest(f"timeout_s must be between 0 and 600, got {timeout_s}")
        info = await self.get(sandbox_id)
        if info.state in _LIVE:
            clean = False
            try:
                clean = await self.call(sandbox_id, lambda edge: edge.shutdown(sandbox_id, timeout_s))
            finally:  # destroyed and ended whatever the clean stop did
                message = "stopped cleanly" if clean else f"still running after {timeout_s:g}s: killed"
                await self._destroy(sandbox_id, "shutdown", message)
        return await self.get(sandbox_id)

    async def pause(self, sandbox_id: str, wait_reclaim: bool = False) -> PauseResult:
        """Freeze it with its state kept and give its memory back; any later request resumes it."""
        info = await self.get(sandbox_id)
        self._raise_if_ended(info)
        started = time.perf_counter()
        before, after = await self.call(sandbox_id, lambda edge: edge.pause(sandbox_id, wait_reclaim))
        duration_ms = (time.perf_counter() - started) * 1000
        if info.state != SandboxState.PAUSED:
            await self._db.run(self._store.mark_paused, sandbox_id, time.time())
            self.metrics.operations.labels("paused").inc()
            log.info("paused in %.0f ms", duration_ms)  # the request's sandbox (corral.logs.current_sandbox)
        return PauseResult(
            sandbox=await self.get(sandbox_id),
            memory_before_bytes=before,
            memory_after_bytes=after,
            reclaim_pending=not wait_reclaim,
            duration_ms=duration_ms,
        )

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        info = await self.get(sandbox_id)
        self._raise_if_ended(info)
        await self.call(sandbox_id, lambda edge: edge.resume(sandbox_id))
        await self._db.run(self._store.mark_resumed, sandbox_id, time.time())
        if info.state == SandboxState.PAUSED:
            self.metrics.operations.labels("resumed").inc()
        return await self.get(sandbox_id)

    async def _destroy(self, sandbox_id: str, reason: str, message: str | None = None) -> SandboxRecord | None:
        """Destroy it on its edge and mark its record ended, in a transaction shared with the ends of concurrent
        destroys (a bulk kill's); the record as ended, None if it had ended already."""
        edge = self._edge_for(edge_of(sandbox_id))
        if edge is not None:
            await edge.destroy(sandbox_id)
        self.scheduler.release(sandbox_id)
        ended = await self._writes.end(sandbox_id, SandboxState.ENDED, reason, message)
        self.metrics.ended.labels(reason).inc()
        log.info("ended: %s", reason, extra={"sandbox_id": sandbox_id})
        return ended

    async def set_ttl(self, sandbox_id: str, ttl_s: float | None) -> SandboxInfo:
        info = await self.get(sandbox_id)
        self._raise_if_ended(info)
        await self._db.run(self._store.update, sandbox_id, expires_at=time.time() + ttl_s if ttl_s else None)
        return await self.get(sandbox_id)

    @staticmethod
    def _raise_if_ended(info: SandboxInfo) -> None:
        if info.state in (SandboxState.ENDED, SandboxState.LOST):
            detail = f" ({info.status_message})" if info.status_message else ""
            raise SandboxGone(f"sandbox {info.id} has ended: {info.end_reason}{detail}; create a new one")

    # -- routing to the owning edge ------------------------------------------

    def _edge_for(self, edge_id: str) -> Edge | None:
        edge = self._edges.get(edge_id)
        if edge is None and self._remote is not None:
            return self._remote.get(edge_id)
        return edge

    def edge(self, sandbox_id: str) -> Edge:
        edge = self._edge_for(edge_of(sandbox_id))
        if edge is None:
            raise NotFound(
                f"sandbox {sandbox_id} belongs to edge {edge_of(sandbox_id)}, which this gateway does not know"
            )
        return edge

    async def call(self, sandbox_id: str, operation: Callable[[Edge], Awaitable[T]]) -> T:
        """Run an operation on the sandbox's edge; explain a miss from the record."""
        try:
            return await operation(self.edge(sandbox_id))
        except (NotFound, ServerUnavailable) as exc:
            await self._explain_missing(sandbox_id, exc)
            raise

    async def stream(self, sandbox_id: str, operation: Callable[[Edge], AsyncIterator[T]]) -> AsyncIterator[T]:
        try:
            async for item in operation(self.edge(sandbox_id)):
                yield item
        except (NotFound, ServerUnavailable) as exc:
            await self._explain_missing(sandbox_id, exc)
            raise

    async def _explain_missing(self, sandbox_id: str, exc: CorralError) -> None:
        record = await self._db.run(self._store.get, sandbox_id)
        if record is None:
            raise NotFound(f"no sandbox {sandbox_id}") from exc
        self._raise_if_ended(record.to_info())
