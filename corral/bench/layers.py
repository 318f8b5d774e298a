"""`corral bench layers`: what composing sandboxes from shared EROFS layers costs, against same-run baselines.

1. Compose-and-mount: k = 1, 2, 3 EROFS layer files mounted with mount(2) plus
   an overlay over them, in this process's private mount namespace; baseline:
   one bare tmpfs mount(2) in the same loop, so the ratio is in syscalls.
2. Create -> first exec with a tools layer the node has never used (cold: the
   edge checks its sha256 and mounts it), against the same create again (warm);
   an in-process sha256 of the same file is the part verification explains.
3. Page cache per extra sandbox reading a layer it shares, against copying the
   same bytes into each sandbox's writable layer (what not sharing costs).
4. The size of the default base (debian-12) and, on request, its build time.

This machine is noisy and shared, so absolute numbers drift from run to run;
each figure sits next to a baseline sampled in the same run and is read as a
ratio. The server is an EmbeddedServer whose node dir hard-links the real
store, so the layers built here vanish with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.backends.common import host
from corral.backends.common.host import _mount
from corral.bench.containers import summarize
from corral.config import Settings
from corral.embedded import EmbeddedServer, linked_node_dir
from corral.images.erofs import build_erofs
from corral.images.store import LayerStore, check_layer_file
from corral.procfs import mount_field
from corral.sdk import Client, ExecResult, InvalidRequest, Sandbox

__all__ = ["run_layers_benchmark"]

BASE = "busybox"
DEFAULT_BASE = "debian-12"
MAX_LAYERS = 3
TOOLS_LAYER_MIB, TOOLS_FILES = 32, 4
SHARED_LAYER_MIB, SHARED_FILES = 64, 8
UNSHARED_SANDBOXES = 2
SANDBOX_CPU, SANDBOX_MEMORY_MB = 0.25, 256
SANDBOX_TTL_S = 600.0  # a sandbox leaked by a crashed bench still goes away
_MS_RDONLY = 1
_MNT_DETACH = 2
_MIB = 1 << 20


def _umount(target: Path, flags: int = 0) -> None:
    if host._libc.umount2(os.fsencode(target), flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"umount {target}: {os.strerror(err)}")


def _unmount_under(root: Path) -> None:
    """Detach whatever is still mounted under ``root``, deepest (latest) first."""
    prefix = f"{root}/"
    targets = [mount_field(fields[1]) for line in Path("/proc/self/mounts").read_text().splitlines()
               if len(fields := line.split()) > 1 and mount_field(fields[1]).startswith(prefix)]  # fmt: skip
    for target in reversed(targets):
        with contextlib.suppress(OSError):
            _umount(Path(target), _MNT_DETACH)


def _random_tree(root: Path, subdir: str, total_mib: int, files: int) -> Path:
    """``root/subdir`` with ``files`` files of random bytes, ``total_mib`` in all (unique, so never deduped)."""
    data = root / subdir
    data.mkdir(parents=True)
    for n in range(files):
        (data / f"blob-{n}").write_bytes(os.urandom(total_mib * _MIB // files))
    return root


def _compose_samples(work: Path, layer_files: list[Path], runs: int, progress: Progress) -> dict[str, list[float]]:
    """Per round: compose 1..3 layers plus an overlay, then one bare tmpfs mount; round 0 only warms up."""
    samples: dict[str, list[float]] = {**{f"layers_{k}": [] for k in range(1, MAX_LAYERS + 1)}, "tmpfs": []}
    scratch = work / "mnt"
    scratch.mkdir()
    _mount("tmpfs", str(scratch), "tmpfs", 0, "size=64m,mode=700")  # mountpoints, upper and work dirs
    task = progress.add_task(f"compose-and-mount 1..{MAX_LAYERS} layers, tmpfs baseline", total=runs)
    for round_no in range(runs + 1):
        for k in range(1, MAX_LAYERS + 1):
            root = scratch / f"{round_no}-{k}"
            lowers = [root / f"lower-{n}" for n in range(k)]
            upper, workdir, merged = root / "upper", root / "work", root / "merged"
            for directory in (*lowers, upper, workdir, merged):
                directory.mkdir(parents=True)
            # lowerdir lists the top layer first; the bottom (busybox) is layer_files[0].
            options = f"lowerdir={':'.join(map(str, reversed(lowers)))},upperdir={upper},workdir={workdir}"
            started = time.perf_counter_ns()
            for lower, layer_file in zip(lowers, layer_files, strict=False):
                _mount(str(layer_file), str(lower), "erofs", _MS_RDONLY, None)
            _mount("overlay", str(merged), "overlay", 0, options)
            elapsed_ms = (time.perf_counter_ns() - started) / 1e6
            for target in (merged, *reversed(lowers)):
                _umount(target)
            if round_no:
                samples[f"layers_{k}"].append(elapsed_ms)
        target = scratch / f"{round_no}-tmpfs"
        target.mkdir()
        started = time.perf_counter_ns()
        _mount("tmpfs", str(target), "tmpfs", 0, "size=1m")
        elapsed_ms = (time.perf_counter_ns() - started) / 1e6
        _umount(target)
        if round_no:
            samples["tmpfs"].append(elapsed_ms)
            progress.advance(task)
    _umount(scratch)
    return samples


def _require_success(result: ExecResult, what: str) -> None:
    if result.exit_code != 0:
        raise RuntimeError(f"`{what}` in the sandbox exited {result.exit_code}: {result.stderr[-300:]}")


def _create(client: Client, tools: str) -> Sandbox:
    return client.create(environment={"base": BASE, "tools": tools}, cpu=SANDBOX_CPU, memory_mb=SANDBOX_MEMORY_MB,
                         ttl_s=SANDBOX_TTL_S)  # fmt: skip


def _create_exec_ms(client: Client, tools: str) -> float:
    started = time.perf_counter()
    sandbox = _create(client, tools)
    try:
        _require_success(sandbox.exec("true"), "true")
        return (time.perf_counter() - started) * 1000
    finally:
        sandbox.kill()


def _cold_warm_samples(client: Client, store: LayerStore, work: Path, runs: int, progress: Progress) -> dict[str, Any]:
    samples: dict[str, list[float]] = {"cold": [], "warm": [], "verify": []}
    task = progress.add_task(f"create → first exec, new {TOOLS_LAYER_MIB} MiB tools layer: cold, warm", total=runs)
    for i in range(runs):
        tree = _random_tree(work / f"tools-{i}", "bench", TOOLS_LAYER_MIB, TOOLS_FILES)
        name = f"bench-tools-{i}"
        client.images.build(name, "dir", path=str(tree), no_cache=True)
        shutil.rmtree(tree)
        samples["cold"].append(_create_exec_ms(client, name))
        samples["warm"].append(_create_exec_ms(client, name))
        digest = client.images.inspect(name).layers[-1].digest
        layer_file = store.layer_path(digest)
        started = time.perf_counter()
        check_layer_file(digest, layer_file)
        samples["verify"].append((time.perf_counter() - started) * 1000)
        progress.advance(task)
    return {key: summarize(values) for key, values in samples.items()}


def _cached_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Cached:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/meminfo has no Cached: line")


def _cache_growth_mib(sandbox: Sandbox, command: str) -> float:
    before = _cached_mib()
    _require_success(sandbox.exec(command, timeout_s=120), command)
    return _cached_mib() - before


def _page_cache(client: Client, work: Path, sandboxes: int, progress: Progress) -> dict[str, Any]:
    tree = _random_tree(work / "shared", "data", SHARED_LAYER_MIB, SHARED_FILES)
    client.images.build("bench-shared", "dir", path=str(tree), no_cache=True)
    shutil.rmtree(tree)
    task = progress.add_task(f"page cache: {sandboxes} sandboxes share {SHARED_LAYER_MIB} MiB, "
                             f"{UNSHARED_SANDBOXES} copy it", total=sandboxes + UNSHARED_SANDBOXES)  # fmt: skip
    shared: list[float] = []
    for _ in range(sandboxes):
        shared.append(_cache_growth_mib(_create(client, "bench-shared"), "cat /data/* > /dev/null"))
        progress.advance(task)
    copied: list[float] = []
    for _ in range(UNSHARED_SANDBOXES):
        sandbox = _create(client, "bench-shared")
        copied.append(_cache_growth_mib(sandbox, "cp -r /data /copy && cat /copy/* > /dev/null"))
        progress.advance(task)
    return {"layer_mib": SHARED_LAYER_MIB, "first_reader_mib": shared[0], "extra_readers_mib": shared[1:],
            "extra_reader_median_mib": statistics.median(shared[1:]),
            "unshared_copy_mib": copied, "unshared_copy_median_mib": statistics.median(copied)}  # fmt: skip


def _default_base(client: Client, with_debootstrap: bool, progress: Progress) -> dict[str, Any]:
    result: dict[str, Any] = {"image": DEFAULT_BASE, "size_mib": client.images.inspect(DEFAULT_BASE).size_bytes / _MIB}
    if with_debootstrap:
        task = progress.add_task("debootstrap build of the default base", total=1)
        started = time.perf_counter()

        def show(line: str) -> None:
            progress.update(task, description=f"debootstrap: {line[:60]}")

        client.images.build("bench-debian", "debootstrap", no_cache=True, on_progress=show)
        result["build_s"] = time.perf_counter() - started
        progress.update(task, completed=1)
    return result


def _measure(work: Path, runs: int, sandboxes: int, with_debootstrap: bool, progress: Progress) -> dict[str, Any]:
    store = LayerStore(Settings().layer_dir)
    layer_files = [store.layer_path(store.resolve(BASE).layers[0])]
    for n in range(1, MAX_LAYERS):
        tree = _random_tree(work / f"small-{n}", f"layer-{n}", 1, 4)
        layer_files.append(build_erofs(tree, work / f"small-{n}.erofs"))
    compose = {key: summarize(values) for key, values in _compose_samples(work, layer_files, runs, progress).items()}

    node_dir = work / "node"
    linked_node_dir(node_dir)
    task = progress.add_task("starting corral serve (temporary node dir)", total=1)
    server = EmbeddedServer(work / "server", env={"CORRAL_NODE_DIR": str(node_dir)})
    try:
        server.start()
        progress.update(task, completed=1)
        with server.client() as client:
            cold_warm = _cold_warm_samples(client, LayerStore(node_dir / "layers"), work, runs, progress)
            page_cache = _page_cache(client, work, sandboxes, progress)
            default_base = _default_base(client, with_debootstrap, progress)
        task = progress.add_task("cleaning up (sandboxes, server)", total=1)
    finally:
        server.shutdown()
    progress.update(task, completed=1)
    return {"compose_ms": compose, "create_ms": cold_warm, "page_cache": page_cache, "default_base": default_base}


def _table(report: dict[str, Any]) -> Table:
    compose, create, cache, base = (report[key] for key in ("compose_ms", "create_ms", "page_cache", "default_base"))
    params, info = report["params"], report["host"]
    caption = (
        f"{params['runs']} samples per timing, interleaved with their baseline. Page cache is /proc/meminfo "
        "Cached:, which is machine-wide, so extras and copies are medians over sandboxes. "
        f"Kernel {info['kernel']}, {info['cpu_count']} cpus, cgroup {info['cgroup_layout']}."
    )
    table = Table("measurement", "value", "baseline (same run)", "ratio", title="corral bench layers", caption=caption)
    tmpfs = compose["tmpfs"]
    for k in range(1, MAX_LAYERS + 1):
        ours = compose[f"layers_{k}"]
        table.add_row(
            f"mount {k} EROFS layer{'s' if k > 1 else ''} + overlay",
            f"p50 {ours['p50']:.3f} ms, p95 {ours['p95']:.3f}",
            f"one tmpfs mount(2): p50 {tmpfs['p50']:.3f} ms, p95 {tmpfs['p95']:.3f}",
            f"{ours['p50'] / tmpfs['p50']:.1f}×",
        )
    cold, warm, verify = create["cold"], create["warm"], create["verify"]
    gap_ms = cold["p50"] - warm["p50"]
    table.add_row(
        f"create → first exec, new {TOOLS_LAYER_MIB} MiB tools layer (cold)",
        f"p50 {cold['p50']:.1f} ms, p95 {cold['p95']:.1f}",
        f"same layer again (warm): p50 {warm['p50']:.1f} ms, p95 {warm['p95']:.1f}",
        f"{cold['p50'] / warm['p50']:.2f}×",
    )
    table.add_row(
        f"  sha256 of that {TOOLS_LAYER_MIB} MiB layer file, in-process",
        f"p50 {verify['p50']:.1f} ms",
        f"cold − warm gap: {gap_ms:.1f} ms",
        f"{verify['p50'] / gap_ms:.0%} of the gap" if gap_ms > 0 else "no gap",
    )
    extra, copy = cache["extra_reader_median_mib"], cache["unshared_copy_median_mib"]
    table.add_row(
        f"page cache: first reader of a {cache['layer_mib']} MiB layer", f"+{cache['first_reader_mib']:.1f} MiB"
    )
    table.add_row(
        "page cache: each extra sandbox sharing it",
        f"+{extra:.1f} MiB (median of {len(cache['extra_readers_mib'])})",
        f"copied into each writable layer: +{copy:.1f} MiB (median of {len(cache['unshared_copy_mib'])})",
        f"{extra / copy:.2f}×",
    )
    build = (
        f"debootstrap build: {base['build_s']:.1f} s"
        if "build_s" in base
        else "build time: run with --with-debootstrap"
    )
    table.add_row(f"default base layer ({base['image']})", f"{base['size_mib']:.0f} MiB", build)
    return table


def run_layers_benchmark(*, runs: int, sandboxes: int, as_json: bool, console: Console,
                         with_debootstrap: bool = False) -> None:  # fmt: skip
    """Measure layer composition, cold vs warm creates and page-cache sharing, then print a table (or JSON)."""
    if runs < 1 or sandboxes < 2:
        raise InvalidRequest("--runs must be at least 1 and --sandboxes at least 2")
    if os.geteuid() != 0:
        raise SystemExit("corral bench layers needs root: it mounts EROFS layers and overlays itself")
    layout = host.detect_cgroup_layout()
    # First, before any thread (the progress bar starts one): unshare(CLONE_NEWNS)
    # refuses a threaded process, and every mount below then dies with us.
    host.enter_private_mount_namespace(layout)
    work = Path(tempfile.mkdtemp(prefix="corral-bench-layers."))
    columns: tuple[Any, ...] = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                MofNCompleteColumn(), TimeElapsedColumn())  # fmt: skip
    try:
        with Progress(*columns, console=Console(stderr=True) if as_json else console) as progress:
            results = _measure(work, runs, sandboxes, with_debootstrap, progress)
    finally:
        _unmount_under(work)
        shutil.rmtree(work, ignore_errors=True)
    report: dict[str, Any] = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "params": {"runs": runs, "sandboxes": sandboxes, "with_debootstrap": with_debootstrap, "base": BASE,
                   "tools_layer_mib": TOOLS_LAYER_MIB, "shared_layer_mib": SHARED_LAYER_MIB},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count(), "cgroup_layout": layout.value},
        **results,
    }  # fmt: skip
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        console.print(_table(report))
