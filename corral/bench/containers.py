"""`corral bench containers`: container sandbox latency, measured against plain crun in the same run.

Corral is measured through the real SDK over HTTP against an embedded server
this command starts for itself: create -> first exec, exec round trip, and a
burst of concurrent creates. The baseline is plain crun on a copy of the same
busybox rootfs, with Corral's own config.json (limits, namespaces, seccomp)
minus the agent: `crun run --detach` + `crun exec`, `crun exec` alone, and for
the burst as many `crun run --detach` as there are creates, as many at once as
the server starts (its create concurrency), each on a bundle of its own. Both
bursts also report the host's CPU time per create (all processes, from
/proc/stat): on a node with C cores, C seconds divided by that is the most
creates per second that way of starting containers can reach there.
The same two are also taken on a second bundle without the security profile
(no seccomp, no masked or read-only paths, no no_new_privs; the capability set
is kept, dropping capabilities costs nothing measurable), which gives the
profile's own cost as a with/without ratio.
This machine is noisy, so absolute numbers drift from run to run; both sides
are sampled in one process, interleaved sample by sample, and the verdicts
compare them as ratios (or against the absolute ceiling for exec).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Any, Self, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.backends.common import host
from corral.backends.container import oci
from corral.bench.harness import own_node_dir
from corral.config import Settings
from corral.embedded import EmbeddedServer
from corral.images.store import LayerStore
from corral.procfs import host_cpu_s
from corral.sdk import AsyncClient, AsyncSandbox, Client, ExecResult, InvalidRequest, Sandbox

__all__ = ["fill_layer", "percentile", "run_benchmark", "summarize"]

IMAGE = "busybox"
EXEC_WARMUP_CALLS = 5
EXEC_SAMPLES_PER_RUN = 10
# Small enough that a burst of a hundred fits the server's CPU admission
# (cores x cpu_overcommit); the baseline containers get the same limits.
LIMITS = oci.ContainerLimits(cpu=0.25, memory_mb=128, pids_max=256)
SANDBOX_TTL_S = 600.0  # a sandbox leaked by a crashed bench still goes away
BENCH_JOB = "bench-exec"  # the job label of the exec sandbox, reached by a job token too
CREATE_RATIO_TARGET = 1.5  # create -> first exec p50, as a multiple of plain crun's
EXEC_P50_TARGET_MS = 5.0  # exec round trip p50, absolute, in turns with crun exec
EXEC_BACK_TO_BACK_TARGET_MS = 1.5  # exec round trip p50, one exec right after another (issue 22)
OUTPUT_BYTES = 64 << 10  # the output of the "back to back, with output" row: a test run's log, a long listing
# The writable layer of the "a step among many files" row: a checkout and its virtualenv, say. A step with a client's
# id records the files it changed: that must cost what it changed, not what the layer holds.
STEP_LAYER_FILES = 20_000
CRUN_TIMEOUT_S = 30.0
BENCH_CGROUP = "corral-bench"
_CGROUP_ROOT = Path("/sys/fs/cgroup")

_T = TypeVar("_T")


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), interpolating linearly between the two
    closest ranks (numpy's default): rank = (n - 1) * q / 100."""
    if not samples:
        raise ValueError("percentile of an empty sample")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """p50, p95, mean, min, max and n of a non-empty sample."""
    if not samples:
        raise ValueError("summary of an empty sample")
    return {"p50": percentile(samples, 50), "p95": percentile(samples, 95), "mean": statistics.fmean(samples),
            "min": min(samples), "max": max(samples), "n": len(samples)}  # fmt: skip


def _spawn_true() -> None:
    """``true`` started and waited for, as directly as Python can (posix_spawn, no shell, no pipes)."""
    pid = os.posix_spawn("/bin/true", ["true"], {})
    os.waitpid(pid, 0)


