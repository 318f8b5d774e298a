"""`corral bench density`: how many idle containers one node holds, and what each one costs the host.

Idle busybox sandboxes (cpu 0.01, 64 MiB limit, no TTL) are created in batches of `step`, 16 at a time;
at 0 and after every batch this records:

- host memory in use (MemTotal - MemAvailable) and its growth per sandbox since the reading just before
  the first create. That same-run baseline, never a constant, because "in use" drifts between runs (other
  tenants, page cache, memory cgroups of destroyed sandboxes lingering in unreclaimable slab);
- exec("true") round trip on 20 random live sandboxes, sequential: the node still answers when full.
  cpu 0.01 is a CFS quota of 1 ms per 100 ms, so the p95 shows throttling and the p50 the node;
- create latency of the batch just made;
- the kernel's 1 KiB slab (``kmalloc-1k`` in /proc/slabinfo), where it keeps every memory cgroup's slots for
  every superblock's shrinker: the term that grows with the square of the count (docs/spec.md, Density), shown
  beside the superblocks a sandbox has of its own (mounts of the first sandbox that the second does not share);
- the host's CPU per create of the batch, user and system apart (/proc/stat): the system share is the kernel's
  work, the part that grows with the count (docs/spec.md, Density: why creates slow down as the node fills);
- the server's CPU while the sandboxes sit idle (its own and its commands', over ``idle_window_s``): what each
  idle sandbox costs the node's housekeeping, against the same window at 0 sandboxes. With ``--network`` every
  sandbox has an egress allowlist (its own veth and address), so the edge also lists its denied-packet counters
  every few seconds (docs/spec.md, Density: networked sandboxes);
- the mount count of the server process: overlays live in each container's own mount namespace, so this
  stays flat as containers pile up (overlays piling up in one shared namespace slow every later create);
  with quotas on, one more: the node's btrfs of writable layers.

It stops early, and says why, if a create fails or MemAvailable falls under 2 GiB. At the end one bulk
kill by label removes every sandbox (timed), the server stops, and what could be left behind is counted:
containers in the crun state root, cgroups of our sandboxes, erofs/overlay mounts in the host namespace,
the loop device of the quota pool.

``--disk-quota on`` (the default) runs the server as shipped: every writable layer in its own subvolume
of the node's quota pool (CORRAL_SANDBOX_DISK_MB); ``off`` sets no limit (layers on the data dir), and
``compare`` runs off, on, on, off (ABBA: other tenants' drift hits both alike) and reports the ratios of
host memory per sandbox and of the median create time, each the mean over a mode's two runs (target
≤ 1.10 each: bounded disks must hold at density).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import platform
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.bench.containers import summarize
from corral.bench.harness import bench_session, emit
from corral.embedded import EmbeddedServer
from corral.procfs import host_cpu_s, process_cpu_s, superblocks
from corral.sdk import AsyncClient, Client, CorralError, InvalidRequest
from corral.testing.leftovers import find_leftovers

__all__ = ["run_density_benchmark"]

IMAGE, CPU, MEMORY_MB = "busybox", 0.1, 64
LABELS = {"bench": "density"}
# Allowed to a port of an address in the sandbox network where nothing listens: idle sandboxes send nothing anyway.
NETWORK = {"allow": [{"cidr": "10.88.200.9/32", "ports": [8080], "protocol": "tcp"}]}
IDLE_WINDOW_S = 10.0  # the edge looks at each networked sandbox's denied-packet counters every 5 s
IDLE_SETTLE_S = 3.0  # before the window: the creates' own aftermath (their events, the first housekeeping rounds)
CREATE_CONCURRENCY = 16
EXEC_PROBES = 20
MIN_AVAILABLE_MIB = 2048
# The defaults (4× RAM in limits) admit ~1,500 of these at 64 MiB each; idle ones come nowhere near their limits.
SERVER_ENV = {"CORRAL_CPU_OVERCOMMIT": "5000", "CORRAL_MEMORY_OVERCOMMIT": "50"}
MIB_PER_SANDBOX_TARGET = 2.0
EXEC_TARGET_MS = 20.0
QUOTA_RATIO_TARGET = 1.10
QUOTA_MODES = ("on", "off", "compare")


def _meminfo_mib() -> dict[str, float]:
    fields = (line.split() for line in Path("/proc/meminfo").read_text().splitlines())
    return {parts[0].rstrip(":"): int(parts[1]) / 1024 for parts in fields
            if parts[0] in ("MemTotal:", "MemAvailable:", "SUnreclaim:")}  # fmt: skip


def _used_mib() -> float:
    info = _meminfo_mib()
    return info["MemTotal"] - info["MemAvailable"]


def _one_kib_slab_mib() -> float | None:
    """MiB of objects in use in the kernel's ``kmalloc-1k`` cache (not its free ones, which a teardown leaves by
    the hundreds of MiB); None where /proc/slabinfo cannot be read (not root)."""
    try:
        lines = Path("/proc/slabinfo").read_text().splitlines()
    except OSError:
        return None
    fields = next((line.split() for line in lines if line.startswith("kmalloc-1k ")), None)
    return int(fields[1]) * int(fields[3]) / (1 << 20) if fields else None  # active objects × object size


def _superblocks_of_its_own(client: Client, ids: list[str]) -> list[str]:
    """The filesystem types of the superblocks the first sandbox has and the second does not: what each sandbox
    adds to the node's shrinkers."""
    first, second = (
        superblocks(client.get(sandbox_id).exec("cat /proc/self/mountinfo").stdout) for sandbox_id in ids[:2]
    )
    return sorted(kind for device, (kind, _) in first.items() if device not in second)


