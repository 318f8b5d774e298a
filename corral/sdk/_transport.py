"""The HTTP transports under the SDK's clients: requests out, error answers turned into CorralErrors.

The async client's is httpx's, with one check made cheap. Before every request httpcore asks each idle
pooled connection whether its socket is readable (the server closed it). Through anyio that question
builds the stream's attribute table, with a `getpeername` call, every time: with 16 connections it was a
fifth of the async client's CPU per call. The wrapper answers it with one `poll` on the same socket and
leaves everything else (connect, TLS, reads, writes, timeouts, errors) to httpcore's own backend.

httpcore's pool also does work proportional to its connections for every request it queues, assigns or
finishes (it walks them all): one pool of 1,000 connections under 1,000 concurrent execs spent over half the
async client's CPU there (py-spy, `corral bench load`) and capped the client at ~40 execs/s. So the async
client's connections are split over pools of at most ``SHARD_CONNECTIONS``, requests dealt round-robin.

The sync client's is corral/sdk/_http1.py's pool: requests written whole, answers parsed by httptools. An exec
round trip cost the calling process 0.13-0.15 ms of CPU there, against 0.47-0.56 ms through urllib3 (its use until
2026-12; http.client and the email package's header parsing) and 0.57 ms through httpx's client.
"""

from __future__ import annotations

import functools
import importlib.metadata
import itertools
import json
import math
import select
import socket
import ssl
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any, Protocol
from urllib.parse import urlencode

import httpcore
import httpx

from corral.api.errors import ServerUnavailable, error_from_response
from corral.sdk._http1 import AnswerParser, Connection, ConnectionPool, Origin, request_bytes