def _timed_ms(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


@contextlib.contextmanager
def _embedded_server(data_dir: Path) -> Iterator[tuple[str, str]]:
    """Yield (url, api_key) of a throwaway server; reap what its sandboxes leave us as subreaper."""
    try:
        with EmbeddedServer(data_dir) as server:
            yield server.url, server.api_key
    finally:
        host.orphans.reap()


class _Crun:
    """Plain crun with a state root of its own. Its stderr goes to a log file,
    never a pipe: a detached container keeps the stderr it inherited open."""

    def __init__(self, state_root: Path, log_path: Path) -> None:
        binary = shutil.which("crun")
        if binary is None:
            raise InvalidRequest("crun is not installed: apt-get install crun")
        self._base = [binary, "--root", str(state_root)]
        self._log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._log.close()

    def _run(self, *args: str, check: bool = True) -> None:
        try:
            subprocess.run([*self._base, *args], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=self._log, check=check, timeout=CRUN_TIMEOUT_S)  # fmt: skip
        except subprocess.CalledProcessError as exc:
            self._log.flush()
            tail = self._log_path.read_bytes()[-600:].decode(errors="replace").strip()
            raise RuntimeError(f"crun {args[0]} exited {exc.returncode}: {tail}") from None

    def run_detached(self, container_id: str, bundle: Path) -> None:
        self._run("run", "--detach", "--bundle", str(bundle), container_id)

    def exec_true(self, container_id: str) -> None:
        self._run("exec", container_id, "/bin/true")

    async def run_detached_async(self, container_id: str, bundle: Path) -> None:
        """``run_detached`` without blocking the event loop: the burst baseline starts several at once."""
        process = await asyncio.create_subprocess_exec(
            *self._base, "run", "--detach", "--bundle", str(bundle), container_id,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log,
        )  # fmt: skip
        if await asyncio.wait_for(process.wait(), CRUN_TIMEOUT_S) != 0:
            self._log.flush()
            tail = self._log_path.read_bytes()[-600:].decode(errors="replace").strip()
            raise RuntimeError(f"crun run exited {process.returncode}: {tail}")

    def kill_and_delete(self, container_id: str) -> None:
        """By the time delete -f returns the init has exited, so its zombie is reaped here."""
        self._run("kill", container_id, "KILL", check=False)
        self._run("delete", "-f", container_id, check=False)
        host.orphans.reap()

    def delete_all(self) -> None:
        listing = subprocess.run([*self._base, "list", "-q"], stdin=subprocess.DEVNULL, capture_output=True,
                                 text=True, check=False, timeout=CRUN_TIMEOUT_S)  # fmt: skip
        for container_id in listing.stdout.split():
            self.kill_and_delete(container_id)


def _build_baseline_rootfs(rootfs: Path, layer_file: Path) -> None:
    """Copy the busybox EROFS layer into rootfs, a plain directory."""
    mountpoint = rootfs.parent / "layer-mnt"
    mountpoint.mkdir(parents=True)
    subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(layer_file), str(mountpoint)],
                   check=True, capture_output=True, timeout=CRUN_TIMEOUT_S)  # fmt: skip
    try:
        copy = ["cp", "-a", f"{mountpoint}/.", str(rootfs)]
        subprocess.run(copy, check=True, capture_output=True, timeout=CRUN_TIMEOUT_S * 10)
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True, capture_output=True, timeout=CRUN_TIMEOUT_S)


@dataclass(frozen=True)
class _Bundle:
    """A crun bundle on the shared baseline rootfs, with or without Corral's security profile."""

    directory: Path
    rootfs: Path
    profile: bool

    def write_config(self, container_id: str) -> None:
        """A sandbox's config.json, running sleep instead of the agent."""
        config = oci.build_config(
            hostname=container_id[-12:],
            limits=LIMITS,
            cgroup_path=f"/{BENCH_CGROUP}/{container_id}",
            agent_binary=Path("/nonexistent"),
        )
        config["process"]["args"] = ["/bin/sleep", "1000"]
        config["mounts"] = [m for m in config["mounts"] if m["destination"] != oci.AGENT_PATH]
        config["root"]["path"] = str(self.rootfs)
        if not self.profile:
            for key in ("seccomp", "maskedPaths", "readonlyPaths"):
                del config["linux"][key]
            config["process"]["noNewPrivileges"] = False
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "config.json").write_text(json.dumps(config))


def _in_turn(sample_index: int, first: _T, second: _T) -> tuple[_T, _T]:
    """Swap the order on odd samples, so neither side always runs right after the other (or after Corral)."""
    return (first, second) if sample_index % 2 == 0 else (second, first)


