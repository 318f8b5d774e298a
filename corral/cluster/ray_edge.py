"""The gateway's side of a Ray cluster: an ``Edge`` that calls a node's edge actor.

Calls go over a connection the gateway keeps to the actor's channel (cluster/channel.py), asked for through Ray
on first use; large transfers, and every call of an edge whose channel is off or cannot be reached, go as Ray
actor calls. Arguments and results cross pickled (models, specs, bytes).
Errors come back as the Corral error the edge raised; an actor that is down
or restarting becomes ``ServerUnavailable`` (a create tries another node).
Paths do not cross nodes: a snapshot's diff layer comes back as bytes, and a
VM/gVisor fork's checkpoint stays on its node, where its children start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any, TypeVar

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from corral.api.errors import CorralError, InternalError, ServerUnavailable
from corral.api.models import ExecEvent, ExecRequest
from corral.cluster.channel import ChannelAddress, ChannelClient, ChannelClosed, edge_error
from corral.cluster.edge_actor import (
    ACTOR_NAMESPACE,
    BY_RAY,
    WIRE_NAMES,
    actor_name,
    node_resource,
)
from corral.edge.protocol import AuditedExec

__all__ = ["RayEdge", "RayEdges", "restarting_edges"]

log = logging.getLogger("corral.cluster")

T = TypeVar("T")

PROBE_TIMEOUT_S = 5.0
"""How long a node heard again after a silence gets to answer the probe before it is placed on (next beat: again)."""
CHANNEL_CONNECT_TIMEOUT_S = 5.0
CHANNEL_RETRY_S = 10.0
"""After an edge's channel was found missing or could not be reached, its calls go through Ray this long before it
is tried again (in the background: no call waits for a try)."""


class RayEdge:
    """``Edge`` over the named actor of one node: every Edge method not defined here is forwarded as is (the actor
    accepts exactly those, see edge_actor.CALLABLE); those defined here are the actor's own business or cross
    under another name (edge_actor.WIRE_NAMES)."""

    remote = True

    def __init__(self, edge_id: str) -> None:
        self.edge_id = edge_id
        self._handle: Any = None
        self._silent = asyncio.Event()  # set while the node's heartbeats have stopped (RayEdges.set_silent)
        self._probe: asyncio.Task[None] | None = None  # a call through to the edge of a node heard again
        self._channel: ChannelClient | None = None
        self._channel_lock = asyncio.Lock()  # one connection at a time is made
        self._connecting: asyncio.Task[None] | None = None  # a connection being made in the background
        self._channel_tried_at = -CHANNEL_RETRY_S  # when a channel was last found missing or unreachable

    async def _answer(self, pending: Awaitable[T]) -> T:
        """``pending``'s result, unless the node goes silent first: a call to a cut-off node would wait until
        Ray gives up on the node (tens of seconds) or for ever (a frozen one)."""
        if self._silent.is_set():
            raise self._gone_silent()
        answer = asyncio.ensure_future(pending)
        silence = asyncio.ensure_future(self._silent.wait())
        try:
            await asyncio.wait({answer, silence}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            silence.cancel()
        if not answer.done():
            answer.cancel()
            raise self._gone_silent()
        return answer.result()

    def set_silent(self, silent: bool) -> bool:
        """Set while the node's heartbeats have stopped: calls, and those waiting, end at once. Whether calls
        go through now: a node heard again after a silence is called again only once a probe (the actor's pid)
        has gone through, since the first call over a connection the silence broke fails ("the actor is
        temporarily unavailable", seen after a 30 s network cut) and a create that fails so is not sent again
        (it may have run)."""
        if silent:
            self._silent.set()
            self._drop_channel()  # a cut may leave it half open: a new one once the node answers again
            return False
        if not self._silent.is_set():
            return True
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().create_task(self._wake())
        return False

    async def _wake(self) -> None:
        try:
            actor = await self._actor()
            await asyncio.wait_for(asyncio.ensure_future(actor.pid.remote()), PROBE_TIMEOUT_S)
            await self._open_channel(probing=True)  # before any call: not on a call's time
        except (ActorUnavailableError, RayActorError, RayTaskError, CorralError, TimeoutError) as exc:
            if isinstance(exc, ActorDiedError):
                self._handle = None
            log.info("edge %s: heard again but not answering yet (%s)", self.edge_id, type(exc).__name__)
            return
        log.warning("edge %s answers again after its node's silence", self.edge_id)
        self._silent.clear()

    def _gone_silent(self) -> ServerUnavailable:
        return ServerUnavailable(f"edge {self.edge_id} is unavailable: its node stopped heartbeating")

    async def _actor(self) -> Any:
        if self._handle is None:
            try:
                self._handle = await asyncio.to_thread(ray.get_actor, actor_name(self.edge_id), ACTOR_NAMESPACE)
            except ValueError:
                raise ServerUnavailable(
                    f"edge {self.edge_id} has no actor in the Ray cluster: its node is down or has not joined"
                ) from None
        return self._handle

    def _unavailable(self, exc: BaseException) -> ServerUnavailable:
        if isinstance(exc, ActorDiedError):
            self._handle = None  # a new actor under the same name gets a new handle
        return ServerUnavailable(f"edge {self.edge_id} is unavailable (its node is down or the edge restarting): {exc}")

    async def _open_channel(self, *, probing: bool = False) -> ChannelClient | None:
        """The open connection to the actor's channel; None: this call goes through Ray. A connection is made in
        the background (the calls meanwhile go through Ray), so a channel that cannot be reached (a firewall that
        drops the packets) never holds a call up; after a failed try calls go through Ray ``CHANNEL_RETRY_S``
        before the next. ``probing``: the probe of a node heard again waits for the connection, so the node's
        first calls after the silence use it; the actor not answering the ask fails the probe."""
        if self._channel is not None and not self._channel.closed:
            return self._channel
        if probing:
            await self._connect_channel(probing=True)
            return self._channel
        if (
            self._connecting is None
            and not self._silent.is_set()  # the ask would wait on the silent node for nothing: the probe connects
            and time.monotonic() - self._channel_tried_at >= CHANNEL_RETRY_S
        ):
            self._connecting = asyncio.get_running_loop().create_task(self._connect_channel())
            self._connecting.add_done_callback(self._connected)
        return None

    def _connected(self, _: asyncio.Task[None]) -> None:
        self._connecting = None

    async def _connect_channel(self, *, probing: bool = False) -> None:
        """Ask the actor (through Ray) where its channel is and connect to it. A connection that fails is logged,
        and calls go through Ray until the next try; an ask the actor does not answer too, unless ``probing``
        (raised: the node is not let back in yet)."""
        async with self._channel_lock:
            if self._channel is not None and not self._channel.closed:
                return
            try:
                actor = await self._actor()
                ask = getattr(actor, "channel", None)
                address: ChannelAddress | None = (
                    None
                    if ask is None
                    else await asyncio.wait_for(asyncio.ensure_future(ask.remote()), PROBE_TIMEOUT_S)
                )
            except (TimeoutError, RayActorError, RayTaskError, ActorUnavailableError, CorralError) as exc:
                self._channel_tried_at = time.monotonic()
                if probing:
                    raise
                log.warning("edge %s: its actor did not say where its channel is (%s); calling it through Ray",
                            self.edge_id, type(exc).__name__)  # fmt: skip
                return
            if address is None:  # an edge without one (CORRAL_EDGE_CHANNEL=false, or an older Corral's actor)
                self._channel_tried_at = time.monotonic()
                return
            try:
                self._channel = await ChannelClient.connect(address, CHANNEL_CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                self._channel_tried_at = time.monotonic()
                log.warning("edge %s: its channel at %s:%d cannot be reached (%s); calling it through Ray for %.0f s",
                            self.edge_id, address.host, address.port, exc, CHANNEL_RETRY_S)  # fmt: skip

    def _drop_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def _channel_lost(self, exc: ChannelClosed) -> ServerUnavailable:
        """Why a call over the channel failed: its node went silent (``set_silent`` closed the channel, which ends
        what waits on it, so those calls need no race with the silence of their own), or the connection broke."""
        if self._silent.is_set():
            return self._gone_silent()
        self._drop_channel()
        self._handle = None  # the actor may be a new one (restarted): ask Ray for it again
        return ServerUnavailable(f"edge {self.edge_id} is unavailable (its node is down or the edge restarting): {exc}")

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        channel = None if method in BY_RAY else await self._open_channel()
        if channel is not None:
            try:
                return await channel.call(method, args, kwargs)
            except ChannelClosed as exc:
                raise self._channel_lost(exc) from None
        actor = await self._actor()
        try:
            return await self._answer(actor.call.remote(method, *args, **kwargs))
        except RayTaskError as exc:
            raise edge_error(exc.cause) from None
        except (ActorUnavailableError, RayActorError) as exc:
            raise self._unavailable(exc) from None

    def __getattr__(self, method: str) -> Callable[..., Coroutine[Any, Any, Any]]:
        if method.startswith("_"):
            raise AttributeError(method)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await self._call(method, *args, **kwargs)

        return call

    async def start(self) -> None:
        """The actor started itself (and re-adopted its sandboxes)."""

    async def close(self) -> None:
        """The actor outlives gateways: only this gateway's connection to it closes (or stops being made)."""
        if self._connecting is not None:
            self._connecting.cancel()
        self._drop_channel()

    async def adopt(self, specs: list[Any]) -> dict[str, str | None]:
        raise InternalError("a Ray edge adopts its sandboxes itself when it starts")

    async def pack_diff(self, sandbox_id: str, dest: Path) -> None:
        data = await self._call(WIRE_NAMES["pack_diff"], sandbox_id)
        await asyncio.to_thread(dest.write_bytes, data)

    async def checkpoint(self, sandbox_id: str, dest: Path) -> Path:
        """Checkpoint into a scratch dir on the sandbox's node (``dest`` is the gateway's); returns that dir,
        which its forks restore from there (``discard_checkpoint`` removes it)."""
        written: Path = await self._call(WIRE_NAMES["checkpoint"], sandbox_id)
        return written

    def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        return self._stream("exec_stream", sandbox_id, request)

    def exec_stream_audited(
        self, sandbox_id: str, request: ExecRequest, *, step_files: bool = False
    ) -> AsyncIterator[ExecEvent | AuditedExec]:
        return self._stream("exec_stream_audited", sandbox_id, request, step_files=step_files)

    async def _stream(self, method: str, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """A streaming Edge method's items as the actor yields them; leaving early closes it on the edge."""
        channel = await self._open_channel()
        if channel is not None:
            try:
                async with contextlib.aclosing(channel.stream(method, args, kwargs)) as items:
                    async for item in items:
                        yield item
                return
            except ChannelClosed as exc:
                raise self._channel_lost(exc) from None
        actor = await self._actor()
        try:
            refs = actor.stream.options(num_returns="streaming").remote(method, *args, **kwargs)
            while True:
                try:
                    ref = await self._answer(refs.__anext__())
                except StopAsyncIteration:
                    return
                yield await self._answer(ref)
        except RayTaskError as exc:
            raise edge_error(exc.cause) from None
        except (ActorUnavailableError, RayActorError) as exc:
            raise self._unavailable(exc) from None


class RayEdges:
    """The cluster's edges by id, each resolved to its actor on first use."""

    def __init__(self) -> None:
        self._edges: dict[str, RayEdge] = {}

    def get(self, edge_id: str) -> RayEdge:
        edge = self._edges.get(edge_id)
        if edge is None:
            edge = self._edges[edge_id] = RayEdge(edge_id)
        return edge

    def set_silent(self, edge_id: str, silent: bool) -> bool:
        return self.get(edge_id).set_silent(silent)

    def restarting(self, last_seen: Mapping[str, float]) -> set[str]:
        """Of these edges (id -> when its node last heartbeat), those Ray is restarting on a live raylet: the
        actor is RESTARTING, or was restarted (ALIVE again, which Ray says once it has leased a worker, before
        the constructor, the re-adoption, has run) after the node's last heartbeat. The edge's process died and
        a new one re-adopts the node's sandboxes. A machine that stopped keeps its actor ALIVE in Ray's books
        until Ray's health checks give up on the node, and a frozen edge stays ALIVE from before its last
        heartbeat: neither is restarting. Asks Ray's GCS; an answer it cannot give counts as no restart, so the
        node is marked lost as it would have been."""
        if not last_seen:
            return set()
        try:
            # The GCS actor table: Ray's public state API needs the dashboard, which cluster nodes run without.
            actors = list(ray._private.state.state.actor_table(None).values())
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
        except Exception:
            log.warning("could not ask Ray which edges are restarting", exc_info=True)
            return set()
        return restarting_edges(actors, nodes, last_seen)


def restarting_edges(
    actors: list[dict[str, Any]], nodes: list[dict[str, Any]], last_seen: Mapping[str, float]
) -> set[str]:
    """``RayEdges.restarting`` over what Ray's GCS said: its actor table's entries and ``ray.nodes()``."""
    # One live actor per name; dead ones of the same name (a node that left and joined again) stay listed.
    live = {info["Name"]: info for info in actors if info["State"] != "DEAD"}
    alive = {resource for node in nodes if node.get("Alive") for resource in node.get("Resources", {})}
    restarting = set()
    for edge_id, seen in last_seen.items():
        info = live.get(actor_name(edge_id))
        if info is None or node_resource(edge_id) not in alive:
            continue
        # Timestamp: when the actor's state last changed (ms), here when it came back.
        if info["State"] == "RESTARTING" or (
            info["State"] == "ALIVE" and info["NumRestarts"] > 0 and info["Timestamp"] / 1000 > seen
        ):
            restarting.add(edge_id)
    return restarting
