"""Node stats through the API, and what the edge does when the node's memory runs short."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import corral
from corral.edge.host_readings import read_host
from corral.embedded import EmbeddedServer


def test_node_stats_count_sandboxes_and_show_commitment_use_and_pressure(client: corral.Client) -> None:
    with client.create("busybox", memory_mb=256, ttl_s=120) as running, client.create("busybox", ttl_s=120) as paused:
        running.exec("dd if=/dev/zero of=/dev/shm/fill bs=1M count=32")  # resident: 32 MiB of shmem at least
        paused.pause()
        (node,) = client.nodes()
        assert node.sandboxes["container"]["running"] >= 1 and node.sandboxes["container"]["paused"] >= 1
        assert node.memory_committed_mb >= 256 + 512 and node.cpu_committed >= 2.0
        assert node.cpu_overcommit == pytest.approx(node.cpu_committed / node.cpu_cores)
        assert node.memory_resident_mb >= 32
        assert 0 < node.memory_available_mb <= node.memory_total_mb
        assert set(node.pressure) == {"cpu_some", "memory_some", "memory_full", "io_some"}
        assert node.refusing is None


def test_a_node_short_of_memory_refuses_new_sandboxes_clearly(tmp_path: Path, test_env: dict[str, str]) -> None:
    env = {**test_env, "CORRAL_MEMORY_RESERVE_MB": str(read_host().memory_total_mb * 2)}
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        with pytest.raises(corral.CapacityExhausted, match="refuses new sandboxes: memory is short"):
            client.create("busybox", ttl_s=60)
        (node,) = client.nodes()
        assert node.refusing and "memory is short" in node.refusing


def test_under_memory_pressure_idle_sandboxes_are_paused_first(tmp_path: Path, test_env: dict[str, str]) -> None:
    # A reserve between half and all of what is available: new sandboxes are still admitted, but the node
    # counts as short (available < 2 × reserve), so idle sandboxes are paused and their memory reclaimed.
    reserve = int(read_host().memory_available_mb * 0.6)
    env = {**test_env, "CORRAL_MEMORY_RESERVE_MB": str(reserve), "CORRAL_PRESSURE_PAUSE_IDLE_S": "1"}
    with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
        idle = client.create("busybox", ttl_s=120)
        busy = client.create("busybox", ttl_s=120)
        command = busy.start("sleep 30")
        deadline = time.monotonic() + 20
        while idle.refresh().state != "paused" and time.monotonic() < deadline:
            time.sleep(0.25)
        assert idle.refresh().state == "paused"
        assert busy.refresh().state == "running"  # a sandbox with a command running is not idle
        assert idle.exec("echo back").stdout == "back\n"  # and a paused one resumes on the next request
        busy.signal(command.command_id)
