"""`corral bench e2b`: the unmodified e2b SDK against Corral's own SDK, interleaved in one run, same server.

Two timings, each sampled alternately through both clients on the same
image (``e2b-base``, as user ``user``) and the same command (``bash -l -c
true``, what ``commands.run`` sends):

1. create → first command result: ``Sandbox.create("base",
   allow_internet_access=False)`` + ``commands.run`` vs
   ``client.create("e2b-base")`` + ``exec``; the sandbox is killed after each
   sample (not timed). Both without network: E2B's default internet grant
   would plug the e2b sandbox into the sandbox network, work the Corral
   sandbox does not do.
2. command round trip on a running sandbox: ``commands.run`` (a Connect
   server stream with start, data and end events) vs ``exec`` (one JSON
   request and answer).

The e2b client is pointed at the server with E2B_API_URL and E2B_SANDBOX_URL,
set in this process for the run and restored afterwards.
"""

from __future__ import annotations

import contextlib
import os
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from corral.backends.common import host
from corral.bench.containers import summarize
from corral.bench.harness import ResultTable, bench_session, emit
from corral.embedded import EmbeddedServer
from corral.gateway.e2b import e2b_api_key
from corral.sdk import Client, InvalidRequest

__all__ = ["run_e2b_benchmark"]

TEMPLATE, IMAGE, USER = "base", "e2b-base", "user"
COMMAND = ["/bin/bash", "-l", "-c", "true"]  # what commands.run("true") runs
SANDBOX_TTL_S = 600  # a sandbox leaked by a crashed bench still goes away
ROUNDTRIPS_PER_SANDBOX = 10


def _ms_since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


@contextlib.contextmanager
def _e2b_pointed_at(server: EmbeddedServer) -> Iterator[None]:
    values = {"E2B_API_URL": server.url, "E2B_SANDBOX_URL": server.url, "E2B_API_KEY": e2b_api_key(server.api_key)}
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _measure(data_dir: Path, runs: int, progress: Progress) -> dict[str, Any]:
    from e2b import Sandbox  # the bench's own dependency (the dev extra), not the server's

    task = progress.add_task("starting corral serve", total=1)
    server = EmbeddedServer(data_dir)
    samples: dict[str, list[float]] = {"e2b_create": [], "corral_create": [], "e2b_run": [], "corral_run": []}
    try:
        server.start()
        progress.update(task, completed=1)
        with server.client() as client, _e2b_pointed_at(server):
            _warm_up(client, Sandbox)
            task = progress.add_task("create → first command (e2b, corral)", total=runs)
            for _ in range(runs):
                started = time.perf_counter()
                sandbox = Sandbox.create(TEMPLATE, timeout=SANDBOX_TTL_S, allow_internet_access=False)
                sandbox.commands.run("true")
                samples["e2b_create"].append(_ms_since(started))
                sandbox.kill()
                started = time.perf_counter()
                own = client.create(IMAGE, user=USER, cwd=f"/home/{USER}", ttl_s=SANDBOX_TTL_S)
                own.exec(COMMAND)
                samples["corral_create"].append(_ms_since(started))
                own.kill()
                progress.advance(task)
            task = progress.add_task("command round trip (e2b, corral)", total=runs * ROUNDTRIPS_PER_SANDBOX)
            sandbox = Sandbox.create(TEMPLATE, timeout=SANDBOX_TTL_S, allow_internet_access=False)
            own = client.create(IMAGE, user=USER, cwd=f"/home/{USER}", ttl_s=SANDBOX_TTL_S)
            try:
                for _ in range(runs * ROUNDTRIPS_PER_SANDBOX):
                    started = time.perf_counter()
                    sandbox.commands.run("true")
                    samples["e2b_run"].append(_ms_since(started))
                    started = time.perf_counter()
                    own.exec(COMMAND)
                    samples["corral_run"].append(_ms_since(started))
                    progress.advance(task)
            finally:
                sandbox.kill()
                own.kill()
        task = progress.add_task("cleaning up (sandboxes, server)", total=1)
    finally:
        server.shutdown()
        host.orphans.reap()
    progress.update(task, completed=1)
    return {name: summarize(values) for name, values in samples.items()}


def _warm_up(client: Client, sandbox_class: Any) -> None:
    """One of each first, so the layer mounts and connection pools are in place for both."""
    sandbox = sandbox_class.create(TEMPLATE, timeout=SANDBOX_TTL_S)
    sandbox.commands.run("true")
    sandbox.kill()
    with client.create(IMAGE, user=USER, ttl_s=SANDBOX_TTL_S) as own:
        own.exec(COMMAND)


def _table(report: dict[str, Any]) -> Table:
    params, info = report["params"], report["host"]
    caption = (
        f"{params['runs']} creates and {params['runs'] * ROUNDTRIPS_PER_SANDBOX} round trips per client, interleaved; "
        f"image {IMAGE}, command {' '.join(COMMAND)}; client and server share {info['cpu_count']} cpus. "
        f"Kernel {info['kernel']}."
    )
    rows = ResultTable("corral bench e2b", caption, report["checks"], digits=2)
    rows.timing("create → first command, e2b SDK", report["e2b_create"], "Corral SDK", report["corral_create"])
    rows.timing("command round trip, e2b SDK", report["e2b_run"], "Corral SDK", report["corral_run"])
    return rows.table


def run_e2b_benchmark(*, runs: int, as_json: bool, console: Console) -> None:
    """Measure the e2b SDK against Corral's own SDK in the same run, then print a table (or JSON)."""
    if runs < 1:
        raise InvalidRequest("--runs must be at least 1")
    with bench_session("bench-e2b", as_json=as_json, console=console) as (scratch, progress):
        results = _measure(scratch / "server", runs, progress)
    report: dict[str, Any] = {
        "unit": "ms",
        "params": {"runs": runs, "roundtrips": runs * ROUNDTRIPS_PER_SANDBOX, "image": IMAGE, "command": COMMAND},
        "host": {"kernel": platform.release(), "cpu_count": os.cpu_count()},
        "checks": [],
        **results,
    }
    emit(report, _table, as_json=as_json, console=console)