def _remove_bench_cgroups() -> None:
    """crun delete removes each container's cgroup; drop the (empty) parents."""
    for parent in [_CGROUP_ROOT / BENCH_CGROUP, *(d / BENCH_CGROUP for d in _CGROUP_ROOT.iterdir() if d.is_dir())]:
        with contextlib.suppress(OSError):
            parent.rmdir()


def fill_layer(sandbox: Sandbox, count: int) -> None:
    """Write ``count`` empty files (100 a directory) under /work/many in the sandbox's writable layer, and check they
    are all there: a row measured against a layer of that size means nothing with fewer."""
    made = sandbox.exec(f"mkdir -p /work/many && cd /work/many && for d in $(seq {count // 100}); do mkdir $d && "
                        "(cd $d && touch $(seq 100)) || exit 1; done && find /work/many -type f | wc -l",
                        timeout_s=300)  # fmt: skip
    _require_success(made)
    if made.stdout.strip() != str(count):
        raise RuntimeError(f"the bench's sandbox holds {made.stdout.strip()} files in its layer, not {count}")


def _step_true(sandbox: Sandbox, step_id: str) -> None:
    _require_success(sandbox.exec("true", step_id=step_id))


def _require_success(result: ExecResult) -> None:
    if result.exit_code != 0:
        raise RuntimeError(f"the bench's command in the sandbox exited {result.exit_code}: {result.stderr[-300:]}")


def _require_output(result: ExecResult, size: int) -> None:
    _require_success(result)
    if len(result.stdout) != size:
        raise RuntimeError(f"bench exec printed {len(result.stdout)} bytes where {size} were expected")


def _corral_create_sample(client: Client) -> float:
    started = time.perf_counter()
    sandbox = client.create(IMAGE, cpu=LIMITS.cpu, memory_mb=LIMITS.memory_mb, ttl_s=SANDBOX_TTL_S)
    try:
        _require_success(sandbox.exec("true"))
        return (time.perf_counter() - started) * 1000
    finally:
        sandbox.kill()


def _crun_create_sample(crun: _Crun, bundle: _Bundle, container_id: str) -> float:
    bundle.write_config(container_id)
    started = time.perf_counter()
    try:
        crun.run_detached(container_id, bundle.directory)
        crun.exec_true(container_id)
        return (time.perf_counter() - started) * 1000
    finally:
        crun.kill_and_delete(container_id)


def _host_busy_s() -> float:
    """CPU seconds this host's cores have spent busy since boot (every process and the kernel)."""
    return sum(host_cpu_s().values())


async def _concurrent_create(url: str, api_key: str, count: int, on_created: Callable[[], None]) -> dict[str, Any]:
    async with AsyncClient(url, api_key) as client:

        async def create_one() -> AsyncSandbox:
            sandbox = await client.create(IMAGE, cpu=LIMITS.cpu, memory_mb=LIMITS.memory_mb, ttl_s=SANDBOX_TTL_S)
            on_created()
            return sandbox

        busy_before, started = _host_busy_s(), time.perf_counter()
        results = await asyncio.gather(*(create_one() for _ in range(count)), return_exceptions=True)
        wall_s, busy_s = time.perf_counter() - started, _host_busy_s() - busy_before
        created = [r for r in results if isinstance(r, AsyncSandbox)]
        errors = sorted({f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)})
        await asyncio.gather(*(sandbox.kill() for sandbox in created), return_exceptions=True)
    return {"requested": count, "succeeded": len(created), "wall_s": wall_s,
            "creations_per_s": len(created) / wall_s, "host_cpu_ms_per_create": busy_s * 1000 / count,
            "errors": errors[:5]}  # fmt: skip


