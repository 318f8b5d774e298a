"""The async SDK's HTTP transport (corral/sdk/_http1.py on asyncio) against a real HTTP/1.1 server on loopback: what
it sends, how it streams, which connections it keeps, how many it opens, answers cut short or not HTTP, timeouts,
cancelled requests, event loops that end, TLS, and its errors. One TLS context serves every client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import uvloop

from corral.api.errors import NotFound, ServerUnavailable
from corral.embedded import free_port
from corral.sdk._transport import AsyncTransport, SyncTransport, _tls_context
from tests.http_answers import AnswerServer, serving, tls_contexts


@pytest.fixture
def server() -> Iterator[AnswerServer]:
    with serving() as server:
        yield server


def _transport(server: AnswerServer, prefix: str = "", timeout_s: float = 10.0) -> AsyncTransport:
    return AsyncTransport(f"http://127.0.0.1:{server.server_address[1]}{prefix}", "ck_test", timeout_s)


async def test_a_request_carries_the_key_its_query_and_a_compact_json_body_on_one_kept_connection(
    server: AnswerServer,
) -> None:
    transport = _transport(server, "/behind/a/proxy/")
    try:
        response = await transport.request(
            "POST", "/v1/thing", params={"flag": True, "none": None, "label": ["a=1", "b=2"]}, json={"cmd": ["é"]}
        )
        assert response.status_code == 200 and response.json()["ok"] is True
        await transport.request("PUT", "/v1/raw", content=b"\x00bytes")
        assert (await transport.request("GET", "/v1/x")).text == '{"ok": true}'
    finally:
        await transport.aclose()
    sent, raw, get = server.seen
    assert sent["path"] == "/behind/a/proxy/v1/thing" and sent["body"] == '{"cmd":["é"]}'.encode()
    assert sent["query"] == {"flag": ["true"], "none": [""], "label": ["a=1", "b=2"]}
    headers = sent["headers"]
    assert isinstance(headers, dict)
    assert headers["Authorization"] == "Bearer ck_test" and headers["Content-Type"] == "application/json"
    assert raw["body"] == b"\x00bytes" and get["body"] == b""
    assert len(set(server.peers)) == 1


async def test_stream_lines_yields_each_line_as_it_arrives_and_a_half_read_stream_gives_up_its_connection(
    server: AnswerServer,
) -> None:
    transport = _transport(server)
    try:
        lines = transport.stream_lines("GET", "/v1/lines", timeout_s=5)
        assert await anext(lines) == '{"n": 1}'
        server.first_line_read.set()
        assert [line async for line in lines] == ['{"n": 2}', '{"n": 3}']
        assert (await transport.request("GET", "/v1/after")).json() == {"ok": True}  # on the stream's connection
        forever = transport.stream_lines("GET", "/v1/forever", timeout_s=5)
        assert await anext(forever) == '{"n": 1}'
        await forever.aclose()
        assert (await transport.request("GET", "/v1/after")).json() == {"ok": True}  # not behind the stream
    finally:
        await transport.aclose()
    assert len(server.peers) == 4 and len(set(server.peers)) == 2


async def test_connections_the_server_closed_or_asked_to_close_are_not_used_again(server: AnswerServer) -> None:
    transport = _transport(server)
    try:
        assert (await transport.request("GET", "/v1/then-hang-up")).json() == {"ok": True}
        await asyncio.sleep(0.2)  # the server's FIN has arrived: the idle connection saw EOF
        assert (await transport.request("GET", "/v1/close")).json() == {"ok": True}
        assert (await transport.request("GET", "/v1/a")).json() == {"ok": True}
        assert (await transport.request("GET", "/v1/b")).json() == {"ok": True}
    finally:
        await transport.aclose()
    assert len(server.peers) == 4 and len(set(server.peers)) == 3


async def test_answers_cut_short_or_not_http_are_errors_and_an_unframed_one_runs_to_the_end(
    server: AnswerServer,
) -> None:
    transport = _transport(server)
    try:
        with pytest.raises(ServerUnavailable, match="before its answer ended"):
            await transport.request("GET", "/v1/cut")
        with pytest.raises(ServerUnavailable, match="not HTTP"):
            await transport.request("GET", "/v1/garbage")
        assert (await transport.request("GET", "/v1/unframed")).json() == {"unframed": True}
        assert (await transport.request("GET", "/v1/after")).json() == {"ok": True}
    finally:
        await transport.aclose()
    assert len(set(server.peers)) == 4


async def test_a_late_answer_never_reaches_the_next_request_after_a_timeout_or_a_cancel(server: AnswerServer) -> None:
    transport = _transport(server, timeout_s=0.5)
    try:
        started = asyncio.get_running_loop().time()
        with pytest.raises(ServerUnavailable, match="timed out"):
            await transport.request("GET", "/v1/slow")
        assert 0.4 < asyncio.get_running_loop().time() - started < 3
        slow = asyncio.create_task(transport.request("GET", "/v1/slow", timeout_s=30))
        await asyncio.sleep(0.2)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        server.released.set()
        answers = [(await transport.request("GET", "/v1/after", params={"n": n})).json() for n in range(3)]
        assert answers == [{"ok": True, "query": f"n={n}"} for n in range(3)]
    finally:
        await transport.aclose()


async def test_concurrent_requests_each_get_their_own_answer_within_the_connection_limit(
    server: AnswerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("corral.sdk._transport.MAX_CONNECTIONS", 4)
    transport = _transport(server)
    try:
        answers = await asyncio.gather(
            *(transport.request("POST", "/v1/echo", params={"n": n}, json={}) for n in range(200))
        )
        assert [answer.json() for answer in answers] == [{"ok": True, "query": f"n={n}"} for n in range(200)]
    finally:
        await transport.aclose()
    assert len(server.seen) == 200 and len(set(server.peers)) <= 4


def test_on_uvloop_as_on_asyncio(server: AnswerServer) -> None:
    """The server's loop (and the control-plane bench's, whose client shares it): its transports are not
    asyncio.Transport's, and a protocol that assumed so never saw its answer."""

    async def scenario() -> None:
        transport = _transport(server, timeout_s=0.5)
        try:
            assert (await transport.request("POST", "/v1/x", json={"a": 1})).json() == {"ok": True}
            lines = transport.stream_lines("GET", "/v1/lines", timeout_s=5)
            assert await anext(lines) == '{"n": 1}'
            server.first_line_read.set()
            assert [line async for line in lines] == ['{"n": 2}', '{"n": 3}']
            with pytest.raises(ServerUnavailable, match="before its answer ended"):
                await transport.request("GET", "/v1/cut")
            with pytest.raises(ServerUnavailable, match="timed out"):
                await transport.request("GET", "/v1/slow")
            server.released.set()
            assert (await transport.request("GET", "/v1/y", params={"n": 1})).json() == {"ok": True, "query": "n=1"}
        finally:
            await transport.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


