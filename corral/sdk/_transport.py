"""The HTTP transports under the SDK's clients: requests out, error answers turned into CorralErrors.

Both clients speak HTTP/1.1 through corral/sdk/_http1.py: a request written out whole, its answer parsed by
httptools (llhttp). The sync client's connections are blocking sockets shared by threads, the async client's
asyncio transports whose protocol feeds the parser.

Why not httpx's client and urllib3's pool (their use until 2026-12): a back-to-back exec of ``true`` cost the
calling process 0.13-0.15 ms of CPU through the sync transport here against 0.47-0.56 ms through urllib3
(http.client, and the email package parsing each answer's headers) and 0.57 ms through httpx's client (request
building, URL merging, its cookie jar, h11). The async client's CPU per call was 1.16-1.24 ms with 16 clients
(``corral bench fncall``), the largest share of a call there; httpcore's pool also walks every connection for
every request it queues, assigns or finishes, which with 1,000 connections under 1,000 concurrent execs capped the
client at ~40 execs/s (it had to be split into pools of 64). Here taking and giving back a connection is O(1).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import ssl
from collections.abc import AsyncIterator, Iterator
from typing import Any, Protocol
from urllib.parse import urlencode

import httpx

from corral.api.errors import ServerUnavailable, error_from_response
from corral.sdk._http1 import (
    AnswerParser,
    AsyncConnection,
    AsyncConnectionPool,
    Connection,
    ConnectionPool,
    LineSplitter,
    Origin,
    request_bytes,
)

__all__ = ["IDLE_EXPIRY_S", "MAX_CONNECTIONS", "MAX_IDLE_CONNECTIONS", "AsyncTransport", "Response", "SyncTransport"]

# An idle connection is dropped by the client after 60 s, long before the server's 620 s
# (``Settings.http_keepalive_s``): the side that closes an idle connection must be the side that
# would send on it next, or a request sent as the server closes is lost.
IDLE_EXPIRY_S = 60.0
MAX_CONNECTIONS = 1000  # the async client's, in use at once: a request beyond waits (within its timeout)
MAX_IDLE_CONNECTIONS = 100  # kept open for the next requests, per client


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context (httpx's default: certifi's CAs, or SSL_CERT_FILE / SSL_CERT_DIR) for every client of the
    process: making one costs ~18 ms of CPU."""
    return httpx.create_ssl_context()


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


class Response:
    """An answer, read whole, under httpx's names (``status_code``, ``content``, ``json()``, ``text``)."""

    __slots__ = ("content", "status_code")

    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code = status_code
        self.content = content

    def json(self) -> Any:
        return json.loads(self.content)

    @property
    def text(self) -> str:
        return self.content.decode()


def _answered(parser: AnswerParser) -> Response:
    """The whole answer ``parser`` read; an error answer raised as its CorralError."""
    response = Response(parser.status, b"".join(parser.body))
    _raise_for(response)
    return response


_TRANSPORT_ERRORS = (OSError,)  # BrokenAnswer, timeouts, refused and reset connections, TLS failures


