"""`corral bench vm`: the VM backends (microvm, vm) against same-run baselines, on whatever accelerator the node has.

1. Boot to first exec: `create(backend=B)` + `exec("true")` wall time, for microvm (busybox) and vm (debian-12,
   a q35 guest booting an ext4 root disk). One untimed warm-up create per kind comes first: the first microvm
   create prepares the guest kit and the accelerator choice, the first vm create builds the root disk image
   of the stack (once per node). Baselines: `probe_boot(kit, "tcg")` (the bare kernel + initramfs to init,
   no disks, no agent) and a busybox container create + first exec.
2. Exec round trip of `true` through the API on one running microvm, alternating with the same on a container.
3. fork(1) of a running microvm until the child answers an exec (checkpoint + restore, processes included),
   against the microvm boot to first exec of step 1; pause and resume (vCPUs stop and continue).
4. Host memory per idle microvm: `idle` busybox microvms left alone for a few seconds, then the PSS and RSS of
   each QEMU process (/proc/<pid>/smaps_rollup; guest memory is a shared file under /dev/shm, so PSS counts
   the pages the guest touched), and the growth of host memory in use per VM. Baseline: the PSS of one idle
   busybox container's processes.

This machine has no working KVM, so the guests run on TCG (software emulation); the accelerator in use comes
from the sandbox's status message and is printed with the table. No targets are promised for TCG yet, so the
table has no verdicts. On a host with VT-x/AMD-V, CORRAL_VM_ACCEL=auto picks KVM after its probe boot: the same
command measures KVM there.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.backends.common.host import runtime_state_root
from corral.backends.vm.accel import probe_boot
from corral.backends.vm.guest import GuestKit, ensure_guest_kit
from corral.backends.vm.memory import KSM_DIR, ksm_merged_bytes
from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit, ms_since, require_success
from corral.config import Settings
from corral.embedded import EmbeddedServer
from corral.sdk import Client, InvalidRequest, Sandbox

__all__ = ["run_vm_benchmark"]

MICROVM_IMAGE, VM_IMAGE, CONTAINER_IMAGE = "busybox", "debian-12", "busybox"
EXEC_SAMPLES = 50
IDLE_SETTLE_S = 5.0
KSM_SETTLE_MAX_S, KSM_SETTLE_STEP_S = 90.0, 3.0
SANDBOX_TTL_S = 900.0  # a sandbox leaked by a crashed bench still goes away
PROBE_TIMEOUT_S = 30.0  # the noisy shared host: give the bare boot room, it is a baseline, not the accel probe
CRUN_TIMEOUT_S = 30.0
KVM_NOTE = ("On a host with VT-x/AMD-V, CORRAL_VM_ACCEL=auto picks KVM after its probe boot; run the same command "
            "there to measure KVM (expect boot well under 1 s and exec RTT near the container's).")  # fmt: skip


def _boot(client: Client, image: str, backend: str, tracked: list[Sandbox]) -> tuple[Sandbox, float]:
    """A sandbox answering its first exec, and the wall ms from the create call to that answer."""
    started = time.perf_counter()
    sandbox = client.create(image, backend=backend, ttl_s=SANDBOX_TTL_S)
    tracked.append(sandbox)
    require_success(sandbox.exec("true"), "true")
    return sandbox, ms_since(started)


def _kill(sandbox: Sandbox, tracked: list[Sandbox]) -> None:
    sandbox.kill()
    tracked.remove(sandbox)


def _boot_samples(client: Client, kit: GuestKit, runs: int, tracked: list[Sandbox],
                  progress: Progress) -> tuple[dict[str, Any], str]:  # fmt: skip
    """Boot-to-first-exec summaries (and the microvm's status message, which names the accelerator)."""
    vm_runs = max(2, runs // 2)  # each q35 boot takes several seconds on TCG
    task = progress.add_task("boot → first exec (warm-ups, then rounds: probe boot, container, microvm, vm)",
                             total=2 + 3 * runs + vm_runs)  # fmt: skip
    samples: dict[str, list[float]] = {"probe_boot": [], "container": [], "microvm": [], "vm": []}
    warm, warm_ms = _boot(client, MICROVM_IMAGE, "microvm", tracked)  # prepares the kit and the accelerator choice
    info = warm.refresh()
    status = info.status_message or "unknown"
    _kill(warm, tracked)
    progress.advance(task)
    warm, vm_warm_ms = _boot(client, VM_IMAGE, "vm", tracked)  # builds the root disk of the stack once per node
    _kill(warm, tracked)
    progress.advance(task)
    failures = []
    # Interleaved rounds: the load of this shared host drifts, and each kind then sees the same drift.
    for round_no in range(max(runs, vm_runs)):
        if round_no < runs:
            started = time.perf_counter()
            ok, what = probe_boot(kit, "tcg", PROBE_TIMEOUT_S)
            if ok:
                samples["probe_boot"].append(ms_since(started))
            else:
                failures.append(what)
            progress.advance(task)
        kinds = [("container", CONTAINER_IMAGE), ("microvm", MICROVM_IMAGE)] if round_no < runs else []
        for backend, image in kinds + ([("vm", VM_IMAGE)] if round_no < vm_runs else []):
            sandbox, ms = _boot(client, image, backend, tracked)
            samples[backend].append(ms)
            _kill(sandbox, tracked)
            progress.advance(task)
    if not samples["probe_boot"]:
        raise RuntimeError(f"the bare TCG probe boot never reached init: {failures[-1]}")
    out: dict[str, Any] = {key: summarize(values) for key, values in samples.items()}
    out["warmup_ms"] = {"microvm": warm_ms, "vm": vm_warm_ms}
    out["probe_boot_failures"] = len(failures)
    out["guest_memory_mb"] = info.memory_mb
    return out, status


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return ms_since(started)


def _exec_and_lifecycle(client: Client, runs: int, tracked: list[Sandbox], progress: Progress) -> dict[str, Any]:
    """Exec round trips on a microvm and a container (alternating), then fork(1), pause and resume of the microvm."""
    task = progress.add_task(f"exec ×{EXEC_SAMPLES} (microvm, container), fork(1), pause/resume",
                             total=EXEC_SAMPLES + 2 * runs)  # fmt: skip
    samples: dict[str, list[float]] = {key: [] for key in (
        "exec_microvm", "exec_container", "fork", "pause", "resume", "first_exec_after_resume")}  # fmt: skip
    vm, _ = _boot(client, MICROVM_IMAGE, "microvm", tracked)
    box, _ = _boot(client, CONTAINER_IMAGE, "container", tracked)
    for _ in range(EXEC_SAMPLES):
        samples["exec_microvm"].append(_timed(lambda: require_success(vm.exec("true"), "true")))
        samples["exec_container"].append(_timed(lambda: require_success(box.exec("true"), "true")))
        progress.advance(task)
    _kill(box, tracked)
    # A process the children must inherit: fork carries memory and processes, not only the disk.
    vm.start("sleep 3600")
    for _ in range(runs):
        started = time.perf_counter()
        children = vm.fork(1)
        tracked.extend(children)
        require_success(children[0].exec("true"), "true")
        samples["fork"].append(ms_since(started))
        for child in children:
            _kill(child, tracked)
        progress.advance(task)
    for _ in range(runs):
        samples["pause"].append(_timed(vm.pause))
        samples["resume"].append(_timed(vm.resume))
        samples["first_exec_after_resume"].append(_timed(lambda: require_success(vm.exec("true"), "true")))
        progress.advance(task)
    _kill(vm, tracked)
    return {key: summarize(values) for key, values in samples.items()}


SMAPS_FIELDS = ("Rss", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def _memory_kib(pid: int) -> dict[str, int]:
    """Rss, Pss and its split (anon, file, shmem: the guest's memory file) of one process in KiB, from smaps_rollup."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2 and parts[0].rstrip(":") in SMAPS_FIELDS:
            fields[parts[0].rstrip(":")] = int(parts[1])
    return fields


def _descendants(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        for task_dir in Path(f"/proc/{current}/task").glob("*"):
            try:
                todo.extend(int(child) for child in (task_dir / "children").read_text().split())
            except OSError:
                continue
    return pids


def _used_mib() -> float:
    info = {line.split(":")[0]: int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def _container_pss_mib(data_dir: Path, sandbox_id: str) -> float | None:
    """PSS of a container sandbox's processes (its init and descendants), or None if crun does not say."""
    try:
        out = subprocess.run(["crun", "--root", str(runtime_state_root(data_dir, "crun")), "state", sandbox_id],
                             capture_output=True, text=True, check=True, timeout=CRUN_TIMEOUT_S)  # fmt: skip
        pid = int(json.loads(out.stdout)["pid"])
        return sum(_memory_kib(p).get("Pss", 0) for p in _descendants(pid)) / 1024
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return None


def _idle_memory(client: Client, data_dir: Path, idle: int, tracked: list[Sandbox],
                 progress: Progress) -> dict[str, Any]:  # fmt: skip
    task = progress.add_task(f"host memory: {idle} idle microvms + 1 container, {IDLE_SETTLE_S:g} s settle",
                             total=idle + 2)  # fmt: skip
    used_before = _used_mib()
    vms = []
    for _ in range(idle):
        vms.append(_boot(client, MICROVM_IMAGE, "microvm", tracked)[0])
        progress.advance(task)
    box, _ = _boot(client, CONTAINER_IMAGE, "container", tracked)
    progress.advance(task)
    time.sleep(IDLE_SETTLE_S)
    used_after = _used_mib()
    per_vm: dict[str, list[float]] = {field: [] for field in SMAPS_FIELDS}
    for sandbox in vms:
        pid = int((data_dir / "vms" / sandbox.id / "qemu.pid").read_text().strip())
        kib = _memory_kib(pid)
        for field in SMAPS_FIELDS:
            per_vm[field].append(kib.get(field, 0) / 1024)
    container_pss = _container_pss_mib(data_dir, box.id)
    progress.advance(task)
    for sandbox in [*vms, box]:
        _kill(sandbox, tracked)
    return {
        "count": idle,
        **{f"{field.lower()}_mib": summarize(values) for field, values in per_vm.items()},
        "per_vm_pss_mib": per_vm["Pss"],
        "host_used_growth_mib_per_vm": (used_after - used_before) / idle,  # includes the one container (~1 MiB)
        "container_pss_mib": container_pss,
    }


@contextlib.contextmanager
def _bench_server(data_dir: Path, env: dict[str, str] | None = None) -> Iterator[tuple[Client, list[Sandbox]]]:
    """A throwaway server and the list of sandboxes to kill, whatever happens, before it stops."""
    server = EmbeddedServer(data_dir, env=env)
    tracked: list[Sandbox] = []
    try:
        server.start()
        with server.client() as client:
            yield client, tracked
    finally:
        for sandbox in tracked:
            try:
                sandbox.kill()
            except Exception:  # noqa: BLE001 - best effort; the server's shutdown kills the rest
                pass
        server.shutdown()
        host.orphans.reap()


def _template_boots(data_dir: Path, runs: int, progress: Progress) -> dict[str, Any]:
    """Create → first exec on a server with boot templates on: one cold boot keeps the template, the rest
    restore it (the main measurement runs with templates off, so its boots are cold)."""
    task = progress.add_task("microvm creates restored from a boot template", total=runs + 1)
    samples: list[float] = []
    with _bench_server(data_dir) as (client, tracked):
        first, first_ms = _boot(client, MICROVM_IMAGE, "microvm", tracked)  # boots, then keeps the template
        progress.advance(task)
        for _ in range(runs):
            sandbox, ms = _boot(client, MICROVM_IMAGE, "microvm", tracked)
            samples.append(ms)
            _kill(sandbox, tracked)
            progress.advance(task)
        _kill(first, tracked)
    return {"restored": summarize(samples), "first_with_template_save_ms": first_ms}


def _merged_memory(data_dir: Path, idle: int, progress: Progress) -> dict[str, Any]:
    """The same idle microvms on a server with CORRAL_VM_MEMORY=mergeable, once KSM has merged them.

    KSM is a host-wide switch: whatever state it was in is put back afterwards."""
    run_file, scan_file = KSM_DIR / "run", KSM_DIR / "pages_to_scan"
    was_run, was_scan = run_file.read_text().strip(), scan_file.read_text().strip()
    task = progress.add_task(f"mergeable memory: {idle} idle microvms, until KSM settles", total=idle + 1)
    try:
        with _bench_server(data_dir, {"CORRAL_VM_MEMORY": "mergeable"}) as (client, tracked):
            vms = []
            for _ in range(idle):
                vms.append(_boot(client, MICROVM_IMAGE, "microvm", tracked)[0])
                progress.advance(task)
            started, last, merged = time.monotonic(), -1.0, 0.0
            while time.monotonic() - started < KSM_SETTLE_MAX_S:  # until a few seconds pass with no new merges
                time.sleep(KSM_SETTLE_STEP_S)
                merged = ksm_merged_bytes() / (1 << 20)
                if merged > 0 and merged - last < 1:
                    break
                last = merged
            settle_s = time.monotonic() - started
            pss = [_memory_kib(int((data_dir / "vms" / vm.id / "qemu.pid").read_text()))["Pss"] / 1024 for vm in vms]
            progress.advance(task)
            for sandbox in vms:
                _kill(sandbox, tracked)
    finally:
        run_file.write_text(was_run)
        scan_file.write_text(was_scan)
    return {"count": idle, "pss_mib": summarize(pss), "per_vm_pss_mib": pss, "ksm_merged_mib": merged,
            "ksm_settle_s": settle_s}  # fmt: skip


def _measure(data_dir: Path, runs: int, idle: int, progress: Progress) -> dict[str, Any]:
    node_dir = Settings().node_dir
    kit = ensure_guest_kit(node_dir, host.build_native_helpers(node_dir).agent)
    task = progress.add_task("starting corral serve", total=1)
    server = EmbeddedServer(data_dir, env={"CORRAL_VM_TEMPLATES": "false"})  # cold boots, every time
    tracked: list[Sandbox] = []
    try:
        server.start()
        progress.update(task, completed=1)
        with server.client() as client:
            boot, status = _boot_samples(client, kit, runs, tracked, progress)
            lifecycle = _exec_and_lifecycle(client, runs, tracked, progress)
            memory = _idle_memory(client, data_dir, idle, tracked, progress)
        task = progress.add_task("cleaning up (sandboxes, server)", total=1)
    finally:
        for sandbox in tracked:
            try:
                sandbox.kill()
            except Exception:  # noqa: BLE001 - best effort; kill_all_sandboxes follows
                pass
        server.shutdown()
        host.orphans.reap()
    progress.update(task, completed=1)
    templates = _template_boots(data_dir.with_name("server-templates"), runs, progress)
    merged = _merged_memory(data_dir.with_name("server-mergeable"), idle, progress)
    return {"status_message": status, "boot": boot, "lifecycle": lifecycle, "memory": memory, "mergeable": merged,
            "templates": templates}  # fmt: skip


def _table(report: dict[str, Any]) -> Table:
    boot, life, mem, params = report["boot"], report["lifecycle"], report["memory"], report["params"]
    info = report["host"]
    caption = (f"Accelerator: {report['status_message']}. "
               f"Guests: {boot['guest_memory_mb']} MiB, 1 vCPU. {params['runs']} samples per boot timing "
               f"(vm: {params['vm_runs']}), {EXEC_SAMPLES} exec samples, {params['runs']} fork/pause samples; "
               f"each after one untimed warm-up create (microvm {boot['warmup_ms']['microvm']:.0f} ms, "
               f"vm {boot['warmup_ms']['vm']:.0f} ms, which also builds the vm root disk if the node has none yet). "
               f"Kernel {info['kernel']}, {info['cpu_count']} cpus, load at start {info['loadavg_at_start']}. "
               f"No targets are promised for TCG in docs/spec.md. {KVM_NOTE}")  # fmt: skip
    rows = ResultTable("corral bench vm", caption, [], digits=1)
    table, timing = rows.table, rows.timing
    timing("microvm create → first exec", boot["microvm"], "bare TCG boot to init", boot["probe_boot"])
    timing("  same, vs a container", boot["microvm"], "container create+exec", boot["container"])
    timing("microvm create from its boot template → first exec", report["templates"]["restored"],
           "cold microvm boot", boot["microvm"])  # fmt: skip
    timing("vm (q35) create → first exec", boot["vm"], "bare TCG boot to init", boot["probe_boot"])
    timing("  same, vs a container", boot["vm"], "container create+exec", boot["container"])
    timing("exec round trip (microvm)", life["exec_microvm"], "container exec", life["exec_container"])
    timing("fork(1) microvm → child exec", life["fork"], "microvm cold boot", boot["microvm"])
    timing("pause microvm", life["pause"], "-", None)
    timing("resume microvm", life["resume"], "-", None)
    timing("first exec after resume", life["first_exec_after_resume"], "warm exec", life["exec_microvm"])
    base = mem["container_pss_mib"]
    pss, rss = mem["pss_mib"], mem["rss_mib"]
    table.add_row(f"host memory per idle microvm (PSS, {mem['count']} VMs)", f"{pss['p50']:.1f} MiB",
                  f"max {pss['max']:.1f} MiB",
                  f"container PSS {base:.1f} MiB" if base is not None else "-",
                  f"{pss['p50'] / base:.0f}×" if base else "-", "-", "-")  # fmt: skip
    for name, label in (("shmem", "guest RAM touched (shmem)"), ("anon", "QEMU anon (heap, TCG code cache)"),
                        ("file", "files (QEMU, libs; shared by VMs)")):  # fmt: skip
        part = mem[f"pss_{name}_mib"]
        table.add_row(f"  PSS of which {label}", f"{part['p50']:.1f} MiB", f"max {part['max']:.1f} MiB",
                      "-", "-", "-", "-")  # fmt: skip
    table.add_row("  RSS per idle microvm", f"{rss['p50']:.1f} MiB", f"max {rss['max']:.1f} MiB", "-", "-", "-", "-")
    table.add_row("  host memory in use, growth per VM", f"{mem['host_used_growth_mib_per_vm']:.1f} MiB", "-",
                  "-", "-", "-", "-")  # fmt: skip
    merged = report["mergeable"]
    mpss = merged["pss_mib"]
    table.add_row(f"idle microvm, mergeable memory + KSM (PSS, {merged['count']} VMs)", f"{mpss['p50']:.1f} MiB",
                  f"max {mpss['max']:.1f} MiB", f"shared-file memory {pss['p50']:.1f} MiB",
                  f"{mpss['p50'] / pss['p50']:.2f}×", "-", "-")  # fmt: skip
    table.add_row("  merged by KSM across those VMs", f"{merged['ksm_merged_mib']:.1f} MiB",
                  f"after {merged['ksm_settle_s']:.0f} s", "-", "-", "-", "-")  # fmt: skip
    return table


def run_vm_benchmark(*, runs: int, idle: int, as_json: bool, console: Console) -> None:
    """Measure VM boot, exec, fork, pause/resume and idle memory against same-run baselines; print a table or JSON."""
    if runs < 1:
        raise InvalidRequest("--runs must be at least 1")
    if idle < 1:
        raise InvalidRequest("--idle must be at least 1")
    loadavg = " ".join(f"{x:.1f}" for x in os.getloadavg())  # before we add to it
    with bench_session("bench-vm", as_json=as_json, console=console) as (scratch, progress):
        results = _measure(scratch / "server", runs, idle, progress)
    report: dict[str, Any] = {
        "unit": "ms",
        "params": {"runs": runs, "vm_runs": max(2, runs // 2), "idle": idle, "exec_samples": EXEC_SAMPLES,
                   "microvm_image": MICROVM_IMAGE, "vm_image": VM_IMAGE, "container_image": CONTAINER_IMAGE,
                   "idle_settle_s": IDLE_SETTLE_S},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count(),
                 "loadavg_at_start": loadavg,
                 "kvm_device": os.path.exists("/dev/kvm")},
        **results,
        "kvm_note": KVM_NOTE,
        "checks": [],
    }  # fmt: skip
    emit(report, _table, as_json=as_json, console=console)