__all__ = ["POOL_LIMITS", "SHARD_CONNECTIONS", "AsyncTransport", "Response", "SyncTransport", "async_http_transport"]

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


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context (httpx's default: certifi's CAs) for every pool of the process, both clients: httpx makes
    one per transport at ~18 ms of CPU each, and an async client has 16 pools, so an AsyncClient cost 0.3 s of
    CPU to make before a single request (``corral bench fncall``'s throughput runs paid it in their figures)."""
    return httpx.create_ssl_context()


def _pool_transport(limits: httpx.Limits) -> httpx.AsyncHTTPTransport:
    transport = httpx.AsyncHTTPTransport(limits=limits, verify=_tls_context())
    pool = getattr(transport, "_pool", None)  # httpx==0.28 and httpcore 1.x, as pinned: else left as it is
    if isinstance(pool, httpcore.AsyncConnectionPool) and hasattr(pool, "_network_backend"):
        pool._network_backend = _Backend(pool._network_backend)
    return transport


class _Answer(Protocol):
    @property
    def status_code(self) -> int: ...

    def json(self) -> Any: ...


def _raise_for(response: _Answer) -> None:
    if response.status_code < 400:
        return
    try:
        body = response.json()
    except ValueError:
        body = None
    raise error_from_response(response.status_code, body)


class AsyncTransport:
    """One httpx connection pool (sharded, above) for the async client."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(timeout_s),
            transport=async_http_transport(POOL_LIMITS),
        )

    async def request(self, method: str, path: str, *, timeout_s: float | None = None, **kwargs: Any) -> httpx.Response:
        """``timeout_s``: the call's own time, on top of the client's; ``kwargs``: params, json or content."""
        if timeout_s is not None:
            kwargs["timeout"] = httpx.Timeout(timeout_s + self.timeout_s)
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"cannot reach the Corral server at {self.url}: {exc!r}") from exc
        _raise_for(response)
        return response

    async def stream_lines(self, method: str, path: str, *, timeout_s: float, **kwargs: Any) -> AsyncIterator[str]:
        """The answer's non-empty lines as they arrive; ``timeout_s`` bounds each wait for more."""
        try:
            async with self._http.stream(
                method, path, timeout=httpx.Timeout(timeout_s + self.timeout_s), **kwargs
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    _raise_for(response)
                async for line in response.aiter_lines():
                    if line:
                        yield line
        except httpx.TransportError as exc:
            raise ServerUnavailable(f"lost the stream from the Corral server at {self.url}: {exc!r}") from exc

    async def aclose(self) -> None:
        await self._http.aclose()


class Response:
    """An answer as the sync client reads it, under httpx's names (the async client's answers are httpx's)."""

    __slots__ = ("content", "status_code")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode()


_TRANSPORT_ERRORS = (OSError,)  # BrokenAnswer, timeouts, refused and reset connections, TLS failures


class SyncTransport:
    """One pool of HTTP/1.1 connections (corral/sdk/_http1.py) for the sync client, with the async one's methods."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        origin = Origin(url)
        self._prefix = origin.prefix
        self._head = (
            f"Host: {origin.host_header}\r\nAuthorization: Bearer {api_key}\r\n"
            f"User-Agent: corral-sdk/{_version()}\r\nAccept-Encoding: identity\r\n"
        ).encode()
        self._json_head = self._head + b"Content-Type: application/json\r\n"
        self._pool = ConnectionPool(
            origin,
            max_idle=POOL_LIMITS.max_keepalive_connections or 1,
            idle_expiry_s=POOL_LIMITS.keepalive_expiry or 60.0,
            tls=_tls_context,  # the CAs the async client trusts
        )

    def _request_bytes(
        self, method: str, path: str, params: dict[str, Any] | None, body: Any, content: bytes | None
    ) -> bytes:
        head = self._head
        if body is not None:  # as httpx encodes json=
            content = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
            head = self._json_head
        target = self._prefix + path
        if params:
            target += "?" + urlencode([(k, _query_value(v)) for k, v in params.items()], doseq=True)
        if content is None and method in ("POST", "PUT", "PATCH"):
            content = b""  # a length, as urllib3 and httpx send for these methods
        return request_bytes(method, target, head, content)

    def _ask(self, request: bytes, timeout_s: float, *, whole: bool) -> tuple[Connection, AnswerParser]:
        """Send ``request`` on a pooled connection; read the answer (``whole``) or its head. The connection is the
        caller's to give back; on any failure it is closed (what is left of an answer must not reach the next)."""
        parser = AnswerParser()
        try:
            connection = self._pool.take(timeout_s)
        except _TRANSPORT_ERRORS as exc:
            raise ServerUnavailable(f"cannot reach the Corral server at {self.url}: {exc!r}") from exc
        try:
            connection.send(request, timeout_s)
            (connection.read_answer if whole else connection.read_head)(parser)
        except BaseException as exc:
            connection.close()
            if isinstance(exc, _TRANSPORT_ERRORS):
                raise ServerUnavailable(f"cannot reach the Corral server at {self.url}: {exc!r}") from exc
            raise
        return connection, parser

    def request(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float | None = None,
        params: dict[str, Any] | None = None,
        json: Any = None,
        content: bytes | None = None,
    ) -> Response:
        """``timeout_s``: the call's own time, on top of the client's (each wait for the server bounded by it)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s + self.timeout_s
        connection, parser = self._ask(self._request_bytes(method, path, params, json, content), timeout, whole=True)
        self._pool.give_back(connection, parser)
        response = Response(parser.status, b"".join(parser.body))
        _raise_for(response)
        return response

    def stream_lines(
        self, method: str, path: str, *, timeout_s: float, params: dict[str, Any] | None = None, json: Any = None
    ) -> Iterator[str]:
        """The answer's non-empty lines as they arrive (each chunk as it comes); ``timeout_s`` bounds each wait."""
        request = self._request_bytes(method, path, params, json, None)
        connection, parser = self._ask(request, timeout_s + self.timeout_s, whole=False)
        read_to_end = False
        try:
            if parser.status >= 400:
                connection.read_answer(parser)
                _raise_for(Response(parser.status, b"".join(parser.body)))
            pending = b""
            for chunk in connection.answer_pieces(parser):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    if line.strip(b"\r"):
                        yield line.rstrip(b"\r").decode()
            if pending.strip(b"\r"):
                yield pending.rstrip(b"\r").decode()
            read_to_end = True
        except _TRANSPORT_ERRORS as exc:
            raise ServerUnavailable(f"lost the stream from the Corral server at {self.url}: {exc!r}") from exc
        finally:
            if read_to_end or parser.complete:
                self._pool.give_back(connection, parser)
            else:
                connection.close()  # a half-read answer cannot carry the next request: its connection goes

    def close(self) -> None:
        self._pool.close()


@functools.cache
def _version() -> str:
    try:
        return importlib.metadata.version("corral")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _query_value(value: Any) -> Any:
    """A query parameter's value as httpx writes it (``true``/``false``, empty for None); lists repeat the key."""
    if isinstance(value, (list, tuple)):
        return [_query_value(item) for item in value]
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else value
