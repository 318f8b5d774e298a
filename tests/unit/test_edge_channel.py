"""The channel a gateway keeps to a node's edge actor (cluster/channel.py), over real TCP on loopback: answers
and errors as through Ray, many calls in flight, streams closed on the edge when their caller leaves, and nothing
read from a connection that does not open with the token."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from corral.api.errors import Conflict, InternalError, NotFound
from corral.api.models import ExecRequest, ExecResult
from corral.cluster.channel import ChannelAddress, ChannelClient, ChannelClosed, ChannelServer


class _Edge:
    """What a channel serves here: a few calls and streams, and what the edge saw of them."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.finished: list[str] = []
        self.closed_streams = 0
        self.streaming = asyncio.Event()

    async def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # noqa: ANN401
        self.calls.append(method)
        if method == "exec":
            request: ExecRequest = args[1]
            return ExecResult(command_id=args[0], exit_code=0, stdout=" ".join(request.cmd), stderr="")
        if method == "missing":
            raise NotFound(f"sandbox {args[0]} not found")
        if method == "crash":
            raise ValueError("the edge's own bug")
        if method == "sleep":
            await asyncio.sleep(kwargs["seconds"])
            self.finished.append(method)
            return kwargs["seconds"]
        return args, kwargs

    async def stream(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
        self.calls.append(method)
        try:
            for item in range(args[0]):
                yield item
            if method == "endless":
                self.streaming.set()
                await asyncio.Event().wait()
            if method == "broken":
                raise Conflict("the command's sandbox was killed")
        finally:
            self.closed_streams += 1


@pytest.fixture
async def served() -> AsyncIterator[tuple[_Edge, ChannelAddress]]:
    edge = _Edge()
    server = ChannelServer(edge.call, edge.stream)
    address = await server.start("127.0.0.1", 0)
    try:
        yield edge, address
    finally:
        await server.close()


@pytest.fixture
async def client(served: tuple[_Edge, ChannelAddress]) -> AsyncIterator[ChannelClient]:
    client = await ChannelClient.connect(served[1], 5.0)
    try:
        yield client
    finally:
        client.close()


async def _eventually(condition: Any, timeout_s: float = 5.0) -> None:  # noqa: ANN401
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "the edge never got there"
        await asyncio.sleep(0.01)


async def test_calls_answer_with_what_the_edge_returned_each_to_its_own_caller(
    served: tuple[_Edge, ChannelAddress], client: ChannelClient
) -> None:
    edge, _ = served
    slow = asyncio.ensure_future(client.call("sleep", (), {"seconds": 0.3}))
    request = ExecRequest(cmd=["echo", "hi"])
    result = await client.call("exec", ("c1", request), {})
    assert not slow.done()  # answered while the slower call was still running on the edge
    assert result == ExecResult(command_id="c1", exit_code=0, stdout="echo hi", stderr="")
    assert await client.call("echo", (1, b"\0bytes"), {"step_files": True}) == (
        (1, b"\0bytes"),
        {"step_files": True},
    )
    assert await slow == 0.3
    assert sorted(edge.calls) == ["echo", "exec", "sleep"]


async def test_errors_arrive_as_the_edge_raised_them_or_as_internal_errors(client: ChannelClient) -> None:
    with pytest.raises(NotFound, match="sandbox s1 not found"):
        await client.call("missing", ("s1",), {})
    with pytest.raises(InternalError, match="the edge's own bug"):
        await client.call("crash", (), {})
    assert await client.call("echo", ("still open",), {}) == (("still open",), {})


async def test_a_stream_yields_the_edges_items_then_ends_or_raises(
    served: tuple[_Edge, ChannelAddress], client: ChannelClient
) -> None:
    edge, _ = served
    assert [item async for item in client.stream("count", (3,), {})] == [0, 1, 2]
    seen = []
    with pytest.raises(Conflict, match="sandbox was killed"):
        async for item in client.stream("broken", (2,), {}):
            seen.append(item)
    assert seen == [0, 1]
    assert edge.closed_streams == 2


async def test_leaving_a_stream_closes_it_on_the_edge(
    served: tuple[_Edge, ChannelAddress], client: ChannelClient
) -> None:
    edge, _ = served
    async with contextlib.aclosing(client.stream("endless", (2,), {})) as items:
        assert [await anext(items), await anext(items)] == [0, 1]
        await asyncio.wait_for(edge.streaming.wait(), 5)
    await _eventually(lambda: edge.closed_streams == 1)  # its finally ran: a command's stream kills it there
    assert await client.call("echo", (), {}) == ((), {})  # the connection serves on


async def test_a_caller_that_goes_away_ends_its_streams_on_the_edge_not_its_calls(
    served: tuple[_Edge, ChannelAddress], client: ChannelClient
) -> None:
    edge, _ = served
    items = client.stream("endless", (0,), {})
    waiting = asyncio.ensure_future(anext(items))
    call = asyncio.ensure_future(client.call("sleep", (), {"seconds": 0.3}))
    await asyncio.wait_for(edge.streaming.wait(), 5)
    client.close()
    with pytest.raises(ChannelClosed):
        await call  # its caller learns the channel closed
    with pytest.raises(ChannelClosed):
        await waiting
    assert client.closed
    await _eventually(lambda: edge.closed_streams == 1)
    await _eventually(lambda: edge.finished == ["sleep"])  # a call the edge began runs to its end (as through Ray)
    with pytest.raises(ChannelClosed):
        await client.call("echo", (), {})


async def test_nothing_is_read_from_a_connection_without_the_token(served: tuple[_Edge, ChannelAddress]) -> None:
    edge, address = served
    wrong = ChannelAddress(address.host, address.port, bytes(len(address.token)))
    client = await ChannelClient.connect(wrong, 5.0)
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(client.call("echo", ("hello",), {}), 5)
    assert edge.calls == []


async def test_a_connection_the_edge_drops_fails_the_calls_waiting_on_it() -> None:
    async def accept_then_drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(accept_then_drop, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        client = await ChannelClient.connect(ChannelAddress("127.0.0.1", port, b"t" * 32), 5.0)
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(client.call("echo", (), {}), 5)
        assert client.closed
    finally:
        server.close()
