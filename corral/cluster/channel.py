"""A connection of a gateway's own to a node's edge actor, for the calls a sandbox's hot path makes.

A Ray actor call goes from the gateway's driver through the worker's task queue to the actor's thread and back:
about 4 ms on these machines, most of a cluster's exec round trip (docs/spec.md, "Cluster"). The edge actor
also listens on its node's address (``ChannelServer``); a gateway asks it through Ray for that address and a
random token, opens one TCP connection (``ChannelClient``) and sends the calls over it, each answered on the
edge's own event loop, many in flight at once. A connection that does not start with the token is closed
before anything else is read from it, so only a caller that can reach the actor through Ray can use it; what
follows is pickled, as Ray's own calls are.

Frames: a 4-byte length, then a pickled tuple. To the edge: ``("call", id, method, args, kwargs)``,
``("stream", id, method, args, kwargs)``, ``("cancel", id)`` (the caller left a stream: the edge closes it, which
ends its command). Back: ``("ok", id, value)``, ``("error", id, error)``, and for a stream ``("item", id,
value)`` ... ``("end", id)``. An error crosses as ``edge_error`` makes it, as through Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import itertools
import logging
import pickle
import secrets
import struct
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from corral.api.errors import CorralError, InternalError

__all__ = ["ChannelAddress", "ChannelClient", "ChannelClosed", "ChannelServer", "edge_error"]

log = logging.getLogger("corral.cluster")

_LENGTH = struct.Struct("!I")
_TOKEN_BYTES = 32
_HANDSHAKE_TIMEOUT_S = 5.0
_PICKLE_PROTOCOL = 5

Call = Callable[[str, tuple[Any, ...], dict[str, Any]], Awaitable[Any]]
Stream = Callable[[str, tuple[Any, ...], dict[str, Any]], AsyncGenerator[Any, None]]


class ChannelClosed(Exception):
    """The connection to the edge is gone (its node or actor went away, or the caller closed it)."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where an edge actor listens, and the token a connection opens with (handed out through Ray)."""

    host: str
    port: int
    token: bytes


def _frame(message: tuple[Any, ...]) -> list[bytes]:
    payload = pickle.dumps(message, protocol=_PICKLE_PROTOCOL)
    return [_LENGTH.pack(len(payload)), payload]