async def _crun_concurrent_create(crun: _Crun, rootfs: Path, work_dir: Path, count: int, at_once: int,
                                  on_created: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
    """``count`` plain ``crun run --detach``, ``at_once`` at a time, each on a bundle of its own (written first,
    outside the timing), with Corral's profile; then all killed and deleted."""
    bundles = [_Bundle(work_dir / f"burst-{i}", rootfs, profile=True) for i in range(count)]
    for index, bundle in enumerate(bundles):
        bundle.write_config(f"bench-burst-{index}")
    slots = asyncio.Semaphore(at_once)

    async def start(index: int) -> None:
        async with slots:
            await crun.run_detached_async(f"bench-burst-{index}", bundles[index].directory)
        on_created()

    busy_before, started = _host_busy_s(), time.perf_counter()
    results = await asyncio.gather(*(start(i) for i in range(count)), return_exceptions=True)
    wall_s, busy_s = time.perf_counter() - started, _host_busy_s() - busy_before
    errors = sorted({f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)})
    succeeded = sum(r is None for r in results)
    for index in range(count):
        await asyncio.to_thread(crun.kill_and_delete, f"bench-burst-{index}")
    return {"requested": count, "succeeded": succeeded, "at_once": at_once, "wall_s": wall_s,
            "creations_per_s": succeeded / wall_s, "host_cpu_ms_per_create": busy_s * 1000 / count,
            "errors": errors[:5]}  # fmt: skip


def _profile_cost(with_profile: Sequence[float], without_profile: Sequence[float]) -> dict[str, Any]:
    profiled, bare = summarize(with_profile), summarize(without_profile)
    return {"with_profile": profiled, "without_profile": bare, "p50_ratio": profiled["p50"] / bare["p50"]}


