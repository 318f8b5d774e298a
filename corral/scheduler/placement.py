"""Placement: choose the edge for a new sandbox.

Filter the edges that could take it (free CPU and memory within their
overcommit), then pick the least loaded of ``k`` random candidates (the
"power of k choices": near-best balance without scanning every node at burst
scale). The edge still has the last word: if it refuses, the caller retries
with the next choice.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from corral.sdk._exceptions import CapacityExhausted, InvalidRequest
from corral.sdk._models import EdgeLoad

__all__ = ["place", "utilisation"]

DEFAULT_CANDIDATES = 2


def utilisation(load: EdgeLoad) -> float:
    """The tighter of CPU and memory commitment, 0 (idle) to 1 (full)."""
    cpu = load.cpu_committed / load.cpu_capacity if load.cpu_capacity else 1.0
    memory = load.memory_committed_mb / load.memory_capacity_mb if load.memory_capacity_mb else 1.0
    return max(cpu, memory)


def place(
    loads: Sequence[EdgeLoad],
    *,
    cpu: float,
    memory_mb: int,
    exclude: frozenset[str] = frozenset(),
    candidates: int = DEFAULT_CANDIDATES,
    rng: random.Random | None = None,
) -> str:
    """The id of the edge to try; InvalidRequest when no node could ever fit
    it, CapacityExhausted when none can now."""
    if loads and all(cpu > load.node_cpu or memory_mb > load.node_memory_mb for load in loads):
        biggest = max(loads, key=lambda load: (load.node_cpu, load.node_memory_mb))
        raise InvalidRequest(
            f"no node is that big: asked for cpu={cpu:g}, memory_mb={memory_mb}; the largest node has "
            f"{biggest.node_cpu:g} cores and {biggest.node_memory_mb} MiB"
        )
    fitting = [
        load
        for load in loads
        if load.edge_id not in exclude
        and load.cpu_committed + cpu <= load.cpu_capacity
        and load.memory_committed_mb + memory_mb <= load.memory_capacity_mb
    ]
    if not fitting:
        raise CapacityExhausted(
            f"no node can take a sandbox with cpu={cpu:g}, memory_mb={memory_mb} now "
            f"({len(loads)} node(s), {len(exclude)} refused): retry later or kill sandboxes"
        )
    picked = (rng or random).sample(fitting, min(candidates, len(fitting)))
    return min(picked, key=utilisation).edge_id