def test_a_transport_outlives_the_event_loop_it_was_first_used_on(
    server: AnswerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client kept across ``asyncio.run`` calls: a connection of an ended loop is not used on the next one, and
    requests that wait for a free connection wait on the loop they run on (an asyncio.Semaphore that one loop waited
    on raises on another)."""
    monkeypatch.setattr("corral.sdk._transport.MAX_CONNECTIONS", 1)
    transport = _transport(server)

    async def three(n: int) -> list[object]:
        answers = await asyncio.gather(*(transport.request("GET", "/v1/x", params={"n": n, "i": i}) for i in range(3)))
        return [answer.json() for answer in answers]

    for n in range(2):
        assert asyncio.run(three(n)) == [{"ok": True, "query": f"n={n}&i={i}"} for i in range(3)]
    asyncio.run(transport.aclose())
    assert len(set(server.peers)) == 2  # one connection a loop: the limit held, and none crossed loops


async def test_error_answers_and_an_unreachable_server_become_corral_errors(server: AnswerServer) -> None:
    transport = _transport(server)
    try:
        with pytest.raises(NotFound, match="no such thing"):
            await transport.request("GET", "/v1/missing")
        with pytest.raises(NotFound, match="no such thing"):
            await anext(transport.stream_lines("GET", "/v1/missing", timeout_s=5))
        assert (await transport.request("GET", "/v1/after")).json() == {"ok": True}
    finally:
        await transport.aclose()
    nowhere = AsyncTransport(f"http://127.0.0.1:{free_port()}", "ck_test", 2.0)
    with pytest.raises(ServerUnavailable, match="cannot reach"):
        await nowhere.request("GET", "/v1/sandboxes")
    with pytest.raises(ServerUnavailable, match="cannot reach"):
        await anext(nowhere.stream_lines("GET", "/v1/events", timeout_s=1))


async def test_https_with_the_trusted_authority_and_refused_without_it(monkeypatch: pytest.MonkeyPatch) -> None:
    server_tls, trusting = tls_contexts()
    with serving(server_tls) as server:
        url = f"https://127.0.0.1:{server.server_address[1]}"
        untrusting = AsyncTransport(url, "ck_test", 5.0)
        with pytest.raises(ServerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusting.request("GET", "/v1/x")
        await untrusting.aclose()
        monkeypatch.setattr("corral.sdk._transport._tls_context", lambda: trusting)
        transport = AsyncTransport(url, "ck_test", 5.0)
        try:
            assert (await transport.request("POST", "/v1/x", json={"a": 1})).json() == {"ok": True}
            assert (await transport.request("GET", "/v1/y")).json() == {"ok": True}
        finally:
            await transport.aclose()
    assert [seen["body"] for seen in server.seen] == [b'{"a":1}', b""]
    assert len(set(server.peers)) == 1


def test_every_client_shares_one_tls_context() -> None:
    """Making a TLS context costs ~18 ms of CPU: not paid per client or connection."""
    sync = SyncTransport("https://127.0.0.1:1", "ck_test", 1.0)
    first = AsyncTransport("https://127.0.0.1:1", "ck_test", 1.0)
    second = AsyncTransport("https://127.0.0.1:2", "ck_test", 1.0)
    try:
        tls = [pool._tls() for pool in (sync._pool, first._pool, second._pool) if pool._tls is not None]
        assert len(tls) == 3 and all(context is _tls_context() for context in tls)
    finally:
        sync.close()