def _measure(work_dir: Path, layer_file: Path, runs: int, concurrency: int, progress: Progress) -> dict[str, Any]:
    rootfs = work_dir / "baseline" / "rootfs"
    profiled = _Bundle(work_dir / "baseline" / "profiled", rootfs, profile=True)
    bare = _Bundle(work_dir / "baseline" / "bare", rootfs, profile=False)
    samples: dict[str, list[float]] = {key: [] for key in ("corral_create", "crun_create", "crun_create_bare",
                                                           "corral_exec", "corral_exec_back_to_back", "corral_http",
                                                           "corral_exec_job_token", "corral_exec_output",
                                                           "corral_exec_step", "corral_exec_step_many_files",
                                                           "host_spawn", "crun_exec", "crun_exec_bare")}  # fmt: skip
    with contextlib.ExitStack() as stack:
        task = progress.add_task("baseline rootfs (mount EROFS, cp -a)", total=1)
        _build_baseline_rootfs(rootfs, layer_file)
        crun = stack.enter_context(_Crun(work_dir / "crun-root", work_dir / "crun.log"))
        stack.callback(crun.delete_all)
        progress.update(task, completed=1)
        task = progress.add_task("starting corral serve", total=1)
        url, api_key = stack.enter_context(_embedded_server(work_dir / "server"))
        client = stack.enter_context(Client(url, api_key))
        progress.update(task, completed=1)

        task = progress.add_task("create → first exec (corral, crun ± profile)", total=runs)
        for i in range(runs):
            samples["corral_create"].append(_corral_create_sample(client))
            for key, bundle, container_id in _in_turn(
                i, ("crun_create", profiled, f"bench-create-{i}"), ("crun_create_bare", bare, f"bench-create-bare-{i}")
            ):
                samples[key].append(_crun_create_sample(crun, bundle, container_id))
            progress.advance(task)

        calls = EXEC_WARMUP_CALLS + runs * EXEC_SAMPLES_PER_RUN
        task = progress.add_task("exec round trip (corral, crun ± profile)", total=calls)
        exec_containers = {"crun_exec": (profiled, "bench-exec"), "crun_exec_bare": (bare, "bench-exec-bare")}
        with client.create(IMAGE, cpu=LIMITS.cpu, memory_mb=LIMITS.memory_mb, ttl_s=SANDBOX_TTL_S,
                           labels={"job": BENCH_JOB}) as sandbox:  # fmt: skip
            for bundle, container_id in exec_containers.values():
                bundle.write_config(container_id)
                crun.run_detached(container_id, bundle.directory)
            for i in range(calls):
                timings_ms = {"corral_exec": _timed_ms(lambda: _require_success(sandbox.exec("true")))}
                for key, (_, container_id) in _in_turn(i, *exec_containers.items()):
                    timings_ms[key] = _timed_ms(partial(crun.exec_true, container_id))
                if i >= EXEC_WARMUP_CALLS:
                    for key, elapsed_ms in timings_ms.items():
                        samples[key].append(elapsed_ms)
                progress.advance(task)
            for _, container_id in exec_containers.values():
                crun.kill_and_delete(container_id)
            # In turns with crun, each exec finds the CPUs just left by crun's processes; back to back is the path's
            # own cost, and a bare HTTP request through the same client is the floor under it.
            task = progress.add_task(
                "exec round trip back to back (server key, job token, with output), a bare HTTP round trip, a bare "
                "spawn",
                total=5 * calls,
            )
            trainer = stack.enter_context(Client(url, client.issue_job_token(BENCH_JOB)))  # a training job's client
            as_job = trainer.get(sandbox.id)
            _require_success(sandbox.exec(f"head -c {OUTPUT_BYTES} /dev/zero | tr '\\0' x > /tmp/bench-output"))
            for key, action in (
                ("corral_exec_back_to_back", lambda: _require_success(sandbox.exec("true"))),
                ("corral_exec_job_token", lambda: _require_success(as_job.exec("true"))),
                ("corral_exec_output", lambda: _require_output(sandbox.exec("cat /tmp/bench-output"), OUTPUT_BYTES)),
                ("corral_http", lambda: client._transport.request("GET", "/healthz")),  # noqa: SLF001
                ("host_spawn", _spawn_true),  # and a process started and waited for, the other floor
            ):
                for i in range(calls):
                    elapsed_ms = _timed_ms(action)
                    if i >= EXEC_WARMUP_CALLS:
                        samples[key].append(elapsed_ms)
                    progress.advance(task)
            task = progress.add_task(f"a step with a client's id, back to back: in that sandbox and in one with "
                                     f"{STEP_LAYER_FILES:,} files in its layer", total=2 * calls + 1)  # fmt: skip
            with client.create(IMAGE, cpu=LIMITS.cpu, memory_mb=LIMITS.memory_mb, ttl_s=SANDBOX_TTL_S) as full:
                fill_layer(full, STEP_LAYER_FILES)
                progress.advance(task)
                steps = {"corral_exec_step": sandbox, "corral_exec_step_many_files": full}
                for i in range(calls):
                    for key, in_sandbox in _in_turn(i, *steps.items()):
                        elapsed_ms = _timed_ms(partial(_step_true, in_sandbox, f"bench-step-{i}"))
                        if i >= EXEC_WARMUP_CALLS:
                            samples[key].append(elapsed_ms)
                        progress.advance(task)

        task = progress.add_task(f"concurrent create ×{concurrency} (corral)", total=concurrency)
        burst = asyncio.run(_concurrent_create(url, api_key, concurrency, lambda: progress.advance(task)))
        at_once = Settings().create_concurrency  # what the server starts at once
        task = progress.add_task(f"concurrent create ×{concurrency} (plain crun, {at_once} at once)", total=concurrency)
        crun_burst = asyncio.run(_crun_concurrent_create(crun, rootfs, work_dir / "baseline" / "burst", concurrency,
                                                         at_once, lambda: progress.advance(task)))  # fmt: skip
        cleanup = progress.add_task("cleaning up (sandboxes, server, containers)", total=1)
    progress.update(cleanup, completed=1)
    return {
        "corral": {"create_to_first_exec": summarize(samples["corral_create"]),
                   "exec_roundtrip": summarize(samples["corral_exec"]),
                   "exec_back_to_back": summarize(samples["corral_exec_back_to_back"]),
                   "exec_job_token": summarize(samples["corral_exec_job_token"]),
                   "exec_output": {**summarize(samples["corral_exec_output"]), "output_bytes": OUTPUT_BYTES},
                   "exec_step": summarize(samples["corral_exec_step"]),
                   "exec_step_many_files": {**summarize(samples["corral_exec_step_many_files"]),
                                            "layer_files": STEP_LAYER_FILES},
                   "http_roundtrip": summarize(samples["corral_http"]), "concurrent_create": burst},
        "baseline": {"crun_create_start_exec": summarize(samples["crun_create"]),
                     "crun_exec": summarize(samples["crun_exec"]), "crun_concurrent_create": crun_burst,
                     "host_spawn": summarize(samples["host_spawn"])},
        "profile_cost": {"crun_create_start_exec": _profile_cost(samples["crun_create"], samples["crun_create_bare"]),
                         "crun_exec": _profile_cost(samples["crun_exec"], samples["crun_exec_bare"])},
    }  # fmt: skip


