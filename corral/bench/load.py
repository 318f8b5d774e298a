"""`corral bench load`: many concurrent execs through the HTTP API, counting errors and the latency tail.

A server of the bench's own starts ``--sandboxes`` busybox sandboxes (one batch
create). Then, ``--rounds`` times, ``--execs`` execs of a small command
(``cat /n``, a file holding the sandbox's number: an answer from the wrong
sandbox is an error) are sent at
once from one AsyncClient, spread round-robin over the sandboxes, and each one's
round trip is timed from its send to its answer. Every answer is checked:
anything but exit 0 with the expected output, and any exception, is an error.

Baseline, in the same run: the same exec sent one at a time (after the load, on
the same sandboxes), so the loaded latency reads as a multiple of the idle one.
Targets (issue 19): no errors; p99 at most 10x p50 under load.

One machine runs the client, the server and every sandbox, so the absolute
figures (and the rate) are what 2 cores give, not a ceiling.
"""

from __future__ import annotations

import asyncio
import platform
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from corral.bench.containers import percentile, summarize
from corral.bench.harness import bench_session, emit, ms_since
from corral.embedded import EmbeddedServer
from corral.sdk import AsyncClient, AsyncSandbox

__all__ = ["run_load_benchmark"]

SANDBOX_MEMORY_MB = 32
SANDBOX_CPU = 0.1  # 200 of them fit a 2-core node's admission (CORRAL_CPU_OVERCOMMIT 64: 128 at cpu=1)
SANDBOX_TTL_S = 900.0  # a sandbox leaked by a crashed bench still goes away
IDLE_SAMPLES = 100
TAIL_TARGET = 10.0  # p99 / p50 under load
COMMAND = "cat /n"  # /n holds the sandbox's number, so an answer from the wrong sandbox is an error
EXEC_TIMEOUT_S = 120.0


async def _timed_exec(sandbox: AsyncSandbox, number: int) -> tuple[float, str | None]:
    """(round trip in ms, None or what went wrong)."""
    started = time.perf_counter()
    try:
        result = await sandbox.exec(COMMAND, timeout_s=EXEC_TIMEOUT_S)
    except Exception as exc:  # every failure counts, whatever its kind
        return ms_since(started), f"{type(exc).__name__}: {exc}"[:200]
    took = ms_since(started)
    if result.exit_code != 0 or result.stdout != f"{number}\n":
        return took, f"exit {result.exit_code}, stdout {result.stdout[:40]!r}"
    return took, None


def _latency(samples: list[float]) -> dict[str, float]:
    return {**summarize(samples), "p99": percentile(samples, 99)}


async def _measure(url: str, api_key: str, *, sandboxes: int, execs: int, rounds: int, progress: Any) -> dict[str, Any]:
    async with AsyncClient(url, api_key) as client:
        task = progress.add_task(f"creating {sandboxes} sandboxes", total=sandboxes)
        started = time.perf_counter()
        pool: list[AsyncSandbox] = []
        async for sandbox in client.create_many(
            sandboxes,
            "busybox",
            cpu=SANDBOX_CPU,
            memory_mb=SANDBOX_MEMORY_MB,
            ttl_s=SANDBOX_TTL_S,
            labels={"bench": "load"},
        ):
            pool.append(sandbox)
            progress.advance(task)
        create_s = ms_since(started) / 1000
        try:
            numbered = [(sandbox, number) for number, sandbox in enumerate(pool)]
            for sandbox, number in numbered:
                await sandbox.files.write("/n", f"{number}\n")
                await _timed_exec(sandbox, number)  # warm-up
            loaded: list[float] = []
            errors: list[str] = []
            rates: list[float] = []
            task = progress.add_task(f"{rounds} rounds of {execs} concurrent execs", total=rounds)
            for _ in range(rounds):
                calls = [numbered[i % len(numbered)] for i in range(execs)]
                started = time.perf_counter()
                answers = await asyncio.gather(*(_timed_exec(sandbox, number) for sandbox, number in calls))
                rates.append(execs / (ms_since(started) / 1000))
                loaded += [took for took, _ in answers]
                errors += [error for _, error in answers if error is not None]
                progress.advance(task)
            task = progress.add_task("the same exec, one at a time (baseline)", total=IDLE_SAMPLES)
            idle: list[float] = []
            for i in range(IDLE_SAMPLES):
                took, error = await _timed_exec(*numbered[i % len(numbered)])
                idle.append(took)
                if error is not None:
                    errors.append(error)
                progress.advance(task)
        finally:
            await asyncio.gather(*(client.kill(sandbox.id) for sandbox in pool), return_exceptions=True)
    under_load, baseline = _latency(loaded), _latency(idle)
    tail = under_load["p99"] / under_load["p50"]
    return {
        "create_s": create_s,
        "under_load_ms": under_load,
        "idle_ms": baseline,
        "execs_per_s": sorted(rates)[len(rates) // 2],
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:5],
        "checks": [
            {"metric": "errors", "target": "0", "ok": not errors},
            {"metric": "p99 / p50 under load", "target": f"<= {TAIL_TARGET:g}", "ok": tail <= TAIL_TARGET},
        ],
    }


def _table(report: dict[str, Any]) -> Table:
    table = Table("metric", "value", "baseline (same run)", "ratio", "target", "verdict",
                  title=f"corral bench load: {report['execs']} concurrent execs over {report['sandboxes']} sandboxes",
                  caption=f"{report['rounds']} rounds; {report['machine']}")  # fmt: skip
    checks = {check["metric"]: check for check in report["checks"]}

    def verdict(metric: str) -> str:
        return "[green]ok[/green]" if checks[metric]["ok"] else "[red]missed[/red]"

    loaded, idle = report["under_load_ms"], report["idle_ms"]
    for name in ("p50", "p95", "p99", "max"):
        table.add_row(f"exec round trip {name}", f"{loaded[name]:.1f} ms", f"one at a time {idle[name]:.1f} ms",
                      f"{loaded[name] / idle[name]:.1f}×", "-", "-")  # fmt: skip
    tail = loaded["p99"] / loaded["p50"]
    table.add_row("p99 / p50 under load", f"{tail:.1f}", f"idle {idle['p99'] / idle['p50']:.1f}", "-",
                  checks["p99 / p50 under load"]["target"], verdict("p99 / p50 under load"))  # fmt: skip
    table.add_row("execs/s (median round)", f"{report['execs_per_s']:.0f}", "-", "-", "-", "-")
    table.add_row("errors", str(report["errors"]), "-", "-", "0", verdict("errors"))
    table.add_row("create (one batch)", f"{report['create_s']:.1f} s", "-", "-", "-", "-")
    for example in report["error_examples"]:
        table.add_row("[red]error[/red]", example, "", "", "", "")
    return table


def run_load_benchmark(*, sandboxes: int, execs: int, rounds: int, as_json: bool, console: Console) -> dict[str, Any]:
    with bench_session("bench-load", as_json=as_json, console=console) as (scratch, progress):
        with EmbeddedServer(scratch / "server") as server:
            measured = asyncio.run(
                _measure(server.url, server.api_key, sandboxes=sandboxes, execs=execs, rounds=rounds, progress=progress)
            )
    report = {"sandboxes": sandboxes, "execs": execs, "rounds": rounds, "machine": platform.node(), **measured}
    emit(report, _table, as_json=as_json, console=console)
    return report