async def _read(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    message: tuple[Any, ...] = pickle.loads(await reader.readexactly(length))
    return message


def edge_error(cause: BaseException) -> CorralError:
    """What a gateway raises for an error its edge raised, through the channel or Ray: the same Corral error, any
    other as ``InternalError``."""
    if isinstance(cause, CorralError):
        return type(cause)(cause.message)
    return InternalError(f"the edge failed: {cause!r}")


class ChannelServer:
    """The edge actor's listener: each connection's calls run as tasks on this loop (the edge's)."""

    def __init__(self, call: Call, stream: Stream) -> None:
        self._call = call
        self._stream = stream
        self._token = secrets.token_bytes(_TOKEN_BYTES)
        self._server: asyncio.Server | None = None
        self.address: ChannelAddress | None = None

    async def start(self, host: str, port: int) -> ChannelAddress:
        self._server = await asyncio.start_server(self._serve, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = ChannelAddress(host, int(bound[1]), self._token)
        return self.address

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        streams: dict[int, asyncio.Task[None]] = {}  # a caller that goes away closes its streams, not its calls
        calls: set[asyncio.Task[None]] = set()
        try:
            token = await asyncio.wait_for(reader.readexactly(_TOKEN_BYTES), _HANDSHAKE_TIMEOUT_S)
            if not hmac.compare_digest(token, self._token):
                log.warning("a connection to the edge's channel from %s had the wrong token: closed",
                            writer.get_extra_info("peername"))  # fmt: skip
                return
            loop = asyncio.get_running_loop()
            while True:
                kind, request_id, *rest = await _read(reader)
                if kind == "cancel":
                    if (task := streams.get(request_id)) is not None:
                        task.cancel()
                elif kind == "stream":
                    task = streams[request_id] = loop.create_task(self._answer_stream(writer, request_id, *rest))
                    task.add_done_callback(functools.partial(_forget, streams, request_id))
                else:
                    call = loop.create_task(self._answer_call(writer, request_id, *rest))
                    calls.add(call)  # held until done (the loop keeps only a weak reference)
                    call.add_done_callback(calls.discard)
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError):
            pass  # the caller went away (or never said the token)
        except Exception:  # a frame it could not read: nothing after it can be trusted to line up
            log.exception("the edge's channel closed a connection it could not read")
        finally:
            for task in list(streams.values()):
                task.cancel()
            writer.close()

    async def _answer_call(
        self, writer: asyncio.StreamWriter, request_id: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            answer: tuple[Any, ...] = ("ok", request_id, await self._call(method, args, kwargs))
            frame = _frame(answer)
        except Exception as exc:  # noqa: BLE001 - the caller's to handle, as a Ray call's error would be
            frame = _frame(("error", request_id, edge_error(exc)))
        await _send(writer, frame)

    async def _answer_stream(
        self, writer: asyncio.StreamWriter, request_id: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            async with contextlib.aclosing(self._stream(method, args, kwargs)) as items:
                async for item in items:
                    await _send(writer, _frame(("item", request_id, item)))
            frame = _frame(("end", request_id))
        except Exception as exc:  # noqa: BLE001 - the caller's to handle
            frame = _frame(("error", request_id, edge_error(exc)))
        await _send(writer, frame)


def _forget(streams: dict[int, asyncio.Task[None]], request_id: int, _: asyncio.Task[None]) -> None:
    streams.pop(request_id, None)


async def _send(writer: asyncio.StreamWriter, frame: list[bytes]) -> None:
    if writer.is_closing():
        return  # the caller went away: a call's answer has nobody to go to
    writer.writelines(frame)
    with contextlib.suppress(ConnectionError):
        await writer.drain()


class ChannelClient:
    """A gateway's connection to one edge actor's channel (made with ``connect``; one event loop's)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self._waiting: dict[int, asyncio.Future[Any] | asyncio.Queue[tuple[Any, ...]]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._reading = asyncio.get_running_loop().create_task(self._read_forever(reader))

    @classmethod
    async def connect(cls, address: ChannelAddress, timeout_s: float) -> ChannelClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(address.host, address.port), timeout_s)
        writer.write(address.token)
        return cls(reader, writer)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the connection: what waits on it ends with ``ChannelClosed``."""
        self._reading.cancel()
        self._lost()

    async def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # noqa: ANN401
        request_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        try:
            await self._send(("call", request_id, method, args, kwargs))
            return await future
        finally:
            self._waiting.pop(request_id, None)

    async def stream(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """The items an edge's streaming method yields; leaving before its end closes it on the edge."""
        request_id = next(self._ids)
        items: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        self._waiting[request_id] = items
        ended = False
        try:
            await self._send(("stream", request_id, method, args, kwargs))
            while True:
                kind, *rest = await items.get()
                if kind == "item":
                    yield rest[0]
                    continue
                ended = True
                if kind == "end":
                    return
                raise rest[0] if kind == "error" else ChannelClosed("the edge's channel closed")
        finally:
            self._waiting.pop(request_id, None)
            if not ended and not self._closed:
                with contextlib.suppress(ChannelClosed):
                    await self._send(("cancel", request_id))

    async def _send(self, message: tuple[Any, ...]) -> None:
        if self._closed:
            raise ChannelClosed("the edge's channel is closed")
        self._writer.writelines(_frame(message))
        try:
            await self._writer.drain()
        except ConnectionError as exc:
            self._lost()
            raise ChannelClosed(f"the edge's channel closed: {exc}") from None

    async def _read_forever(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                kind, request_id, *rest = await _read(reader)
                waiting = self._waiting.get(request_id)
                if isinstance(waiting, asyncio.Queue):
                    waiting.put_nowait((kind, *rest))
                elif waiting is not None and not waiting.done():
                    waiting.set_result(rest[0]) if kind == "ok" else waiting.set_exception(rest[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception:  # an answer it could not read: the calls waiting learn the channel closed
            log.exception("a gateway's channel to an edge could not read an answer; closed")
        finally:
            self._lost()

    def _lost(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        for waiting in self._waiting.values():
            if isinstance(waiting, asyncio.Queue):
                waiting.put_nowait(("lost",))
            elif not waiting.done():
                waiting.set_exception(ChannelClosed("the edge's channel closed"))
