"""What every `corral bench NAME` command shares: the root check, the subreaper, a scratch dir, the progress bar,
and printing the report as a table or as JSON (progress then goes to stderr, so stdout is the JSON alone)."""

from __future__ import annotations

import datetime
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, RenderableType
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.backends.common import host
from corral.embedded import EmbeddedServer, linked_node_dir
from corral.sdk import ExecResult

__all__ = [
    "bench_server",
    "bench_session",
    "emit",
    "metric_sum",
    "ms_since",
    "own_node_dir",
    "require_success",
    "throwaway_postgres",
]

REPO = Path(__file__).resolve().parents[2]


def ms_since(started: float) -> float:
    """Milliseconds since a ``time.perf_counter()`` reading."""
    return (time.perf_counter() - started) * 1000


def require_success(result: ExecResult, what: str) -> ExecResult:
    """The result, or an error naming the command, if it did not exit 0 (a bench must not time failures)."""
    if result.exit_code != 0:
        raise RuntimeError(f"`{what}` in the sandbox exited {result.exit_code}: {result.stderr[-300:]}")
    return result


def metric_sum(server: EmbeddedServer, name: str, **labels: str) -> float:
    """The sum of the server's samples called ``name`` (a counter's ``..._total``) that carry ``labels``, read
    from its /metrics as Prometheus would."""
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30)
    response.raise_for_status()
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(key) == value for key, value in labels.items())
    )


@contextmanager
def bench_session(name: str, *, as_json: bool, console: Console) -> Iterator[tuple[Path, Progress]]:
    """A scratch dir (removed afterwards) and a progress bar, for a bench that starts its own server as root."""
    if os.geteuid() != 0:
        raise SystemExit(f"corral {name} needs root: the server it starts runs containers")
    scratch = Path(tempfile.mkdtemp(prefix=f"corral-{name}."))
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())  # fmt: skip
    try:
        with (
            host.child_subreaper(),  # what the server's sandboxes leave behind comes to us; host.orphans reaps it
            own_node_dir(scratch),
            Progress(*columns, console=Console(stderr=True) if as_json else console) as progress,
        ):
            yield scratch, progress
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def own_node_dir(scratch: Path) -> Iterator[Path]:
    """A node dir of the bench's own in ``scratch`` (the real layers, helpers and VM kit hard-linked), named by
    CORRAL_NODE_DIR for this process and every server it starts until the block ends: what a bench's server
    builds (layers, a VM's boot templates, helpers of another version) stays out of the user's node dir."""
    node_dir = linked_node_dir(scratch / "bench-node")
    was = os.environ.get("CORRAL_NODE_DIR")
    os.environ["CORRAL_NODE_DIR"] = str(node_dir)
    try:
        yield node_dir
    finally:
        if was is None:
            os.environ.pop("CORRAL_NODE_DIR", None)
        else:
            os.environ["CORRAL_NODE_DIR"] = was


@contextmanager
def bench_server(data_dir: Path, progress: Progress) -> Iterator[EmbeddedServer]:
    """A started `corral serve` of the bench's own, shut down afterwards (it kills its sandboxes and pools as it
    stops), and what its sandboxes left behind reaped."""
    task = progress.add_task("starting corral serve", total=1)
    server = EmbeddedServer(data_dir)
    try:
        server.start()
        progress.update(task, completed=1)
        yield server
        task = progress.add_task("cleaning up (sandboxes, server)", total=1)
    finally:
        server.shutdown()
        host.orphans.reap()
    progress.update(task, completed=1)


@contextmanager
def throwaway_postgres() -> Iterator[str]:
    """A PostgreSQL of the bench's own (scripts/postgres.sh: unix socket only); yields its SQLAlchemy URL."""
    directory = Path(tempfile.mkdtemp(prefix="corral-pg-", dir="/var/tmp"))
    script = str(REPO / "scripts" / "postgres.sh")
    started = subprocess.run(["bash", script, "start", str(directory)], capture_output=True, text=True)
    if started.returncode != 0:
        raise SystemExit(f"could not start PostgreSQL: {started.stderr.strip()}")
    try:
        yield started.stdout.strip()
    finally:
        subprocess.run(["bash", script, "stop", str(directory)], capture_output=True)
        shutil.rmtree(directory, ignore_errors=True)


def emit(
    report: dict[str, Any],
    table: Callable[[dict[str, Any]], RenderableType],
    *,
    as_json: bool,
    console: Console,
) -> None:
    """Stamp the report and print it: JSON on stdout, or the table."""
    report.setdefault("timestamp", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        console.print(table(report))


class ResultTable:
    """The bench table: metric, p50, p95, same-run baseline, ratio, target, verdict; verdicts come from the
    report's checks (``{"metric", "target", "ok"}``)."""

    def __init__(self, title: str, caption: str, checks: list[dict[str, Any]], *, digits: int) -> None:
        self.table = Table("metric", "p50", "p95", "baseline (same run)", "ratio", "target", "verdict",
                           title=title, caption=caption)  # fmt: skip
        self._checks = {check["metric"]: check for check in checks}
        self._digits = digits

    def verdict(self, metric: str) -> str:
        return "[green]ok[/green]" if self._checks[metric]["ok"] else "[red]missed[/red]"

    def target(self, metric: str) -> str:
        return str(self._checks[metric]["target"])

    def timing(self, label: str, ours: dict[str, float], base_label: str, base: dict[str, float] | None,
               metric: str | None = None) -> None:  # fmt: skip
        """A row of medians (ms) beside a baseline's median, with the ratio and, for a checked metric, its verdict."""
        d = self._digits
        ratio = f"{ours['p50'] / base['p50']:.{d}f}×" if base else "-"
        self.table.add_row(label, f"{ours['p50']:.{d}f} ms", f"{ours['p95']:.{d}f} ms",
                           f"{base_label} {base['p50']:.{d}f} ms" if base else base_label, ratio,
                           self.target(metric) if metric else "-", self.verdict(metric) if metric else "-")  # fmt: skip
