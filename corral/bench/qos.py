"""`corral bench qos`: exec latency of a latency-class sandbox on an idle node and on one that batch work keeps busy.

One latency sandbox (debian-12) answers two kinds of exec, each timed at the
client from request to result: `true` (the round trip itself) and a CPU-bound
`python3 -c` loop of about 20 ms (interpreter start included). Between execs it
sleeps, as an agent does while its model thinks, so each exec is a wake-up.

Three phases, in the same run and interleaved over rounds so that the
machine's drift falls on all of them alike:

- idle: only the latency sandbox (the baseline);
- QoS on: B batch sandboxes (`qos="batch"`, low CPU weight), each running a
  `while :; do :; done` loop, B = 2 per core by default, so every core is busy;
- QoS off: the same load from sandboxes of the latency class (equal weights,
  what every sandbox had before classes existed).

Inflation is the busy phase's median over the idle median, minus one; the
target is ≤ 20 % with QoS on (DSec reports 45.2 % without its QoS and 17.3 %
with it). The CPU the batch sandboxes got in each busy phase is reported too:
weights decide who runs first, not whether batch work runs at all.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host, qos
from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit
from corral.embedded import EmbeddedServer
from corral.sdk import Client, ExecResult, InvalidRequest, Sandbox

__all__ = ["run_qos_benchmark"]

IMAGE = "debian-12"
TRIVIAL = ["true"]
CPU_LOOP = ["python3", "-c", "for _ in range(150_000): pass"]  # ~20 ms with interpreter start, idle
BURN = ["sh", "-c", "while :; do :; done"]
BURN_TIMEOUT_S = 3600.0  # killed with its sandbox at the end of the phase long before
THINK_S = 0.05  # between execs: each exec wakes the sandbox, as an agent's does
WARMUP_S = 1.0  # after the batch loops start, before timing
SANDBOX_TTL_S = 1800.0  # a sandbox leaked by a crashed bench still goes away
INFLATION_TARGET = 0.20
PHASES = ("idle", "qos_on", "qos_off")
KINDS = {"trivial": TRIVIAL, "cpu": CPU_LOOP}


def _timed_exec(sandbox: Sandbox, argv: list[str]) -> float:
    started = time.perf_counter()
    result: ExecResult = sandbox.exec(argv)
    elapsed_ms = (time.perf_counter() - started) * 1000
    if result.exit_code != 0:
        raise RuntimeError(f"`{' '.join(argv)}` in the sandbox exited {result.exit_code}: {result.stderr[-300:]}")
    return elapsed_ms


def _cpu_used_s(layout: host.CgroupLayout, sandbox: Sandbox) -> float:
    """CPU time a sandbox's cgroup has used, read on the host."""
    relative = qos.cgroup_path(sandbox.id, sandbox.info.qos).lstrip("/")
    if layout is host.CgroupLayout.UNIFIED:
        stat = Path("/sys/fs/cgroup", relative, "cpu.stat").read_text().split()
        return int(stat[stat.index("usage_usec") + 1]) / 1e6
    return int(Path("/sys/fs/cgroup/cpuacct", relative, "cpuacct.usage").read_text()) / 1e9


@contextlib.contextmanager
def _batch_load(client: Client, phase: str, count: int) -> Iterator[list[Sandbox]]:
    """``count`` sandboxes burning a core each (batch class for qos_on, latency class for qos_off)."""
    sandboxes: list[Sandbox] = []
    try:
        if phase != "idle":
            cpu_class = "batch" if phase == "qos_on" else "latency"
            for _ in range(count):
                sandboxes.append(client.create("busybox", cpu=1.0, qos=cpu_class, ttl_s=SANDBOX_TTL_S))
                sandboxes[-1].start(BURN, timeout_s=BURN_TIMEOUT_S)
            time.sleep(WARMUP_S)
        yield sandboxes
    finally:
        for sandbox in sandboxes:
            with contextlib.suppress(Exception):
                sandbox.kill()


