"""A node's edge as a detached, named Ray actor, pinned to its node and restarted there by Ray.

The actor runs the same ``LocalEdge`` as `corral serve`, over the real
backends, with the node's settings from its environment (``CORRAL_*`` set
when the node joined: its edge id, data dir, the shared database, the layer
store). Gateways call it through ``RayEdge`` (cluster/ray_edge.py). What the
edge notices on its own (a sandbox ended, paused, resumed; audit events) it
writes to the shared store itself, and it heartbeats its load there, so no
gateway has to be up for the node to stay known.

A Ray worker is multi-threaded, so it cannot enter a mount namespace of its
own: the node's launcher (``corral cluster up|join``) enters one before
``ray start``, and every worker of that raylet inherits it. The edge runs on
an event loop in a thread of its own, started in ``__init__``, so a
restarted actor re-adopts its node's sandboxes and heartbeats at once,
before any gateway calls it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any, TypeVar

from corral.api.errors import InvalidRequest
from corral.api.models import NodeStats, SandboxState
from corral.backends.base import LayerRef, SandboxSpec
from corral.cluster.channel import ChannelAddress, ChannelServer
from corral.config import Settings
from corral.edge.adoption import RECONCILE_EVERY_BEATS, end_stale, readopt
from corral.edge.local import LocalEdge
from corral.edge.protocol import EDGE_METHODS
from corral.guard.audit import AuditLog
from corral.images.fetch import layer_fetcher
from corral.images.store import LayerStore
from corral.node import build_edge, prepare_host
from corral.state.db import StateStore, database_unreachable

__all__ = [
    "ACTOR_NAMESPACE", "ACTOR_OWN", "BY_RAY", "CALLABLE", "ON_NODE", "STREAMING", "WIRE_NAMES", "EdgeActor",
    "NodeEdge", "actor_name", "node_resource",
]  # fmt: skip

log = logging.getLogger("corral.cluster")

T = TypeVar("T")

ACTOR_NAMESPACE = "corral"
ACTOR_OWN = frozenset({"start", "adopt", "close"})
"""Edge methods that do not cross to the actor: it starts its edge, adopts its node's sandboxes and closes itself."""
WIRE_NAMES = {"pack_diff": "pack_diff_bytes", "checkpoint": "checkpoint_on_node"}
"""Edge methods that take a path on the gateway's machine: RayEdge calls the node-side variant instead (the diff
comes back as bytes, the checkpoint stays in a scratch directory on the node)."""
STREAMING = frozenset({"exec_stream", "exec_stream_audited"})
"""Edge methods that yield: called through ``EdgeActor.stream``."""
CALLABLE = frozenset(WIRE_NAMES.get(name, name) for name in EDGE_METHODS - ACTOR_OWN - STREAMING)
"""What a gateway may call through ``EdgeActor.call``: derived from the Edge protocol, so a method added there is
callable here."""
ON_NODE = frozenset({"create", "discard_checkpoint", "stats", *WIRE_NAMES.values()})
"""The callable methods ``NodeEdge`` answers itself; the rest go to its ``LocalEdge``."""
BY_RAY = frozenset({"pack_diff_bytes", "upload_tar", "download_tar"})
"""Calls whose arguments or answers can be a whole layer or a tree's archive: they go through Ray, whose object
store is made for large objects; the rest through the edge's channel (cluster/channel.py), where a large frame
would hold up the small ones behind it."""


def actor_name(edge_id: str) -> str:
    return f"edge-{edge_id}"


def node_resource(edge_id: str) -> str:
    """The Ray custom resource a node offers (one unit) so its edge actor is placed, and restarted, there."""
    return f"corral_edge_{edge_id}"


_DB_WAIT_EVERY_S = 1.0


def _until_reachable(make: Callable[[], T]) -> T:
    """``make()``, tried again every second while the database cannot be reached."""
    while True:
        try:
            return make()
        except Exception as exc:
            if not database_unreachable(exc):
                raise
            log.warning("the state database is unreachable (%s); waiting for it", type(exc).__name__)
            time.sleep(_DB_WAIT_EVERY_S)


async def _until_reachable_async(run: Callable[[], Awaitable[object]]) -> None:
    while True:
        try:
            await run()
            return
        except Exception as exc:
            if not database_unreachable(exc):
                raise
            log.warning("the state database is unreachable (%s); waiting for it", type(exc).__name__)
            await asyncio.sleep(_DB_WAIT_EVERY_S)