def _checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    corral, baseline = results["corral"], results["baseline"]
    create_ratio = corral["create_to_first_exec"]["p50"] / baseline["crun_create_start_exec"]["p50"]
    exec_p50, burst = corral["exec_roundtrip"]["p50"], corral["concurrent_create"]
    back_to_back = corral["exec_back_to_back"]["p50"]
    baseline_burst = baseline["crun_concurrent_create"]
    return [
        {"metric": "create_to_first_exec", "target": f"ratio ≤ {CREATE_RATIO_TARGET:g}", "value": create_ratio,
         "ok": create_ratio <= CREATE_RATIO_TARGET},
        {"metric": "exec_roundtrip", "target": f"p50 ≤ {EXEC_P50_TARGET_MS:g} ms", "value": exec_p50,
         "ok": exec_p50 <= EXEC_P50_TARGET_MS},
        {"metric": "exec_back_to_back", "target": f"p50 ≤ {EXEC_BACK_TO_BACK_TARGET_MS:g} ms", "value": back_to_back,
         "ok": back_to_back <= EXEC_BACK_TO_BACK_TARGET_MS},
        {"metric": "concurrent_create", "target": "all succeed", "value": burst["succeeded"],
         "ok": burst["succeeded"] == burst["requested"]},
        {"metric": "crun_concurrent_create", "target": "all succeed", "value": baseline_burst["succeeded"],
         "ok": baseline_burst["succeeded"] == baseline_burst["requested"]},
    ]  # fmt: skip


def _table(report: dict[str, Any]) -> Table:
    corral, baseline, info, params = report["corral"], report["baseline"], report["host"], report["params"]
    checks = {check["metric"]: check for check in report["checks"]}
    at_once = baseline["crun_concurrent_create"]["at_once"]
    caption = (f"baselines: crun run --detach + crun exec, and crun exec; {params['runs']} creates and "
               f"{params['exec_samples']} execs per side, interleaved; the burst's: as many crun run --detach, "
               f"{at_once} at once. Back to back: one exec right after another, the same by a job token's client "
               "(a training job's: its hold on the sandbox is checked), the same printing "
               f"{OUTPUT_BYTES >> 10} KiB (cat of a file), the same as a step with a client's id (its changed "
               f"files recorded) in turns with one in a sandbox holding {STEP_LAYER_FILES:,} files in its writable "
               "layer, then as many GET /healthz through the "
               "same client and posix_spawn + wait of /bin/true on the host (the floors under an exec). "
               "Profile cost: the same crun runs with "
               "Corral's profile vs without seccomp, masked/read-only paths and no_new_privs. "
               f"Kernel {info['kernel']}, {info['cpu_count']} cpus, cgroup {info['cgroup_layout']}, "
               f"{info['crun_version']}.")  # fmt: skip
    table = Table("metric", "p50 ms", "p95 ms", "baseline p50 ms", "ratio", "target", "verdict",
                  title="corral bench containers", caption=caption)  # fmt: skip

    def verdict(metric: str, failed: str = "over") -> str:
        return "[green]ok[/green]" if checks[metric]["ok"] else f"[red]{failed}[/red]"

    for metric, label, base_key in (
        ("create_to_first_exec", "create → first exec", "crun_create_start_exec"),
        ("exec_roundtrip", "exec round trip", "crun_exec"),
    ):
        ours, theirs = corral[metric], baseline[base_key]
        table.add_row(label, f"{ours['p50']:.1f}", f"{ours['p95']:.1f}", f"{theirs['p50']:.1f}",
                      f"{ours['p50'] / theirs['p50']:.2f}", checks[metric]["target"], verdict(metric))  # fmt: skip
    for metric, label in (
        ("exec_back_to_back", "  back to back"),
        ("exec_job_token", "  back to back, by a job token's client"),
        ("exec_output", f"  back to back, {OUTPUT_BYTES >> 10} KiB of output"),
        ("exec_step", "  back to back, a step with a client's id"),
        ("exec_step_many_files", f"  the same step, {STEP_LAYER_FILES:,} files in the layer"),
        ("http_roundtrip", "  a bare HTTP round trip"),
        ("host_spawn", "  a bare spawn of true on the host"),
    ):
        ours = baseline[metric] if metric == "host_spawn" else corral[metric]
        target, ok = (checks[metric]["target"], verdict(metric)) if metric in checks else ("-", "-")
        base = {
            "exec_output": corral["exec_back_to_back"]["p50"],
            "exec_step": corral["exec_back_to_back"]["p50"],
            "exec_step_many_files": corral["exec_step"]["p50"],
        }.get(metric)  # against `true`'s, the step's
        table.add_row(label, f"{ours['p50']:.2f}", f"{ours['p95']:.2f}", "-" if base is None else f"{base:.2f}",
                      "-" if base is None else f"{ours['p50'] / base:.2f}", target, ok)  # fmt: skip
    burst, crun_burst = corral["concurrent_create"], baseline["crun_concurrent_create"]
    table.add_row(f"concurrent creates ×{burst['requested']}", f"{burst['succeeded']}/{burst['requested']} ok",
                  f"{burst['wall_s']:.2f} s wall", f"crun: {crun_burst['creations_per_s']:.1f}/s",
                  f"{burst['creations_per_s'] / crun_burst['creations_per_s']:.2f}",
                  "all succeed", verdict("concurrent_create", "failed"))  # fmt: skip
    table.add_row("  creates per second", f"{burst['creations_per_s']:.1f}/s", "-",
                  f"{crun_burst['creations_per_s']:.1f}/s", "-", "-", "-")  # fmt: skip
    table.add_row("  host CPU per create", f"{burst['host_cpu_ms_per_create']:.1f} ms", "-",
                  f"{crun_burst['host_cpu_ms_per_create']:.1f} ms", "-", "-",
                  verdict("crun_concurrent_create", "baseline failed"))  # fmt: skip
    table.add_section()
    for label, key in (("profile cost: create+exec", "crun_create_start_exec"), ("profile cost: exec", "crun_exec")):
        cost = report["profile_cost"][key]
        profiled, bare = cost["with_profile"], cost["without_profile"]
        table.add_row(label, f"{profiled['p50']:.1f}", f"{profiled['p95']:.1f}", f"{bare['p50']:.1f}",
                      f"{cost['p50_ratio']:.2f}", "-", "-")  # fmt: skip
    return table


