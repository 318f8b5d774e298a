"""`corral bench lifecycle`: pause/resume, fork and step replay, each against a baseline sampled in the same run.

1. Pause and resume of a debian-12 sandbox holding ~100 MB of touched anonymous
   memory: client wall time of pause (it returns once frozen; the memory then
   goes to zram in the background), the server's own duration, the time until
   the reclaim is done, the fraction of memory reclaimed, resume, and the first
   exec after resume. Baseline: plain `crun pause` + `crun resume` (freezer only, no
   reclaim) on the same container, run by this process; and a warm exec.
2. Fork: `sandbox.fork(1)` of a busybox sandbox that wrote a few files, until
   the child is ready (the call returns); baseline: a plain busybox create.
   Also fork(4) as a total.
3. Replay: S steps with step ids executed once, then sent again and answered
   from the trajectory log (every result must say `replayed`, and the log file
   must hold exactly S lines), sequentially with the sync Client (a reconnecting
   trainer) and with 16 concurrent AsyncClient requests; baseline: plain
   `exec("true")` without step ids at the same concurrency.
4. Sandboxes stepping at once, as an RL trainer drives them: N busybox sandboxes,
   each with 1,000 files in its writable layer, each taking S steps one after
   another (a write of one file, with a step id), all sandboxes at once through
   one AsyncClient. Each step's logged files must be the one file it wrote, and
   the node's metrics must say its change journal found every step's files (the
   walk of a 1,000-file layer is what it replaces). Baseline: the same writes
   without step ids on the same sandboxes, in alternating rounds.

This machine is noisy and shared, so absolute numbers drift from run to run;
each figure sits next to its baseline from the same run and is read as a ratio
or against the target the spec promises. The server is an EmbeddedServer in a
temporary data dir over the node's real layer store; the diff layers that
forks leave in that store are removed before it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.backends.common.host import runtime_state_root
from corral.bench.containers import fill_layer, summarize
from corral.bench.harness import (
    ResultTable,
    bench_session,
    emit,
    metric_sum,
    ms_since,
    require_success,
    throwaway_postgres,
)
from corral.embedded import EmbeddedServer
from corral.sdk import AsyncClient, AsyncSandbox, Client, CorralError, ExecResult, InvalidRequest, Sandbox

__all__ = ["run_lifecycle_benchmark"]

PAUSE_IMAGE, PAUSE_MEMORY_MB, HELD_MIB = "debian-12", 512, 100
HOLD_MEMORY = (f"python3 -c 'import os,time; b=bytearray(os.urandom({HELD_MIB}<<20)); "
               "open(\"/tmp/held\",\"w\").close(); time.sleep(3600)'")  # fmt: skip
HOLD_WAIT_S = 30.0
FORK_IMAGE, FORK_FILES, FORK_BURST, FORK_BURST_SAMPLES = "busybox", 8, 4, 3
REPLAY_STEPS, REPLAY_CONCURRENCY = 200, 16
STEPPING_SANDBOXES, STEPPING_STEPS, STEPPING_ROUNDS, STEPPING_LAYER_FILES = 16, 30, 2, 1_000
STEP_LOOKUPS = "corral_edge_step_files_lookups_total"
SANDBOX_TTL_S = 600.0  # a sandbox leaked by a crashed bench still goes away
PAUSE_TARGET_MS = RESUME_TARGET_MS = 50.0
RECLAIMED_TARGET = 0.80
FORK_TARGET_MS = 100.0
CRUN_TIMEOUT_S = 30.0


def _crun(state_root: Path, action: str, container_id: str) -> float:
    """Wall ms of one `crun pause|resume`, the freezer alone."""
    started = time.perf_counter()
    subprocess.run(["crun", "--root", str(state_root), action, container_id], stdin=subprocess.DEVNULL,
                   capture_output=True, check=True, timeout=CRUN_TIMEOUT_S)  # fmt: skip
    return ms_since(started)


def _wait_for_held_memory(sandbox: Sandbox) -> None:
    deadline = time.monotonic() + HOLD_WAIT_S
    while not sandbox.files.exists("/tmp/held"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the sandbox did not allocate {HELD_MIB} MiB within {HOLD_WAIT_S:g} s")
        time.sleep(0.05)


def _pause_samples(client: Client, crun_root: Path, runs: int, progress: Progress) -> dict[str, Any]:
    samples: dict[str, list[float]] = {key: [] for key in (
        "pause", "pause_server", "reclaim_done", "resume", "first_exec", "warm_exec", "crun_pause", "crun_resume",
        "reclaimed",
        "before_mib", "after_mib")}  # fmt: skip
    task = progress.add_task(f"pause/resume, {HELD_MIB} MiB resident (corral, crun freezer)", total=runs)
    for _ in range(runs):
        with client.create(PAUSE_IMAGE, memory_mb=PAUSE_MEMORY_MB, ttl_s=SANDBOX_TTL_S) as sandbox:
            sandbox.start(HOLD_MEMORY)
            _wait_for_held_memory(sandbox)
            started = time.perf_counter()
            require_success(sandbox.exec("true"), "true")
            samples["warm_exec"].append(ms_since(started))
            samples["crun_pause"].append(_crun(crun_root, "pause", sandbox.id))
            samples["crun_resume"].append(_crun(crun_root, "resume", sandbox.id))
            started = time.perf_counter()
            paused = sandbox.pause()  # returns once frozen; the memory goes out in the background
            samples["pause"].append(ms_since(started))
            samples["pause_server"].append(paused.duration_ms)
            reclaimed = sandbox.pause(wait_reclaim=True)  # already paused: waits for the reclaim to finish
            samples["reclaim_done"].append(ms_since(started))
            samples["reclaimed"].append(1 - reclaimed.memory_after_bytes / max(paused.memory_before_bytes, 1))
            samples["before_mib"].append(paused.memory_before_bytes / (1 << 20))
            samples["after_mib"].append(reclaimed.memory_after_bytes / (1 << 20))
            started = time.perf_counter()
            sandbox.resume()
            samples["resume"].append(ms_since(started))
            started = time.perf_counter()
            require_success(sandbox.exec("true"), "true")
            samples["first_exec"].append(ms_since(started))
        progress.advance(task)
    return {key: summarize(values) for key, values in samples.items()}


def _fork_samples(client: Client, runs: int, progress: Progress) -> dict[str, Any]:
    """Fork summaries (the diff layers fork packs land in the bench's own node dir: ``_measure``)."""
    samples: dict[str, list[float]] = {"fork": [], "create": [], f"fork_{FORK_BURST}": []}
    task = progress.add_task(f"fork(1) vs create, then fork({FORK_BURST})", total=runs + FORK_BURST_SAMPLES)
    with client.create(FORK_IMAGE, ttl_s=SANDBOX_TTL_S) as parent:
        script = f"mkdir -p /data && for i in $(seq {FORK_FILES}); do echo file $i > /data/f$i; done"
        require_success(parent.exec(script), "write files")
        for round_no in range(runs + FORK_BURST_SAMPLES):
            count = 1 if round_no < runs else FORK_BURST
            started = time.perf_counter()
            children = parent.fork(count)
            samples["fork" if count == 1 else f"fork_{FORK_BURST}"].append(ms_since(started))
            for child in children:
                child.kill()
            if count == 1:
                started = time.perf_counter()
                fresh = client.create(FORK_IMAGE, ttl_s=SANDBOX_TTL_S)
                samples["create"].append(ms_since(started))
                fresh.kill()
            progress.advance(task)
    return {key: summarize(values) for key, values in samples.items()}


def _append_line(k: int) -> str:
    return f"echo {k} >> /log"


def _sequential_pass(sandbox: Sandbox, step_ids: list[str] | None) -> tuple[list[ExecResult], dict[str, Any]]:
    """Each step in turn: ``echo k >> /log`` with its step id, or plain ``true`` without step ids."""
    results, latencies = [], []
    started = time.perf_counter()
    for k, step_id in enumerate(step_ids or [None] * REPLAY_STEPS):
        step_started = time.perf_counter()
        results.append(sandbox.exec(_append_line(k) if step_id else "true", step_id=step_id))
        latencies.append(ms_since(step_started))
    wall_s = time.perf_counter() - started
    return results, {**summarize(latencies), "steps_per_s": len(results) / wall_s}


async def _concurrent_pass(
    url: str, api_key: str, sandbox_id: str, step_ids: list[str] | None
) -> tuple[list[ExecResult], dict[str, Any]]:
    """The same steps, REPLAY_CONCURRENCY requests in flight at once."""
    async with AsyncClient(url, api_key) as client:
        sandbox = await client.get(sandbox_id)
        gate = asyncio.Semaphore(REPLAY_CONCURRENCY)
        latencies: list[float] = []

        async def one(k: int, step_id: str | None) -> ExecResult:
            async with gate:
                step_started = time.perf_counter()
                result = await sandbox.exec(_append_line(k) if step_id else "true", step_id=step_id)
                latencies.append(ms_since(step_started))
                return result

        started = time.perf_counter()
        results = await asyncio.gather(*(one(k, s) for k, s in enumerate(step_ids or [None] * REPLAY_STEPS)))
        wall_s = time.perf_counter() - started
    return list(results), {**summarize(latencies), "steps_per_s": len(results) / wall_s}


def _replay(client: Client, url: str, api_key: str, progress: Progress) -> dict[str, Any]:
    task = progress.add_task(f"replay: {REPLAY_STEPS} steps run, resent (sync, async ×{REPLAY_CONCURRENCY})", total=6)
    steps = [f"s{k}" for k in range(REPLAY_STEPS)]
    out: dict[str, Any] = {}
    with client.create(FORK_IMAGE, ttl_s=SANDBOX_TTL_S) as sandbox:
        _, out["plain_sync"] = _sequential_pass(sandbox, None)
        progress.advance(task)
        first, out["execute_sync"] = _sequential_pass(sandbox, steps)
        progress.advance(task)
        resent, out["replay_sync"] = _sequential_pass(sandbox, steps)
        progress.advance(task)
        _, out["plain_async"] = asyncio.run(_concurrent_pass(url, api_key, sandbox.id, None))
        progress.advance(task)
        concurrent, out["replay_async"] = asyncio.run(_concurrent_pass(url, api_key, sandbox.id, steps))
        progress.advance(task)
        lines = int(require_success(sandbox.exec("wc -l < /log"), "wc -l").stdout.strip())
        progress.advance(task)
    out["check"] = {
        "first_pass_executed": sum(not r.replayed and r.exit_code == 0 for r in first),
        "sync_resend_replayed": sum(r.replayed for r in resent),
        "async_resend_replayed": sum(r.replayed for r in concurrent),
        "log_lines": lines,
    }
    return out


async def _stepping_passes(url: str, api_key: str, sandbox_ids: list[str]) -> dict[str, list[float]]:
    """Rounds of a pass without step ids, then one with: every sandbox takes its steps in turn, all at once.
    Per kind: each step's latency (ms) and each pass's rate (``<kind>_rate``, steps/s)."""
    out: dict[str, list[float]] = {"plain": [], "steps": [], "plain_rate": [], "steps_rate": []}
    async with AsyncClient(url, api_key) as client:
        sandboxes = [await client.get(sandbox_id) for sandbox_id in sandbox_ids]
        await asyncio.gather(*(sandbox.exec("true") for sandbox in sandboxes))  # connections open, untimed

        async def trajectory(sandbox: AsyncSandbox, kind: str, round_no: int) -> None:
            for k in range(STEPPING_STEPS):
                name = f"{kind}-{round_no}-{k}"
                started = time.perf_counter()
                result = await sandbox.exec(f"echo {k} > /work/{name}", step_id=name if kind == "steps" else None)
                out[kind].append(ms_since(started))
                require_success(result, f"echo > /work/{name}")

        for round_no in range(STEPPING_ROUNDS):
            for kind in ("plain", "steps"):
                started = time.perf_counter()
                await asyncio.gather(*(trajectory(sandbox, kind, round_no) for sandbox in sandboxes))
                out[f"{kind}_rate"].append(len(sandboxes) * STEPPING_STEPS / (time.perf_counter() - started))
    return out


def _stepping(server: EmbeddedServer, client: Client, sandboxes: int, progress: Progress) -> dict[str, Any]:
    task = progress.add_task(f"{sandboxes} sandboxes stepping at once ({STEPPING_LAYER_FILES:,} files in each layer)",
                             total=sandboxes + 1)  # fmt: skip
    created: list[Sandbox] = []
    try:
        for _ in range(sandboxes):
            sandbox = client.create(FORK_IMAGE, ttl_s=SANDBOX_TTL_S)
            created.append(sandbox)
            fill_layer(sandbox, STEPPING_LAYER_FILES)
            progress.advance(task)
        before = {how: metric_sum(server, STEP_LOOKUPS, how=how) for how in ("journal", "walk")}
        passes = asyncio.run(_stepping_passes(server.url, server.api_key, [sandbox.id for sandbox in created]))
        found = {how: metric_sum(server, STEP_LOOKUPS, how=how) - before[how] for how in ("journal", "walk")}
        wrong = sum(
            step.files != [f"/work/{step.step_id}"]
            for sandbox in created
            for step in sandbox.trajectory()
            if step.step_id.startswith("steps-")
        )
        progress.advance(task)
    finally:
        for sandbox in created:
            with contextlib.suppress(CorralError):
                sandbox.kill()
    return {
        "plain": {**summarize(passes["plain"]), "steps_per_s": statistics.median(passes["plain_rate"])},
        "steps": {**summarize(passes["steps"]), "steps_per_s": statistics.median(passes["steps_rate"])},
        "rates": {"plain": passes["plain_rate"], "steps": passes["steps_rate"]},
        "check": {"steps": sandboxes * STEPPING_STEPS * STEPPING_ROUNDS, "files_not_as_written": wrong,
                  "found_by_journal": int(found["journal"]), "found_by_walk": int(found["walk"])},
        "sandboxes": sandboxes,
    }  # fmt: skip


def _measure(data_dir: Path, runs: int, stepping: int, progress: Progress, database_url: str | None) -> dict[str, Any]:
    task = progress.add_task("starting corral serve", total=1)
    # On the session's own node dir (bench_session): the diff layers fork packs go with the scratch dir, never for
    # a moment in the user's store (a test run beside it checks that store is left alone).
    server = EmbeddedServer(data_dir, env={"CORRAL_DATABASE_URL": database_url} if database_url else {})
    try:
        server.start()
        progress.update(task, completed=1)
        with server.client() as client:
            pause = _pause_samples(client, runtime_state_root(data_dir, "crun"), runs, progress)
            fork = _fork_samples(client, runs, progress)
            replay = _replay(client, server.url, server.api_key, progress)
            steps = _stepping(server, client, stepping, progress)
        task = progress.add_task("cleaning up (sandboxes, server)", total=1)
    finally:
        server.kill_all_sandboxes()
        server.shutdown()
        host.orphans.reap()
    progress.update(task, completed=1)
    return {"pause": pause, "fork": fork, "replay": replay, "stepping": steps}


def _checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    pause, fork, check, stepping = results["pause"], results["fork"], results["replay"]["check"], results["stepping"]
    stepped = stepping["check"]
    exactly_once = (check["first_pass_executed"] == check["sync_resend_replayed"] == REPLAY_STEPS
                    and check["async_resend_replayed"] == check["log_lines"] == REPLAY_STEPS)  # fmt: skip
    pause_ms, resume_ms, fork_ms = pause["pause"]["p50"], pause["resume"]["p50"], fork["fork"]["p50"]
    reclaimed = pause["reclaimed"]["p50"]
    return [
        {"metric": "pause", "target": f"p50 ≤ {PAUSE_TARGET_MS:g} ms", "value": pause_ms,
         "ok": pause_ms <= PAUSE_TARGET_MS},
        {"metric": "resume", "target": f"p50 ≤ {RESUME_TARGET_MS:g} ms", "value": resume_ms,
         "ok": resume_ms <= RESUME_TARGET_MS},
        {"metric": "reclaimed", "target": f"median ≥ {RECLAIMED_TARGET:.0%}", "value": reclaimed,
         "ok": reclaimed >= RECLAIMED_TARGET},
        {"metric": "fork", "target": f"p50 ≤ {FORK_TARGET_MS:g} ms", "value": fork_ms, "ok": fork_ms <= FORK_TARGET_MS},
        {"metric": "replay", "target": f"{REPLAY_STEPS} replayed, {REPLAY_STEPS} lines", "value": check,
         "ok": exactly_once},
        {"metric": "stepping", "target": "each step's own file; all by the journal", "value": stepped,
         "ok": stepped["files_not_as_written"] == 0 and stepped["found_by_journal"] == stepped["steps"]},
    ]  # fmt: skip


def _table(report: dict[str, Any]) -> Table:
    pause, fork, replay, info = report["pause"], report["fork"], report["replay"], report["host"]
    caption = (f"{report['params']['runs']} samples per timing, each beside its baseline in the same run; "
               f"replay: {REPLAY_STEPS} steps per pass, log check {replay['check']}. Kernel {info['kernel']}, "
               f"{info['cpu_count']} cpus, cgroup {info['cgroup_layout']}, swap {info['swap_mib']} MiB; state on "
               f"{report['database']}.")  # fmt: skip
    rows = ResultTable("corral bench lifecycle", caption, report["checks"], digits=1)
    table, verdict, timing = rows.table, rows.verdict, rows.timing

    timing(f"pause, {HELD_MIB} MiB resident (client)", pause["pause"], "crun pause", pause["crun_pause"], "pause")
    timing("  pause, server side", pause["pause_server"], "crun pause", pause["crun_pause"])
    timing("  memory out (pause → reclaim done)", pause["reclaim_done"], "crun pause", pause["crun_pause"])
    reclaimed = pause["reclaimed"]
    table.add_row("  memory reclaimed by pause", f"{reclaimed['p50']:.0%}", f"min {reclaimed['min']:.0%}",
                  f"freezer only: 0% (of {pause['before_mib']['p50']:.0f} MiB)", "-",
                  rows.target("reclaimed"), verdict("reclaimed"))  # fmt: skip
    timing("resume", pause["resume"], "crun resume", pause["crun_resume"], "resume")
    timing("first exec after resume", pause["first_exec"], "warm exec", pause["warm_exec"])
    timing("fork(1) → child ready", fork["fork"], "create", fork["create"], "fork")
    timing(f"fork({FORK_BURST}) total", fork[f"fork_{FORK_BURST}"], "one create", fork["create"])
    for key, label, base_key in (
        ("execute_sync", "steps, first run (sync)", "plain_sync"),
        ("replay_sync", "steps, resent → replayed (sync)", "plain_sync"),
        ("replay_async", f"steps, resent → replayed (async ×{REPLAY_CONCURRENCY})", "plain_async"),
    ):
        ours, base = replay[key], replay[base_key]
        gated = key != "execute_sync"
        table.add_row(label, f"{ours['p50']:.1f} ms ({ours['steps_per_s']:.0f} steps/s)", f"{ours['p95']:.1f} ms",
                      f"exec true: {base['steps_per_s']:.0f} steps/s",
                      f"{ours['steps_per_s'] / base['steps_per_s']:.2f}× rate",
                      rows.target("replay") if gated else "-", verdict("replay") if gated else "-")  # fmt: skip
    stepping = report["stepping"]
    ours, base = stepping["steps"], stepping["plain"]
    table.add_row(f"{stepping['sandboxes']} sandboxes stepping at once, {STEPPING_LAYER_FILES:,} files in each layer",
                  f"{ours['p50']:.1f} ms ({ours['steps_per_s']:.0f} steps/s)", f"{ours['p95']:.1f} ms",
                  f"without step ids: {base['p50']:.1f} ms ({base['steps_per_s']:.0f} steps/s)",
                  f"{ours['steps_per_s'] / base['steps_per_s']:.2f}× rate", rows.target("stepping"),
                  verdict("stepping"))  # fmt: skip
    return table


def run_lifecycle_benchmark(*, runs: int, stepping: int, as_json: bool, console: Console,
                            postgres: bool = False) -> None:  # fmt: skip
    """Measure pause/resume, fork and replay against same-run baselines, then print a table (or JSON)."""
    if runs < 1:
        raise InvalidRequest("--runs must be at least 1")
    if stepping < 1:
        raise InvalidRequest("--stepping must be at least 1")
    if os.geteuid() != 0:
        raise SystemExit("corral bench lifecycle needs root: its baseline runs crun on the server's containers")
    layout = host.detect_cgroup_layout()
    # Before any thread (the progress bar starts one): unshare(CLONE_NEWNS)
    # refuses a threaded process. On hybrid hosts this hides v2 so crun works.
    host.enter_private_mount_namespace(layout)
    if shutil.which("crun") is None:
        raise InvalidRequest("crun is not installed: apt-get install crun")
    with contextlib.ExitStack() as stack:
        database_url = stack.enter_context(throwaway_postgres()) if postgres else None
        scratch, progress = stack.enter_context(bench_session("bench-lifecycle", as_json=as_json, console=console))
        results = _measure(scratch / "server", runs, stepping, progress, database_url)
    swap_kib = [int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("SwapTotal:")]  # fmt: skip
    report: dict[str, Any] = {
        "unit": "ms",
        "params": {"runs": runs, "pause_image": PAUSE_IMAGE, "pause_memory_mb": PAUSE_MEMORY_MB,
                   "held_mib": HELD_MIB, "fork_image": FORK_IMAGE, "fork_burst": FORK_BURST,
                   "replay_steps": REPLAY_STEPS, "replay_concurrency": REPLAY_CONCURRENCY,
                   "stepping_sandboxes": stepping, "stepping_steps": STEPPING_STEPS,
                   "stepping_rounds": STEPPING_ROUNDS, "stepping_layer_files": STEPPING_LAYER_FILES},
        "database": "postgresql" if postgres else "sqlite",
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count(), "cgroup_layout": layout.value,
                 "swap_mib": (swap_kib or [0])[0] // 1024},
        **results,
    }  # fmt: skip
    report["checks"] = _checks(report)
    emit(report, _table, as_json=as_json, console=console)
