"""`corral bench restart`: how long a server takes to come back with N sandboxes to re-adopt, one at a time
against CORRAL_ADOPT_CONCURRENCY at a time, in the same run.

Two embedded servers side by side over the node's layer store, one adopting one sandbox at a time
(CORRAL_ADOPT_CONCURRENCY=1), one with the default. Each gets N busybox sandboxes, then, alternately, is
stopped (SIGTERM: the server only, its sandboxes keep running) and started again, timed from the start until
it answers (`EmbeddedServer.start` returns once the API is up, which is after adoption). The same restart with
no sandbox gives each round's baseline (the server's own start-up), so per sandbox is (restart - empty) / N.
After every restart each sandbox must answer an exec (a restart that lost one is not timed as a success).

A restart must end inside the heartbeat timeout plus the restart grace (docs/cluster.md) or the node's
sandboxes are lost: verdict, the default restart of N ≤ CORRAL_NODE_LOST_AFTER_S's default (15 s).
"""

from __future__ import annotations

import os
import platform
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit, require_success
from corral.config import Settings
from corral.edge.local import ADOPT_CONCURRENCY
from corral.embedded import EmbeddedServer

__all__ = ["run_restart_benchmark"]

IMAGE = "busybox"
SANDBOX_TTL_S = 1800.0  # a sandbox leaked by a crashed bench still goes away
CPU, MEMORY_MB = 0.05, 32
LABEL = {"bench": "restart"}
SETTINGS = {"one at a time": "1", "concurrent": str(ADOPT_CONCURRENCY)}


def _restart_s(server: EmbeddedServer) -> float:
    server.stop()
    started = time.perf_counter()
    server.start()
    return time.perf_counter() - started


def _all_answer(server: EmbeddedServer, ids: list[str]) -> None:
    with server.client() as client:
        for sandbox_id in ids:
            require_success(client.get(sandbox_id).exec("true"), "true")


def run_restart_benchmark(*, sandboxes: int, runs: int, as_json: bool, console: Console) -> dict[str, Any]:
    with bench_session("bench restart", as_json=as_json, console=console) as (scratch, progress):
        servers = {name: EmbeddedServer(scratch / name.replace(" ", "-"), env={"CORRAL_ADOPT_CONCURRENCY": value})
                   for name, value in SETTINGS.items()}  # fmt: skip
        try:
            report = _measure(servers, sandboxes=sandboxes, runs=runs, progress=progress)
        finally:
            for server in servers.values():
                server.shutdown()
            host.orphans.reap()
    emit(report, _table, as_json=as_json, console=console)
    return report


def _measure(servers: dict[str, EmbeddedServer], *, sandboxes: int, runs: int,
             progress: Progress) -> dict[str, Any]:  # fmt: skip
    task = progress.add_task("starting two servers", total=len(servers))
    for server in servers.values():
        server.start()
        progress.advance(task)
    empty: dict[str, list[float]] = {name: [] for name in servers}
    full: dict[str, list[float]] = {name: [] for name in servers}
    task = progress.add_task("restarts with no sandbox (baseline)", total=runs * len(servers))
    for _ in range(runs):
        for name, server in servers.items():
            empty[name].append(_restart_s(server))
            progress.advance(task)
    ids: dict[str, list[str]] = {}
    task = progress.add_task(f"creating {sandboxes} sandboxes on each", total=len(servers))
    for name, server in servers.items():
        with server.client() as client:
            ids[name] = [sandbox.id for sandbox in client.create_many(
                sandboxes, IMAGE, cpu=CPU, memory_mb=MEMORY_MB, ttl_s=SANDBOX_TTL_S, labels=LABEL)]  # fmt: skip
        progress.advance(task)
    task = progress.add_task(f"restarts with {sandboxes} sandboxes to re-adopt", total=runs * len(servers))
    for _ in range(runs):
        for name, server in servers.items():
            full[name].append(_restart_s(server))
            _all_answer(server, ids[name])
            progress.advance(task)
    results: dict[str, dict[str, Any]] = {}
    for name in servers:
        restart, baseline = summarize(full[name]), summarize(empty[name])
        results[name] = {"restart_s": restart, "empty_s": baseline,
                         "per_sandbox_ms": (restart["p50"] - baseline["p50"]) * 1000 / sandboxes}  # fmt: skip
    limit_s = Settings.model_fields["node_lost_after_s"].default
    concurrent = results["concurrent"]
    return {
        "benchmark": "restart",
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "sandboxes": sandboxes,
        "runs": runs,
        "adopt_concurrency": ADOPT_CONCURRENCY,
        "results": results,
        "speedup_per_sandbox": results["one at a time"]["per_sandbox_ms"] / max(concurrent["per_sandbox_ms"], 1e-9),
        "checks": [{"metric": "restart", "target": f"p50 ≤ {limit_s:g} s (the default heartbeat timeout)",
                    "value": concurrent["restart_s"]["p50"], "ok": concurrent["restart_s"]["p50"] <= limit_s}],
    }  # fmt: skip


def _table(report: dict[str, Any]) -> Table:
    results = report["results"]
    result = ResultTable(
        f"Restart with {report['sandboxes']} busybox sandboxes to re-adopt ({report['runs']} restarts each, "
        f"{report['host']['cpus']} cores)",
        f"per sandbox: (restart - restart with none) / N, medians; one at a time takes "
        f"{report['speedup_per_sandbox']:.1f}× the time per sandbox of {report['adopt_concurrency']} at a time",
        report["checks"],
        digits=2,
    )
    for name, row in results.items():
        restart, empty = row["restart_s"], row["empty_s"]
        checked = name == "concurrent"
        result.table.add_row(
            f"restart, {name}", f"{restart['p50']:.2f} s", f"{restart['p95']:.2f} s",
            f"none to adopt {empty['p50']:.2f} s", f"{restart['p50'] / empty['p50']:.1f}×",
            result.target("restart") if checked else "-", result.verdict("restart") if checked else "-",
        )  # fmt: skip
        result.table.add_row(f"  per sandbox, {name}", f"{row['per_sandbox_ms']:.1f} ms", "-", "-", "-", "-", "-")
    return result.table
