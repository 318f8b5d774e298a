"""`corral bench containers` at a tiny size (2 samples, a burst of 6), so that the benchmark and its baselines cannot
rot: it runs as its own process, as users run it, with its own server and its own crun state."""

from __future__ import annotations

from tests.conftest import bench_report

BURST = 6


def test_bench_containers_measures_the_burst_against_plain_crun() -> None:
    report = bench_report("containers", "--runs", "2", "--concurrency", str(BURST))
    corral, baseline = report["corral"]["concurrent_create"], report["baseline"]["crun_concurrent_create"]
    for burst in (corral, baseline):
        assert burst["requested"] == burst["succeeded"] == BURST, burst["errors"]
        assert burst["creations_per_s"] > 0 and burst["wall_s"] > 0
        # The host was busy starting them: at least one process ran for each (crun forks, execs and clones).
        assert 0.1 < burst["host_cpu_ms_per_create"] < 10_000
    assert baseline["at_once"] == 8  # the server's default create concurrency
    assert report["baseline"]["crun_create_start_exec"]["n"] == 2
    corral_runs = report["corral"]
    for metric in ("exec_roundtrip", "exec_back_to_back", "exec_job_token", "exec_output", "exec_step",
                   "exec_step_many_files", "http_roundtrip"):  # fmt: skip
        assert corral_runs[metric]["n"] == report["params"]["exec_samples"], metric
    assert corral_runs["exec_output"]["output_bytes"] == 64 << 10  # each sample checked that it got all of it
    assert corral_runs["exec_step_many_files"]["layer_files"] == 20_000
    assert 0 < corral_runs["http_roundtrip"]["p50"] < corral_runs["exec_back_to_back"]["p50"]  # an exec is more
    assert 0 < corral_runs["http_roundtrip"]["p50"] < corral_runs["exec_job_token"]["p50"]  # an exec by a job token
    spawn = report["baseline"]["host_spawn"]
    assert spawn["n"] == report["params"]["exec_samples"] and 0 < spawn["p50"] < corral_runs["exec_back_to_back"]["p50"]
    assert {check["metric"]: check["ok"] for check in report["checks"]}["crun_concurrent_create"] is True