class NodeEdge:
    """The node side: the LocalEdge, its records and heartbeat in the shared store, and the layers it fetches.

    It is the edge's ``EdgeEvents`` too: what the edge reports is written to the shared store directly."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store = _until_reachable(lambda: StateStore(settings.database))
        self._audit = AuditLog(self.store.engine)
        self._layers = LayerStore(settings.layer_dir)
        self._fetcher = layer_fetcher(settings, self._layers, settings.api_key or "", audit=self._audit.record)
        self.edge: LocalEdge = build_edge(settings, prepare_host(settings, inherited_namespace=True), self)
        self._heartbeat: asyncio.Task[None] | None = None
        self._creating: set[str] = set()  # creates in progress on this node (fetching layers or starting)
        self._channel = ChannelServer(self._call_by_channel, self._stream_by_channel)

    async def start(self, host: str | None = None) -> None:
        """Start the edge, heartbeat, re-adopt, heartbeat; then listen for gateways on ``host`` (the node's
        address; None: no channel, every call through Ray). A database that cannot be reached (a restart) is
        waited for: an actor whose constructor fails is not restarted by Ray, and its node would stay lost."""
        await self.edge.start()
        await _until_reachable_async(self._beat)  # heard at once: not taken for a lost node while it re-adopts
        await _until_reachable_async(lambda: readopt(self.edge, self.store, self.layer_refs))
        await _until_reachable_async(self._beat)
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat_forever())
        if host is not None and self.settings.edge_channel:
            try:
                address = await self._channel.start(host, self.settings.edge_channel_port)
            except OSError as exc:
                log.warning("edge %s: no channel for gateways on %s:%d (%s): they call it through Ray",
                            self.edge.edge_id, host, self.settings.edge_channel_port, exc)  # fmt: skip
            else:
                log.info("edge %s: gateways' channel on %s:%d", self.edge.edge_id, address.host, address.port)

    @property
    def channel_address(self) -> ChannelAddress | None:
        """Where gateways reach this edge directly, with the token to say; None: through Ray only."""
        return self._channel.address

    async def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, via: str) -> Any:  # noqa: ANN401
        """One Edge method a gateway called (``via`` Ray or the channel: counted by path)."""
        if method not in CALLABLE:
            raise InvalidRequest(f"the edge has no method {method!r}")
        self.edge.metrics.gateway_call(via)
        target: Any = self if method in ON_NODE else self.edge
        return await getattr(target, method)(*args, **kwargs)

    def stream(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], *, via: str
    ) -> AsyncGenerator[Any, None]:
        """An Edge method that yields (exec_stream and its audited form), called by a gateway."""
        if method not in STREAMING:
            raise InvalidRequest(f"the edge has no streaming method {method!r}")
        self.edge.metrics.gateway_call(via)
        items: AsyncGenerator[Any, None] = getattr(self.edge, method)(*args, **kwargs)
        return items

    async def _call_by_channel(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # noqa: ANN401
        if method in BY_RAY:
            raise InvalidRequest(f"{method} goes through Ray, not the edge's channel")
        return await self.call(method, args, kwargs, via="channel")

    def _stream_by_channel(
        self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AsyncGenerator[Any, None]:
        return self.stream(method, args, kwargs, via="channel")

    async def layer_refs(self, entries: Iterable[str]) -> tuple[LayerRef, ...]:
        """Stack entries (``digest`` or ``digest#alias``) to files on this node, fetching the missing ones."""
        refs = []
        for entry in entries:
            digest, _, alias = entry.partition("#")
            path = await self._fetcher.ensure(digest) if self._fetcher else self._layers.layer_path(digest)
            refs.append(LayerRef(digest=digest, path=path, alias=alias))
        return tuple(refs)

    async def create(self, spec: SandboxSpec) -> str | None:
        """The gateway's spec names the layers; the files are this node's (fetched first if missing), and the
        node's layer cache is kept under its budget, sparing these layers until the sandbox runs on them."""
        fetcher = self._fetcher
        self._creating.add(spec.sandbox_id)
        try:
            with fetcher.hold(ref.digest for ref in spec.layers) if fetcher else contextlib.nullcontext():
                layers = await self.layer_refs(ref.mount_key for ref in spec.layers)
                if fetcher is not None:
                    await fetcher.enforce_cache_budget(self._layers_in_use)
                return await self.edge.create(dataclasses.replace(spec, layers=layers))
        finally:
            self._creating.discard(spec.sandbox_id)

    async def end_orphaned_creates(self) -> list[str]:
        """End this node's sandboxes whose records still say creating ``create_orphan_after_s`` after they were
        recorded while no create of them runs here: the gateway that asked died (or lost the database) before
        it marked them running, so no client was ever told they exist. The record ends first (only if still
        creating), then the sandbox, if it got as far as running; returns their ids."""
        before = time.time() - self.settings.create_orphan_after_s
        candidates = await asyncio.to_thread(self.store.creating_before, self.edge.edge_id, before)
        ended = []
        for sandbox_id in candidates:
            if sandbox_id in self._creating:
                continue
            message = "its create was never answered (the gateway that asked went away); ended by its node"
            if not await asyncio.to_thread(
                self.store.end, sandbox_id, SandboxState.ENDED, "error", message, if_creating=True
            ):
                continue
            log.warning("edge %s: ending %s, %s", self.edge.edge_id, sandbox_id, message)
            if sandbox_id in await self.edge.sandbox_ids():
                await self.edge.destroy(sandbox_id)
            ended.append(sandbox_id)
        return ended

    def _layers_in_use(self) -> set[str]:
        """The layers this node's sandboxes run on, from the shared records (a paused VM has no mount)."""
        return self.store.layers_in_use([self.edge.edge_id])

    async def stats(self) -> NodeStats:
        """The edge's stats, with what this node's layer cache takes on disk."""
        stats = await self.edge.stats()
        if self._fetcher is None:
            return stats
        return stats.model_copy(update={"layer_cache_bytes": await asyncio.to_thread(self._fetcher.cache_bytes)})

    async def pack_diff_bytes(self, sandbox_id: str) -> bytes:
        """The sandbox's changes as an EROFS layer, returned whole (the gateway imports it into the store)."""
        dest = self._scratch() / f"{sandbox_id}-{time.monotonic_ns()}.erofs"
        try:
            await self.edge.pack_diff(sandbox_id, dest)
            return await asyncio.to_thread(dest.read_bytes)
        finally:
            dest.unlink(missing_ok=True)

    async def checkpoint_on_node(self, sandbox_id: str) -> Path:
        """A fork's checkpoint, in a scratch dir on this node (its children restore it here)."""
        dest = self._scratch() / f"fork-{sandbox_id}-{time.monotonic_ns()}"
        try:
            return await self.edge.checkpoint(sandbox_id, dest)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, dest, True)  # a half-written checkpoint is of no use
            raise

    async def discard_checkpoint(self, path: Path) -> None:
        if path.parent != self._scratch() or not path.name.startswith("fork-"):
            raise InvalidRequest(f"{path} is not a fork checkpoint of this node")
        await asyncio.to_thread(shutil.rmtree, path, True)

    def _scratch(self) -> Path:
        scratch = self.settings.data_dir / "scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        return scratch

    async def _beat(self) -> None:
        load = await self.edge.load()
        await asyncio.to_thread(self.store.heartbeat, self.edge.edge_id, load.model_dump(), time.time())

    async def _beat_forever(self) -> None:
        beats = 0
        while True:
            await asyncio.sleep(self.settings.node_heartbeat_s)
            beats += 1
            try:
                await self._beat()
                if beats % RECONCILE_EVERY_BEATS == 0:
                    await end_stale(self.edge, self.store)
                    await self.end_orphaned_creates()
            except Exception:
                log.exception("edge %s: heartbeat failed; retrying", self.edge.edge_id)

    async def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self._channel.close()
        await self.edge.close()
        if self._fetcher is not None:
            try:
                in_use: set[str] | None = await asyncio.to_thread(self._layers_in_use)
            except Exception:  # the database is down: let every helper go (free for an unused layer)
                log.warning("edge %s: could not read which layers are in use", self.edge.edge_id, exc_info=True)
                in_use = None
            await asyncio.to_thread(self._fetcher.close, in_use)
        self.store.close()

    # -- EdgeEvents ----------------------------------------------------------

    def ended(self, sandbox_id: str, reason: str, message: str) -> None:
        self.store.end(sandbox_id, SandboxState.ENDED, reason, message)

    def paused(self, sandbox_id: str, at: float) -> None:
        self.store.mark_paused(sandbox_id, at)

    def resumed(self, sandbox_id: str, at: float) -> None:
        self.store.mark_resumed(sandbox_id, at)

    def audit(self, sandbox_id: str, kind: str, severity: str, detail: dict[str, Any]) -> None:
        self._audit.record(sandbox_id, kind, severity, detail)


