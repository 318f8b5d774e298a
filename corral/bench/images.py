"""`corral bench images`: a node that has never seen an image, with layers on demand against the eager path.

A source server holds a large image: debian-12 plus a data layer of files
whose sizes run from 64 KiB to 8 MiB (random bytes, so nothing dedupes or
compresses). Each run starts two fresh nodes that share its PostgreSQL and
have empty layer stores, one with ``layer_fetch=on_demand`` and one with
``layer_fetch=eager`` (today's path: fetch the whole blob, verify it, mount),
and times on each:

1. cold create -> first exec (``true``): the node lacks every layer;
2. warm create -> first exec, once the node has the image mounted: the
   eager node's warm create is today's warm path, the baseline;
3. on the on-demand node, a task that reads random whole files adding up to
   ``--read-pct`` of the image's bytes: bytes fetched (the node's present
   chunks, counted from its own files) against bytes read.

Nodes start before the clock does; both kinds run in the same run against
the same warm source, so the ratios are what to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import random
import shlex
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit, ms_since, require_success, throwaway_postgres
from corral.embedded import EmbeddedServer, linked_node_dir
from corral.images.store import CHUNK_INDEX_BYTES, LayerStore
from corral.sdk import AsyncClient, AsyncSandbox, Client, InvalidRequest

__all__ = ["run_images_benchmark", "run_images_burst_benchmark"]

BASE = "debian-12"
DATA_IMAGE = "bench-images-data"
DATA_DIR = "/benchdata"
MIN_FILE_BYTES, MAX_FILE_BYTES = 64 << 10, 8 << 20
SANDBOX_CPU, SANDBOX_MEMORY_MB, SANDBOX_TTL_S = 0.5, 256, 600.0
COLD_TARGET_S, COLD_RATIO_TARGET = 1.0, 0.2
FETCH_TARGET = 0.15
WARM_RATIO_TARGET = 1.05
_MIB = 1 << 20


def _data_tree(root: Path, total_mib: int, seed: int) -> dict[str, int]:
    """``root/benchdata`` of random files with log-uniform sizes (64 KiB to 8 MiB) adding up to ``total_mib``;
    their sizes by name."""
    rng = random.Random(seed)
    tree = root / DATA_DIR.lstrip("/")
    tree.mkdir(parents=True)
    sizes: dict[str, int] = {}
    left = total_mib * _MIB
    while left > 0:
        size = min(left, int(MIN_FILE_BYTES * (MAX_FILE_BYTES / MIN_FILE_BYTES) ** rng.random()))
        name = f"d{len(sizes) // 100:02d}/f{len(sizes):05d}"
        (tree / name).parent.mkdir(exist_ok=True)
        (tree / name).write_bytes(os.urandom(size))
        sizes[name] = size
        left -= size
    return sizes


def _fetched_bytes(node_dir: Path, digests: list[str]) -> int:
    """What the node has of these layers: whole files in its store, present chunks of partial ones."""
    store_root = node_dir / "layers"
    fetched = 0
    for digest in digests:
        hex_digest = digest.removeprefix("sha256:")
        whole = store_root / "layers" / f"{hex_digest}.erofs"
        present = store_root / "partial" / f"{hex_digest}.present"
        if whole.exists():
            fetched += whole.stat().st_size
        elif present.exists():
            fetched += present.read_bytes().count(1) * CHUNK_INDEX_BYTES
    return fetched


def _create(client: Client) -> Any:  # noqa: ANN401 - a Sandbox
    return client.create(environment={"base": BASE, "tools": DATA_IMAGE}, cpu=SANDBOX_CPU,
                         memory_mb=SANDBOX_MEMORY_MB, ttl_s=SANDBOX_TTL_S)  # fmt: skip


def _create_exec_ms(client: Client) -> tuple[float, Any]:
    started = time.perf_counter()
    sandbox = _create(client)
    require_success(sandbox.exec("true"), "true")
    return ms_since(started), sandbox


@contextlib.contextmanager
def _node(work: Path, name: str, env: dict[str, str]) -> Any:  # noqa: ANN401 - yields an EmbeddedServer
    """A node with an empty layer store (its compiled helpers linked from the real node dir)."""
    node_dir = linked_node_dir(work / f"{name}-node", parts=("bin",))
    server = EmbeddedServer(work / name, env={**env, "CORRAL_NODE_DIR": str(node_dir)})
    server.start()
    try:
        yield server, node_dir
    finally:
        server.kill_all_sandboxes()
        server.shutdown()
        shutil.rmtree(work / f"{name}-node", ignore_errors=True)
        shutil.rmtree(work / name, ignore_errors=True)
        host.orphans.reap()


def _one_run(work: Path, shared: dict[str, str], run: int, sizes: dict[str, int], image_bytes: int,
             digests: list[str], read_pct: float, warm_runs: int) -> dict[str, Any]:  # fmt: skip
    """Both nodes up first; cold creates (which kind goes first alternates by run), then warm creates taken in
    turns, so the two kinds see the same machine; then the read task on the on-demand node."""
    modes = ("eager", "on_demand") if run % 2 == 0 else ("on_demand", "eager")
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        nodes = {mode: stack.enter_context(_node(work, f"{mode}-{run}", {**shared, "CORRAL_EDGE_ID": f"r{run}{mode[0]}",
                                                                         "CORRAL_LAYER_FETCH": mode}))
                 for mode in modes}  # fmt: skip
        clients = {mode: stack.enter_context(server.client()) for mode, (server, _) in nodes.items()}
        first = {}
        for mode in modes:
            cold_ms, first[mode] = _create_exec_ms(clients[mode])
            out[mode] = {"cold_ms": cold_ms, "warm_ms": [], "after_cold_bytes": _fetched_bytes(nodes[mode][1], digests)}
        for _ in range(warm_runs):
            for mode in modes:
                ms, sandbox = _create_exec_ms(clients[mode])
                out[mode]["warm_ms"].append(ms)
                sandbox.kill()
        out["on_demand"]["task"] = _read_task(first["on_demand"], nodes["on_demand"][1], sizes, image_bytes, digests,
                                              read_pct, run)  # fmt: skip
    return out


def _read_task(sandbox: Any, node_dir: Path, sizes: dict[str, int], image_bytes: int, digests: list[str],  # noqa: ANN401
               read_pct: float, run: int) -> dict[str, Any]:  # fmt: skip
    """Read random whole files adding up to ``read_pct`` of the image; what the node fetched for it."""
    names = list(sizes)
    random.Random(run).shuffle(names)
    chosen, read_bytes = [], 0
    for name in names:
        if read_bytes >= image_bytes * read_pct / 100:
            break
        chosen.append(name)
        read_bytes += sizes[name]
    before = _fetched_bytes(node_dir, digests)
    started = time.perf_counter()
    paths = " ".join(shlex.quote(f"{DATA_DIR}/{name}") for name in chosen)
    require_success(sandbox.exec(f"cat {paths} > /dev/null", timeout_s=600), "cat the chosen files")
    fetched_total = _fetched_bytes(node_dir, digests)
    return {"files": len(chosen), "read_bytes": read_bytes, "ms": ms_since(started),
            "fetched_for_task_bytes": fetched_total - before, "fetched_total_bytes": fetched_total,
            "read_fraction": read_bytes / image_bytes, "fetched_fraction": fetched_total / image_bytes}  # fmt: skip


@contextlib.contextmanager
def _source(work: Path, env: dict[str, str] | None = None) -> Iterator[tuple[EmbeddedServer, dict[str, str]]]:
    """The source server (a store of the real node's layers, linked) on the run's PostgreSQL; yields it and the
    settings a fresh node needs to share its catalogue (``env`` and the database)."""
    with throwaway_postgres() as database_url:
        shared = {**(env or {}), "CORRAL_DATABASE_URL": database_url}
        source = EmbeddedServer(work / "source", env={**shared,
                                "CORRAL_NODE_DIR": str(linked_node_dir(work / "source-node"))})  # fmt: skip
        source.start()
        try:
            yield source, shared
        finally:
            source.kill_all_sandboxes()
            source.shutdown()
            host.orphans.reap()


def _build_data_image(client: Client, work: Path, name: str, data_mib: int, seed: int) -> tuple[dict[str, int], str]:
    """A ``dir`` image of a fresh random data tree; the files' sizes and the layer's digest."""
    tree = work / f"tree-{name}"
    sizes = _data_tree(tree, data_mib, seed=seed)
    client.images.build(name, "dir", path=str(tree), no_cache=True)
    shutil.rmtree(tree)
    return sizes, client.images.inspect(name).layers[-1].digest


def _indexed_bytes(work: Path, digests: list[str]) -> int:
    """The layers' total size in the source's store, each with its chunk index made (as an import would have
    made it for a layer older than indexes)."""
    store = LayerStore(work / "source-node" / "layers")
    for digest in dict.fromkeys(digests):
        store.chunk_index(digest)
    return sum(store.layer_path(digest).stat().st_size for digest in dict.fromkeys(digests))


def _measure(work: Path, runs: int, warm_runs: int, data_mib: int, read_pct: float,
             progress: Progress) -> dict[str, Any]:  # fmt: skip
    task = progress.add_task(f"source server, a {data_mib} MiB data layer over {BASE}", total=1)
    with _source(work) as (source, shared):
        with source.client() as client:
            sizes, data_digest = _build_data_image(client, work, DATA_IMAGE, data_mib, seed=1)
            digests = [layer.digest for layer in client.images.inspect(BASE).layers] + [data_digest]
        image_bytes = _indexed_bytes(work, digests)
        progress.update(task, completed=1)
        shared.update({"CORRAL_LAYER_SOURCE_URL": source.url, "CORRAL_LAYER_SOURCE_KEY": source.api_key})
        samples = []
        task = progress.add_task("fresh nodes: eager, then on demand (cold, warm, 10% read)", total=runs)
        for run in range(runs):
            samples.append(_one_run(work, shared, run, sizes, image_bytes, digests, read_pct, warm_runs))
            progress.advance(task)
    return {"image_bytes": image_bytes, "layers": len(set(digests)), "data_files": len(sizes),
            **_summaries(samples)}  # fmt: skip


def _summaries(samples: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("eager", "on_demand"):
        out[mode] = {
            "cold_ms": summarize([s[mode]["cold_ms"] for s in samples]),
            "warm_ms": summarize([ms for s in samples for ms in s[mode]["warm_ms"]]),
            "after_cold_bytes": summarize([s[mode]["after_cold_bytes"] for s in samples]),
        }
    tasks = [s["on_demand"]["task"] for s in samples]
    out["task"] = {key: summarize([t[key] for t in tasks]) for key in tasks[0]}
    return out


def _checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    lazy, eager, task = report["on_demand"], report["eager"], report["task"]
    cold_s = lazy["cold_ms"]["p50"] / 1000
    cold_ratio = lazy["cold_ms"]["p50"] / eager["cold_ms"]["p50"]
    warm_ratio = lazy["warm_ms"]["p50"] / eager["warm_ms"]["p50"]
    fetched = task["fetched_fraction"]["p50"]
    return [
        {"metric": "cold", "target": f"≤ {COLD_TARGET_S:g} s", "value": cold_s, "ok": cold_s <= COLD_TARGET_S},
        {"metric": "cold_ratio", "target": f"≤ {COLD_RATIO_TARGET:g}× eager", "value": cold_ratio,
         "ok": cold_ratio <= COLD_RATIO_TARGET},
        {"metric": "fetched", "target": f"≤ {FETCH_TARGET:.0%} fetched", "value": fetched,
         "ok": fetched <= FETCH_TARGET},
        {"metric": "warm", "target": f"≤ {WARM_RATIO_TARGET:g}× today's warm", "value": warm_ratio,
         "ok": warm_ratio <= WARM_RATIO_TARGET},
    ]  # fmt: skip


def _table(report: dict[str, Any]) -> Table:
    lazy, eager, task, params = report["on_demand"], report["eager"], report["task"], report["params"]
    caption = (f"{params['runs']} fresh nodes of each kind; image {report['image_bytes'] / _MIB:.0f} MiB in "
               f"{report['layers']} layers ({report['data_files']} data files); chunks of "
               f"{params['chunk_bytes'] // 1024} KiB. Kernel {report['host']['kernel']}, "
               f"{report['host']['cpu_count']} cpus.")  # fmt: skip
    rows = ResultTable("corral bench images", caption, report["checks"], digits=2)
    table, timing = rows.table, rows.timing
    timing("cold create → first exec, on demand", lazy["cold_ms"], "eager", eager["cold_ms"], "cold_ratio")
    table.add_row("  (same, in seconds)", f"{lazy['cold_ms']['p50'] / 1000:.2f} s", "-", "-", "-",
                  rows.target("cold"), rows.verdict("cold"))  # fmt: skip
    timing("warm create → first exec, on demand", lazy["warm_ms"], "eager (today's warm)", eager["warm_ms"], "warm")
    table.add_row(f"task reads {task['read_fraction']['p50']:.1%} of the image ({task['files']['p50']:.0f} files)",
                  f"{task['fetched_fraction']['p50']:.1%} fetched", f"max {task['fetched_fraction']['max']:.1%}",
                  f"read {task['read_bytes']['p50'] / _MIB:.0f} MiB",
                  f"{task['fetched_total_bytes']['p50'] / task['read_bytes']['p50']:.2f}× read",
                  rows.target("fetched"), rows.verdict("fetched"))  # fmt: skip
    table.add_row("  fetched by the cold create alone", f"{lazy['after_cold_bytes']['p50'] / _MIB:.1f} MiB", "-",
                  f"eager: {eager['after_cold_bytes']['p50'] / _MIB:.0f} MiB", "-", "-", "-")  # fmt: skip
    return table


def run_images_benchmark(*, runs: int, warm_runs: int, data_mib: int, read_pct: float, as_json: bool,
                         console: Console) -> None:  # fmt: skip
    """Cold and warm creates on fresh nodes, on demand against eager, and bytes fetched for a partial read."""
    if runs < 1 or warm_runs < 1 or data_mib < 1 or not 0 < read_pct < 100:
        raise InvalidRequest("--runs and --warm-runs must be ≥ 1, --data-mib ≥ 1, --read-pct between 0 and 100")
    with bench_session("bench-images", as_json=as_json, console=console) as (scratch, progress):
        results = _measure(scratch, runs, warm_runs, data_mib, read_pct, progress)
    report: dict[str, Any] = {
        "unit": "ms",
        "params": {"runs": runs, "warm_runs": warm_runs, "data_mib": data_mib, "read_pct": read_pct,
                   "base": BASE, "chunk_bytes": CHUNK_INDEX_BYTES},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count()},
        **results,
    }  # fmt: skip
    report["checks"] = _checks(report)
    emit(report, _table, as_json=as_json, console=console)


# -- a burst of cold images ---------------------------------------------------------------------------------------

BURST_IMAGE = "bench-burst-{index:02d}"
BURST_CPU, BURST_MEMORY_MB = 0.1, 128
BURST_RATIO_TARGET = 1.2
BURST_NODE_LOST_AFTER_S = 120
BURST_SETTLE_S = 10.0


@dataclass(frozen=True)
class _BurstSandbox:
    image: str
    files: list[str]  # what it reads, a slice of its image's data files no other sandbox reads
    read_bytes: int


@dataclass
class _BurstResult:
    create_exec_ms: list[float] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    read_failed: int = 0
    wall_s: float = 0.0
    fetched_by_starts: int = 0  # the node's fetched bytes once every sandbox started, before any read


def _burst_plan(sizes: list[dict[str, int]], sandboxes: int, read_pct: float) -> list[_BurstSandbox]:
    """Sandbox ``n`` on image ``n % images``; an image's sandboxes together read random whole files adding up to
    ``read_pct`` of its data, each a disjoint slice of them (so bytes read are distinct bytes)."""
    per_image = [len(range(index, sandboxes, len(sizes))) for index in range(len(sizes))]
    slices = []
    for index, image_sizes in enumerate(sizes):
        names = list(image_sizes)
        random.Random(index).shuffle(names)
        chosen, total = [], 0
        for name in names:
            if total >= sum(image_sizes.values()) * read_pct / 100:
                break
            chosen.append(name)
            total += image_sizes[name]
        slices.append([chosen[k :: per_image[index]] for k in range(per_image[index])])
    plan = []
    for n in range(sandboxes):
        index = n % len(sizes)
        files = slices[index][n // len(sizes)]
        plan.append(_BurstSandbox(BURST_IMAGE.format(index=index), files, sum(sizes[index][f] for f in files)))
    return plan


async def _start_one(client: AsyncClient, image: str) -> tuple[AsyncSandbox, float]:
    started = time.perf_counter()
    sandbox = await client.create(environment={"base": BASE, "tools": image}, cpu=BURST_CPU,
                                  memory_mb=BURST_MEMORY_MB, ttl_s=SANDBOX_TTL_S)  # fmt: skip
    result = await sandbox.exec("true")
    if result.exit_code != 0:
        raise RuntimeError(f"`true` exited {result.exit_code} in {sandbox.id}: {result.stderr[-300:]}")
    return sandbox, ms_since(started)


async def _burst(server: EmbeddedServer, plan: list[_BurstSandbox], fetched: Callable[[], int], *,
                 read: bool) -> _BurstResult:  # fmt: skip
    """Every sandbox of the plan created at once, timed to its first exec; then (``read``) every one reads its
    files at once; then all are killed. ``fetched``: the node's fetched bytes, read once all have started."""
    out = _BurstResult()
    started = time.perf_counter()
    async with AsyncClient(server.url, server.api_key, timeout_s=SANDBOX_TTL_S) as client:
        starts = await asyncio.gather(*(_start_one(client, entry.image) for entry in plan), return_exceptions=True)
        out.wall_s = time.perf_counter() - started
        running = []
        for entry, start in zip(plan, starts, strict=True):
            if isinstance(start, BaseException):
                out.failed.append(f"{entry.image}: {start!r}"[:300])
            else:
                running.append((entry, start[0]))
                out.create_exec_ms.append(start[1])
        out.fetched_by_starts = fetched()
        try:
            if read:
                reads = await asyncio.gather(*(sandbox.exec(
                    "cat " + " ".join(shlex.quote(f"{DATA_DIR}/{name}") for name in entry.files) + " > /dev/null",
                    timeout_s=SANDBOX_TTL_S) for entry, sandbox in running if entry.files))  # fmt: skip
                out.read_failed = sum(result.exit_code != 0 for result in reads)
        finally:
            await asyncio.gather(*(sandbox.kill() for _, sandbox in running), return_exceptions=True)
    return out


def _burst_summary(result: _BurstResult, count: int) -> dict[str, Any]:
    return {"sandboxes": count, "started": len(result.create_exec_ms), "failed": result.failed[:5],
            "read_failed": result.read_failed, "wall_s": result.wall_s,
            "create_exec_ms": summarize(result.create_exec_ms) if result.create_exec_ms else None}  # fmt: skip


def _measure_burst(work: Path, images: int, sandboxes: int, image_mib: int, read_pct: float, eager_images: int,
                   progress: Progress) -> dict[str, Any]:  # fmt: skip
    task = progress.add_task(f"source server: {images} images, {image_mib} MiB of data each over {BASE}", total=images)
    # A node's heartbeat went 15 s stale (the default CORRAL_NODE_LOST_AFTER_S) while it killed one burst of 100
    # and started the next on this shared 2-core machine, and the source then marked it lost with its sandboxes.
    with _source(work, {"CORRAL_NODE_LOST_AFTER_S": str(BURST_NODE_LOST_AFTER_S)}) as (source, shared):
        sizes, data_digests = [], []
        with source.client() as client:
            for index in range(images):
                image_sizes, digest = _build_data_image(client, work, BURST_IMAGE.format(index=index), image_mib,
                                                        seed=1000 + index)  # fmt: skip
                sizes.append(image_sizes)
                data_digests.append(digest)
                progress.advance(task)
            base_digests = [layer.digest for layer in client.images.inspect(BASE).layers]
        digests = base_digests + data_digests
        image_bytes = _indexed_bytes(work, digests)
        plan = _burst_plan(sizes, sandboxes, read_pct)
        shared.update({"CORRAL_LAYER_SOURCE_URL": source.url, "CORRAL_LAYER_SOURCE_KEY": source.api_key})
        task = progress.add_task(f"a fresh node: {sandboxes} cold sandboxes at once, reads, then a warm burst",
                                 total=2)  # fmt: skip
        with _node(work, "burst", {**shared, "CORRAL_EDGE_ID": "bo", "CORRAL_LAYER_FETCH": "on_demand"}) as (
                server, node_dir):  # fmt: skip
            cold = asyncio.run(_burst(server, plan, lambda: _fetched_bytes(node_dir, digests), read=True))
            after_reads = _fetched_bytes(node_dir, digests)
            data_fetched = _fetched_bytes(node_dir, data_digests)
            progress.advance(task)
            # The baseline: the same burst again on the same node, now warm (its layers mounted, chunks here),
            # once the node has settled after tearing the first one down.
            time.sleep(BURST_SETTLE_S)
            warm = asyncio.run(_burst(server, plan, lambda: _fetched_bytes(node_dir, digests), read=False))
            progress.advance(task)
        subset = [entry for entry in plan if entry.image in {BURST_IMAGE.format(index=i) for i in range(eager_images)}]
        eager, eager_fetched = _BurstResult(), 0
        if subset:
            task = progress.add_task(f"a fresh eager node: {len(subset)} sandboxes of {eager_images} images", total=1)
            with _node(work, "burst-eager", {**shared, "CORRAL_EDGE_ID": "be", "CORRAL_LAYER_FETCH": "eager"}) as (
                    server, node_dir):  # fmt: skip
                eager = asyncio.run(_burst(server, subset, lambda: 0, read=False))
                eager_fetched = _fetched_bytes(node_dir, base_digests + data_digests[:eager_images])
                progress.advance(task)
    read_bytes = sum(entry.read_bytes for entry in plan)
    return {
        "image_bytes": image_bytes, "data_bytes": sum(sum(s.values()) for s in sizes),
        "data_files": sum(len(s) for s in sizes), "layers": len(set(digests)),
        "cold": _burst_summary(cold, len(plan)), "warm": _burst_summary(warm, len(plan)),
        "eager": {**_burst_summary(eager, len(subset)), "images": eager_images, "fetched_bytes": eager_fetched},
        "bytes": {"read": read_bytes, "fetched_by_starts": cold.fetched_by_starts, "fetched": after_reads,
                  "fetched_data_layers": data_fetched, "fetched_base_layers": after_reads - data_fetched,
                  "ratio": after_reads / read_bytes},
    }  # fmt: skip


def _burst_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    cold, ratio = report["cold"], report["bytes"]["ratio"]
    all_started = cold["started"] == cold["sandboxes"] and cold["read_failed"] == 0
    return [
        {"metric": "started", "target": f"all {cold['sandboxes']} start and read", "value": cold["started"],
         "ok": all_started},
        {"metric": "ratio", "target": f"≤ {BURST_RATIO_TARGET:g}× read", "value": ratio,
         "ok": ratio <= BURST_RATIO_TARGET},
    ]  # fmt: skip


def _burst_table(report: dict[str, Any]) -> Table:
    cold, warm, eager, data, params = report["cold"], report["warm"], report["eager"], report["bytes"], report["params"]
    caption = (f"{params['images']} images of {params['image_mib']} MiB of random files over {BASE} "
               f"({report['image_bytes'] / _MIB:.0f} MiB in {report['layers']} layers, {report['data_files']} data "
               f"files); each image's sandboxes read {params['read_pct']:g}% of its data, in disjoint slices; chunks "
               f"of {params['chunk_bytes'] // 1024} KiB. Kernel {report['host']['kernel']}, "
               f"{report['host']['cpu_count']} cpus.")  # fmt: skip
    rows = ResultTable("corral bench images-burst", caption, report["checks"], digits=0)
    table = rows.table
    rows.timing(f"{cold['sandboxes']} cold sandboxes at once: create → first exec", cold["create_exec_ms"],
                "the same burst warm", warm["create_exec_ms"])  # fmt: skip
    table.add_row("  started (and read their files)", f"{cold['started']} of {cold['sandboxes']}",
                  f"read failed: {cold['read_failed']}", f"warm: {warm['started']}", f"{cold['wall_s']:.1f} s wall",
                  rows.target("started"), rows.verdict("started"))  # fmt: skip
    table.add_row("bytes fetched / bytes the tasks read", f"{data['ratio']:.2f}×",
                  f"{data['fetched'] / _MIB:.0f} of {data['read'] / _MIB:.0f} MiB",
                  f"data layers {data['fetched_data_layers'] / data['read']:.2f}×",
                  f"base {data['fetched_base_layers'] / _MIB:.1f} MiB", rows.target("ratio"),
                  rows.verdict("ratio"))  # fmt: skip
    table.add_row("  fetched by the starts alone", f"{data['fetched_by_starts'] / _MIB:.1f} MiB", "-", "-", "-", "-",
                  "-")  # fmt: skip
    if eager["create_exec_ms"] is not None:
        table.add_row(f"eager node: {eager['sandboxes']} cold sandboxes of {eager['images']} images at once",
                      f"{eager['create_exec_ms']['p50']:.0f} ms", f"{eager['create_exec_ms']['p95']:.0f} ms",
                      f"fetched {eager['fetched_bytes'] / _MIB:.0f} MiB", "-", "-", "-")  # fmt: skip
    return table


def run_images_burst_benchmark(*, images: int, sandboxes: int, image_mib: int, read_pct: float, eager_images: int,
                               as_json: bool, console: Console) -> None:  # fmt: skip
    """Many cold images at once on a fresh node: all start, and what it fetches against what its tasks read."""
    if not 1 <= images <= sandboxes or image_mib < 1 or not 0 < read_pct <= 100 or not 0 <= eager_images <= images:
        raise InvalidRequest("need 1 ≤ --images ≤ --sandboxes, --image-mib ≥ 1, --read-pct in (0, 100] and "
                             "--eager-images between 0 and --images")  # fmt: skip
    with bench_session("bench-images-burst", as_json=as_json, console=console) as (scratch, progress):
        results = _measure_burst(scratch, images, sandboxes, image_mib, read_pct, eager_images, progress)
    report: dict[str, Any] = {
        "unit": "ms",
        "params": {"images": images, "sandboxes": sandboxes, "image_mib": image_mib, "read_pct": read_pct,
                   "eager_images": eager_images, "base": BASE, "chunk_bytes": CHUNK_INDEX_BYTES},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count()},
        **results,
    }  # fmt: skip
    report["checks"] = _burst_checks(report)
    emit(report, _burst_table, as_json=as_json, console=console)
