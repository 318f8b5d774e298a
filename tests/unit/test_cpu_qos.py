"""The CPU QoS classes' weights and the v1 shares ↔ v2 weight map."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.backends.common import qos
from corral.backends.container import oci


def test_defaults_map_to_each_other() -> None:
    assert qos.weight_to_shares(100) == 1024
    assert qos.shares_to_weight(1024) == 100


def test_classes_keep_their_order_and_ratio_in_both_units() -> None:
    latency, batch = qos.weight_of("latency"), qos.weight_of("batch")
    assert latency == 100  # a latency sandbox keeps the kernel's default weight
    assert latency >= 50 * batch
    assert qos.weight_to_shares(latency) >= 50 * qos.weight_to_shares(batch)
    for weight in (latency, batch):
        assert qos.shares_to_weight(qos.weight_to_shares(weight)) == weight


def test_map_clamps_to_each_versions_range() -> None:
    assert qos.weight_to_shares(1) == 10
    assert qos.weight_to_shares(10000) == 102400
    assert qos.shares_to_weight(2) == 1  # v1's minimum is below v2's
    assert qos.shares_to_weight(262144) == 10000
    assert qos.weight_to_shares(0) == 2


def test_unknown_class_is_refused() -> None:
    with pytest.raises(ValueError, match="latency, batch"):
        qos.weight_of("realtime")
    with pytest.raises(ValueError, match="latency, batch"):
        qos.cgroup_path("sb-x", "realtime")


def test_batch_sandboxes_live_in_an_idle_tier_of_their_own() -> None:
    assert qos.cgroup_path("sb-x", "latency") == "/corral/sb-x"
    assert qos.cgroup_path("sb-x", "batch") == "/corral-batch/sb-x"
    assert qos.IDLE_TIERS == {qos.TIERS["batch"]}


def test_config_carries_shares_and_quota() -> None:
    limits = oci.ContainerLimits(cpu=0.5, memory_mb=64, pids_max=32, cpu_shares=qos.weight_to_shares(1))
    config = oci.build_config(hostname="h", limits=limits, cgroup_path="/corral/x", agent_binary=Path("/a"))
    assert config["linux"]["resources"]["cpu"] == {"shares": 10, "quota": 50_000, "period": oci.CFS_PERIOD_US}