def _rss_mib(pid: int) -> float:
    return next(int(line.split()[1]) / 1024 for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("VmRSS:"))  # fmt: skip


def _memory_low() -> str | None:
    """Why to stop creating, if MemAvailable fell under MIN_AVAILABLE_MIB."""
    available = _meminfo_mib()["MemAvailable"]
    return f"MemAvailable {available:.0f} MiB < {MIN_AVAILABLE_MIB} MiB" if available < MIN_AVAILABLE_MIB else None


async def _create_batch(
    url: str, api_key: str, count: int, *, network: bool
) -> tuple[list[str], list[float], str | None]:
    """Create `count` sandboxes, CREATE_CONCURRENCY at a time; stop starting new ones at the first failure."""
    ids: list[str] = []
    latencies: list[float] = []
    problems: list[str] = []
    async with AsyncClient(url, api_key) as client:
        gate = asyncio.Semaphore(CREATE_CONCURRENCY)

        async def one() -> None:
            async with gate:
                if problems:
                    return
                if low := _memory_low():
                    problems.append(low)
                    return
                started = time.perf_counter()
                try:
                    sandbox = await client.create(IMAGE, cpu=CPU, memory_mb=MEMORY_MB, ttl_s=None, labels=LABELS,
                                                  network=NETWORK if network else None)  # fmt: skip
                except CorralError as exc:
                    problems.append(f"create failed: {exc}")
                    return
                latencies.append((time.perf_counter() - started) * 1000)
                ids.append(sandbox.id)

        async with asyncio.TaskGroup() as group:
            for _ in range(count):
                group.create_task(one())
    return ids, latencies, problems[0] if problems else None


def _exec_probe(client: Client, ids: list[str]) -> dict[str, float] | None:
    """exec("true") round trip on EXEC_PROBES random live sandboxes, one after another."""
    if not ids:
        return None
    latencies = []
    for sandbox_id in random.sample(ids, min(EXEC_PROBES, len(ids))):
        sandbox = client.get(sandbox_id)
        started = time.perf_counter()
        result = sandbox.exec("true")
        latencies.append((time.perf_counter() - started) * 1000)
        if result.exit_code != 0:
            raise RuntimeError(f"`true` in {sandbox_id} exited {result.exit_code}: {result.stderr[-300:]}")
    return summarize(latencies)


def _idle_cpu_percent(server_pid: int, window_s: float) -> float | None:
    """The server's CPU (with the commands it ran) over ``window_s`` of nobody asking it anything, in % of a core,
    from IDLE_SETTLE_S after the last request."""
    if window_s <= 0:
        return None
    time.sleep(IDLE_SETTLE_S)
    before, started = process_cpu_s(server_pid), time.monotonic()
    time.sleep(window_s)
    after = process_cpu_s(server_pid)
    if before is None or after is None:
        return None
    return (after - before) * 100 / (time.monotonic() - started)


def _sample(
    client: Client,
    server_pid: int,
    ids: list[str],
    baseline_mib: float,
    create: dict[str, Any] | None,
    idle_window_s: float,
) -> dict[str, Any]:
    idle_cpu = _idle_cpu_percent(server_pid, idle_window_s)  # first: the exec probes below are not idle
    used, meminfo = _used_mib(), _meminfo_mib()
    return {"server_idle_cpu_percent": idle_cpu, "sandboxes": len(ids), "used_mib": used,
            "delta_mib": used - baseline_mib,
            "mib_per_sandbox": (used - baseline_mib) / len(ids) if ids else None, "exec": _exec_probe(client, ids),
            "create": create, "server_mounts": len(Path(f"/proc/{server_pid}/mounts").read_text().splitlines()),
            "server_rss_mib": _rss_mib(server_pid), "available_mib": meminfo["MemAvailable"],
            "slab_unreclaimable_mib": meminfo["SUnreclaim"], "one_kib_slab_mib": _one_kib_slab_mib()}  # fmt: skip


