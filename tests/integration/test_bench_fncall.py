"""`corral bench fncall` at a small size (20 sequential calls, 4 clients), so that the benchmark cannot rot.

It runs as its own process, as users run it: it starts its own server and pools.
"""

from __future__ import annotations

from corral.bench.fncall import WARMUP_PASSES
from tests.conftest import bench_report

RUNS, CLIENTS = 20, 4


def test_bench_fncall_times_pooled_calls_against_a_shell_and_checks_issue_22s_targets() -> None:
    report = bench_report("fncall", "--runs", str(RUNS), "--clients", str(CLIENTS))
    assert {"params", "host", "roundtrip", "throughput", "batched", "cold", "pools", "checks"} <= set(report)
    roundtrip = report["roundtrip"]
    assert roundtrip["fncall"]["n"] + roundtrip["probe"]["n"] == RUNS and roundtrip["shell"]["n"] == RUNS
    assert roundtrip["probe"]["n"] == RUNS // 10  # each printed 1: the bench fails on a leak before reporting
    assert set(report["throughput"]) == {str(CLIENTS), "1"}
    for side in report["throughput"].values():
        fncall, shell = side["fncall"], side["shell"]
        assert fncall["calls"] == shell["calls"] == RUNS * 5 and fncall["calls_per_s"] > 0 < shell["calls_per_s"]
        # Timed once an untimed pass was all hits (the pool grown to the callers), or after the passes' cap: a miss
        # (a container started) is not in the rate. Under a full test run's load a timed pass of 100 still had one
        # miss once (a sandbox replaced, or the pool grown, meanwhile).
        assert 1 <= fncall["warmup"]["passes"] <= WARMUP_PASSES
        assert fncall["warmup"]["hit_rate"] == 1.0 or fncall["warmup"]["passes"] == WARMUP_PASSES
        assert fncall["hit_rate"] >= 0.95
        assert all(cpu > 0 for cpu in fncall["cpu_ms_per_call"].values()), fncall["cpu_ms_per_call"]
    assert report["cold"]["pool_hits"] == 0  # a new pool each: every cold call starts its sandbox
    checks = {check["metric"]: check for check in report["checks"]}
    assert set(checks) == {"roundtrip", "throughput", "single caller", "isolation"}
    assert checks["throughput"]["target"] == "≥ 1500 calls/s"
    assert checks["single caller"]["value"] == report["throughput"]["1"]["fncall"]["p50"]
    assert checks["throughput"]["ok"] == (report["throughput"][str(CLIENTS)]["fncall"]["calls_per_s"] >= 1500)
