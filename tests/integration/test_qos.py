"""CPU QoS classes: the weights land in the sandbox's cgroup, and on a busy node latency work gets the CPU.

Cgroup files are read from the host: v1 controllers under /sys/fs/cgroup/<controller>/<tier>/<id>, or the
unified tree under /sys/fs/cgroup/<tier>/<id> on a pure v2 host; the tier is corral (latency) or corral-batch."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import corral
from corral.embedded import EmbeddedServer

V1_CPU = Path("/sys/fs/cgroup/cpu")
BURN = ["taskset", "-c", "0", "sh", "-c", "while :; do :; done"]  # all on one CPU: the load balancer cannot part them
WINDOW_S = 3.0


def _unified() -> bool:
    return not V1_CPU.is_dir()


def _cgroup_dir(sandbox: corral.Sandbox, controller: str) -> Path:
    relative = Path("corral-batch" if sandbox.info.qos == "batch" else "corral") / sandbox.id
    return Path("/sys/fs/cgroup") / relative if _unified() else Path("/sys/fs/cgroup") / controller / relative


def _cpu_used_s(sandbox: corral.Sandbox) -> float:
    """CPU time the sandbox's cgroup has used so far."""
    if _unified():
        stat = dict(line.split() for line in (_cgroup_dir(sandbox, "cpu") / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6
    return int((_cgroup_dir(sandbox, "cpuacct") / "cpuacct.usage").read_text()) / 1e9


def _burn(sandbox: corral.Sandbox, loops: int) -> None:
    for _ in range(loops):
        sandbox.start(BURN, timeout_s=120)


def test_classes_set_weight_and_keep_quota(client: corral.Client) -> None:
    with (
        client.create("busybox", cpu=0.5, ttl_s=600) as latency,
        client.create("busybox", cpu=0.5, qos="batch", ttl_s=600) as batch,
    ):
        assert (latency.info.qos, batch.info.qos) == ("latency", "batch")
        for sandbox, shares, weight in ((latency, 1024, 100), (batch, 10, 1)):
            cpu = _cgroup_dir(sandbox, "cpu")
            if _unified():
                assert int((cpu / "cpu.weight").read_text()) == weight
                assert (cpu / "cpu.max").read_text().split()[0] == "50000"
            else:
                assert int((cpu / "cpu.shares").read_text()) == shares
                assert int((cpu / "cpu.cfs_quota_us").read_text()) == 50_000
        tier = _cgroup_dir(batch, "cpu").parent
        assert tier.name == "corral-batch"
        if (tier / "cpu.idle").exists():
            assert (tier / "cpu.idle").read_text().strip() == "1"
        assert not (_cgroup_dir(latency, "cpu").parent / "cpu.idle").read_text().strip() == "1"


def test_batch_class_is_only_for_containers(client: corral.Client) -> None:
    with pytest.raises(corral.InvalidRequest, match="qos"):
        client.create("busybox", backend="microvm", qos="batch")


def test_latency_work_gets_the_cpu_ahead_of_batch_work(client: corral.Client) -> None:
    """Both burn CPU 0 (batch with twice the loops); over a fixed window the latency sandbox must get several
    times the batch one's CPU time. Equal weights would give about 1:1; the weights are 100:1."""
    with (
        client.create("busybox", qos="batch", ttl_s=600) as batch,
        client.create("busybox", ttl_s=600) as latency,
    ):
        _burn(batch, 2)
        _burn(latency, 1)
        time.sleep(0.5)  # the loops are all running
        latency_before, batch_before = _cpu_used_s(latency), _cpu_used_s(batch)
        time.sleep(WINDOW_S)
        latency_used, batch_used = _cpu_used_s(latency) - latency_before, _cpu_used_s(batch) - batch_before
    assert latency_used > 0.2 * WINDOW_S, (latency_used, batch_used)  # it ran at all on a loaded machine
    assert latency_used > 4 * batch_used, (latency_used, batch_used)


def test_a_fork_keeps_its_parents_class(client: corral.Client) -> None:
    with client.create("busybox", qos="batch", ttl_s=600) as parent:
        (child,) = parent.fork(1)
        with child:
            assert child.info.qos == "batch"
            assert _cgroup_dir(child, "cpu").is_dir()


def test_a_batch_sandbox_is_readopted_in_its_tier_after_a_restart(fresh_server: EmbeddedServer) -> None:
    """The class comes back from the state store, and the re-attached sandbox still lives in the batch tier."""
    with fresh_server.client() as client:
        sandbox = client.create("busybox", qos="batch", ttl_s=600)
        sandbox.start("sleep 600")
    fresh_server.stop()
    fresh_server.start()
    with fresh_server.client() as client:
        handle = client.connect(sandbox)
        assert handle.refresh().qos == "batch"
        assert "sleep 600" in handle.exec("ps").stdout
        assert _cgroup_dir(sandbox, "cpu").is_dir()
        handle.kill()
    assert not _cgroup_dir(sandbox, "cpu").exists()
