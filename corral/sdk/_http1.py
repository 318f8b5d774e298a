"""HTTP/1.1 for the SDK: requests written out whole, answers parsed by httptools (llhttp, Node.js's parser).

Why not urllib3 (the sync client's transport until 2026-12): on a back-to-back exec of ``true`` the calling process
spent 0.47-0.56 ms of CPU a request there, most of it in ``http.client`` (a request built header by header, an
answer's headers parsed by the ``email`` package) against 0.13-0.15 ms for the same request written in one piece and
its answer parsed by httptools; the round trip's p50 went 1.78-2.26 -> 1.41-1.72 ms (same run, alternating).

The parts that do no I/O (``request_bytes``, ``AnswerParser``) are the protocol; ``Connection`` and ``ConnectionPool``
move them over blocking sockets. What is left out, on purpose: proxies, redirects, retries, HEAD, request bodies
of unknown length, 1xx answers (the SDK sends none of what would bring them); answers compressed (it asks for
``identity``).
"""

from __future__ import annotations

import collections
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import httptools

__all__ = ["AnswerParser", "BrokenAnswer", "Connection", "ConnectionPool", "Origin", "request_bytes"]

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
        self.sock.settimeout(timeout_s)
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
        tls = self._tls() if self.origin.tls and self._tls is not None else None
        if self.origin.tls and tls is None:
            tls = ssl.create_default_context()
        return Connection(self.origin, timeout_s, tls)

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
