"""`corral bench lifecycle` at a tiny size (1 sample each, 2 sandboxes stepping at once), so that the benchmark and
its baselines cannot rot: it runs as its own process, as users run it, with its own server (and with
``--postgres`` its own PostgreSQL)."""

from __future__ import annotations

import pytest

from corral.bench.lifecycle import REPLAY_STEPS, STEPPING_ROUNDS, STEPPING_STEPS
from tests.conftest import bench_report

STEPPING = 2


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_bench_lifecycle_measures_each_part_against_its_baseline(database: str) -> None:
    on_postgres = ["--postgres"] if database == "postgresql" else []
    report = bench_report("lifecycle", "--runs", "1", "--stepping", str(STEPPING), *on_postgres, timeout_s=300)
    assert report["database"] == database
    assert report["pause"]["pause"]["n"] == report["pause"]["crun_pause"]["n"] == 1
    assert report["fork"]["fork"]["n"] == report["fork"]["create"]["n"] == 1
    assert report["replay"]["check"] == {"first_pass_executed": REPLAY_STEPS, "sync_resend_replayed": REPLAY_STEPS,
                                         "async_resend_replayed": REPLAY_STEPS, "log_lines": REPLAY_STEPS}  # fmt: skip
    stepping = report["stepping"]
    steps = STEPPING * STEPPING_STEPS * STEPPING_ROUNDS
    # Each step's logged files are the one file it wrote, and the node's change journal found them all.
    assert stepping["check"] == {"steps": steps, "files_not_as_written": 0, "found_by_journal": steps,
                                 "found_by_walk": 0}  # fmt: skip
    for kind in ("steps", "plain"):
        assert stepping[kind]["n"] == steps and stepping[kind]["steps_per_s"] > 0
        assert len(stepping["rates"][kind]) == STEPPING_ROUNDS
    assert {check["metric"]: check["ok"] for check in report["checks"]}["stepping"] is True
