"""The async SDK's transport: its cheap readability check sees a connection the server closed; its many connections
are several small pools."""

from __future__ import annotations

import asyncio

import httpx

from corral.sdk._transport import POOL_LIMITS, SHARD_CONNECTIONS, SyncTransport, _ShardedTransport, async_http_transport

_RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def test_a_connection_the_server_closed_is_replaced_not_reused() -> None:
    connections: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(_RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    try:
        transport = async_http_transport(httpx.Limits(max_connections=4, max_keepalive_connections=4))
        async with httpx.AsyncClient(transport=transport) as client:
            assert (await client.get(url)).text == "ok"
            pooled = transport._pool.connections[0]
            assert not pooled.has_expired()  # idle and open: poll says nothing to read
            connections[0].close()  # the server drops the idle keep-alive connection
            await asyncio.sleep(0.05)
            assert pooled.has_expired()  # EOF waiting: seen by the check
            assert (await client.get(url)).text == "ok"  # on a new connection, no ReadError
            assert len(connections) == 2
    finally:
        server.close()
        await server.wait_closed()


async def test_many_connections_are_split_over_small_pools_within_the_limits() -> None:
    """httpcore's pool walks every connection for every request event: the SDK's 1,000 are 16 pools of 62."""
    answered = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal answered
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                await asyncio.sleep(0.05)  # slow enough that the requests overlap
                answered += 1
                writer.write(_RESPONSE)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    transport = async_http_transport(POOL_LIMITS)
    assert isinstance(transport, _ShardedTransport)
    assert len(transport.shards) == 16
    pools = [shard._pool for shard in transport.shards]
    assert sum(pool._max_connections for pool in pools) <= 1000
    assert all(pool._max_connections <= SHARD_CONNECTIONS for pool in pools)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
    try:
        async with httpx.AsyncClient(transport=transport) as client:
            answers = await asyncio.gather(*(client.get(url) for _ in range(200)))
            assert [answer.text for answer in answers] == ["ok"] * 200 and answered == 200
            assert all(len(pool.connections) > 0 for pool in pools)  # every pool took its share
    finally:
        server.close()
        await server.wait_closed()


def test_every_pool_of_both_clients_shares_one_tls_context() -> None:
    """Making a TLS context costs ~18 ms of CPU: one per pool made an AsyncClient (16 pools) cost 0.3 s to make."""
    first = async_http_transport(POOL_LIMITS)
    second = async_http_transport(POOL_LIMITS)
    assert isinstance(first, _ShardedTransport) and isinstance(second, _ShardedTransport)
    contexts = {id(shard._pool._ssl_context) for shard in [*first.shards, *second.shards]}
    sync = SyncTransport("https://127.0.0.1:1", "ck_test", 1.0)
    try:
        assert sync._pool._tls is not None
        contexts.add(id(sync._pool._tls()))
    finally:
        sync.close()
    assert len(contexts) == 1
