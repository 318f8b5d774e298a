"""`corral bench warm-pool`: creates claimed from a warm pool against cold creates, in the same run.

Two embedded servers run side by side over the node's layer store: one with warm pools on
(CORRAL_WARM_POOL_MEMORY_MB), one with them off (the default). Through the real SDK over HTTP:

1. create → first exec (`true`) of a busybox sandbox (debian-12 for a full vm), sampled alternately on both: a
   pooled sample waits (untimed) until its pool has a warm sandbox, then times create + exec; the cold one is
   the same calls on the server without pools. A second exec on each pooled sandbox gives one request's round trip under
   the same load: a pooled create + first exec can take no less than about two of them. Each sample is also
   split into the create call alone (the claim, or the cold start) and the first exec after it.
2. A batch of N creates (`create_many`): the pooled server's first batch of a new shape finds its pool empty
   (every create is a miss and starts cold): that is the same-run baseline, and its N creates are the demand
   the pool then refills to. Once the pool holds N warm sandboxes, a second batch of N is timed. The rate is
   N over the client's wall time from the request until the last sandbox arrived.

Verdicts: pooled create → first exec p50 ≤ 5 ms, pooled batch ≥ 1,000/s (issue 22). The machine is shared
and noisy: read the figures against their same-run baselines.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit, metric_sum, ms_since, require_success
from corral.embedded import EmbeddedServer
from corral.gateway.warm_pool import CLAIMED_NOTE
from corral.sdk import Client

__all__ = ["run_warm_pool_benchmark"]

IMAGE = {"container": "busybox", "microvm": "busybox", "vm": "debian-12"}  # a vm boots a disk of a whole system
SANDBOX_TTL_S = 600.0  # a sandbox leaked by a crashed bench still goes away
# A microvm's guest gets a core: an exec in a TCG guest takes ~30 ms of CPU, which a quarter core's CFS quota
# (25 ms per 100 ms) would stretch over two periods. Containers keep the quarter core of earlier runs.
SAMPLE_CPU = {"container": 0.25, "microvm": 1.0, "vm": 1.0}
SAMPLE_MEMORY_MB = {"container": 64, "microvm": 256, "vm": 512}
BATCH_CPU, BATCH_MEMORY_MB = 0.05, 32  # a thousand of them, twice, fit the node's CPU and memory admission
CREATE_P50_TARGET_MS = {"container": 5.0, "microvm": 30.0}  # issue 22 (none for a full vm)
POOL_GUESTS = 2  # the pooled server's budget for VMs, in guests (an idle microvm holds ~200 MiB of the host)
BATCH_RATE_TARGET = 1000.0  # sandboxes per second
WARM_WAIT_S = 600.0
BATCH_LABEL = {"bench": "warm-pool-batch"}


def _warm(server: EmbeddedServer, memory_mb: int) -> float:
    """Warm sandboxes of the pools of this memory size, from the server's metrics."""
    return metric_sum(server, "corral_warm_pool_sandboxes", memory_mb=str(memory_mb), state="warm")


def _wait_warm(server: EmbeddedServer, memory_mb: int, count: int, on_wait: Callable[[float], None]) -> float:
    """Seconds until the pools of this memory size hold ``count`` warm sandboxes."""
    started = time.perf_counter()
    while (warm := _warm(server, memory_mb)) < count:
        on_wait(warm)
        if time.perf_counter() - started > WARM_WAIT_S:
            raise RuntimeError(f"the pool reached only {warm:.0f} of {count} warm sandboxes in {WARM_WAIT_S:g} s")
        time.sleep(0.05)
    return time.perf_counter() - started


class _Sample(NamedTuple):
    """One create → first exec, split: the create call alone (a claim, or a cold start), the first command, and
    a second exec on the same sandbox (one request's round trip under the same load)."""

    total_ms: float
    create_ms: float
    first_exec_ms: float
    claimed: bool
    second_exec_ms: float


