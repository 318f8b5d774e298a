"""`corral bench NAME`: every benchmark, each against a baseline measured in the same run (docs/spec.md).

Each command imports its benchmark only when run: the benchmarks are not part of the server, and
loading them would slow every other `corral` command.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console

__all__ = ["bench_app"]

bench_app = typer.Typer(
    help="Benchmarks: each prints a table (or --json) with ratios to a same-run baseline.", no_args_is_help=True
)
console = Console()


@bench_app.command("containers")
def bench_containers(
    runs: Annotated[int, typer.Option(help="Samples per measurement.")] = 30,
    concurrency: Annotated[int, typer.Option(help="Sandboxes created at once in the burst test.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure create-to-first-exec and exec round trip against plain crun in the same run."""
    from corral.bench.containers import run_benchmark

    run_benchmark(runs=runs, concurrency=concurrency, as_json=as_json, console=console)


@bench_app.command("warm-pool")
def bench_warm_pool(
    runs: Annotated[int, typer.Option(help="Samples of create → first exec, pooled and cold each.")] = 30,
    batch: Annotated[
        int | None,
        typer.Option(
            help="Sandboxes per batch (cold, then from the pool); 0: none. Default: 1000, none for VMs."
        ),  # fmt: skip
    ] = None,
    backend: Annotated[str, typer.Option(help="container, microvm or vm.")] = "container",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure creates claimed from a warm pool against cold creates: create-to-first-exec and a batch's rate."""
    from corral.bench.warm_pool import run_warm_pool_benchmark

    if backend not in ("container", "microvm", "vm"):
        raise typer.BadParameter("container, microvm or vm", param_hint="--backend")
    if batch is None:
        batch = 1000 if backend == "container" else 0
    run_warm_pool_benchmark(runs=runs, batch=batch, backend=backend, as_json=as_json, console=console)


@bench_app.command("restart")
def bench_restart(
    sandboxes: Annotated[int, typer.Option(help="Sandboxes each server re-adopts at every restart.")] = 100,
    runs: Annotated[int, typer.Option(help="Restarts of each server, with and without sandboxes.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure how long a server takes to come back with sandboxes to re-adopt, one at a time and concurrently."""
    from corral.bench.restart import run_restart_benchmark

    run_restart_benchmark(sandboxes=sandboxes, runs=runs, as_json=as_json, console=console)


@bench_app.command("layers")
def bench_layers(
    runs: Annotated[int, typer.Option(help="Samples per timing.")] = 20,
    sandboxes: Annotated[int, typer.Option(help="Sandboxes sharing one layer in the page-cache test.")] = 8,
    with_debootstrap: Annotated[
        bool, typer.Option("--with-debootstrap", help="Also time a debootstrap build of the default base (~40 s).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure layer composition, cold vs warm creates and page-cache sharing against same-run baselines."""
    from corral.bench.layers import run_layers_benchmark

    run_layers_benchmark(
        runs=runs, sandboxes=sandboxes, as_json=as_json, console=console, with_debootstrap=with_debootstrap
    )


@bench_app.command("images")
def bench_images(
    runs: Annotated[int, typer.Option(help="Fresh nodes of each kind (on demand, eager).")] = 3,
    warm_runs: Annotated[int, typer.Option(help="Warm creates per node.")] = 5,
    data_mib: Annotated[int, typer.Option(help="Size of the data layer over debian-12.")] = 512,
    read_pct: Annotated[float, typer.Option(help="Share of the image's bytes the task reads (%).")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure cold and warm creates on nodes that never saw the image, layers on demand against eager."""
    from corral.bench.images import run_images_benchmark

    run_images_benchmark(runs=runs, warm_runs=warm_runs, data_mib=data_mib, read_pct=read_pct, as_json=as_json,
                         console=console)  # fmt: skip


@bench_app.command("images-burst")
def bench_images_burst(
    images: Annotated[int, typer.Option(help="Distinct cold images (each its own data layer over debian-12).")] = 20,
    sandboxes: Annotated[int, typer.Option(help="Sandboxes started at once across them.")] = 100,
    image_mib: Annotated[int, typer.Option(help="Size of each image's data layer.")] = 24,
    read_pct: Annotated[float, typer.Option(help="Share of each image's data its sandboxes read (%).")] = 50.0,
    eager_images: Annotated[int, typer.Option(help="Images of the eager baseline (a fresh eager node).")] = 2,
    quick: Annotated[bool, typer.Option(help="4 images, 20 sandboxes, 8 MiB each: a short check.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Start many sandboxes of many cold images at once on a fresh node: all start, bytes fetched against read."""
    from corral.bench.images import run_images_burst_benchmark

    if quick:
        images, sandboxes, image_mib, eager_images = 4, 20, 8, 1
    run_images_burst_benchmark(images=images, sandboxes=sandboxes, image_mib=image_mib, read_pct=read_pct,
                               eager_images=eager_images, as_json=as_json, console=console)  # fmt: skip


@bench_app.command("pull")
def bench_pull(
    runs: Annotated[int, typer.Option(help="Runs, each in a fresh store.")] = 3,
    layer_mib: Annotated[int, typer.Option(help="Size of each of the 5 layers (random bytes).")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Pull from a local OCI registry (docker-registry): cold, shared-base and warm pulls against a plain download."""
    from corral.bench.pull import run_pull_benchmark

    run_pull_benchmark(runs=runs, layer_mib=layer_mib, as_json=as_json, console=console)


@bench_app.command("lifecycle")
def bench_lifecycle(
    runs: Annotated[int, typer.Option(help="Samples per timing.")] = 10,
    stepping: Annotated[int, typer.Option(help="Sandboxes taking steps at once (one trajectory each).")] = 16,
    postgres: Annotated[
        bool, typer.Option("--postgres", help="State in a throwaway PostgreSQL (scripts/postgres.sh), not SQLite.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure pause/resume, fork and step replay against same-run baselines."""
    from corral.bench.lifecycle import run_lifecycle_benchmark

    run_lifecycle_benchmark(runs=runs, stepping=stepping, postgres=postgres, as_json=as_json, console=console)


@bench_app.command("qos")
def bench_qos(
    rounds: Annotated[int, typer.Option(help="Rounds of idle / QoS on / QoS off, interleaved.")] = 6,
    samples: Annotated[int, typer.Option(help="Execs of each kind per phase per round.")] = 25,
    batch: Annotated[
        int | None, typer.Option(help="Batch sandboxes with a busy loop each; default 2 per core.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure a latency sandbox's exec latency idle and with busy batch sandboxes, with QoS on and off."""
    from corral.bench.qos import run_qos_benchmark

    run_qos_benchmark(rounds=rounds, samples=samples, batch=batch, as_json=as_json, console=console)


@bench_app.command("control-plane")
def bench_control_plane(
    nodes: Annotated[str, typer.Option(help="Node counts to measure sustained creates on, comma-separated.")] = (
        "10,40,160"
    ),
    creates: Annotated[int, typer.Option(help="Single creates per node count (sustained rate).")] = 20_000,
    burst: Annotated[int, typer.Option(help="Sandboxes in the one-batch burst (on the largest node count).")] = 32_000,
    live: Annotated[int, typer.Option(help="Live sandboxes to track for get/list latency.")] = 400_000,
    postgres: Annotated[
        bool, typer.Option("--postgres", help="State in a throwaway PostgreSQL (scripts/postgres.sh), not SQLite.")
    ] = False,
    http: Annotated[bool, typer.Option(help="Also send the burst through the HTTP API and the SDK.")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure the control plane alone (service, scheduler, state store, edges) against simulated nodes."""
    from corral.bench.control_plane import run_control_plane_benchmark

    counts = [int(item) for item in nodes.split(",") if item.strip()]
    run_control_plane_benchmark(nodes=counts, creates=creates, burst=burst, live=live, postgres=postgres, http=http,
                                as_json=as_json, console=console)  # fmt: skip


@bench_app.command("vm")
def bench_vm(
    runs: Annotated[int, typer.Option(help="Samples per boot, fork and pause timing (vm: half, min 2).")] = 5,
    idle: Annotated[int, typer.Option(help="Idle microVMs whose host memory is measured.")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure microvm and vm boot, exec, fork, pause/resume and idle memory against same-run baselines."""
    from corral.bench.vm import run_vm_benchmark

    run_vm_benchmark(runs=runs, idle=idle, as_json=as_json, console=console)


@bench_app.command("guard")
def bench_guard(
    runs: Annotated[int, typer.Option(help="One-second loops per side.")] = 6,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure what logging refused syscalls and watching sensitive paths cost, against same-run baselines."""
    from corral.bench.guard import run_guard_benchmark

    run_guard_benchmark(runs=runs, as_json=as_json, console=console)


@bench_app.command("cluster")
def bench_cluster(
    nodes: Annotated[int, typer.Option(min=1, help="Nodes (raylets with an edge each) in the cluster.")] = 3,
    count: Annotated[int, typer.Option(min=1, help="Sandboxes per burst.")] = 60,
    rounds: Annotated[int, typer.Option(min=1, help="Alternating rounds of cluster and embedded node.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure a real N-node Ray cluster on this machine (burst creates, create, exec) against one embedded node."""
    from corral.bench.cluster import run_cluster_benchmark

    run_cluster_benchmark(nodes=nodes, count=count, rounds=rounds, as_json=as_json, console=console)


@bench_app.command("partition")
def bench_partition(
    cut_s: Annotated[float, typer.Option(min=10, max=45, help="How long each cut lasts (seconds).")] = 30.0,
    rounds: Annotated[int, typer.Option(min=1, help="Cuts (both nodes at once each time).")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure a cluster node's network cut (lost, heard again, placed on again) with the database's TCP timeouts
    against without, same run."""
    from corral.bench.partition import run_partition_benchmark

    run_partition_benchmark(cut_s=cut_s, rounds=rounds, as_json=as_json, console=console)


@bench_app.command("gvisor")
def bench_gvisor(
    runs: Annotated[int, typer.Option(help="Runs; each creates one sandbox per runtime and snapshots once.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure gVisor (runsc) create and exec against crun in the same run, and its checkpoint, rewind and fork."""
    from corral.bench.gvisor import run_gvisor_benchmark

    run_gvisor_benchmark(runs=runs, as_json=as_json, console=console)


@bench_app.command("fncall")
def bench_fncall(
    runs: Annotated[int, typer.Option(help="Sequential calls timed; throughput passes make 5× as many.")] = 200,
    clients: Annotated[int, typer.Option(help="Concurrent callers in the throughput test.")] = 16,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure fncall round trip, throughput and cold-pool start against same-run baselines."""
    from corral.bench.fncall import run_fncall_benchmark

    run_fncall_benchmark(runs=runs, clients=clients, as_json=as_json, console=console)


@bench_app.command("load")
def bench_load(
    sandboxes: Annotated[int, typer.Option(help="Sandboxes the execs are spread over.")] = 200,
    execs: Annotated[int, typer.Option(help="Execs sent at once in each round.")] = 1000,
    rounds: Annotated[int, typer.Option(help="Rounds of concurrent execs.")] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Concurrent execs through the HTTP API: errors and the latency tail, against one-at-a-time execs."""
    from corral.bench.load import run_load_benchmark

    run_load_benchmark(sandboxes=sandboxes, execs=execs, rounds=rounds, as_json=as_json, console=console)


@bench_app.command("e2b")
def bench_e2b(
    runs: Annotated[int, typer.Option(help="Creates per client; round trips are 10× as many.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure the e2b SDK against Corral's own SDK (create → first command, command round trip) in one run."""
    from corral.bench.e2b import run_e2b_benchmark

    run_e2b_benchmark(runs=runs, as_json=as_json, console=console)


@bench_app.command("sandbox-fusion")
def bench_sandbox_fusion(
    runs: Annotated[int, typer.Option(help="Round trips per client; throughput passes make 5× as many.")] = 100,
    clients: Annotated[int, typer.Option(help="Concurrent callers in the throughput test.")] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure SandboxFusion's /run_code (its released client) against Corral's /v1/run_code in one run."""
    from corral.bench.sandbox_fusion import run_sandbox_fusion_benchmark

    run_sandbox_fusion_benchmark(runs=runs, clients=clients, as_json=as_json, console=console)


@bench_app.command("memory")
def bench_memory(
    count: Annotated[int, typer.Option(help="Sandboxes that read the shared layer, then idle ones paused.")] = 100,
    layer_mib: Annotated[int, typer.Option(help="Size of the layer of random files they all read.")] = 200,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure host memory for sandboxes reading one shared layer (1 vs many) and what pausing idle ones reclaims."""
    from corral.bench.memory import run_memory_benchmark

    run_memory_benchmark(count=count, layer_mib=layer_mib, as_json=as_json, console=console)


@bench_app.command("density")
def bench_density(
    count: Annotated[int, typer.Option(help="Idle sandboxes to create in all.")] = 1000,
    step: Annotated[int, typer.Option(help="Sandboxes created between two measurements.")] = 250,
    disk_quota: Annotated[
        str,
        typer.Option(help="Writable-layer quotas: on (as shipped), off, or compare (off, then on, and the ratios)."),
    ] = "on",
    network: Annotated[
        bool, typer.Option("--network", help="Give every sandbox an egress allowlist (its own veth and address).")
    ] = False,
    idle_window_s: Annotated[
        float, typer.Option(help="Seconds of the server's idle CPU measured at each step (0: not measured).")
    ] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure host memory per idle sandbox, exec round trip and the server's idle CPU as the node fills, against
    a same-run baseline."""
    from corral.bench.density import run_density_benchmark

    run_density_benchmark(count=count, step=step, disk_quota=disk_quota, as_json=as_json, console=console,
                          network=network, idle_window_s=idle_window_s)  # fmt: skip
