"""`corral bench memory`: host memory when many sandboxes read the same layer files, and what pausing gives back.

1. Sharing: a layer of incompressible files (os.urandom, `layer_mib` in all) is built once from a
   directory as a tools layer over busybox. One sandbox is created and reads all of it; then
   count - 1 more are created and each reads all of it too. Host memory is read before the first
   create, after each phase's creates (sandboxes idle) and after its reads. Ours: the sum of our
   sandboxes' cgroup usage from the node stats (the layer's pages are charged to the first reader)
   plus the page cache of the layer's EROFS image file, which the edge's sha256 check reads at the
   first mount, charged outside the sandboxes; and, for the split, the page cache of the files in
   the edge's one mount of the layer. Both page-cache figures come from fincore, which reads
   nothing in. The MemAvailable drop and Cached growth are kept too, but they are host-wide and
   other tenants move them. No host-wide drop_caches: only our image file is evicted (fsync, then
   posix_fadvise DONTNEED) so the first reader starts cold. Baselines in the same run: the one
   reader, the same sandboxes idle before they read, and the naive count × layer_mib that a copy
   per sandbox would cost.
2. Reclaim: count busybox sandboxes each write HELD_MIB of /dev/urandom to /dev/shm (tmpfs:
   swap-backed like anonymous memory, charged to the sandbox's cgroup), then each is paused with
   wait_reclaim, PAUSE_CONCURRENCY at a time (a bulk pause returns once frozen, before the reclaim
   is done). Resident before and after (node stats and each PauseResult), swap growth, MemAvailable
   and the zram pool; then a bulk resume, after which one sandbox must still hold its bytes.

The server is an EmbeddedServer whose node dir hard-links the real store, so the layer built here is
removed (untag, remove) and what is left of it vanishes with the scratch dir.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import random
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
from corral.bench.harness import ResultTable, bench_session, emit, ms_since, require_success
from corral.config import Settings
from corral.embedded import EmbeddedServer
from corral.images.store import LayerStore
from corral.sdk import AsyncClient, Client, CorralError, ExecResult, InvalidRequest, PauseResult

__all__ = ["run_memory_benchmark"]

BASE, LAYER_NAME, LAYER_FILES = "busybox", "bench-memory-layer", 4
READER_CPU, IDLE_CPU, IDLE_MEMORY_MB = 0.5, 0.1, 64
HELD_MIB = 20
SHARE_LABELS, IDLE_LABELS = {"bench": "memory", "phase": "share"}, {"bench": "memory", "phase": "idle"}
CREATE_CONCURRENCY, READ_CONCURRENCY, PAUSE_CONCURRENCY = 8, 4, 8
SANDBOX_TTL_S = 1800.0  # a sandbox leaked by a crashed bench still goes away
MIB_PER_EXTRA_READER_TARGET = 2.0  # what an idle sandbox may cost (Density): reading a shared layer adds nothing
RECLAIMED_TARGET = 0.80
FINCORE_TIMEOUT_S = 30.0
_MIB = 1 << 20


def _meminfo_mib() -> dict[str, float]:
    fields = (line.split() for line in Path("/proc/meminfo").read_text().splitlines())
    return {parts[0].rstrip(":"): int(parts[1]) / 1024 for parts in fields}


def _zram_used_mib() -> float | None:
    """Host memory the zram swap devices use (compressed pages plus overhead), or None without zram."""
    total, found = 0, False
    for line in Path("/proc/swaps").read_text().splitlines()[1:]:
        stat = Path("/sys/block") / Path(line.split()[0]).name / "mm_stat"
        if stat.is_file():
            total, found = total + int(stat.read_text().split()[2]), True
    return total / _MIB if found else None


def _reading(client: Client) -> dict[str, Any]:
    """Host memory now: MemAvailable, Cached, swap in use and zram's pool (host-wide), our cgroups (ours)."""
    info, node = _meminfo_mib(), client.nodes()[0]
    return {"available_mib": info["MemAvailable"], "cached_mib": info["Cached"],
            "swap_used_mib": info["SwapTotal"] - info["SwapFree"], "zram_used_mib": _zram_used_mib(),
            "resident_mib": node.memory_resident_mb}  # fmt: skip


