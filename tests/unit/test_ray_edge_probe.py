"""RayEdge with stand-ins for Ray's actor handles. A remote edge whose node is heard again after a silence is placed
on only once a probe went through (``RayEdge.set_silent``'s answer, which the gateway's node watcher places by).
The handle here answers the probe as an actor's would (an awaitable per ``pid.remote()``, and no channel); the real actor over a real cut is
tests/cluster/test_cluster_faults.py's network-cut test. An edge actor of an older Corral, without a channel, is
called through Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from corral.cluster import ray_edge
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
