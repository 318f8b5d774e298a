"""`corral bench guard`: what reporting refusals and sensitive reads costs, against same-run baselines.

Two debian-12 sandboxes with the same profile, one under crun (the seccomp filter logs each refusal, which
becomes an audit event) and one under runc (runc 1.1 refuses seccomp flags: the same refusals, unlogged),
take turns:
- a tight loop of a refused syscall (unshare) for one second: refusals per second, and how many of them the
  edge counted in its syscall_denied events;
- creating and joining threads for one second (glibc tries clone3 first; launch's unlogged filter answers it,
  so this should cost nothing);
and exec round trips (`true`) in a sandbox with sensitive paths (marks refreshed after each command) beside
one without. In the bench's own process, with no sandbox: the command detectors the server runs on every
exec, on three commands, against the same patterns scanned without their literals first.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit
from corral.embedded import EmbeddedServer
from corral.guard.audit import COMMAND_DETECTORS, detect_in_command
from corral.sdk import Client, InvalidRequest, Sandbox

__all__ = ["detector_costs", "run_guard_benchmark"]

IMAGE = "debian-12"
LOOP_S = 1.0
REPEAT_WINDOW_S = 1.0
EXEC_SAMPLES_PER_RUN = 20
SENSITIVE_PATHS = ["/work/hidden/"]
DETECTOR_COMMANDS = {
    "`true`": "true",
    "a test run": "cd /work/repo && git status --short && python -m pytest -q tests/test_parser.py -x 2>&1 | tail -20",
    "a heredoc of 100 lines": "cat > /work/repo/src/parser.py <<'EOF'\n"
    + "def parse(text):\n    return [line.split() for line in text.splitlines()]  # one record a line\n" * 100
    + "EOF\n",
}  # how agents send commands: short ones, and files written through a heredoc
DETECTOR_ROUNDS = 30
DETECTOR_CALLS = 100  # per round and side
FLOOD_EVENTS_TARGET = 2  # per repeat window of flooding, at most: the first occurrence, then one summary

REFUSALS = f"""
import ctypes, time
libc = ctypes.CDLL(None)
calls, end = 0, time.perf_counter() + {LOOP_S}
while time.perf_counter() < end:
    for _ in range(1000):
        libc.unshare(0x20000)
    calls += 1000
print(calls)
"""
THREADS = f"""
import threading, time
created, end = 0, time.perf_counter() + {LOOP_S}
while time.perf_counter() < end:
    thread = threading.Thread(target=int)
    thread.start()
    thread.join()
    created += 1
print(created)
"""


def _rate(sandbox: Sandbox, script: str) -> float:
    result = sandbox.exec(["python3", "-c", script], timeout_s=60)
    if result.exit_code != 0:
        raise RuntimeError(f"the loop failed in {sandbox.id}: {result.stderr[-300:]}")
    return int(result.stdout) / LOOP_S


def _counted(sandbox: Sandbox) -> tuple[int, int]:
    """(events, refusals they count) of the sandbox's syscall_denied events for unshare."""
    events = [e for e in sandbox.audit_events() if e.kind == "syscall_denied" and e.detail.get("key") == "unshare"]
    return len(events), sum(int(e.detail["count"]) for e in events)


def _timed_ms(sandbox: Sandbox) -> float:
    started = time.perf_counter()
    sandbox.exec("true")
    return (time.perf_counter() - started) * 1000


def _measure(client: Client, runs: int, progress: Progress) -> dict[str, Any]:
    rates: dict[str, list[float]] = {key: [] for key in ("refused_crun", "refused_runc", "threads_crun",
                                                         "threads_runc")}  # fmt: skip
    execs: dict[str, list[float]] = {"sensitive": [], "plain": []}
    with contextlib.ExitStack() as stack:
        boxes = {runtime: stack.enter_context(client.create(IMAGE, runtime=runtime)) for runtime in ("crun", "runc")}
        watched = stack.enter_context(client.create(IMAGE, sensitive_paths=SENSITIVE_PATHS))
        watched.exec("mkdir -p /work/hidden/a /work/hidden/b && echo 42 > /work/hidden/a/expected")
        plain = stack.enter_context(client.create(IMAGE))
        task = progress.add_task("refusals and threads (crun logged, runc not)", total=runs)
        flood_started = time.monotonic()
        for i in range(runs):
            order = ("crun", "runc") if i % 2 == 0 else ("runc", "crun")
            for runtime in order:
                rates[f"refused_{runtime}"].append(_rate(boxes[runtime], REFUSALS))
            for runtime in order:
                rates[f"threads_{runtime}"].append(_rate(boxes[runtime], THREADS))
            progress.advance(task)
        flood_s = time.monotonic() - flood_started
        time.sleep(2 * REPEAT_WINDOW_S + 1.5)  # the last summary, then the edge's next round
        events, counted = _counted(boxes["crun"])
        task = progress.add_task("exec with sensitive paths (vs without)", total=runs * EXEC_SAMPLES_PER_RUN)
        for i in range(runs * EXEC_SAMPLES_PER_RUN):
            pair = (("sensitive", watched), ("plain", plain))
            for key, sandbox in pair if i % 2 == 0 else pair[::-1]:
                execs[key].append(_timed_ms(sandbox))
            progress.advance(task)
    refused_made = sum(rates["refused_crun"]) * LOOP_S
    return {
        "refusals_per_s": {key: summarize(rates[f"refused_{key}"]) for key in ("crun", "runc")},
        "threads_per_s": {key: summarize(rates[f"threads_{key}"]) for key in ("crun", "runc")},
        "flood": {"refusals": int(refused_made), "counted": counted, "events": events, "seconds": flood_s,
                  "windows": flood_s / REPEAT_WINDOW_S},
        "exec_ms": {key: summarize(samples) for key, samples in execs.items()},
    }  # fmt: skip