def _cached_mib(paths: list[Path]) -> float:
    """Page cache the files hold now (fincore: resident pages, nothing is read in to count them)."""
    if not paths:
        return 0.0
    run = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, paths)],
                         capture_output=True, text=True, check=True, timeout=FINCORE_TIMEOUT_S)  # fmt: skip
    return sum(int(line) for line in run.stdout.split()) / _MIB


class _LayerCache:
    """The page cache our layer holds: its files, read through the edge's one mount of it (seen through the
    server's mount namespace), and the EROFS image file in the store (which the edge's sha256 check reads)."""

    def __init__(self, server: EmbeddedServer, image: Path, digest: str) -> None:
        assert server.process is not None
        mount = server.data_dir / "mnt" / "layers" / digest.replace(":", "-")
        self.files = Path(f"/proc/{server.process.pid}/root{mount}") / "data"
        self._image = image

    def mounted(self) -> bool:
        return self.files.is_dir()

    def reading(self, client: Client) -> dict[str, Any]:
        files = sorted(self.files.iterdir()) if self.mounted() else []
        layer = {"layer_files_cached_mib": _cached_mib(files), "image_cached_mib": _cached_mib([self._image])}
        return {**_reading(client), **layer}


def _growth(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """From one reading to another: ours (cgroups + the image file's cache, charged outside them), its parts,
    and the host-wide MemAvailable drop and Cached growth."""
    growth = {key: after[key] - before[key] for key in ("resident_mib", "layer_files_cached_mib", "image_cached_mib",
                                                         "cached_mib")}  # fmt: skip
    return {"ours_mib": growth["resident_mib"] + growth["image_cached_mib"], **growth,
            "host_mib": before["available_mib"] - after["available_mib"]}  # fmt: skip


def _build_layer(client: Client, scratch: Path, store: LayerStore, layer_mib: int) -> tuple[str, Path]:
    """Build the layer of random files and evict its image file from the page cache; its digest and file."""
    data = scratch / "layer" / "data"
    data.mkdir(parents=True)
    for n in range(LAYER_FILES):
        (data / f"blob-{n}").write_bytes(os.urandom(layer_mib * _MIB // LAYER_FILES))
    client.images.build(LAYER_NAME, "dir", path=str(data.parent), layer_kind="tools", no_cache=True)
    shutil.rmtree(data.parent)
    digest = client.images.inspect(LAYER_NAME).layers[-1].digest
    image = store.layer_path(digest)
    fd = os.open(image, os.O_RDONLY)
    try:  # clean pages only: written back first, then dropped; no other file is touched
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return digest, image


async def _create_many(url: str, api_key: str, count: int, progress: Progress, task: Any,
                       **options: Any) -> list[str]:  # fmt: skip
    async with AsyncClient(url, api_key) as client:
        gate = asyncio.Semaphore(CREATE_CONCURRENCY)

        async def one() -> str:
            async with gate:
                sandbox = await client.create(ttl_s=SANDBOX_TTL_S, **options)
                progress.advance(task)
                return sandbox.id

        return list(await asyncio.gather(*(one() for _ in range(count))))


async def _exec_all(url: str, api_key: str, ids: list[str], command: str, progress: Progress,
                    task: Any) -> list[ExecResult]:  # fmt: skip
    async with AsyncClient(url, api_key) as client:
        gate = asyncio.Semaphore(READ_CONCURRENCY)

        async def one(sandbox_id: str) -> ExecResult:
            async with gate:
                result = await (await client.get(sandbox_id)).exec(command, timeout_s=600)
                progress.advance(task)
                return require_success(result, command)

        return list(await asyncio.gather(*(one(i) for i in ids)))


async def _pause_all(url: str, api_key: str, ids: list[str], progress: Progress, task: Any) -> list[PauseResult]:
    async with AsyncClient(url, api_key) as client:
        gate = asyncio.Semaphore(PAUSE_CONCURRENCY)

        async def one(sandbox_id: str) -> PauseResult:
            async with gate:
                result = await (await client.get(sandbox_id)).pause(wait_reclaim=True)
                progress.advance(task)
                return result

        return list(await asyncio.gather(*(one(i) for i in ids)))


def _sharing(server: EmbeddedServer, client: Client, layer: _LayerCache, count: int, layer_mib: int,
             progress: Progress) -> dict[str, Any]:  # fmt: skip
    url, key = server.url, server.api_key
    layer_bytes = LAYER_FILES * (layer_mib * _MIB // LAYER_FILES)
    options = {"environment": {"base": BASE, "tools": LAYER_NAME}, "cpu": READER_CPU,
               "memory_mb": 2 * layer_mib + 64, "labels": SHARE_LABELS}  # fmt: skip
    read = "cat /data/* | wc -c"
    task = progress.add_task(f"sharing: 1, then {count - 1} more sandboxes read {layer_mib} MiB (create, read)",
                             total=2 * count)  # fmt: skip
    readings = {"before": layer.reading(client)}
    first = asyncio.run(_create_many(url, key, 1, progress, task, **options))
    if not layer.mounted():
        raise RuntimeError(f"the layer's mount is not at {layer.files}: where does the edge mount layers now?")
    readings["one_idle"] = layer.reading(client)
    results = asyncio.run(_exec_all(url, key, first, read, progress, task))
    readings["one_read"] = layer.reading(client)
    others = asyncio.run(_create_many(url, key, count - 1, progress, task, **options))
    readings["all_idle"] = layer.reading(client)
    results += asyncio.run(_exec_all(url, key, others, read, progress, task))
    readings["all_read"] = layer.reading(client)
    short = [r.stdout.strip() for r in results if int(r.stdout.strip()) != layer_bytes]
    if short:
        raise RuntimeError(f"{len(short)} sandboxes read {short[0]} bytes of the layer, not {layer_bytes}")
    one, every = _growth(readings["before"], readings["one_read"]), _growth(readings["before"], readings["all_read"])
    extra = count - 1
    return {
        "layer_mib": layer_bytes / _MIB, "readers": count, "readings": readings,
        "one": one, "one_idle": _growth(readings["before"], readings["one_idle"]),
        "all": every, "all_idle": _growth(readings["before"], readings["all_idle"]),
        "extra_reads": _growth(readings["all_idle"], readings["all_read"]),
        "per_extra_reader": {k: (every[k] - one[k]) / extra for k in every} if extra else None,
        "naive_mib": count * layer_bytes / _MIB,
        "ratio_to_naive": {k: every[k] / (count * layer_bytes / _MIB) for k in every},
    }  # fmt: skip


def _reclaim(server: EmbeddedServer, client: Client, count: int, progress: Progress) -> dict[str, Any]:
    url, key = server.url, server.api_key
    fill = f"dd if=/dev/urandom of=/dev/shm/held bs=1M count={HELD_MIB} 2>/dev/null"
    task = progress.add_task(f"reclaim: {count} sandboxes hold {HELD_MIB} MiB (create, fill, pause)", total=3 * count)
    ids = asyncio.run(_create_many(url, key, count, progress, task, image=BASE, cpu=IDLE_CPU,
                                   memory_mb=IDLE_MEMORY_MB, labels=IDLE_LABELS))  # fmt: skip
    asyncio.run(_exec_all(url, key, ids, fill, progress, task))
    before = _reading(client)
    started = time.perf_counter()
    paused = asyncio.run(_pause_all(url, key, ids, progress, task))
    pause_all_ms = ms_since(started)
    after = _reading(client)
    started = time.perf_counter()
    resumed = client.bulk(IDLE_LABELS, "resume")
    resume_all_ms = ms_since(started)
    probe = random.choice(ids)
    held = require_success(client.get(probe).exec("wc -c < /dev/shm/held"), "wc -c").stdout.strip()
    fractions = [1 - p.memory_after_bytes / max(p.memory_before_bytes, 1) for p in paused]
    reclaimed_mib = before["resident_mib"] - after["resident_mib"]
    zram = before["zram_used_mib"], after["zram_used_mib"]
    return {
        "sandboxes": count, "held_mib": HELD_MIB, "before": before, "after": after,
        "resident_before_mib": before["resident_mib"], "resident_after_mib": after["resident_mib"],
        "reclaimed_mib": reclaimed_mib, "reclaimed_fraction": reclaimed_mib / max(before["resident_mib"], 1e-9),
        "per_sandbox_fraction": {"p50": statistics.median(fractions), "min": min(fractions)},
        "swap_growth_mib": after["swap_used_mib"] - before["swap_used_mib"],
        "zram_growth_mib": zram[1] - zram[0] if None not in zram else None,
        "available_growth_mib": after["available_mib"] - before["available_mib"],
        "pause_all_ms": pause_all_ms, "resume_all_ms": resume_all_ms,
        "resumed": {"matched": resumed.matched, "done": len(resumed.done), "failed": len(resumed.failed)},
        "probe": {"sandbox": probe, "held_bytes": int(held), "ok": int(held) == HELD_MIB * _MIB},
    }  # fmt: skip


def _measure(scratch: Path, count: int, layer_mib: int, progress: Progress) -> dict[str, Any]:
    node_dir = Settings().node_dir  # the session's own (bench_session): the layer it builds goes with it
    task = progress.add_task("starting corral serve", total=1)
    server = EmbeddedServer(scratch / "server")
    digest: str | None = None
    try:
        server.start()
        progress.update(task, completed=1)
        with server.client() as client:
            task = progress.add_task(f"building the {layer_mib} MiB layer of random files", total=1)
            digest, image = _build_layer(client, scratch, LayerStore(node_dir / "layers"), layer_mib)
            progress.update(task, completed=1)
            sharing = _sharing(server, client, _LayerCache(server, image, digest), count, layer_mib, progress)
            client.bulk(SHARE_LABELS, "kill")
            reclaim = _reclaim(server, client, count, progress)
        task = progress.add_task("cleaning up (sandboxes, layer, server)", total=1)
    finally:
        server.kill_all_sandboxes()
        if server.running():
            with server.client() as client, contextlib.suppress(CorralError):
                client.images.untag(LAYER_NAME)
                if digest is not None:
                    client.images.remove_layer(digest)
        server.shutdown()
        host.orphans.reap()
    progress.update(task, completed=1)
    return {"sharing": sharing, "reclaim": reclaim}


def _checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    per_extra, reclaim = report["sharing"]["per_extra_reader"], report["reclaim"]
    extra_mib = per_extra["ours_mib"] if per_extra else None
    fraction = reclaim["reclaimed_fraction"]
    return [
        {"metric": "per_extra_reader", "target": f"≤ {MIB_PER_EXTRA_READER_TARGET:g} MiB",
         "value": extra_mib, "ok": extra_mib is not None and extra_mib <= MIB_PER_EXTRA_READER_TARGET},
        {"metric": "reclaimed", "target": f"≥ {RECLAIMED_TARGET:.0%}", "value": fraction,
         "ok": fraction >= RECLAIMED_TARGET and reclaim["probe"]["ok"]},
    ]  # fmt: skip


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:+,.1f} MiB"


def _table(report: dict[str, Any]) -> Table:
    share, reclaim, info = report["sharing"], report["reclaim"], report["host"]
    count, layer = share["readers"], share["layer_mib"]
    caption = (f"Ours = our sandboxes' cgroups (node stats; the layer's pages are charged to the first reader) + "
               "the EROFS image file's page cache (fincore; charged outside them). Layer files cached: fincore on "
               "the files of the edge's one mount of the layer. Host-wide MemAvailable and Cached also move with "
               "other tenants; no drop_caches was used, only our image file was evicted first. Reclaim data is "
               f"/dev/urandom, which zram cannot compress. Kernel {info['kernel']}, {info['cpu_count']} cpus, "
               f"{info['mem_total_mib']:.0f} MiB RAM, swap {info['swap_total_mib']:.0f} MiB.")  # fmt: skip
    rows = ResultTable("corral bench memory", caption, report["checks"], digits=1)

    def add(label: str, value: str, spread: str = "-", base: str = "-", ratio: str = "-", metric: str = "") -> None:
        rows.table.add_row(label, value, spread, base, ratio, rows.target(metric) if metric else "-",
                           rows.verdict(metric) if metric else "-")  # fmt: skip

    def parts(growth: dict[str, float]) -> str:
        keys = ("resident_mib", "layer_files_cached_mib", "image_cached_mib")
        return " / ".join(f"{growth[key]:+,.1f}" for key in keys) + " MiB"

    def host_wide(growth: dict[str, float]) -> str:
        return f"{-growth['host_mib']:+,.0f} / {growth['cached_mib']:+,.0f} MiB"

    one, every, one_idle, all_idle = share["one"], share["all"], share["one_idle"], share["all_idle"]
    ratio = share["ratio_to_naive"]
    add(f"1 sandbox reads the {layer:.0f} MiB layer: ours", _mib(one["ours_mib"]),
        base=f"same sandbox idle: {_mib(one_idle['ours_mib'])}")  # fmt: skip
    add("  cgroups / layer files cached / image cached", parts(one), base=f"idle: {parts(one_idle)}")
    add(f"{count} sandboxes read it: ours", _mib(every["ours_mib"]),
        base=f"naive {count} × {layer:.0f} = {share['naive_mib']:,.0f} MiB",
        ratio=f"{ratio['ours_mib']:.4f}×")  # fmt: skip
    add("  cgroups / layer files cached / image cached", parts(every), base=f"all idle, unread: {parts(all_idle)}")
    if per_extra := share["per_extra_reader"]:
        idle_each = (all_idle["ours_mib"] - one["ours_mib"]) / (count - 1)
        add("  per extra sandbox: ours (cgroups / files / image)",
            f"{per_extra['ours_mib']:.2f} MiB ({parts(per_extra)})",
            base=f"idle, before reading: {idle_each:.2f} MiB", metric="per_extra_reader")  # fmt: skip
    add("  host-wide MemAvailable drop / Cached growth", f"1: {host_wide(one)}", f"{count}: {host_wide(every)}",
        "other tenants move these")  # fmt: skip
    add(f"{reclaim['sandboxes']} idle sandboxes holding {reclaim['held_mib']} MiB each: cgroups",
        f"{reclaim['resident_before_mib']:,.1f} MiB")  # fmt: skip
    add(f"  after pause(wait_reclaim) of all ({reclaim['pause_all_ms'] / 1000:.1f} s)",
        f"{reclaim['resident_after_mib']:,.1f} MiB")  # fmt: skip
    per_sandbox = reclaim["per_sandbox_fraction"]
    add("  memory reclaimed", f"{reclaim['reclaimed_mib']:,.1f} MiB ({reclaim['reclaimed_fraction']:.1%})",
        spread=f"per sandbox p50 {per_sandbox['p50']:.1%}, min {per_sandbox['min']:.1%}", base="freezer only: 0%",
        metric="reclaimed")  # fmt: skip
    add(
        "  swap growth / zram pool growth / MemAvailable change",
        " / ".join(_mib(reclaim[key]) for key in ("swap_growth_mib", "zram_growth_mib", "available_growth_mib")),
    )
    resumed, probe = reclaim["resumed"], reclaim["probe"]
    add(f"  bulk resume ({resumed['done']}/{resumed['matched']}), then one answers",
        f"{reclaim['resume_all_ms']:,.0f} ms",
        base=f"holds {probe['held_bytes']:,} bytes" + ("" if probe["ok"] else " (wrong)"))  # fmt: skip
    return rows.table


def run_memory_benchmark(*, count: int, layer_mib: int, as_json: bool, console: Console) -> None:
    """Measure host memory for sandboxes sharing a layer and what pausing idle ones reclaims; print a table."""
    if count < 2 or layer_mib < LAYER_FILES:
        raise InvalidRequest(f"--count must be at least 2 and --layer-mib at least {LAYER_FILES}")
    with bench_session("bench-memory", as_json=as_json, console=console) as (scratch, progress):
        results = _measure(scratch, count, layer_mib, progress)
    info = _meminfo_mib()
    report: dict[str, Any] = {
        "unit": "MiB, ms",
        "params": {"count": count, "layer_mib": layer_mib, "layer_files": LAYER_FILES, "base": BASE,
                   "held_mib": HELD_MIB, "reader_cpu": READER_CPU, "idle_cpu": IDLE_CPU,
                   "idle_memory_mb": IDLE_MEMORY_MB, "create_concurrency": CREATE_CONCURRENCY,
                   "read_concurrency": READ_CONCURRENCY, "pause_concurrency": PAUSE_CONCURRENCY},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count(), "mem_total_mib": info["MemTotal"],
                 "swap_total_mib": info["SwapTotal"]},
        **results,
    }  # fmt: skip
    report["checks"] = _checks(report)
    emit(report, _table, as_json=as_json, console=console)