def _measure(data_dir: Path, layout: host.CgroupLayout, *, rounds: int, samples: int, batch: int,
             progress: Progress) -> dict[str, Any]:  # fmt: skip
    timings: dict[str, dict[str, list[float]]] = {phase: {kind: [] for kind in KINDS} for phase in PHASES}
    batch_cores: dict[str, list[float]] = {"qos_on": [], "qos_off": []}
    task = progress.add_task("starting corral serve", total=1)
    server = EmbeddedServer(data_dir)
    try:
        server.start()
        progress.update(task, completed=1)
        task = progress.add_task(f"{rounds} rounds × {len(PHASES)} phases × {samples} execs per kind",
                                 total=rounds * len(PHASES))  # fmt: skip
        with server.client() as client, client.create(IMAGE, cpu=1.0, ttl_s=SANDBOX_TTL_S) as latency:
            for argv in KINDS.values():  # warm the page cache and the agent
                _timed_exec(latency, argv)
            for _ in range(rounds):
                for phase in PHASES:
                    with _batch_load(client, phase, batch) as loaders:
                        used_before = [_cpu_used_s(layout, sb) for sb in loaders]
                        started = time.perf_counter()
                        for _ in range(samples):
                            for kind, argv in KINDS.items():
                                time.sleep(THINK_S)
                                timings[phase][kind].append(_timed_exec(latency, argv))
                        elapsed_s = time.perf_counter() - started
                        if loaders:
                            used = sum(_cpu_used_s(layout, sb) for sb in loaders) - sum(used_before)
                            batch_cores[phase].append(used / elapsed_s)
                    progress.advance(task)
        task = progress.add_task("cleaning up (sandboxes, server)", total=1)
    finally:
        server.shutdown()
        host.orphans.reap()
    progress.update(task, completed=1)
    results: dict[str, Any] = {phase: {kind: summarize(values) for kind, values in timings[phase].items()}
                               for phase in PHASES}  # fmt: skip
    for phase, cores in batch_cores.items():
        results[phase]["batch_cores"] = summarize(cores)
    return results


def _inflation(report: dict[str, Any], phase: str, kind: str) -> float:
    return float(report[phase][kind]["p50"] / report["idle"][kind]["p50"] - 1)


def _checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    checks = []
    for kind in KINDS:
        value = _inflation(report, "qos_on", kind)
        checks.append({"metric": f"qos_on_{kind}", "target": f"inflation ≤ {INFLATION_TARGET:.0%}", "value": value,
                       "ok": value <= INFLATION_TARGET})  # fmt: skip
    return checks


def _table(report: dict[str, Any]) -> Table:
    params, info = report["params"], report["host"]
    caption = (f"{params['rounds']} rounds of idle / QoS on / QoS off, {params['samples']} execs per kind per phase "
               f"per round ({params['rounds'] * params['samples']} per cell); busy = {params['batch']} batch "
               f"sandboxes, one busy loop each. Inflation = busy p50 / idle p50 - 1. Kernel {info['kernel']}, "
               f"{info['cpu_count']} cpus, cgroup {info['cgroup_layout']}.")  # fmt: skip
    rows = ResultTable("corral bench qos", caption, report["checks"], digits=1)
    labels = {"trivial": "exec `true`", "cpu": "exec python3 ~20 ms loop"}
    for kind, label in labels.items():
        rows.timing(f"{label}, idle node", report["idle"][kind], "-", None)
        for phase, name in (("qos_on", "QoS on"), ("qos_off", "QoS off")):
            ours, base = report[phase][kind], report["idle"][kind]
            metric = f"{phase}_{kind}"
            gated = phase == "qos_on"
            target, verdict = (rows.target(metric), rows.verdict(metric)) if gated else ("-", "-")
            rows.table.add_row(f"  busy, {name}", f"{ours['p50']:.1f} ms", f"{ours['p95']:.1f} ms",
                               f"idle {base['p50']:.1f} ms", f"{_inflation(report, phase, kind):+.1%}", target,
                               verdict)  # fmt: skip
    for phase, name in (("qos_on", "QoS on"), ("qos_off", "QoS off")):
        cores = report[phase]["batch_cores"]
        rows.table.add_row(f"batch CPU while busy, {name}", f"{cores['p50']:.2f} cores", f"min {cores['min']:.2f}",
                           "-", "-", "-", "-")  # fmt: skip
    return rows.table


def run_qos_benchmark(*, rounds: int, samples: int, batch: int | None, as_json: bool, console: Console) -> None:
    """Measure a latency sandbox's exec latency idle and under batch load, with and without QoS; print it."""
    if rounds < 1 or samples < 1:
        raise InvalidRequest("--rounds and --samples must be at least 1")
    cores = os.cpu_count() or 1
    batch = 2 * cores if batch is None else batch
    if batch < 1:
        raise InvalidRequest("--batch must be at least 1")
    layout = host.detect_cgroup_layout()
    with bench_session("bench-qos", as_json=as_json, console=console) as (scratch, progress):
        results = _measure(scratch / "server", layout, rounds=rounds, samples=samples, batch=batch,
                           progress=progress)  # fmt: skip
    report: dict[str, Any] = {
        "unit": "ms",
        "params": {"rounds": rounds, "samples": samples, "batch": batch, "image": IMAGE, "think_s": THINK_S,
                   "cpu_command": " ".join(CPU_LOOP)},
        "host": {"kernel": platform.release(), "cpu_count": cores, "cgroup_layout": layout.value},
        **results,
    }  # fmt: skip
    report["checks"] = _checks(report)
    report["inflation"] = {f"{phase}_{kind}": _inflation(report, phase, kind)
                           for phase in ("qos_on", "qos_off") for kind in KINDS}  # fmt: skip
    emit(report, _table, as_json=as_json, console=console)