def _create_sample(client: Client, backend: str) -> _Sample:
    started = time.perf_counter()
    sandbox = client.create(IMAGE[backend], backend=backend, cpu=SAMPLE_CPU[backend],
                            memory_mb=SAMPLE_MEMORY_MB[backend], ttl_s=SANDBOX_TTL_S)  # fmt: skip
    try:
        created = time.perf_counter()
        require_success(sandbox.exec("true"), "true")
        done = time.perf_counter()
        require_success(sandbox.exec("true"), "true")
        return _Sample((done - started) * 1000, (created - started) * 1000, (done - created) * 1000,
                       sandbox.info.status_message == CLAIMED_NOTE, ms_since(done))  # fmt: skip
    finally:
        sandbox.kill()


def _batch(client: Client, count: int) -> tuple[float, int]:
    """(sandboxes per second, how many were claimed from a pool) of one batch; its sandboxes are killed after."""
    started = time.perf_counter()
    made = list(client.create_many(count, IMAGE["container"], cpu=BATCH_CPU, memory_mb=BATCH_MEMORY_MB,
                                   ttl_s=SANDBOX_TTL_S, labels=BATCH_LABEL))  # fmt: skip
    took_s = time.perf_counter() - started
    claimed = sum(sandbox.info.status_message == CLAIMED_NOTE for sandbox in made)
    client.bulk(BATCH_LABEL, "kill")
    return len(made) / took_s, claimed


def _servers(scratch: Path, backend: str) -> tuple[EmbeddedServer, EmbeddedServer]:
    budget_mb = (2 * 1000 * max(SAMPLE_MEMORY_MB[backend], BATCH_MEMORY_MB) if backend == "container"
                 else POOL_GUESTS * SAMPLE_MEMORY_MB[backend])  # fmt: skip
    pooled = EmbeddedServer(scratch / "pooled", env={"CORRAL_WARM_POOL_MEMORY_MB": str(budget_mb),
                                                     "CORRAL_WARM_POOL_WINDOW_S": "3600"})  # fmt: skip
    return pooled, EmbeddedServer(scratch / "cold")


def run_warm_pool_benchmark(
    *, runs: int, batch: int, backend: str = "container", as_json: bool, console: Console
) -> dict[str, Any]:
    """``batch`` 0: no batch rows (the VMs' default: a thousand guests do not fit a node)."""
    with bench_session("bench warm-pool", as_json=as_json, console=console) as (scratch, progress):
        pooled, cold = _servers(scratch, backend)
        try:
            task = progress.add_task("starting two servers (pools on, off)", total=2)
            pooled.start()
            progress.advance(task)
            cold.start()
            progress.advance(task)
            report = _measure(pooled, cold, runs=runs, batch=batch, backend=backend, progress=progress)
        finally:
            for server in (pooled, cold):
                server.shutdown()
            host.orphans.reap()
    emit(report, _table, as_json=as_json, console=console)
    return report


def _measure(pooled: EmbeddedServer, cold: EmbeddedServer, *, runs: int, batch: int, backend: str,
             progress: Progress) -> dict[str, Any]:  # fmt: skip
    samples: dict[str, list[_Sample]] = {"pooled": [], "cold": []}
    target_ms = CREATE_P50_TARGET_MS.get(backend)
    with pooled.client() as pooled_client, cold.client() as cold_client:
        _create_sample(pooled_client, backend)  # the shape's first create: a miss, which makes its pool
        _create_sample(cold_client, backend)  # a VM's first boot of a shape also makes its boot template
        task = progress.add_task("create → first exec, pooled and cold alternately", total=runs)
        memory_mb = SAMPLE_MEMORY_MB[backend]
        for _ in range(runs):
            _wait_warm(pooled, memory_mb, 1, lambda _: None)
            samples["pooled"].append(_create_sample(pooled_client, backend))
            _wait_warm(pooled, memory_mb, 1, lambda _: None)  # the refill's start is not the cold sample's load
            samples["cold"].append(_create_sample(cold_client, backend))
            progress.advance(task)
    claimed = sum(sample.claimed for sample in samples["pooled"])

    def of(kind: str, part: str) -> dict[str, float]:
        return summarize([getattr(sample, part) for sample in samples[kind]])

    pooled_ms, cold_ms, exec_ms = of("pooled", "total_ms"), of("cold", "total_ms"), of("pooled", "second_exec_ms")
    report: dict[str, Any] = {
        "benchmark": "warm-pool",
        "backend": backend,
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "kernel": platform.release()},
        "runs": runs,
        "create_to_first_exec_ms": {
            "pooled": pooled_ms,
            "cold": cold_ms,
            "claimed": claimed,
            "ratio_p50": pooled_ms["p50"] / cold_ms["p50"],
            "exec_round_trip": exec_ms,
            "ratio_to_exec_p50": pooled_ms["p50"] / exec_ms["p50"],
            "create_call": {"pooled": of("pooled", "create_ms"), "cold": of("cold", "create_ms")},
            "first_exec": {"pooled": of("pooled", "first_exec_ms"), "cold": of("cold", "first_exec_ms")},
        },  # fmt: skip
        "batch": None,
        "checks": [],
    }
    if target_ms is not None:
        report["checks"].append({"metric": "pooled_create_to_first_exec", "target": f"p50 ≤ {target_ms:g} ms",
                                 "value": pooled_ms["p50"], "ok": pooled_ms["p50"] <= target_ms})  # fmt: skip
    if batch:
        report["batch"] = _measure_batch(pooled, batch, progress)
        rate = report["batch"]["pooled_per_s"]
        report["checks"].append({"metric": "pooled_batch_rate", "target": f"≥ {BATCH_RATE_TARGET:,.0f}/s",
                                 "value": rate, "ok": rate >= BATCH_RATE_TARGET})  # fmt: skip
    return report