def _measure(
    data_dir: Path, count: int, step: int, progress: Progress, *, disk_quota: bool, network: bool, idle_window_s: float
) -> dict[str, Any]:
    task = progress.add_task(f"starting corral serve (disk quota {'on' if disk_quota else 'off'})", total=1)
    server = EmbeddedServer(data_dir, env=SERVER_ENV if disk_quota else {**SERVER_ENV, "CORRAL_SANDBOX_DISK_MB": "0"})
    ids: list[str] = []
    all_latencies: list[float] = []
    steps: list[dict[str, Any]] = []
    stopped: str | None = None
    kill: dict[str, Any] | None = None
    own: list[str] = []
    try:
        server.start()
        assert server.process is not None
        progress.update(task, completed=1)
        with server.client() as client:
            baseline_mib = _used_mib()
            steps.append(_sample(client, server.process.pid, ids, baseline_mib, None, idle_window_s))
            kind = "networked " if network else ""
            task = progress.add_task(f"idle {kind}{IMAGE} sandboxes, {step} per step", total=count)
            while len(ids) < count and stopped is None:
                started, cpu_before = time.perf_counter(), host_cpu_s()
                batch = min(step, count - len(ids))
                new_ids, latencies, stopped = asyncio.run(
                    _create_batch(server.url, server.api_key, batch, network=network)
                )
                batch_s, cpu_after = time.perf_counter() - started, host_cpu_s()
                ids.extend(new_ids)
                all_latencies.extend(latencies)
                progress.update(task, completed=len(ids))
                create = None
                if latencies:
                    cpu_ms = {f"host_{kind}_ms_per_create": (cpu_after[kind] - cpu_before[kind]) * 1000 / len(new_ids)
                              for kind in ("user", "system")}  # fmt: skip
                    create = {**summarize(latencies), "batch_s": batch_s, **cpu_ms}
                if new_ids:
                    steps.append(_sample(client, server.process.pid, ids, baseline_mib, create, idle_window_s))
                if len(ids) >= 2 and not own:
                    own = _superblocks_of_its_own(client, ids)
                stopped = stopped or _memory_low()
            task = progress.add_task(f"bulk kill of {len(ids)} sandboxes, stopping the server", total=1)
    finally:
        if server.running():
            with server.client() as client, contextlib.suppress(CorralError):
                started = time.perf_counter()
                result = client.bulk(LABELS, "kill")
                kill = {"matched": result.matched, "killed": len(result.done), "failed": len(result.failed),
                        "wall_s": time.perf_counter() - started,
                        "failure_reasons": _reasons(result.failed.values())}  # fmt: skip
        server.shutdown()
        leftovers = find_leftovers(data_dir, ids).counts()
        host.orphans.reap()
    progress.update(task, completed=1)
    return {"disk_quota": disk_quota, "network": network, "baseline_used_mib": baseline_mib, "steps": steps,
            "stopped": stopped,
            "kill": kill, "leftovers": leftovers, "superblocks_of_its_own": own,
            "create_ms": summarize(all_latencies) if all_latencies else None}  # fmt: skip


def _reasons(messages: Iterable[str], keep: int = 5) -> dict[str, int]:
    """The most frequent failure messages (their first 200 characters) and how many failed so."""
    return dict(collections.Counter(message[:200] for message in messages).most_common(keep))


def _checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    last = report["steps"][-1]
    per_sandbox = last["mib_per_sandbox"]
    exec_p50 = last["exec"]["p50"] if last["exec"] else None
    return [
        {"metric": "mib_per_sandbox", "target": f"≤ {MIB_PER_SANDBOX_TARGET:g} MiB at {last['sandboxes']}",
         "value": per_sandbox, "ok": per_sandbox is not None and per_sandbox <= MIB_PER_SANDBOX_TARGET},
        {"metric": "exec", "target": f"p50 ≤ {EXEC_TARGET_MS:g} ms at {last['sandboxes']}", "value": exec_p50,
         "ok": exec_p50 is not None and exec_p50 <= EXEC_TARGET_MS},
    ]  # fmt: skip


