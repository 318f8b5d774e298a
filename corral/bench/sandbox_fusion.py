"""`corral bench sandbox-fusion`: SandboxFusion's /run_code against Corral's own /v1/run_code, one run, one server.

Both run the same Python program (``print(sum(range(1000)))``) in the same
pool (debian-12, 256 MB), so the difference is the facade: its wire format,
its compile/run steps and, for the SandboxFusion side, the released
``sandbox-fusion`` client (``requests``, a new connection per call, as verl
calls it) against Corral's SDK (one kept-alive connection).

1. Round trip: one call at a time, the two clients interleaved call by call,
   after warm-up calls.
2. Throughput: ``--clients`` threads, each making its share of the calls, one
   client after the other; calls/s and each call's latency. Client, server and
   sandboxes share this machine's cores, so the rates are floors.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_server, bench_session, emit, ms_since
from corral.embedded import EmbeddedServer
from corral.gateway.sandbox_fusion import sandbox_fusion_key
from corral.sdk import Client, InvalidRequest

__all__ = ["run_sandbox_fusion_benchmark"]

CODE = "print(sum(range(1000)))"
EXPECTED = "499500\n"
MEMORY_MB = 256  # Corral's run_code default: both land in one pool
WARMUP_CALLS = 20
THROUGHPUT_CALLS_PER_RUN = 5


def _clients(server: EmbeddedServer, client: Client) -> dict[str, Callable[[], None]]:
    """One call of each kind; each checks its answer (a bench must not time failures)."""
    from sandbox_fusion import RunCodeRequest, run_code  # the bench's own dependency (the dev extra)

    endpoint = f"{server.url}/sandbox-fusion/{sandbox_fusion_key(server.api_key)}"

    def fusion() -> None:
        answer = run_code(
            RunCodeRequest(code=CODE, language="python", memory_limit_MB=MEMORY_MB), endpoint=endpoint, max_attempts=1
        )
        if answer.status != "Success" or answer.run_result is None or answer.run_result.stdout != EXPECTED:
            raise RuntimeError(f"SandboxFusion /run_code answered {answer}")

    def corral() -> None:
        answer = client.run_code(CODE, language="python", memory_mb=MEMORY_MB)
        if answer.passed != 1 or answer.tests[0].stdout != EXPECTED:
            raise RuntimeError(f"/v1/run_code answered {answer}")

    return {"sandbox_fusion": fusion, "corral": corral}


def _timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    call()
    return ms_since(started)


def _throughput(call: Callable[[], None], calls: int, clients: int) -> dict[str, Any]:
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=clients) as pool:
        latencies = list(pool.map(lambda _: _timed(call), range(calls)))
    elapsed_s = time.perf_counter() - started
    return {"calls_per_s": calls / elapsed_s, "latency_ms": summarize(latencies), "calls": calls}


def _measure(data_dir: Path, runs: int, clients: int, progress: Progress) -> dict[str, Any]:
    with bench_server(data_dir, progress) as server, server.client() as client:
        calls = _clients(server, client)
        for call in calls.values():
            for _ in range(WARMUP_CALLS):
                call()
        samples: dict[str, list[float]] = {name: [] for name in calls}
        task = progress.add_task("round trip (SandboxFusion, Corral), interleaved", total=runs)
        for _ in range(runs):
            for name, call in calls.items():
                samples[name].append(_timed(call))
            progress.advance(task)
        results: dict[str, Any] = {f"{name}_roundtrip": summarize(values) for name, values in samples.items()}
        for name, call in calls.items():
            task = progress.add_task(f"throughput, {clients} threads: {name}", total=1)
            results[f"{name}_throughput"] = _throughput(call, runs * THROUGHPUT_CALLS_PER_RUN, clients)
            progress.update(task, completed=1)
    return results


def _table(report: dict[str, Any]) -> Table:
    params, info = report["params"], report["host"]
    caption = (
        f"{params['runs']} round trips per client, interleaved; throughput {params['throughput_calls']} calls from "
        f"{params['clients']} threads per client; python {CODE!r}, {MEMORY_MB} MB pool; client, server and sandboxes "
        f"share {info['cpu_count']} cpus. Kernel {info['kernel']}."
    )
    rows = ResultTable("corral bench sandbox-fusion", caption, report["checks"], digits=2)
    rows.timing("round trip, SandboxFusion /run_code", report["sandbox_fusion_roundtrip"], "/v1/run_code",
                report["corral_roundtrip"])  # fmt: skip
    fusion, corral = report["sandbox_fusion_throughput"], report["corral_throughput"]
    rows.timing("latency under load, SandboxFusion", fusion["latency_ms"], "/v1/run_code", corral["latency_ms"])
    ratio = fusion["calls_per_s"] / corral["calls_per_s"]
    rows.table.add_row(
        "throughput, SandboxFusion /run_code", f"{fusion['calls_per_s']:.0f}/s", "-",
        f"/v1/run_code {corral['calls_per_s']:.0f}/s", f"{ratio:.2f}×", "-", "-",
    )  # fmt: skip
    return rows.table


def run_sandbox_fusion_benchmark(*, runs: int, clients: int, as_json: bool, console: Console) -> None:
    """Measure SandboxFusion's /run_code against /v1/run_code in the same run, then print a table (or JSON)."""
    if runs < 1 or clients < 1:
        raise InvalidRequest("--runs and --clients must be at least 1")
    params = {"runs": runs, "clients": clients, "throughput_calls": runs * THROUGHPUT_CALLS_PER_RUN, "code": CODE,
              "memory_mb": MEMORY_MB}  # fmt: skip
    with bench_session("bench-sandbox-fusion", as_json=as_json, console=console) as (scratch, progress):
        results = _measure(scratch / "server", runs, clients, progress)
    host_info = {"kernel": platform.release(), "cpu_count": os.cpu_count()}
    emit({"unit": "ms", "params": params, "host": host_info, "checks": [], **results}, _table, as_json=as_json,
         console=console)  # fmt: skip
