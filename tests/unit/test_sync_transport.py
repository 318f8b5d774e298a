"""The sync SDK's HTTP transport (urllib3) against a real HTTP/1.1 server on loopback: what it sends, how it
streams, what it does with a stream left half read, and its errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from corral.api.errors import NotFound, ServerUnavailable
from corral.embedded import free_port
from corral.sdk._transport import SyncTransport


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict[str, object]] = []
        self.peers: list[tuple[str, int]] = []
        self.first_line_read = threading.Event()
        self.released = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

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
        payload = json.dumps({"ok": True}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _answer


@pytest.fixture
def server() -> Iterator[_Server]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.released.set()
        server.shutdown()
        server.server_close()
        thread.join(10)


def _transport(server: _Server, prefix: str = "", timeout_s: float = 10.0) -> SyncTransport:
    return SyncTransport(f"http://127.0.0.1:{server.server_address[1]}{prefix}", "ck_test", timeout_s)


def test_a_request_carries_the_key_its_query_as_httpx_writes_it_and_a_compact_json_body(server: _Server) -> None:
    transport = _transport(server, "/behind/a/proxy/")
    try:
        response = transport.request(
            "POST", "/v1/thing", params={"flag": True, "off": False, "none": None, "label": ["a=1", "b=2"], "n": 3},
            json={"cmd": ["echo", "é"]},
        )  # fmt: skip
        assert (response.status_code, response.json()) == (200, {"ok": True})
        transport.request("PUT", "/v1/raw", content=b"\x00bytes")
    finally:
        transport.close()
    sent, raw = server.seen
    assert sent["path"] == "/behind/a/proxy/v1/thing"
    assert sent["query"] == {"flag": ["true"], "off": ["false"], "none": [""], "label": ["a=1", "b=2"], "n": ["3"]}
    assert sent["body"] == '{"cmd":["echo","é"]}'.encode()
    headers = sent["headers"]
    assert isinstance(headers, dict)
    assert headers["Authorization"] == "Bearer ck_test" and headers["Content-Type"] == "application/json"
    assert raw["body"] == b"\x00bytes" and raw["path"] == "/behind/a/proxy/v1/raw"
    assert len(set(server.peers)) == 1  # one kept-alive connection for both


def test_stream_lines_yields_each_line_as_it_arrives_skipping_blank_ones(server: _Server) -> None:
    transport = _transport(server)
    try:
        lines = transport.stream_lines("GET", "/v1/lines", timeout_s=5)
        assert next(lines) == '{"n": 1}'
        server.first_line_read.set()
        assert list(lines) == ['{"n": 2}', '{"n": 3}']
        assert transport.request("GET", "/v1/after").json() == {"ok": True}
    finally:
        transport.close()
    assert len(set(server.peers)) == 1  # a stream read to its end gives its connection back


def test_a_stream_left_half_read_does_not_hand_its_connection_to_the_next_request(server: _Server) -> None:
    """Nothing more of the stream is waiting on its socket, so urllib3's own check before reuse (EOF or data
    waiting) does not catch it: the connection must be closed, or the next request would wait behind the
    stream for its timeout. (urllib3 also closes it when the stream's reader is dropped mid-read.)"""
    transport = _transport(server, timeout_s=3.0)
    try:
        lines = transport.stream_lines("GET", "/v1/forever", timeout_s=5)
        assert next(lines) == '{"n": 1}'
        lines.close()
        assert transport.request("GET", "/v1/after").json() == {"ok": True}
    finally:
        transport.close()
    assert len(set(server.peers)) == 2


def test_error_answers_and_an_unreachable_server_become_corral_errors(server: _Server) -> None:
    transport = _transport(server)
    try:
        with pytest.raises(NotFound, match="no such thing"):
            transport.request("GET", "/v1/missing")
        with pytest.raises(NotFound, match="no such thing"):
            next(transport.stream_lines("GET", "/v1/missing", timeout_s=5))
    finally:
        transport.close()
    nowhere = SyncTransport(f"http://127.0.0.1:{free_port()}", "ck_test", 2.0)
    with pytest.raises(ServerUnavailable, match="cannot reach"):
        nowhere.request("GET", "/v1/sandboxes")
    with pytest.raises(ServerUnavailable, match="cannot reach"):
        next(nowhere.stream_lines("GET", "/v1/events", timeout_s=1))