def _table(report: dict[str, Any]) -> Table:
    info, kill, left = report["host"], report["kill"], report["leftovers"]
    killed = f"{kill['killed']}/{kill['matched']} in {kill['wall_s']:.1f} s" if kill else "not run"
    if kill and kill["failed"]:
        killed += " (failed: " + "; ".join(f"{n}× {why}" for why, n in kill["failure_reasons"].items()) + ")"
    caption = (f"Baseline {report['baseline_used_mib']:.0f} MiB in use before the first create (same run); "
               f"{IMAGE}, cpu {CPU:g}, {MEMORY_MB} MiB limit, {CREATE_CONCURRENCY} creates in flight; exec on "
               f"{EXEC_PROBES} random sandboxes. Bulk kill: {killed}. "
               f"Left behind: {left['containers']} containers, {left['processes']} processes, {left['cgroups']} "
               f"cgroups, {left['mounts']} mounts, {left['veths']} veths, {left['loop_devices']} loop devices, "
               f"{left['sandbox_dirs']} sandbox dirs. Superblocks of a sandbox's own: "
               f"{len(report['superblocks_of_its_own'])} ({', '.join(report['superblocks_of_its_own'])}). "
               f"Kernel {info['kernel']}, {info['cpu_count']} cpus, {info['mem_total_mib']:.0f} MiB RAM.")  # fmt: skip
    kind = ", networked sandboxes" if report["network"] else ""
    title = f"corral bench density (disk quota {'on' if report['disk_quota'] else 'off'}{kind})"
    table = Table("sandboxes", "host MiB used", "MiB / sandbox", "1 KiB slab MiB (shrinker slots)", "exec p50 / p95",
                  "create p50 (rate)", "host CPU per create, user / system",
                  "server CPU idle, % of a core (+ per 1,000 over 0)", "server mounts", title=title,
                  caption=caption)  # fmt: skip
    idle_at_zero = report["steps"][0]["server_idle_cpu_percent"]
    for row in report["steps"]:
        per_sandbox = f"{row['mib_per_sandbox']:.2f}" if row["mib_per_sandbox"] is not None else "-"
        probe = f"{row['exec']['p50']:.1f} / {row['exec']['p95']:.1f} ms" if row["exec"] else "-"
        batch = row["create"]
        create = f"{batch['p50']:.0f} ms ({batch['n'] / batch['batch_s']:.0f}/s)" if batch else "-"
        cpu = f"{batch['host_user_ms_per_create']:.1f} / {batch['host_system_ms_per_create']:.1f} ms" if batch else "-"
        slab = f"{row['one_kib_slab_mib']:.0f}" if row.get("one_kib_slab_mib") is not None else "-"
        idle = row["server_idle_cpu_percent"]
        idle_text = "-" if idle is None else f"{idle:.1f}"
        if idle is not None and idle_at_zero is not None and row["sandboxes"]:
            idle_text += f" (+{(idle - idle_at_zero) * 1000 / row['sandboxes']:.1f})"
        table.add_row(str(row["sandboxes"]), f"{row['used_mib']:.0f} (+{row['delta_mib']:.0f})", per_sandbox, slab,
                      probe, create, cpu, idle_text, str(row["server_mounts"]))  # fmt: skip
    verdicts = [f"{check['target']}: " + ("[green]ok[/green]" if check["ok"] else "[red]missed[/red]")
                for check in report["checks"]]  # fmt: skip
    stopped = f"[yellow]stopped early: {report['stopped']}[/yellow]" if report["stopped"] else "ran to the end"
    table.add_section()
    table.add_row("verdict", stopped, verdicts[0], "-", verdicts[1], "-", "-", "-", "-")
    return table


