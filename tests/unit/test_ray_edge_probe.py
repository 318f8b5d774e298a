"""RayEdge with stand-ins for Ray's actor handles (each answers as an actor's would: an awaitable per
``remote()``). A remote edge whose node is heard again after a silence is placed on only once a probe went through
(``RayEdge.set_silent``'s answer, which the gateway's node watcher places by); the real actor over a real cut is
tests/cluster/test_cluster_faults.py's network-cut test. Calls go through Ray while the edge's channel is being
connected, or when there is none (an older Corral's actor) or it cannot be reached, and over it once it is."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncGenerator, Awaitable
from typing import Any

import pytest

from corral.cluster import ray_edge
from corral.cluster.channel import ChannelAddress, ChannelServer
from corral.cluster.ray_edge import RayEdge


class _Probe:
    def __init__(self, answers: list[asyncio.Future[int]]) -> None:
        self.answers = answers
        self.calls = 0

    def remote(self) -> Awaitable[int]:
        self.calls += 1
        return self.answers.pop(0)


class _NoChannel:
    """An actor's answer to ``channel.remote()`` when it has none (cluster/channel.py): calls go through Ray."""

    def remote(self) -> Awaitable[None]:
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        answer.set_result(None)
        return answer


class _Handle:
    def __init__(self, probe: _Probe) -> None:
        self.pid = probe
        self.channel = _NoChannel()  # the probe asks for it once the pid answered


async def test_a_node_heard_again_is_placed_on_once_its_edge_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray_edge, "PROBE_TIMEOUT_S", 0.05)
    loop = asyncio.get_running_loop()
    never: asyncio.Future[int] = loop.create_future()  # the first probe meets a connection the cut broke
    answered: asyncio.Future[int] = loop.create_future()
    answered.set_result(4242)
    probe = _Probe([never, answered])
    edge = RayEdge("e9")
    edge._handle = _Handle(probe)  # what ray.get_actor would have given
    assert edge.set_silent(False) is True  # never silent: calls go through, no probe
    assert probe.calls == 0
    assert edge.set_silent(True) is False
    assert edge.set_silent(False) is False  # heard again: a probe starts, not placed on yet
    assert edge.set_silent(False) is False  # one probe at a time
    await asyncio.sleep(0.2)
    assert probe.calls == 1 and never.cancelled()  # it timed out: still not placed on
    assert edge.set_silent(False) is False  # the next beat probes again
    await asyncio.sleep(0.05)
    assert probe.calls == 2
    assert edge.set_silent(False) is True  # answered: placed on again
    assert edge.set_silent(False) is True and probe.calls == 2


class _OlderActor:
    """An edge actor of a Corral from before the channel (a rolling upgrade: gateways first): no ``channel``
    method; its ``call`` answers as the actor's would."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.call = self

    def remote(self, method: str, *args: object) -> Awaitable[str]:
        self.calls.append(method)
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        answer.set_result(f"{method} answered through Ray")
        return answer


async def test_an_edge_actor_without_a_channel_is_called_through_ray() -> None:
    actor = _OlderActor()
    edge = RayEdge("e9")
    edge._handle = actor  # what ray.get_actor would have given
    assert await edge.sandbox_ids() == "sandbox_ids answered through Ray"
    assert await edge.fs_clock("sb-e9-1") == "fs_clock answered through Ray"
    assert actor.calls == ["sandbox_ids", "fs_clock"]


class _ChannelAt:
    """An actor's answer to ``channel.remote()``: where its channel listens."""

    def __init__(self, address: ChannelAddress) -> None:
        self.address = address

    def remote(self) -> Awaitable[ChannelAddress]:
        answer: asyncio.Future[ChannelAddress] = asyncio.get_running_loop().create_future()
        answer.set_result(self.address)
        return answer


async def _over_the_channel(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return f"{method} answered over the channel"


async def _no_streams(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AsyncGenerator[Any, None]:
    raise AssertionError("no stream here")
    yield


async def test_calls_go_through_ray_until_the_channel_is_connected_then_over_it() -> None:
    server = ChannelServer(_over_the_channel, _no_streams)
    actor = _OlderActor()
    actor.channel = _ChannelAt(await server.start("127.0.0.1", 0))  # type: ignore[attr-defined]
    edge = RayEdge("e9")
    edge._handle = actor
    try:
        assert await edge.sandbox_ids() == "sandbox_ids answered through Ray"  # the connection is being made
        deadline = time.monotonic() + 5
        while (answer := await edge.fs_clock("sb-e9-1")) != "fs_clock answered over the channel":
            assert answer == "fs_clock answered through Ray" and time.monotonic() < deadline, answer
            await asyncio.sleep(0.01)
    finally:
        await edge.close()
        await server.close()


async def test_a_channel_that_cannot_be_reached_holds_no_call_up(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as unused:  # a port nothing listens on: connections are refused
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    actor = _OlderActor()
    actor.channel = _ChannelAt(ChannelAddress("127.0.0.1", port, b"t" * 32))  # type: ignore[attr-defined]
    edge = RayEdge("e9")
    edge._handle = actor
    for _ in range(20):
        assert await edge.sandbox_ids() == "sandbox_ids answered through Ray"
        await asyncio.sleep(0.01)
    assert actor.calls == ["sandbox_ids"] * 20
    assert f"its channel at 127.0.0.1:{port} cannot be reached" in caplog.text
