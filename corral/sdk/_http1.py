"""HTTP/1.1 for the SDK: requests written out whole, answers parsed by httptools (llhttp, Node.js's parser).

Why (corral/sdk/_transport.py has the figures): urllib3's and httpx's clients spent three to eight times this CPU
a request, and httpcore's pool walks all its connections for every request.

The parts that do no I/O (``request_bytes``, ``AnswerParser``) are the protocol, written once; ``Connection`` and
``ConnectionPool`` move them over blocking sockets, ``AsyncConnection`` and ``AsyncConnectionPool`` over asyncio's
transports (a protocol whose ``data_received`` feeds the parser: no stream reader between). Left out on purpose:
proxies, redirects, retries, HEAD, request bodies of unknown length, 1xx answers (the SDK sends none of what
would bring them), compressed answers (it asks for ``identity``).
"""

from __future__ import annotations

import asyncio
import collections
import select
import socket
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from urllib.parse import urlsplit

import httptools

__all__ = [
    "AnswerParser", "AsyncConnection", "AsyncConnectionPool", "BrokenAnswer", "Connection", "ConnectionPool",
    "LineSplitter", "Origin", "request_bytes",
]  # fmt: skip

_READ_BYTES = 1 << 16


class BrokenAnswer(OSError):
    """The server's answer could not be read to its end: cut short, or not HTTP."""


class Origin:
    """Where the requests go: scheme, host, port, and the URL's own path (a prefix: a server behind a proxy)."""

    __slots__ = ("host", "host_header", "port", "prefix", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.host_header = host if parts.port is None else f"{host}:{parts.port}"
        self.prefix = parts.path.rstrip("/")


def request_bytes(method: str, target: str, head: bytes, body: bytes | None) -> bytes:
    """One request, whole: the request line, ``head`` (``Name: value\\r\\n`` lines, Host first) and the body."""
    if body is None:
        return b"%s %s HTTP/1.1\r\n%s\r\n" % (method.encode(), target.encode(), head)
    return b"%s %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
        method.encode(),
        target.encode(),
        head,
        len(body),
        body,
    )


class AnswerParser:
    """One answer's status and body pieces, fed the bytes as they come (httptools' callbacks)."""

    __slots__ = ("_delimited", "_keep_alive", "_parser", "body", "complete", "headers_done", "messages")

    def __init__(self) -> None:
        self.body: list[bytes] = []
        self.complete = False
        self.headers_done = False
        self.messages = 0
        self._delimited = False  # a Content-Length or chunked body (else it runs to the connection's end)
        self._keep_alive = False  # asked when the message ends: llhttp resets it for the next one after
        self._parser = httptools.HttpResponseParser(self)

    # httptools' callbacks
    def on_message_begin(self) -> None:
        self.messages += 1

    def on_header(self, name: bytes, _value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._delimited = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, data: bytes) -> None:
        self.body.append(data)

    def on_message_complete(self) -> None:
        self.complete = True
        self._keep_alive = bool(self._parser.should_keep_alive())

    def feed(self, data: bytes) -> None:
        """Parse ``data``; an empty ``data`` is the connection's end: an answer without a length ends there."""
        if not data:
            if self.headers_done and not self._delimited and not self.complete:
                self.complete = True
                return
            raise BrokenAnswer("the server closed the connection before its answer ended")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise BrokenAnswer(f"the server's answer is not HTTP/1.1: {exc}") from exc

    @property
    def status(self) -> int:
        return int(self._parser.get_status_code())

    def reusable(self) -> bool:
        """Whether the connection can carry another request: this answer read whole, kept alive, nothing after it."""
        return self.complete and self._delimited and self.messages == 1 and self._keep_alive


def _tls_of(origin: Origin, tls: Callable[[], ssl.SSLContext] | None) -> ssl.SSLContext | None:
    """The TLS context a new connection to ``origin`` uses: None for http, the pool's (else the system's) for https."""
    if not origin.tls:
        return None
    return tls() if tls is not None else ssl.create_default_context()


