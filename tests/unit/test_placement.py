"""Placement: filter by capacity, least loaded of k random choices."""

from __future__ import annotations

import random

import pytest

from corral.scheduler.placement import place, utilisation
from corral.sdk import CapacityExhausted, EdgeLoad, InvalidRequest


def load(edge_id: str, cpu_used: float, mem_used: int, *, cpu_cap: float = 128, mem_cap: int = 98304) -> EdgeLoad:
    return EdgeLoad(
        edge_id=edge_id, node_cpu=2, node_memory_mb=24576, sandboxes=0, cpu_committed=cpu_used,
        cpu_capacity=cpu_cap, memory_committed_mb=mem_used, memory_capacity_mb=mem_cap,
    )  # fmt: skip


def test_utilisation_is_the_tighter_resource() -> None:
    assert utilisation(load("a", 64, 0)) == 0.5
    assert utilisation(load("a", 0, 98304 * 3 // 4)) == 0.75


def test_full_nodes_are_filtered_out() -> None:
    loads = [load("full", 127.5, 0), load("free", 10, 0)]
    assert {place(loads, cpu=1, memory_mb=512, rng=random.Random(seed)) for seed in range(20)} == {"free"}


def test_least_loaded_of_all_when_k_covers_everything() -> None:
    loads = [load("a", 100, 0), load("b", 20, 0), load("c", 60, 0)]
    assert place(loads, cpu=1, memory_mb=1, candidates=3) == "b"


def test_power_of_two_choices_balances() -> None:
    rng = random.Random(7)
    committed = {f"n{i}": 0.0 for i in range(20)}
    for _ in range(2000):
        loads = [load(k, v, 0, cpu_cap=1000) for k, v in committed.items()]
        committed[place(loads, cpu=1, memory_mb=1, rng=rng)] += 1
    assert max(committed.values()) - min(committed.values()) <= 10  # random alone spreads far wider


def test_refused_edges_are_excluded() -> None:
    loads = [load("a", 0, 0), load("b", 50, 0)]
    assert place(loads, cpu=1, memory_mb=1, exclude=frozenset({"a"})) == "b"


def test_no_room_now_is_capacity_exhausted() -> None:
    with pytest.raises(CapacityExhausted, match="retry later"):
        place([load("a", 128, 0)], cpu=1, memory_mb=1)


def test_bigger_than_any_node_is_invalid() -> None:
    with pytest.raises(InvalidRequest, match="largest node has 2 cores"):
        place([load("a", 0, 0)], cpu=4, memory_mb=1)