class _Requests:
    """What both transports share: the origin, the request's fixed head, and requests written out whole."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        self.url = url
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._origin = Origin(url)
        self._prefix = self._origin.prefix
        self._head = (
            f"Host: {self._origin.host_header}\r\nAuthorization: Bearer {api_key}\r\n"
            f"User-Agent: corral-sdk/{_version()}\r\nAccept-Encoding: identity\r\n"
        ).encode()
        self._json_head = self._head + b"Content-Type: application/json\r\n"

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

    def _timeout(self, timeout_s: float | None) -> float:
        """A call's own ``timeout_s`` on top of the client's."""
        return self.timeout_s if timeout_s is None else timeout_s + self.timeout_s

    def _unreachable(self, exc: BaseException) -> ServerUnavailable:
        return ServerUnavailable(f"cannot reach the Corral server at {self.url}: {exc!r}")

    def _lost(self, exc: BaseException) -> ServerUnavailable:
        return ServerUnavailable(f"lost the stream from the Corral server at {self.url}: {exc!r}")


class SyncTransport(_Requests):
    """One pool of HTTP/1.1 connections on blocking sockets for the sync client, for any number of threads."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        super().__init__(url, api_key, timeout_s)
        self._pool = ConnectionPool(self._origin, max_idle=MAX_IDLE_CONNECTIONS, idle_expiry_s=IDLE_EXPIRY_S,
                                    tls=_tls_context)  # fmt: skip

    def _ask(self, request: bytes, timeout_s: float, *, whole: bool) -> tuple[Connection, AnswerParser]:
        """Send ``request`` on a pooled connection; read the answer (``whole``) or its head. The connection is the
        caller's to give back; on any failure it is closed (what is left of an answer must not reach the next)."""
        parser = AnswerParser()
        try:
            connection = self._pool.take(timeout_s)
        except _TRANSPORT_ERRORS as exc:
            raise self._unreachable(exc) from exc
        try:
            connection.send(request, timeout_s)
            (connection.read_answer if whole else connection.read_head)(parser)
        except BaseException as exc:
            connection.close()
            if isinstance(exc, _TRANSPORT_ERRORS):
                raise self._unreachable(exc) from exc
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
        request = self._request_bytes(method, path, params, json, content)
        connection, parser = self._ask(request, self._timeout(timeout_s), whole=True)
        self._pool.give_back(connection, parser)
        return _answered(parser)

    def stream_lines(
        self, method: str, path: str, *, timeout_s: float, params: dict[str, Any] | None = None, json: Any = None
    ) -> Iterator[str]:
        """The answer's non-empty lines as they arrive (each chunk as it comes); ``timeout_s`` bounds each wait."""
        request = self._request_bytes(method, path, params, json, None)
        connection, parser = self._ask(request, self._timeout(timeout_s), whole=False)
        read_to_end = False
        try:
            if parser.status >= 400:
                connection.read_answer(parser)
                _answered(parser)
            splitter = LineSplitter()
            for piece in connection.answer_pieces(parser):
                yield from splitter.lines(piece)
            yield from splitter.rest()
            read_to_end = True
        except _TRANSPORT_ERRORS as exc:
            raise self._lost(exc) from exc
        finally:
            if read_to_end or parser.complete:
                self._pool.give_back(connection, parser)
            else:
                connection.close()  # a half-read answer cannot carry the next request: its connection goes

    def close(self) -> None:
        self._pool.close()


class AsyncTransport(_Requests):
    """One pool of HTTP/1.1 connections on asyncio's transports for the async client (module docstring)."""

    def __init__(self, url: str, api_key: str, timeout_s: float) -> None:
        super().__init__(url, api_key, timeout_s)
        self._pool = AsyncConnectionPool(
            self._origin, max_connections=MAX_CONNECTIONS, max_idle=MAX_IDLE_CONNECTIONS,
            idle_expiry_s=IDLE_EXPIRY_S, tls=_tls_context,
        )  # fmt: skip

    async def _ask(self, request: bytes, timeout_s: float, *, whole: bool) -> tuple[AsyncConnection, AnswerParser]:
        """As SyncTransport._ask: the connection is the caller's to give back; closed on any failure."""
        parser = AnswerParser()
        try:
            connection = await self._pool.take(timeout_s)
        except _TRANSPORT_ERRORS as exc:
            raise self._unreachable(exc) from exc
        try:
            await connection.send(request, parser, timeout_s)
            if whole:
                await connection.read_answer(parser, timeout_s)
            else:
                await connection.read_head(parser, timeout_s)
        except BaseException as exc:
            self._pool.discard(connection)  # a cancelled request too: the rest of its answer must not be read
            if isinstance(exc, _TRANSPORT_ERRORS):
                raise self._unreachable(exc) from exc
            raise
        return connection, parser

    async def request(
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
        request = self._request_bytes(method, path, params, json, content)
        connection, parser = await self._ask(request, self._timeout(timeout_s), whole=True)
        self._pool.give_back(connection, parser)
        return _answered(parser)

    async def stream_lines(
        self, method: str, path: str, *, timeout_s: float, params: dict[str, Any] | None = None, json: Any = None
    ) -> AsyncIterator[str]:
        """The answer's non-empty lines as they arrive; ``timeout_s`` bounds each wait for more."""
        timeout = self._timeout(timeout_s)
        request = self._request_bytes(method, path, params, json, None)
        connection, parser = await self._ask(request, timeout, whole=False)
        given_back = False
        try:
            if parser.status >= 400:
                await connection.read_answer(parser, timeout)
                self._pool.give_back(connection, parser)
                given_back = True
                _answered(parser)
            splitter = LineSplitter()
            async for piece in connection.answer_pieces(parser, timeout):
                for line in splitter.lines(piece):
                    yield line
            self._pool.give_back(connection, parser)
            given_back = True
            for line in splitter.rest():
                yield line
        except _TRANSPORT_ERRORS as exc:
            raise self._lost(exc) from exc
        finally:
            if not given_back:
                self._pool.discard(connection)  # a half-read answer cannot carry the next request

    async def aclose(self) -> None:
        await self._pool.aclose()


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