class EdgeActor:
    """The Ray actor around a ``NodeEdge`` (decorated with ``ray.remote`` where it is created)."""

    def __init__(self) -> None:
        settings = Settings()
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="corral-edge", daemon=True).start()
        from ray.util import get_node_ip_address  # a Ray worker's: imported where the actor runs

        self._node = self._run(self._open(settings, get_node_ip_address())).result()  # type: ignore[no-untyped-call]
        log.info("edge %s up on this node (data in %s)", settings.edge_id, settings.data_dir)

    @staticmethod
    async def _open(settings: Settings, host: str) -> NodeEdge:
        node = NodeEdge(settings)
        await node.start(host)
        return node

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One Edge method, run on the edge's own loop."""
        return await asyncio.wrap_future(self._run(self._node.call(method, args, kwargs, via="ray")))

    async def stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """An Edge method that yields (exec_stream and its audited form), item by item (a Ray streaming
        generator)."""
        items = self._node.stream(method, args, kwargs, via="ray")
        while True:
            try:
                yield await asyncio.wrap_future(self._run(items.__anext__()))
            except StopAsyncIteration:
                return

    def channel(self) -> ChannelAddress | None:
        """Where a gateway reaches this edge without Ray (cluster/channel.py); None: through Ray only."""
        return self._node.channel_address

    def pid(self) -> int:
        """This worker's process id (what a test kills to see Ray restart the edge)."""
        return os.getpid()
