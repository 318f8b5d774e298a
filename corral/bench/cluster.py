"""`corral bench cluster`: a real Ray cluster of N nodes on this machine against one embedded node, same run.

Both run real crun containers. The cluster is ``LocalCluster`` (N raylets,
each with its edge actor, a gateway and PostgreSQL, in a network namespace
of its own); the baseline is the embedded single-process server. Measured on
each, in alternating rounds:

1. a burst: ``create_many(count)`` until the client holds every handle, as
   creations per second, and how the cluster spread them over its nodes;
2. single creates one after another (create → ready), p50/p95;
3. exec round trips on a warm sandbox, p50/p95 (the cluster adds the
   gateway → Ray → edge actor hop);
4. the same execs with a step id (the trajectory log: a begin before, the result
   after, the files the command changed looked up on its node), sent whole and
   streamed (``exec_stream``: the stream, the files and the audit in one actor
   stream).

Every node shares this machine's cores, so the cluster cannot create faster
than one node here: the numbers are the cluster path's cost, read as ratios
to the same-run baseline. On real machines each node brings its own cores.
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from corral.bench.harness import bench_session, emit, ms_since, require_success
from corral.cluster.local import LocalCluster
from corral.embedded import EmbeddedServer
from corral.sdk import Client

__all__ = ["run_cluster_benchmark"]


def _percentiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50": statistics.median(ordered), "p95": ordered[min(len(ordered) - 1, int(len(ordered) * 0.95))]}


def _burst(client: Client, count: int) -> tuple[float, dict[str, int]]:
    started = time.perf_counter()
    created = list(client.create_many(count, "busybox", ttl_s=600))
    elapsed = time.perf_counter() - started
    spread = collections.Counter(sandbox.id.split("-")[1] for sandbox in created)
    for sandbox in created:
        sandbox.kill()
    return count / elapsed, dict(sorted(spread.items()))


def _singles(client: Client, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        sandbox = client.create("busybox", ttl_s=600)
        samples.append(ms_since(started))
        sandbox.kill()
    return samples


def _execs(client: Client, count: int, *, step_ids: bool = False, streamed: bool = False) -> list[float]:
    samples = []
    with client.create("busybox", ttl_s=600) as sandbox:
        require_success(sandbox.exec("true"), "true")
        for k in range(count):
            step_id = f"s{k}" if step_ids else None
            started = time.perf_counter()
            if streamed:
                exit_event = list(sandbox.exec_stream("true", step_id=step_id))[-1]
                if exit_event.type != "exit" or exit_event.result is None:
                    raise RuntimeError(f"a streamed `true` ended without its exit: {exit_event}")
                result = exit_event.result
            else:
                result = sandbox.exec("true", step_id=step_id)
            samples.append(ms_since(started))
            require_success(result, "true")
    return samples


def run_cluster_benchmark(*, nodes: int, count: int, rounds: int, as_json: bool, console: Console) -> dict[str, Any]:
    report: dict[str, Any] = {"nodes": nodes, "burst": count, "rounds": rounds}
    with bench_session("bench-cluster", as_json=as_json, console=console) as (scratch, progress):
        task = progress.add_task("starting the embedded node and the cluster", total=rounds * 2)
        embedded = EmbeddedServer(scratch / "embedded")  # both on the session's own node dir (bench_session)
        cluster = LocalCluster(scratch / "cluster")
        results: dict[str, dict[str, list[Any]]] = {
            side: {"rate": [], "single": [], "exec": [], "step": [], "stream_step": [], "spread": []}
            for side in ("embedded", "cluster")
        }
        try:
            embedded.start()
            started = time.perf_counter()
            state = cluster.up(nodes, progress=lambda what: progress.update(task, description=what))
            report["cluster_up_s"] = time.perf_counter() - started
            clients = {"embedded": embedded.client(), "cluster": Client(state.gateway_url, state.api_key)}
            for client in clients.values():  # warm: layers fetched, helpers and caches ready
                _burst(client, min(count, 3 * nodes))
            for index in range(rounds):
                for side, client in clients.items():
                    progress.update(task, description=f"round {index + 1}/{rounds}: {side}")
                    rate, spread = _burst(client, count)
                    results[side]["rate"].append(rate)
                    results[side]["spread"].append(spread)
                    results[side]["single"] += _singles(client, 10)
                    results[side]["exec"] += _execs(client, 50)
                    results[side]["step"] += _execs(client, 50, step_ids=True)
                    results[side]["stream_step"] += _execs(client, 50, step_ids=True, streamed=True)
                    progress.advance(task)
            for client in clients.values():
                client.close()
        finally:
            if cluster.state is not None:
                cluster.down()
            embedded.shutdown()
    for side, measured in results.items():
        report[side] = {
            "creates_per_s": statistics.median(measured["rate"]) if measured["rate"] else None,
            "creates_per_s_runs": measured["rate"],
            "create_ms": _percentiles(measured["single"]) if measured["single"] else None,
            "exec_ms": _percentiles(measured["exec"]) if measured["exec"] else None,
            "step_ms": _percentiles(measured["step"]) if measured["step"] else None,
            "stream_step_ms": _percentiles(measured["stream_step"]) if measured["stream_step"] else None,
            "spread": measured["spread"],
        }
    emit(report, _table, as_json=as_json, console=console)
    return report


def _table(report: dict[str, Any]) -> Table:
    nodes = report["nodes"]
    table = Table(
        "metric", f"cluster ({nodes} nodes)", "embedded (1 node, same run)", "ratio",
        title=f"Corral on a {nodes}-node Ray cluster (one machine) vs one embedded node",
        caption=f"burst of {report['burst']}, {report['rounds']} alternating rounds, medians; cluster up in "
        f"{report.get('cluster_up_s', 0):.1f} s. All nodes share this machine's cores.",
    )  # fmt: skip
    cluster, embedded = report["cluster"], report["embedded"]
    rate_c, rate_e = cluster["creates_per_s"], embedded["creates_per_s"]
    table.add_row("burst creates/s", f"{rate_c:.1f}", f"{rate_e:.1f}", f"{rate_c / rate_e:.2f}×")
    for key, label in (("create_ms", "single create → ready"), ("exec_ms", "exec round trip"),
                       ("step_ms", "exec with a step id"),
                       ("stream_step_ms", "streamed exec with a step id")):  # fmt: skip
        c, e = cluster[key], embedded[key]
        table.add_row(
            f"{label} p50 (p95)", f"{c['p50']:.1f} ({c['p95']:.1f}) ms", f"{e['p50']:.1f} ({e['p95']:.1f}) ms",
            f"{c['p50'] / e['p50']:.2f}×",
        )  # fmt: skip
    spread = " / ".join(", ".join(f"{edge} {n}" for edge, n in run.items()) for run in cluster["spread"])
    table.add_row("burst spread over nodes", spread, "-", "-")
    return table
