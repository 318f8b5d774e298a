"""The sync SDK's HTTP transport (corral/sdk/_http1.py) against a real HTTP/1.1 server on loopback (http.server,
and with TLS): what it sends, how it streams, which connections it keeps, answers cut short or not HTTP, timeouts,
threads sharing it, and its errors."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from corral.api.errors import NotFound, ServerUnavailable
from corral.embedded import free_port
from corral.sdk._http1 import AnswerParser, ConnectionPool, Origin, request_bytes
from corral.sdk._transport import SyncTransport
from tests.http_answers import AnswerServer, serving, tls_contexts


@pytest.fixture
def server() -> Iterator[AnswerServer]:
    with serving() as server:
        yield server


def _transport(server: AnswerServer, prefix: str = "", timeout_s: float = 10.0) -> SyncTransport:
    return SyncTransport(f"http://127.0.0.1:{server.server_address[1]}{prefix}", "ck_test", timeout_s)


def test_a_request_carries_the_key_its_query_as_httpx_writes_it_and_a_compact_json_body(server: AnswerServer) -> None:
    transport = _transport(server, "/behind/a/proxy/")
    try:
        response = transport.request(
            "POST", "/v1/thing", params={"flag": True, "off": False, "none": None, "label": ["a=1", "b=2"], "n": 3},
            json={"cmd": ["echo", "é"]},
        )  # fmt: skip
        assert response.status_code == 200 and response.json()["ok"] is True
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


def test_stream_lines_yields_each_line_as_it_arrives_skipping_blank_ones(server: AnswerServer) -> None:
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


def test_a_stream_left_half_read_does_not_hand_its_connection_to_the_next_request(server: AnswerServer) -> None:
    """Nothing more of the stream is waiting on its socket, so the pool's check before reuse (EOF or data waiting)
    does not catch it: the connection must be closed, or the next request would wait behind the stream for its
    timeout."""
    transport = _transport(server, timeout_s=3.0)
    try:
        lines = transport.stream_lines("GET", "/v1/forever", timeout_s=5)
        assert next(lines) == '{"n": 1}'
        lines.close()
        assert transport.request("GET", "/v1/after").json() == {"ok": True}
    finally:
        transport.close()
    assert len(set(server.peers)) == 2


def test_error_answers_and_an_unreachable_server_become_corral_errors(server: AnswerServer) -> None:
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


def test_connections_the_server_closed_or_asked_to_close_are_not_used_again(server: AnswerServer) -> None:
    transport = _transport(server)
    try:
        assert transport.request("GET", "/v1/then-hang-up").json() == {"ok": True}
        time.sleep(0.2)  # the server's FIN has arrived: the idle connection reads EOF
        assert transport.request("GET", "/v1/close").json() == {"ok": True}  # on a new connection
        assert transport.request("GET", "/v1/a").json() == {"ok": True}  # and another: the last one said close
        assert transport.request("GET", "/v1/b").json() == {"ok": True}  # kept alive: the same as /v1/a's
    finally:
        transport.close()
    assert len(server.peers) == 4 and len(set(server.peers)) == 3


def test_an_idle_connection_past_its_expiry_is_closed_not_used(server: AnswerServer) -> None:
    """The client closes first (60 s, the server keeps 620 s): a request sent as the server closes would be lost."""
    origin = Origin(f"http://127.0.0.1:{server.server_address[1]}")
    pool = ConnectionPool(origin, max_idle=4, idle_expiry_s=0.3, tls=None)
    head = f"Host: {origin.host_header}\r\n".encode()
    try:
        for pause_s in (0.0, 0.0, 0.5):
            time.sleep(pause_s)
            connection = pool.take(5.0)
            parser = AnswerParser()
            connection.send(request_bytes("GET", "/v1/x", head, None), 5.0)
            connection.read_answer(parser)
            assert (parser.status, b"".join(parser.body)) == (200, b'{"ok": true}')
            pool.give_back(connection, parser)
    finally:
        pool.close()
    assert len(server.peers) == 3 and len(set(server.peers)) == 2  # the third request after 0.5 s: a new one


def test_answers_cut_short_or_not_http_are_errors_and_an_unframed_one_runs_to_the_end(server: AnswerServer) -> None:
    transport = _transport(server)
    try:
        with pytest.raises(ServerUnavailable, match="before its answer ended"):
            transport.request("GET", "/v1/cut")
        with pytest.raises(ServerUnavailable, match="not HTTP"):
            transport.request("GET", "/v1/garbage")
        assert transport.request("GET", "/v1/unframed").json() == {"unframed": True}
        assert transport.request("GET", "/v1/after").json() == {"ok": True}
    finally:
        transport.close()
    assert len(set(server.peers)) == 4  # none of the three could carry another request


def test_a_server_that_does_not_answer_in_time_is_a_timeout(server: AnswerServer) -> None:
    transport = _transport(server, timeout_s=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match="timed out"):
            transport.request("GET", "/v1/slow")
        assert 0.4 < time.monotonic() - started < 3
        server.released.set()
        assert transport.request("GET", "/v1/after").json() == {"ok": True}  # not the slow one's late answer
    finally:
        transport.close()


def test_threads_sharing_a_transport_each_get_their_own_answers(server: AnswerServer) -> None:
    transport = _transport(server)
    wrong: list[tuple[int, object]] = []

    def ask(thread: int) -> None:
        for n in range(40):
            answer = transport.request("POST", "/v1/echo", params={"t": thread, "n": n}, json={}).json()
            if answer != {"ok": True, "query": f"t={thread}&n={n}"}:
                wrong.append((thread, answer))

    threads = [threading.Thread(target=ask, args=(thread,)) for thread in range(8)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    finally:
        transport.close()
    assert wrong == [] and len(server.seen) == 8 * 40
    assert len(set(server.peers)) <= 8  # connections were kept and shared, not one per request


def test_https_with_the_trusted_authority_and_refused_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    server_tls, trusting = tls_contexts()
    with serving(server_tls) as server:
        url = f"https://127.0.0.1:{server.server_address[1]}"
        untrusting = SyncTransport(url, "ck_test", 5.0)
        with pytest.raises(ServerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            untrusting.request("GET", "/v1/x")
        untrusting.close()
        monkeypatch.setattr("corral.sdk._transport._tls_context", lambda: trusting)
        transport = SyncTransport(url, "ck_test", 5.0)
        try:
            assert transport.request("POST", "/v1/x", json={"a": 1}).json() == {"ok": True}
            assert transport.request("GET", "/v1/y").json() == {"ok": True}
        finally:
            transport.close()
    assert [seen["body"] for seen in server.seen] == [b'{"a":1}', b""]
    assert len(set(server.peers)) == 1  # one connection kept alive for both (the refused one sent nothing)
