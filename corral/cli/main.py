"""The `corral` command line (typer + rich).

`serve` runs the embedded server; the other commands are thin wrappers over
the SDK, so they find the server the same way scripts do (CORRAL_URL,
CORRAL_API_KEY or the config file that `serve` wrote).
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Column, Table

from corral.sdk import Client, CorralError, SandboxInfo

app = typer.Typer(help="Corral: sandboxes for agentic RL.", no_args_is_help=True, add_completion=False)
# Piped output (CI logs, scripts) gets full-width tables instead of wrapped 80-column ones.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)


def _client() -> Client:
    return Client()


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else "-"


def _sandbox_table(rows: list[SandboxInfo]) -> Table:
    table = Table("STATE", "IMAGE", "CPU", "MEM MiB", "LABELS", "CREATED", "EXPIRES")
    table.columns.insert(0, Column("ID", no_wrap=True, min_width=22))
    for info in rows:
        labels = ",".join(f"{k}={v}" for k, v in info.labels.items())
        state = info.state.value + (f" ({info.end_reason})" if info.end_reason else "")
        table.add_row(info.id, state, info.image, f"{info.cpu:g}", str(info.memory_mb), labels,
                      _when(info.created_at), _when(info.expires_at))  # fmt: skip
    return table


def _labels(items: list[str] | None) -> dict[str, str]:
    labels = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"label {item!r} must look like key=value")
        labels[key] = value
    return labels


@app.command()
def serve(
    port: Annotated[int | None, typer.Option(help="HTTP port (default 7070 or CORRAL_PORT).")] = None,
    host: Annotated[str | None, typer.Option(help="Listen address (default 127.0.0.1).")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="State directory (default /var/lib/corral/server).")] = None,
) -> None:
    """Run the embedded server: API, scheduler and one edge in this process."""
    from corral.config import Settings
    from corral.server import serve as run_server

    overrides = {k: v for k, v in {"port": port, "host": host, "data_dir": data_dir}.items() if v is not None}
    run_server(Settings(**overrides))


@app.command()
def create(
    image: Annotated[str, typer.Argument(help="Image name, see `corral images`.")] = "busybox",
    cpu: float = 1.0,
    memory_mb: int = 512,
    ttl_s: Annotated[float | None, typer.Option(help="Seconds until it is destroyed.")] = 3600,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="key=value, repeatable.")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="NAME=value, repeatable.")] = None,
    user: str = "root",
    cwd: str = "/",
) -> None:
    """Create a sandbox and print its id."""
    sandbox = _client().create(image, cpu=cpu, memory_mb=memory_mb, ttl_s=ttl_s, labels=_labels(label),
                               env=_labels(env), user=user, cwd=cwd)  # fmt: skip
    console.print(sandbox.id)


@app.command("exec")
def exec_command(
    sandbox_id: str,
    command: Annotated[list[str], typer.Argument(help="A shell command (one argument) or an argv.")],
    timeout_s: float = 300.0,
    cwd: str | None = None,
    user: str | None = None,
) -> None:
    """Run a command in a sandbox, streaming its output; exits with its exit code."""
    sandbox = _client().get(sandbox_id)
    cmd: str | list[str] = command[0] if len(command) == 1 else command
    for event in sandbox.exec_stream(cmd, timeout_s=timeout_s, cwd=cwd, user=user):
        if event.type == "stdout":
            sys.stdout.write(event.data or "")
            sys.stdout.flush()
        elif event.type == "stderr":
            sys.stderr.write(event.data or "")
            sys.stderr.flush()
        elif event.type == "exit" and event.result is not None:
            result = event.result
            if result.timed_out:
                err_console.print(f"[red]timed out after {timeout_s:g}s[/red]")
            if result.oom_killed:
                err_console.print("[red]killed: out of memory[/red]")
            raise typer.Exit(result.exit_code if result.exit_code is not None and result.exit_code >= 0 else 128)


@app.command("ls")
def list_sandboxes(
    all_states: Annotated[bool, typer.Option("--all", "-a", help="Include ended and lost sandboxes.")] = False,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="key=value filter, repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """List sandboxes."""
    states = ["creating", "running", "ended", "lost"] if all_states else None
    rows = _client().list(state=states, labels=_labels(label))
    if as_json:
        print(json.dumps([r.model_dump(mode="json") for r in rows], indent=2))
    else:
        console.print(_sandbox_table(rows))


@app.command("rm")
def remove(sandbox_ids: list[str]) -> None:
    """Kill sandboxes."""
    client = _client()
    for sandbox_id in sandbox_ids:
        info = client.kill(sandbox_id)
        console.print(f"{info.id} {info.state.value} ({info.end_reason})")


@app.command()
def images() -> None:
    """List images on the server."""
    table = Table("IMAGE", "LAYERS", "SIZE MiB", "CREATED")
    for image in _client().images():
        table.add_row(
            image.name, str(len(image.layers)), f"{image.size_bytes / (1 << 20):.1f}", _when(image.created_at)
        )
    console.print(table)


@app.command()
def bench(
    runs: Annotated[int, typer.Option(help="Samples per measurement.")] = 30,
    concurrency: Annotated[int, typer.Option(help="Sandboxes created at once in the burst test.")] = 100,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Measure create-to-first-exec and exec round trip against plain crun in the same run."""
    from corral.bench.containers import run_benchmark

    run_benchmark(runs=runs, concurrency=concurrency, as_json=as_json, console=console)


def main() -> None:
    try:
        app()
    except CorralError as exc:
        err_console.print(f"[red]error ({exc.code}):[/red] {exc.message}")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