def run_benchmark(*, runs: int, concurrency: int, as_json: bool, console: Console) -> None:
    """Measure Corral and the plain-crun baseline, then print a table (or JSON)."""
    if runs < 1 or concurrency < 1:
        raise InvalidRequest("--runs and --concurrency must be at least 1")
    if os.geteuid() != 0:
        raise SystemExit("corral bench needs root: its crun baseline creates namespaces, cgroups and mounts")
    layout = host.detect_cgroup_layout()
    # Before any thread (the progress bar starts one): unshare(CLONE_NEWNS)
    # refuses a threaded process. On hybrid hosts this hides v2 so crun works.
    host.enter_private_mount_namespace(layout)
    store = LayerStore(Settings().layer_dir)
    image = store.resolve(IMAGE)
    if len(image.layers) != 1:
        raise InvalidRequest(f"the bench expects a single-layer {IMAGE} image, found {len(image.layers)} layers")
    layer_file = store.layer_path(image.layers[0])
    crun_version = subprocess.run(["crun", "--version"], capture_output=True, text=True, check=False, timeout=10)

    work_dir = Path(tempfile.mkdtemp(prefix="corral-bench."))
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    try:
        with (
            host.child_subreaper(),  # crun forks and dead inits come to us; host.orphans reaps them
            own_node_dir(work_dir),
            Progress(*columns, console=Console(stderr=True) if as_json else console) as progress,
        ):
            results = _measure(work_dir, layer_file, runs, concurrency, progress)
    finally:
        shutil.rmtree(work_dir, ignore_errors=True)
        _remove_bench_cgroups()
    report: dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "unit": "ms",
        "params": {"runs": runs, "concurrency": concurrency, "image": IMAGE, "cpu": LIMITS.cpu,
                   "memory_mb": LIMITS.memory_mb, "exec_samples": runs * EXEC_SAMPLES_PER_RUN},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count(), "cgroup_layout": layout.value,
                 "crun_version": (crun_version.stdout.splitlines() or ["unknown"])[0]},
        **results,
    }  # fmt: skip
    report["checks"] = _checks(report)
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        console.print(_table(report))
