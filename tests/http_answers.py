"""A real HTTP/1.1 server on loopback (http.server, one thread a connection) for the SDK's transport tests: it
records what each request carried and answers by the path's last part, including the ways an answer goes wrong."""

from __future__ import annotations

import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import trustme

__all__ = ["AnswerServer", "serving", "tls_contexts"]


class AnswerServer(ThreadingHTTPServer):
    """``/missing`` 404; ``/slow`` waits for ``released``; ``/garbage`` not HTTP; ``/cut`` 10 of 100 bytes;
    ``/unframed`` no length; ``/lines`` chunked lines (the rest once ``first_line_read``), ``/forever`` the first
    and no end; ``/close`` asks to close; ``/then-hang-up`` closes after its answer; any other ``{"ok": true}``
    (with ``query`` when there is one)."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict[str, object]] = []
        self.peers: list[tuple[str, int]] = []
        self.first_line_read = threading.Event()
        self.released = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: AnswerServer

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        pass

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _answer(self) -> None:
        self.server.peers.append(self.client_address)
        url = urlsplit(self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.seen.append({"method": self.command, "path": url.path, "query": parse_qs(url.query,
                                 keep_blank_values=True), "body": body, "headers": dict(self.headers)})  # fmt: skip
        if url.path.endswith("/missing"):
            payload = json.dumps({"error": {"code": "not_found", "message": "no such thing"}}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if url.path.endswith("/slow"):
            self.server.released.wait(10)
        if url.path.endswith("/garbage"):
            self.wfile.write(b"SPDY/9 nonsense\r\n\r\n")
            self.close_connection = True
            return
        if url.path.endswith("/cut"):  # 100 bytes promised, 10 sent, then the connection's end
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            self.wfile.write(b"0123456789")
            self.close_connection = True
            return
        if url.path.endswith("/unframed"):  # neither a length nor chunks: the body runs to the connection's end
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"unframed": true}')
            self.close_connection = True
            return
        if url.path.endswith("/lines") or url.path.endswith("/forever"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self._chunk(b'{"n": 1}\n\n{"n"')  # a blank line, and a line cut across chunks
            if url.path.endswith("/forever"):  # then nothing more for a while, the answer still open
                self.server.released.wait(10)
                return
            self.server.first_line_read.wait(10)  # the client has the first line before the rest is sent
            self._chunk(b": 2}\r\n")
            self._chunk(b'{"n": 3}')
            self.wfile.write(b"0\r\n\r\n")
            return
        payload = json.dumps({"ok": True, "query": url.query}).encode() if url.query else b'{"ok": true}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        if url.path.endswith("/close"):
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)
        if url.path.endswith("/then-hang-up"):  # kept alive by the headers, closed by the server once idle
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = _answer


@contextmanager
def serving(tls: ssl.SSLContext | None = None) -> Iterator[AnswerServer]:
    server = AnswerServer()
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def tls_contexts() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server's TLS context with a certificate for 127.0.0.1, and a client's that trusts its (new) authority."""
    authority = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    authority.configure_trust(client)
    return server, client