class LineSplitter:
    """An answer's body pieces as the lines they carry, a line cut across pieces joined; blank lines skipped."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def lines(self, piece: bytes) -> list[str]:
        *whole, self._pending = (self._pending + piece).split(b"\n")
        return [line.rstrip(b"\r").decode() for line in whole if line.strip(b"\r")]

    def rest(self) -> list[str]:
        """The last line, when the body did not end with a newline."""
        last, self._pending = self._pending, b""
        return [last.rstrip(b"\r").decode()] if last.strip(b"\r") else []


class Connection:
    """One kept-alive connection on a blocking socket; one request at a time."""

    def __init__(self, origin: Origin, timeout_s: float, tls: ssl.SSLContext | None) -> None:
        sock = socket.create_connection((origin.host, origin.port), timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one write; answer at once
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=origin.host)
        except BaseException:
            sock.close()
            raise
        self.sock: socket.socket = sock
        self._timeout_s: float | None = timeout_s
        self.idle_since = time.monotonic()

    def dropped(self) -> bool:
        """True when the server closed it (EOF waiting) or sent something unasked: not to be used again."""
        fd = self.sock.fileno()
        if fd < 0:
            return True
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        return bool(poller.poll(0))

    def send(self, data: bytes, timeout_s: float) -> None:
        if timeout_s != self._timeout_s:  # settimeout is two fcntl calls: most requests keep the last one's
            self.sock.settimeout(timeout_s)
            self._timeout_s = timeout_s
        self.sock.sendall(data)

    def answer_pieces(self, parser: AnswerParser) -> Iterator[bytes]:
        """The answer's body as it arrives (after its headers), until it is complete."""
        while True:
            if parser.body:  # some may have come with the headers
                pieces, parser.body = parser.body, []
                yield from pieces
            if parser.complete:
                return
            parser.feed(self.sock.recv(_READ_BYTES))

    def read_answer(self, parser: AnswerParser) -> None:
        while not parser.complete:
            parser.feed(self.sock.recv(_READ_BYTES))

    def read_head(self, parser: AnswerParser) -> None:
        while not parser.headers_done:
            parser.feed(self.sock.recv(_READ_BYTES))

    def close(self) -> None:
        self.sock.close()


class ConnectionPool:
    """Connections to one origin, for any number of threads: each request takes an idle one or opens one, and gives
    it back when its answer was read whole and kept alive. At most ``max_idle`` wait; one idle for
    ``idle_expiry_s`` is closed, not used (the client, which would send next, closes first: a request sent as the
    server closes the connection is lost)."""

    def __init__(
        self, origin: Origin, *, max_idle: int, idle_expiry_s: float, tls: Callable[[], ssl.SSLContext] | None
    ) -> None:
        self.origin = origin
        self._max_idle = max_idle
        self._idle_expiry_s = idle_expiry_s
        self._tls = tls
        self._idle: collections.deque[Connection] = collections.deque()
        self._lock = threading.Lock()
        self._closed = False

    def take(self, timeout_s: float) -> Connection:
        """An idle connection still good, else a new one."""
        now = time.monotonic()
        while True:
            try:
                connection = self._idle.pop()  # the most recently used: least likely to have expired
            except IndexError:
                break
            if now - connection.idle_since < self._idle_expiry_s and not connection.dropped():
                return connection
            connection.close()
        return Connection(self.origin, timeout_s, _tls_of(self.origin, self._tls))

    def give_back(self, connection: Connection, parser: AnswerParser) -> None:
        """Keep ``connection`` for the next request if ``parser``'s answer left it reusable; else close it."""
        if not parser.reusable():
            connection.close()
            return
        connection.idle_since = time.monotonic()
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle), collections.deque()
        for connection in idle:
            connection.close()


class _AnswerReader(asyncio.Protocol):
    """An async connection's protocol: bytes in go to the current answer's parser, and the one waiting for the
    answer is woken on progress (or its failure). Bytes nobody asked for, an EOF or an error mark it broken."""

    def __init__(self) -> None:
        self.parser: AnswerParser | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.broken = False
        self._writable: asyncio.Future[None] | None = None  # set while the transport's buffer is over its mark

    def data_received(self, data: bytes) -> None:
        if self.parser is None:
            self.broken = True  # nothing was asked
            return
        try:
            self.parser.feed(data)
        except BrokenAnswer as exc:
            self.broken = True
            self._wake(exc)
            return
        self._wake(None)

    def eof_received(self) -> bool:
        self._ended(None)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("the connection was lost while sending"))

    def _ended(self, exc: Exception | None) -> None:
        self.broken = True
        parser = self.parser
        if parser is None or parser.complete:
            return
        try:
            parser.feed(b"")  # an answer without a length ends here; any other is cut short
        except BrokenAnswer as broken:
            if exc is not None:
                broken.__cause__ = exc
            self._wake(broken)
            return
        self._wake(None)

    def _wake(self, error: Exception | None) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if error is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(error)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def writable(self) -> asyncio.Future[None] | None:
        """A future done when a paused transport takes writes again; None when it is not paused."""
        return self._writable if self._writable is not None and not self._writable.done() else None


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("timed out"))


