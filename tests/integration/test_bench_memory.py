"""`corral bench memory` at a tiny size (3 sandboxes, an 8 MiB layer), so that the benchmark cannot rot.

It runs as its own process, as users run it: the bench makes itself a subreaper and starts its own server.
"""

from __future__ import annotations

from tests.conftest import bench_report

COUNT, LAYER_MIB, HELD_MIB = 3, 8, 20


def test_bench_memory_runs_at_a_tiny_size_and_reports_sharing_and_reclaim() -> None:
    report = bench_report("memory", "--count", str(COUNT), "--layer-mib", str(LAYER_MIB))
    assert {"params", "host", "sharing", "reclaim", "checks", "timestamp"} <= set(report)

    sharing = report["sharing"]
    assert sharing["readers"] == COUNT and sharing["layer_mib"] == LAYER_MIB
    assert sharing["naive_mib"] == COUNT * LAYER_MIB
    assert set(sharing["readings"]) == {"before", "one_idle", "one_read", "all_idle", "all_read"}
    # The first reader's cgroup is charged the layer's pages; the others find them cached and pay nothing for them.
    assert sharing["one"]["resident_mib"] >= 0.9 * LAYER_MIB
    assert sharing["per_extra_reader"]["resident_mib"] < LAYER_MIB / 2
    # The layer's files sit once in the page cache (the edge's one mount), however many sandboxes read them.
    assert sharing["one"]["layer_files_cached_mib"] >= 0.9 * LAYER_MIB
    assert sharing["all"]["layer_files_cached_mib"] <= 1.1 * LAYER_MIB

    reclaim = report["reclaim"]
    assert reclaim["sandboxes"] == COUNT and reclaim["held_mib"] == HELD_MIB
    assert reclaim["resident_before_mib"] >= COUNT * HELD_MIB
    assert reclaim["reclaimed_fraction"] >= 0.8
    assert reclaim["resumed"] == {"matched": COUNT, "done": COUNT, "failed": 0}
    assert reclaim["probe"]["ok"]
    assert [check["metric"] for check in report["checks"]] == ["per_extra_reader", "reclaimed"]
