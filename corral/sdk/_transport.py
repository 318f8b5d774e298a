"""The HTTP transports under the SDK's clients: httpx's, with one check made cheap for the async one.

Before every request httpcore asks each idle pooled connection whether its socket is readable (the
server closed it). Through anyio that question builds the stream's attribute table, with a
`getpeername` call, every time: with 16 connections it was a fifth of the async client's CPU per
call. The wrapper answers it with one `poll` on the same socket and leaves everything else (connect,
TLS, reads, writes, timeouts, errors) to httpcore's own backend.

httpcore's pool also does work proportional to its connections for every request it queues, assigns or
finishes (it walks them all): one pool of 1,000 connections under 1,000 concurrent execs spent over half the
async client's CPU there (py-spy, `corral bench load`) and capped the client at ~40 execs/s. So the async
client's connections are split over pools of at most ``SHARD_CONNECTIONS``, requests dealt round-robin.
"""

from __future__ import annotations

import itertools
import math
import select
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

__all__ = ["POOL_LIMITS", "SHARD_CONNECTIONS", "async_http_transport", "sync_http_transport"]

# An idle connection is dropped by the client after 60 s, long before the server's 620 s
# (``Settings.http_keepalive_s``): the side that closes an idle connection must be the side that
# would send on it next, or a request sent as the server closes is lost (httpx.ReadError).
POOL_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=60.0)
SHARD_CONNECTIONS = 64


def _readable(sock: socket.socket) -> bool:
    """True when the socket has data or EOF waiting, or is closed (what httpcore's own check answers)."""
    fd = sock.fileno()
    if fd < 0:
        return True
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


class _Stream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._socket: socket.socket | None = stream.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._stream.start_tls(ssl_context, server_hostname, timeout))

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and self._socket is not None:
            return _readable(self._socket)
        return self._stream.get_extra_info(info)


class _Backend(httpcore.AsyncNetworkBackend):
    def __init__(self, backend: httpcore.AsyncNetworkBackend) -> None:
        self._backend = backend

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._backend.connect_tcp(host, port, timeout, local_address, socket_options))

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.AsyncNetworkStream:
        return _Stream(await self._backend.connect_unix_socket(path, timeout, socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _ShardedTransport(httpx.AsyncBaseTransport):
    """Several connection pools as one transport (module docstring): each request goes to the next pool."""

    def __init__(self, shards: list[httpx.AsyncHTTPTransport]) -> None:
        self.shards = shards
        self._next = itertools.cycle(shards)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await next(self._next).handle_async_request(request)

    async def aclose(self) -> None:
        for shard in self.shards:
            await shard.aclose()


def async_http_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """httpx's transport (its TLS and proxy settings untouched) over the cheap readability check; over several
    pools when ``limits`` allow more than ``SHARD_CONNECTIONS`` connections, together within ``limits``."""
    total = limits.max_connections
    if total is None or total <= SHARD_CONNECTIONS:
        return _pool_transport(limits)
    count = math.ceil(total / SHARD_CONNECTIONS)
    keepalive = limits.max_keepalive_connections
    per_shard = httpx.Limits(
        max_connections=total // count,
        max_keepalive_connections=None if keepalive is None else max(1, keepalive // count),
        keepalive_expiry=limits.keepalive_expiry,
    )
    return _ShardedTransport([_pool_transport(per_shard) for _ in range(count)])


def _pool_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(limits=limits)
    pool = getattr(transport, "_pool", None)  # httpx==0.28 and httpcore 1.x, as pinned: else left as it is
    if isinstance(pool, httpcore.AsyncConnectionPool) and hasattr(pool, "_network_backend"):
        pool._network_backend = _Backend(pool._network_backend)
    return transport


def sync_http_transport(limits: httpx.Limits) -> httpx.HTTPTransport:
    """The sync stream's readability check is already one `poll`: httpx's transport as it is."""
    return httpx.HTTPTransport(limits=limits)
