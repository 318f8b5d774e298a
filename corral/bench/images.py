"""`corral bench-images`: a node that has never seen an image, with layers on demand against the eager path.

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

import contextlib
import os
import platform
import random
import shlex
import shutil
import time
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
from corral.sdk import Client, InvalidRequest

__all__ = ["run_images_benchmark"]

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
    """``root/benchdata`` of files with log-uniform sizes adding up to ``total_mib``; their sizes by name."""
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


def _measure(work: Path, runs: int, warm_runs: int, data_mib: int, read_pct: float,
             progress: Progress) -> dict[str, Any]:  # fmt: skip
    task = progress.add_task(f"source server, a {data_mib} MiB data layer over {BASE}", total=1)
    with throwaway_postgres() as database_url:
        shared = {"CORRAL_DATABASE_URL": database_url}
        source = EmbeddedServer(work / "source", env={**shared,
                                "CORRAL_NODE_DIR": str(linked_node_dir(work / "source-node"))})  # fmt: skip
        source.start()
        try:
            with source.client() as client:
                sizes = _data_tree(work / "tree", data_mib, seed=1)
                client.images.build(DATA_IMAGE, "dir", path=str(work / "tree"), no_cache=True)
                shutil.rmtree(work / "tree")
                base_digests = list(client.images.inspect(BASE).layers)
                data_digest = client.images.inspect(DATA_IMAGE).layers[-1].digest
            store = LayerStore(work / "source-node" / "layers")
            digests = [layer.digest for layer in base_digests] + [data_digest]
            image_bytes = sum(store.layer_path(digest).stat().st_size for digest in dict.fromkeys(digests))
            for digest in dict.fromkeys(digests):  # indexes of layers made before them, as an import would have
                store.chunk_index(digest)
            progress.update(task, completed=1)
            shared.update({"CORRAL_LAYER_SOURCE_URL": source.url, "CORRAL_LAYER_SOURCE_KEY": source.api_key})
            samples = []
            task = progress.add_task("fresh nodes: eager, then on demand (cold, warm, 10% read)", total=runs)
            for run in range(runs):
                samples.append(_one_run(work, shared, run, sizes, image_bytes, digests, read_pct, warm_runs))
                progress.advance(task)
        finally:
            source.kill_all_sandboxes()
            source.shutdown()
            host.orphans.reap()
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
    rows = ResultTable("corral bench-images", caption, report["checks"], digits=2)
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
