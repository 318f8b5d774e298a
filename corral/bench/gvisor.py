"""`corral bench gvisor`: what gVisor (runtime="runsc") costs against crun in the same run, and its snapshots.

Interleaved per run, busybox:
- create → first exec finished, runsc beside crun (each sandbox killed after);
- exec round trips (`true`) in one warm sandbox of each;
- pause of each warm sandbox right after writing FILL_MB into /dev/shm, its memory reclaim waited for: the share
  of its memory the edge pushed out (the crun sandbox is the baseline), then resume;
- runsc only: checkpoint (memory with the /dev/shm file, processes, writable layer; a background `sleep`
  running), rewind of the same sandbox to it, and a fork (checkpoint + restore into a new sandbox) whose
  child still runs the `sleep`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit
from corral.embedded import EmbeddedServer
from corral.sdk import Client, InvalidRequest, Sandbox

__all__ = ["run_gvisor_benchmark"]

IMAGE = "busybox"
EXECS_PER_RUN = 20
RUNTIMES = ("runsc", "crun")
FILL_MB = 48  # /dev/shm holds 64 MiB


def _timed_ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def _create_first_exec_ms(client: Client, runtime: str) -> float:
    started = time.perf_counter()
    with client.create(IMAGE, runtime=runtime, ttl_s=120) as sandbox:
        sandbox.exec("true")
        return _timed_ms(started)


def _snapshot_round(sandbox: Sandbox, samples: dict[str, list[float]]) -> None:
    sandbox.exec("sleep 600 >/dev/null 2>&1 & echo $! > /root/pid; echo saved > /root/state")
    started = time.perf_counter()
    saved = sandbox.checkpoint()
    samples["checkpoint"].append(_timed_ms(started))
    sandbox.exec("kill $(cat /root/pid); echo changed > /root/state")
    started = time.perf_counter()
    sandbox.restore(saved.id)
    samples["rewind"].append(_timed_ms(started))
    if sandbox.exec("kill -0 $(cat /root/pid) && cat /root/state").stdout != "saved\n":
        raise RuntimeError(f"the rewound sandbox {sandbox.id} lost its process or file")
    started = time.perf_counter()
    (child,) = sandbox.fork(1)
    samples["fork"].append(_timed_ms(started))
    try:
        if child.exec("kill -0 $(cat /root/pid) && echo alive").stdout != "alive\n":
            raise RuntimeError(f"the forked sandbox {child.id} lost the running process")
    finally:
        child.kill()
    sandbox.exec("kill $(cat /root/pid)")


def _measure(client: Client, runs: int, progress: Progress) -> dict[str, Any]:
    first: dict[str, list[float]] = {runtime: [] for runtime in RUNTIMES}
    execs: dict[str, list[float]] = {runtime: [] for runtime in RUNTIMES}
    snaps: dict[str, list[float]] = {"checkpoint": [], "rewind": [], "fork": []}
    reclaimed: dict[str, list[float]] = {runtime: [] for runtime in RUNTIMES}
    task = progress.add_task("runsc vs crun: create, exec; runsc checkpoint, rewind, fork", total=runs)
    with contextlib.ExitStack() as stack:
        warm = {runtime: stack.enter_context(client.create(IMAGE, runtime=runtime, ttl_s=1800)) for runtime in RUNTIMES}
        for i in range(runs):
            order = RUNTIMES if i % 2 == 0 else RUNTIMES[::-1]
            for runtime in order:
                first[runtime].append(_create_first_exec_ms(client, runtime))
            for _ in range(EXECS_PER_RUN):
                for runtime in order:
                    started = time.perf_counter()
                    warm[runtime].exec("true")
                    execs[runtime].append(_timed_ms(started))
            for runtime in order:  # written afresh each run: all of it resident before the pause
                warm[runtime].exec(f"dd if=/dev/urandom of=/dev/shm/blob bs=1M count={FILL_MB} iflag=fullblock 2>&-")
                paused = warm[runtime].pause(wait_reclaim=True)
                reclaimed[runtime].append(1 - paused.memory_after_bytes / max(1, paused.memory_before_bytes))
                warm[runtime].resume()
            _snapshot_round(warm["runsc"], snaps)
            progress.advance(task)
        image_bytes = max(int(c.size_bytes) for c in warm["runsc"].checkpoints())
    return {
        "create_first_exec_ms": {runtime: summarize(samples) for runtime, samples in first.items()},
        "exec_ms": {runtime: summarize(samples) for runtime, samples in execs.items()},
        "snapshot_ms": {key: summarize(samples) for key, samples in snaps.items()},
        "pause_reclaimed_share": {runtime: summarize(samples) for runtime, samples in reclaimed.items()},
        "checkpoint_bytes": image_bytes,
    }


def _table(report: dict[str, Any]) -> Table:
    info = report["host"]
    caption = (
        f"{report['params']['runs']} runs, interleaved; {IMAGE}; runsc {info['runsc']} (systrap). "
        f"Checkpoint on disk: {report['checkpoint_bytes'] / 2**20:.1f} MiB. "
        f"Kernel {info['kernel']}, {info['cpu_count']} cpus."
    )
    rows = ResultTable("corral bench gvisor", caption, [], digits=1)
    first, execs, snaps = report["create_first_exec_ms"], report["exec_ms"], report["snapshot_ms"]
    rows.timing("create → first exec (runsc)", first["runsc"], "crun", first["crun"])
    rows.timing("exec `true` round trip (runsc)", execs["runsc"], "crun", execs["crun"])
    rows.timing("checkpoint (memory, processes, files)", snaps["checkpoint"], "-", None)
    rows.timing("rewind the same sandbox", snaps["rewind"], "-", None)
    rows.timing("fork 1 (checkpoint + restore)", snaps["fork"], "-", None)
    runsc, crun = report["pause_reclaimed_share"]["runsc"], report["pause_reclaimed_share"]["crun"]
    rows.table.add_row(f"memory reclaimed by pause ({FILL_MB} MiB in /dev/shm)", f"{runsc['p50']:.0%}",
                       f"min {runsc['min']:.0%}", f"crun {crun['p50']:.0%}", "-", "-", "-")  # fmt: skip
    return rows.table


def _runsc_version() -> str:
    run = subprocess.run(["runsc", "--version"], capture_output=True, text=True, timeout=30, check=False)
    return run.stdout.splitlines()[0].removeprefix("runsc version ") if run.returncode == 0 else "missing"


def run_gvisor_benchmark(*, runs: int, as_json: bool, console: Console) -> None:
    """Measure runsc against crun and runsc's snapshots, then print a table (or JSON)."""
    if runs < 1:
        raise InvalidRequest("--runs must be at least 1")
    with bench_session("bench-gvisor", as_json=as_json, console=console) as (scratch, progress):
        task = progress.add_task("starting corral serve", total=1)
        server = EmbeddedServer(scratch / "server")
        try:
            server.start()
            progress.update(task, completed=1)
            with server.client() as client:
                results = _measure(client, runs, progress)
        finally:
            server.shutdown()
    report: dict[str, Any] = {
        "params": {"runs": runs, "image": IMAGE, "execs_per_run": EXECS_PER_RUN},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count(), "runsc": _runsc_version()},
        **results,
        "checks": [],
    }
    emit(report, _table, as_json=as_json, console=console)
