"""The Edge protocol is the whole gateway-to-edge contract: the gateway calls nothing else, and every method of it
reaches a Ray edge actor (the actor's callable surface is derived from it; a hand-kept list once missed one)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from corral.cluster.edge_actor import ACTOR_OWN, BY_RAY, CALLABLE, ON_NODE, STREAMING, WIRE_NAMES, NodeEdge
from corral.cluster.ray_edge import RayEdge
from corral.edge.local import LocalEdge
from corral.edge.protocol import EDGE_METHODS, Edge

CORRAL = Path(__file__).resolve().parents[2] / "corral"
# The gateway's code, and the adoption helpers it calls with its edges
GATEWAY_SIDE = [*sorted((CORRAL / "gateway").rglob("*.py")), CORRAL / "edge" / "adoption.py"]
_EDGE_CALL = re.compile(r"\b(?:edge|(?:self\.edge|_edge_for)\([^()]*\))\.(\w+)\(")


def _parameters(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_the_protocol_declares_every_edge_method_the_gateway_calls() -> None:
    called = {name for path in GATEWAY_SIDE for name in _EDGE_CALL.findall(path.read_text())}
    assert {"create", "exec", "checkpoint_dir", "discard_checkpoint", "sandbox_ids"} <= called  # the scan sees calls
    assert called - EDGE_METHODS == set()


def test_every_edge_method_is_callable_through_the_actor() -> None:
    for name in sorted(EDGE_METHODS):
        declared = getattr(Edge, name)
        if name in ACTOR_OWN or name in STREAMING or name in WIRE_NAMES:
            # RayEdge answers it itself, streams it, or sends it under its wire name
            assert name in vars(RayEdge), name
            assert _parameters(vars(RayEdge)[name]) == _parameters(declared), name
        if name in ACTOR_OWN:
            continue
        if name in STREAMING:
            assert inspect.isasyncgenfunction(getattr(LocalEdge, name)), name
            continue
        wire = WIRE_NAMES.get(name, name)
        assert wire in CALLABLE, name
        target = getattr(NodeEdge if wire in ON_NODE else LocalEdge, wire)
        assert inspect.iscoroutinefunction(target), name
        if wire == name:  # forwarded as is: the same arguments
            assert _parameters(target) == _parameters(declared), name
            assert _parameters(getattr(LocalEdge, name)) == _parameters(declared), name
    assert CALLABLE - {WIRE_NAMES.get(name, name) for name in EDGE_METHODS} == set()  # nothing beyond the protocol


def test_the_actor_refuses_what_the_protocol_does_not_have() -> None:
    assert "edge_id" not in CALLABLE and "sandbox_ids" in CALLABLE and "checkpoint_dir" in CALLABLE
    assert "_get" not in CALLABLE and ACTOR_OWN <= EDGE_METHODS and ACTOR_OWN.isdisjoint(CALLABLE)


def test_the_calls_kept_off_the_channel_are_edge_calls() -> None:
    """A name in BY_RAY that no longer names a call (renamed) would send that call's large payloads over the
    channel."""
    assert BY_RAY
    assert BY_RAY <= CALLABLE
