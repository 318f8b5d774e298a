"""`corral bench pull`: pulling images from an OCI registry, against a plain download of the same blobs.

A docker-registry on loopback (corral/bench/registry.py) holds two images of random (incompressible)
layers pushed with skopeo: ``app`` with 5 layers, and ``app2`` sharing app's first 3 layers plus 2 of its
own. Each run, in a fresh catalogue and store:

1. baseline: the 5 layer blobs of app downloaded with httpx and hashed (no unpacking), what any client must
   at least do;
2. a cold pull of app through the ImagePuller (download, verify, unpack each layer, mkfs.erofs, store);
3. a pull of app2 (3 layers are already here);
4. app again (everything here: its manifest and config only).

Bytes are the puller's own count of what it received (tests/integration/test_registry.py checks the same
against the registry's access log). The promises checked: a 5-layer pull receives its compressed size
once (the config and manifest on top), and app2 receives only its 2 other layers (and its config and
manifest).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from corral.bench.harness import bench_session, emit
from corral.bench.registry import Blob, Member, image_blobs, layer_tar, push, start_registry, write_layout
from corral.images.builders import LayerBuilder
from corral.images.catalogue import Catalogue
from corral.images.pull import ImagePuller, PullResult
from corral.images.registry import RegistryConfig
from corral.images.store import LayerStore
from corral.state.db import StateStore

__all__ = ["run_pull_benchmark"]

LAYERS = 5
SHARED = 3
FILES_PER_LAYER = 4
_MIB = 1 << 20


def _random_layer(size_mib: int, tag: str) -> bytes:
    """A gzip layer of ``FILES_PER_LAYER`` files of random bytes (incompressible, so compressed ≈ raw)."""
    per_file = size_mib * _MIB // FILES_PER_LAYER
    members: dict[str, Member] = {"data": None, f"data/{tag}": None}
    for index in range(FILES_PER_LAYER):
        members[f"data/{tag}/f{index}"] = os.urandom(per_file)
    return layer_tar(members)


def _images(layer_mib: int) -> tuple[list[Blob], list[Blob]]:
    layers = [_random_layer(layer_mib, f"app-{index}") for index in range(LAYERS)]
    own = [_random_layer(layer_mib, f"app2-{index}") for index in range(LAYERS - SHARED)]
    return image_blobs(layers, {"Env": ["A=1"]}), image_blobs([*layers[:SHARED], *own], {"Env": ["B=2"]})


async def _download(url: str, blobs: list[Blob]) -> int:
    """The baseline: GET each layer blob and hash it, nothing else."""
    received = 0
    async with httpx.AsyncClient(timeout=600) as client:
        for blob in blobs:
            hasher = hashlib.sha256()
            async with client.stream("GET", f"{url}/blobs/{blob.digest}") as response:
                response.raise_for_status()
                async for chunk in response.aiter_raw():
                    hasher.update(chunk)
                    received += len(chunk)
            if f"sha256:{hasher.hexdigest()}" != blob.digest:
                raise RuntimeError(f"baseline download of {blob.digest} hashed to another digest")
    return received


async def _one_run(directory: Path, address: str, app: list[Blob]) -> dict[str, Any]:
    store = StateStore(f"sqlite:///{directory / 'state.db'}")
    try:
        catalogue = Catalogue(store.engine, LayerStore(directory / "layers"))
        builder = LayerBuilder(catalogue, directory / "build", 1 << 34)
        puller = ImagePuller(catalogue, builder, RegistryConfig(insecure=frozenset({address})),
                             max_layer_bytes=1 << 34)  # fmt: skip
        sample: dict[str, Any] = {}
        started = time.perf_counter()
        sample["download_bytes"] = await _download(f"http://{address}/v2/bench/app", app[2:])
        sample["download_s"] = time.perf_counter() - started
        for name, ref in (("cold", "bench/app"), ("shared", "bench/app2"), ("warm", "bench/app")):
            started = time.perf_counter()
            result: PullResult = await puller.pull(f"{address}/{ref}:v1")
            sample[f"{name}_s"] = time.perf_counter() - started
            sample[f"{name}_bytes"] = result.bytes_transferred
            sample[f"{name}_reused"] = result.layers_reused
        return sample
    finally:
        store.close()


def run_pull_benchmark(*, runs: int, layer_mib: int, as_json: bool, console: Console) -> dict[str, Any]:
    with bench_session("bench-pull", as_json=as_json, console=console) as (scratch, progress):
        task = progress.add_task("building and pushing the images", total=runs + 1)
        registry = start_registry(scratch / "registry")
        try:
            app, app2 = _images(layer_mib)
            for name, blobs in (("bench/app", app), ("bench/app2", app2)):
                push(write_layout(scratch / name.replace("/", "-"), "v1", blobs), "v1", registry, name)
            progress.update(task, advance=1, description="pulling")
            samples = []
            for run in range(runs):
                directory = scratch / f"run{run}"
                directory.mkdir()
                samples.append(asyncio.run(_one_run(directory, registry.address, app)))
                progress.update(task, advance=1)
        finally:
            registry.stop()
    report = _report(samples, app, app2, layer_mib)
    emit(report, _table, as_json=as_json, console=console)
    return report


def _report(samples: list[dict[str, Any]], app: list[Blob], app2: list[Blob], layer_mib: int) -> dict[str, Any]:
    def median(key: str) -> float:
        return float(statistics.median(sample[key] for sample in samples))

    compressed = sum(len(blob.data) for blob in app[2:])
    # what a pull must receive on top of the layers: its manifest and config
    app_extra = len(app[0].data) + len(app[1].data)
    app2_needed = len(app2[0].data) + len(app2[1].data) + sum(len(blob.data) for blob in app2[2 + SHARED :])
    app_needed = compressed + app_extra
    checks = [
        {"metric": "5-layer pull bytes / (compressed layers + manifest + config)", "target": "= 1.00",
         "value": median("cold_bytes") / app_needed, "ok": median("cold_bytes") == app_needed},
        {"metric": "shared-base pull bytes / (2 other layers + manifest + config)", "target": "= 1.00",
         "value": median("shared_bytes") / app2_needed,
         "ok": median("shared_bytes") == app2_needed and median("shared_reused") == SHARED},
    ]  # fmt: skip
    return {
        "benchmark": "bench-pull",
        "runs": len(samples),
        "layers": LAYERS,
        "layer_mib": layer_mib,
        "compressed_bytes": compressed,
        "median_s": {key: median(f"{key}_s") for key in ("download", "cold", "shared", "warm")},
        "median_bytes": {key: median(f"{key}_bytes") for key in ("download", "cold", "shared", "warm")},
        "cold_over_download": median("cold_s") / median("download_s"),
        "checks": checks,
        "samples": samples,
    }


def _table(report: dict[str, Any]) -> Table:
    seconds, received = report["median_s"], report["median_bytes"]
    table = Table("what", "median s", "MB received", "vs plain download (same run)",
                  title=f"corral bench pull: {report['layers']} layers of {report['layer_mib']} MiB, "
                        f"{report['runs']} runs", caption="medians; bytes as the puller counted them")  # fmt: skip
    ratio = seconds["cold"] / seconds["download"]
    rows = (("plain download + sha256 of the 5 blobs", "download", "1.00×"),
            ("cold pull (download, verify, unpack, mkfs.erofs, store)", "cold", f"{ratio:.2f}×"),
            (f"pull of an image sharing {SHARED} of its layers", "shared", "-"),
            ("pull of the same image again", "warm", "-"))  # fmt: skip
    for label, key, versus in rows:
        table.add_row(label, f"{seconds[key]:.3f}", f"{received[key] / 1e6:.2f}", versus)
    for check in report["checks"]:
        verdict = "[green]ok[/green]" if check["ok"] else "[red]missed[/red]"
        table.add_row(check["metric"], "", f"{check['value']:.4f}", f"target {check['target']}: {verdict}")
    return table