def _measure_batch(pooled: EmbeddedServer, batch: int, progress: Progress) -> dict[str, Any]:
    """A batch of containers with the pool empty (the baseline and the demand), then one from the refilled pool."""
    with pooled.client() as pooled_client:
        task = progress.add_task(f"batch of {batch}, pool empty (cold)", total=1)
        cold_rate, cold_claimed = _batch(pooled_client, batch)
        progress.advance(task)
        task = progress.add_task(f"refilling the pool to {batch}", total=batch)
        refill_s = _wait_warm(pooled, BATCH_MEMORY_MB, batch,
                              lambda warm: progress.update(task, completed=warm))  # fmt: skip
        progress.update(task, completed=batch)
        task = progress.add_task(f"batch of {batch} from the pool", total=1)
        pooled_rate, pooled_claimed = _batch(pooled_client, batch)
        progress.advance(task)
    return {
        "count": batch,
        "pooled_per_s": pooled_rate,
        "pooled_claimed": pooled_claimed,
        "cold_per_s": cold_rate,
        "cold_claimed": cold_claimed,
        "ratio": pooled_rate / cold_rate,
        "refill_s": refill_s,
        "refill_per_s": batch / refill_s,
    }


def _table(report: dict[str, Any]) -> Table:
    created, batch = report["create_to_first_exec_ms"], report["batch"]
    caption = f"{created['claimed']} of {report['runs']} pooled samples claimed"
    if batch:
        caption += (f"; batch of {batch['count']}: {batch['pooled_claimed']} claimed (pooled), "
                    f"{batch['cold_claimed']} (cold); the pool refilled {batch['count']} in {batch['refill_s']:.1f} s "
                    f"({batch['refill_per_s']:.0f}/s)")  # fmt: skip
    result = ResultTable(
        f"Warm pools: {IMAGE[report['backend']]} {report['backend']}, pooled vs cold "
        f"(same run, {report['host']['cpus']} cores)",
        caption, report["checks"], digits=2,
    )  # fmt: skip
    checked = "pooled_create_to_first_exec" if report["checks"] else None
    result.timing("create → first exec", created["pooled"], "cold", created["cold"], checked)
    result.timing("  the create call alone", created["create_call"]["pooled"], "cold", created["create_call"]["cold"])
    result.timing("  the first exec after it", created["first_exec"]["pooled"], "cold", created["first_exec"]["cold"])
    result.timing("exec round trip (same sandboxes)", created["exec_round_trip"], "pooled create → first exec",
                  created["pooled"])  # fmt: skip
    if not batch:
        return result.table
    result.table.add_row(
        f"batch of {batch['count']}", f"{batch['pooled_per_s']:,.0f}/s", "-", f"cold {batch['cold_per_s']:,.0f}/s",
        f"{batch['ratio']:.1f}×", result.target("pooled_batch_rate"), result.verdict("pooled_batch_rate"),
    )  # fmt: skip
    return result.table