def detector_costs(progress: Progress, rounds: int = DETECTOR_ROUNDS) -> dict[str, dict[str, Any]]:
    """Microseconds per command through ``detect_in_command`` (each pattern behind its literals) and through the
    same patterns scanned alone (the baseline: what the server ran before the literals), in alternating rounds."""
    costs: dict[str, dict[str, Any]] = {}
    task = progress.add_task("command detectors (vs the patterns alone)", total=len(DETECTOR_COMMANDS))
    for label, command in DETECTOR_COMMANDS.items():

        def scanned_alone(command: str = command) -> None:
            for detector in COMMAND_DETECTORS:
                detector.pattern.search(command)

        samples: dict[str, list[float]] = {"detectors": [], "patterns_alone": []}
        for i in range(rounds):
            sides = (
                ("detectors", lambda command=command: detect_in_command(command)),
                ("patterns_alone", scanned_alone),
            )
            for side, call in sides if i % 2 == 0 else sides[::-1]:
                started = time.perf_counter()
                for _ in range(DETECTOR_CALLS):
                    call()
                samples[side].append((time.perf_counter() - started) / DETECTOR_CALLS * 1e6)
        costs[label] = {"bytes": len(command), "found": [kind for kind, _ in detect_in_command(command)],
                        **{side: summarize(values) for side, values in samples.items()}}  # fmt: skip
        progress.advance(task)
    return costs


def _checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    flood = results["flood"]
    limit = FLOOD_EVENTS_TARGET * (flood["windows"] + 1)
    return [{"metric": "flood_events", "target": f"≤ {FLOOD_EVENTS_TARGET} per window", "value": flood["events"],
             "ok": flood["events"] <= limit}]  # fmt: skip


def _table(report: dict[str, Any]) -> Table:
    info, flood = report["host"], report["flood"]
    caption = (
        f"{report['params']['runs']} one-second loops per side, interleaved; {IMAGE}, "
        f"repeat window {REPEAT_WINDOW_S:g} s. Kernel {info['kernel']}, {info['cpu_count']} cpus."
    )
    rows = ResultTable("corral bench guard", caption, report["checks"], digits=2)
    table = rows.table
    for key, label in (("refusals_per_s", "refused syscalls / s"), ("threads_per_s", "threads created / s")):
        logged, unlogged = report[key]["crun"], report[key]["runc"]
        table.add_row(f"{label} (crun, logged)", f"{logged['p50']:,.0f}", f"min {logged['min']:,.0f}",
                      f"runc, unlogged: {unlogged['p50']:,.0f}", f"{logged['p50'] / unlogged['p50']:.2f}×",
                      "-", "-")  # fmt: skip
    table.add_row("refusals counted in events", f"{flood['counted']:,} of {flood['refusals']:,}",
                  f"{flood['counted'] / max(1, flood['refusals']):.0%}", "-", "-", "-", "-")  # fmt: skip
    table.add_row("events for the flood", str(flood["events"]), f"over {flood['seconds']:.0f} s", "-", "-",
                  rows.target("flood_events"), rows.verdict("flood_events"))  # fmt: skip
    rows.timing("exec `true`, sensitive paths", report["exec_ms"]["sensitive"], "without",
                report["exec_ms"]["plain"])  # fmt: skip
    for label, cost in report["detectors_us"].items():
        ours, alone = cost["detectors"], cost["patterns_alone"]
        table.add_row(f"command detectors, {label} ({cost['bytes']:,} B)", f"{ours['p50']:,.1f} µs",
                      f"{ours['p95']:,.1f} µs", f"patterns alone {alone['p50']:,.1f} µs",
                      f"{ours['p50'] / alone['p50']:.2f}×", "-", "-")  # fmt: skip
    return table


def run_guard_benchmark(*, runs: int, as_json: bool, console: Console) -> None:
    """Measure the cost of logged refusals and sensitive-path marks, then print a table (or JSON)."""
    if runs < 1:
        raise InvalidRequest("--runs must be at least 1")
    layout = host.detect_cgroup_layout()
    with bench_session("bench-guard", as_json=as_json, console=console) as (scratch, progress):
        detectors = detector_costs(progress)
        task = progress.add_task("starting corral serve", total=1)
        server = EmbeddedServer(scratch / "server", env={"CORRAL_AUDIT_REPEAT_WINDOW_S": str(REPEAT_WINDOW_S)})
        try:
            server.start()
            progress.update(task, completed=1)
            with server.client() as client:
                results = _measure(client, runs, progress)
        finally:
            server.shutdown()
            host.orphans.reap()
    report: dict[str, Any] = {
        "params": {"runs": runs, "image": IMAGE, "loop_s": LOOP_S, "repeat_window_s": REPEAT_WINDOW_S},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count(), "cgroup_layout": layout.value},
        **results,
        "detectors_us": detectors,
    }  # fmt: skip
    report["checks"] = _checks(report)
    emit(report, _table, as_json=as_json, console=console)