class AsyncConnection:
    """One kept-alive connection on the running event loop; one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport, reader: _AnswerReader) -> None:
        self.loop = loop
        self._transport = transport
        self._reader = reader
        self.idle_since = time.monotonic()

    @classmethod
    async def open(cls, origin: Origin, timeout_s: float, tls: ssl.SSLContext | None) -> AsyncConnection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            transport, reader = await loop.create_connection(
                _AnswerReader, origin.host, origin.port, ssl=tls, server_hostname=origin.host if tls else None
            )
        try:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            transport.close()
            raise
        return cls(loop, transport, reader)

    def usable(self, loop: asyncio.AbstractEventLoop, now: float, expiry_s: float) -> bool:
        """Open, nothing unasked came, idle for less than ``expiry_s``, on this loop (a client outlives loops)."""
        return (
            not self._reader.broken
            and loop is self.loop
            and now - self.idle_since < expiry_s
            and not self._transport.is_closing()
        )

    async def send(self, data: bytes, parser: AnswerParser, timeout_s: float) -> None:
        """Write the request; its answer goes to ``parser``. Waits (at most ``timeout_s``) while the transport's
        buffer is full."""
        self._reader.parser = parser
        self._transport.write(data)
        writable = self._reader.writable()
        if writable is not None:
            timer = self.loop.call_later(timeout_s, _time_out, writable)
            try:
                await writable
            finally:
                timer.cancel()

    async def _progress(self, timeout_s: float) -> None:
        waiter = self._reader.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout_s, _time_out, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._reader.waiter = None

    async def read_answer(self, parser: AnswerParser, timeout_s: float) -> None:
        """Until the answer is whole; ``timeout_s`` bounds each wait for more of it."""
        while not parser.complete:
            await self._progress(timeout_s)

    async def read_head(self, parser: AnswerParser, timeout_s: float) -> None:
        while not parser.headers_done:
            await self._progress(timeout_s)

    async def answer_pieces(self, parser: AnswerParser, timeout_s: float) -> AsyncIterator[bytes]:
        """The answer's body as it arrives (after its headers), until it is complete."""
        while True:
            if parser.body:
                pieces, parser.body = parser.body, []
                for piece in pieces:
                    yield piece
            if parser.complete:
                return
            await self._progress(timeout_s)

    def finished(self) -> None:
        """The answer was read: bytes from now on are unasked."""
        self._reader.parser = None

    def close(self) -> None:
        self._reader.parser = None
        if self.loop.is_closed():
            return  # its loop ended (asyncio.run returned): the transport's finalizer closes the socket
        self._transport.close()


class AsyncConnectionPool:
    """Connections to one origin for the tasks of an event loop: at most ``max_connections`` in use (a request
    beyond waits for one, within its timeout), ``max_idle`` kept, none used after ``idle_expiry_s`` idle. Taking
    and giving back are O(1) whatever the number of connections (httpcore's pool walks them all, see
    corral/sdk/_transport.py). A client may outlive its event loop (``asyncio.run`` twice): the count of
    connections in use starts anew on each loop, as their connections do."""

    def __init__(
        self,
        origin: Origin,
        *,
        max_connections: int,
        max_idle: int,
        idle_expiry_s: float,
        tls: Callable[[], ssl.SSLContext] | None,
    ) -> None:
        self.origin = origin
        self._max_idle = max_idle
        self._idle_expiry_s = idle_expiry_s
        self._tls = tls
        self._idle: collections.deque[AsyncConnection] = collections.deque()
        self._max_connections = max_connections
        self._slots = asyncio.Semaphore(max_connections)  # bound to the loop of the first request that waits on it
        self._slots_loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    async def take(self, timeout_s: float) -> AsyncConnection:
        """An idle connection still good, else a new one; the caller gives it back (or discards it)."""
        loop = asyncio.get_running_loop()
        if loop is not self._slots_loop:  # a new loop: the last one's requests all ended with it
            self._slots, self._slots_loop = asyncio.Semaphore(self._max_connections), loop
        if self._slots.locked():
            async with asyncio.timeout(timeout_s):
                await self._slots.acquire()
        else:
            await self._slots.acquire()  # a free slot: returns without suspending
        try:
            now = time.monotonic()
            while self._idle:
                connection = self._idle.pop()  # the most recently used: least likely to have expired
                if connection.usable(loop, now, self._idle_expiry_s):
                    return connection
                connection.close()
            return await AsyncConnection.open(self.origin, timeout_s, _tls_of(self.origin, self._tls))
        except BaseException:
            self._slots.release()
            raise

    def give_back(self, connection: AsyncConnection, parser: AnswerParser) -> None:
        """Keep ``connection`` for the next request if ``parser``'s answer left it reusable; else close it."""
        self._release(connection)
        connection.finished()
        if parser.reusable() and not self._closed and len(self._idle) < self._max_idle:
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            connection.close()

    def discard(self, connection: AsyncConnection) -> None:
        """Close ``connection`` (a request on it failed or was cancelled) and free its slot."""
        self._release(connection)
        connection.close()

    def _release(self, connection: AsyncConnection) -> None:
        if connection.loop is self._slots_loop:
            self._slots.release()

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = list(self._idle), collections.deque()
        for connection in idle:
            connection.close()