def _quota_cost(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """What quotas add: ratios on/off of memory per sandbox (at the count every run reached) and of the median
    create, each the mean over the runs of one mode."""
    at = min(run["steps"][-1]["sandboxes"] for run in runs)

    def mean(values: list[float | None]) -> float | None:
        return sum(v for v in values if v is not None) / len(values) if None not in values else None

    def slab_kib(run: dict[str, Any]) -> float:
        row = next(row for row in run["steps"] if row["sandboxes"] >= at)
        grown_mib = float(row["slab_unreclaimable_mib"] - run["steps"][0]["slab_unreclaimable_mib"])
        return grown_mib * 1024 / int(row["sandboxes"])

    mib, slab, create = [], [], []
    for quota in (False, True):
        mode = [run for run in runs if run["disk_quota"] is quota]
        mib.append(mean([next(row["mib_per_sandbox"] for row in run["steps"] if row["sandboxes"] >= at)
                         for run in mode]))  # fmt: skip
        slab.append(mean([slab_kib(run) for run in mode]))
        create.append(mean([run["create_ms"]["p50"] if run["create_ms"] else None for run in mode]))
    ratios = {"mib_per_sandbox": mib[1] / mib[0] if mib[0] and mib[1] else None,
              "create_p50": create[1] / create[0] if create[0] and create[1] else None}  # fmt: skip
    # Kernel memory the sandboxes pin (unreclaimable slab: cgroups, namespaces, a subvolume's root): the
    # steadier figure when other tenants move MemAvailable by hundreds of MiB; reported, not a target.
    return {"sandboxes": at, "mib_per_sandbox_off_on": mib, "slab_unreclaimable_kib_per_sandbox_off_on": slab,
            "create_p50_ms_off_on": create, "ratios": ratios,
            "checks": [{"metric": f"quota_{name}_ratio", "target": f"≤ {QUOTA_RATIO_TARGET:g}", "value": ratio,
                        "ok": ratio is not None and ratio <= QUOTA_RATIO_TARGET}
                       for name, ratio in ratios.items()]}  # fmt: skip


def _tables(report: dict[str, Any]) -> Group:
    """A table per run, then what quotas cost when both ran."""
    parts: list[Table | str] = [_table(run) for run in report["runs"]]
    if cost := report.get("quota_cost"):
        (mib_off, mib_on), (create_off, create_on) = cost["mib_per_sandbox_off_on"], cost["create_p50_ms_off_on"]
        slab_off, slab_on = cost["slab_unreclaimable_kib_per_sandbox_off_on"]
        verdicts = ", ".join(f"{check['metric']} {check['value']:.2f} " + ("ok" if check["ok"] else "missed")
                             for check in cost["checks"] if check["value"] is not None)  # fmt: skip
        parts.append(f"disk quota on/off at {cost['sandboxes']}: {mib_on:.2f}/{mib_off:.2f} MiB per sandbox "
                     f"({slab_on:.0f}/{slab_off:.0f} KiB unreclaimable slab), "
                     f"create p50 {create_on:.0f}/{create_off:.0f} ms: {verdicts} "
                     f"(target ≤ {QUOTA_RATIO_TARGET:g})")  # fmt: skip
    return Group(*parts)


def run_density_benchmark(
    *,
    count: int,
    step: int,
    disk_quota: str,
    as_json: bool,
    console: Console,
    network: bool = False,
    idle_window_s: float = IDLE_WINDOW_S,
) -> None:
    """Fill the node with idle sandboxes, measuring host memory and responsiveness per step, then print a table
    (one per run: with ``disk_quota="compare"``, without and with writable-layer quotas)."""
    if count < 1 or step < 1:
        raise InvalidRequest("--count and --step must be at least 1")
    if idle_window_s < 0:
        raise InvalidRequest("--idle-window-s must be 0 (not measured) or more")
    if disk_quota not in QUOTA_MODES:
        raise InvalidRequest(f"--disk-quota must be one of {', '.join(QUOTA_MODES)}")
    quotas = {"on": [True], "off": [False], "compare": [False, True, True, False]}[disk_quota]
    host_info = {"kernel": platform.release(), "cpu_count": os.cpu_count(), "mem_total_mib": _meminfo_mib()["MemTotal"]}
    params = {"count": count, "step": step, "image": IMAGE, "cpu": CPU, "memory_mb": MEMORY_MB,
              "create_concurrency": CREATE_CONCURRENCY, "exec_probes": EXEC_PROBES, "server_env": SERVER_ENV,
              "disk_quota": disk_quota, "network": network, "idle_window_s": idle_window_s}  # fmt: skip
    runs: list[dict[str, Any]] = []
    with bench_session("bench-density", as_json=as_json, console=console) as (scratch, progress):
        for number, quota in enumerate(quotas):
            run = {"host": host_info, **_measure(scratch / f"server-{number}", count, step, progress,
                                                 disk_quota=quota, network=network,
                                                 idle_window_s=idle_window_s)}  # fmt: skip
            run["checks"] = _checks(run)
            runs.append(run)
    report: dict[str, Any] = {"unit": "MiB, ms", "params": params, "host": host_info, "runs": runs}
    if disk_quota == "compare":
        report["quota_cost"] = _quota_cost(runs)
    report["checks"] = [check for run in runs for check in run["checks"]] + report.get("quota_cost", {}).get(
        "checks", []
    )
    emit(report, _tables, as_json=as_json, console=console)
