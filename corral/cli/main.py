"""The `corral` command line (typer + rich).

`serve` runs the embedded server; the other commands are thin wrappers over
the SDK, so they find the server the same way scripts do (CORRAL_URL,
CORRAL_API_KEY or the config file that `serve` wrote).
"""

from __future__ import annotations

import asyncio
import datetime
import io
import json
import posixpath
import re
import shlex
import sys
import tarfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.table import Column, Table

from corral.cli.bench import bench_app
from corral.cli.cluster import cluster_app
from corral.cli.shell import DEFAULT_SHELL, run_shell
from corral.sdk import AsyncClient, BatchEvent, Client, CorralError, Event, PullEvent, SandboxInfo, TrajectoryStep

app = typer.Typer(help="Corral: sandboxes for agentic RL.", no_args_is_help=True, add_completion=False)
# Piped output (CI logs, scripts) gets full-width tables instead of wrapped 80-column ones.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)
app.add_typer(cluster_app, name="cluster")
app.add_typer(bench_app, name="bench")


def _client() -> Client:
    return Client()


def _when(ts: float | None) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%H:%M:%S") if ts else "-"


def _sandbox_table(rows: list[SandboxInfo]) -> Table:
    table = Table("STATE", "IMAGE", "CPU", "MEM MiB", "LABELS", "CREATED", "EXPIRES")
    table.columns.insert(0, Column("ID", no_wrap=True, min_width=22))
    for info in rows:
        state = info.state.value + (f" ({info.end_reason})" if info.end_reason else "")
        table.add_row(info.id, state, info.image, f"{info.cpu:g}", str(info.memory_mb), _pairs(info.labels),
                      _when(info.created_at), _when(info.expires_at))  # fmt: skip
    return table


def _pairs(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


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

    overrides: dict[str, Any] = {
        k: v for k, v in {"port": port, "host": host, "data_dir": data_dir}.items() if v is not None
    }
    run_server(Settings(**overrides))


@app.command()
def create(
    image: Annotated[
        str, typer.Argument(help="Image name (see `corral images`) or a registry reference, pulled on first use.")
    ] = "busybox",
    cpu: float = 1.0,
    qos: Annotated[str, typer.Option(help="CPU class: latency (default) or batch (runs on what others leave).")] = (
        "latency"
    ),
    memory_mb: int = 512,
    ttl_s: Annotated[float | None, typer.Option(help="Seconds until it is destroyed.")] = 3600,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="key=value, repeatable.")] = None,
    node_selector: Annotated[
        list[str] | None, typer.Option("--node-selector", help="Only on a node with this key=value label, repeatable.")
    ] = None,
    env: Annotated[list[str] | None, typer.Option("--env", "-e", help="NAME=value, repeatable.")] = None,
    user: Annotated[str | None, typer.Option(help="Default: the image's user, else root.")] = None,
    cwd: Annotated[str | None, typer.Option(help="Default: the image's working directory, else /.")] = None,
    workspace: Annotated[str | None, typer.Option(help="Workspace image stacked over IMAGE.")] = None,
    tools: Annotated[str | None, typer.Option(help="Tools image stacked on top.")] = None,
    count: Annotated[int, typer.Option("--count", "-n", help="Create this many in one batch, with progress.")] = 1,
) -> None:
    """Create sandboxes and print their ids, one per line (IMAGE is the base when --workspace/--tools compose an
    environment). With --count, one batch request: ids as they become ready, a progress bar on stderr."""
    environment = {"base": image, "workspace": workspace, "tools": tools} if workspace or tools else None
    args: dict[str, Any] = {"cpu": cpu, "qos": qos, "memory_mb": memory_mb, "ttl_s": ttl_s, "labels": _labels(label),
            "env": _labels(env), "user": user, "cwd": cwd, "environment": environment,
            "node_selector": _labels(node_selector)}  # fmt: skip
    if count == 1:
        print(_client().create(image, **args).id)
        return
    failures: list[str] = []

    def failed(event: BatchEvent) -> None:
        if event.type == "error":
            failures.append(f"#{event.index}: {(event.error or {}).get('message', 'failed')}")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with _client() as client, Progress(*columns, console=err_console, transient=True) as progress:
        bar = progress.add_task(f"creating {count} x {image}", total=count)
        for sandbox in client.create_many(count, image, on_progress=failed, **args):
            print(sandbox.id, flush=True)
            progress.advance(bar)
    if failures:
        err_console.print(f"{len(failures)} of {count} creates failed; the first: {failures[0]}", markup=False)
        raise typer.Exit(1)


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


@app.command()
def shell(
    sandbox_id: str,
    command: Annotated[
        list[str] | None, typer.Argument(help="What to run (default: bash, else sh, as a login shell).")
    ] = None,
    user: str | None = None,
    cwd: str | None = None,
) -> None:
    """An interactive terminal in a sandbox (like `docker exec -it`); exits with the command's exit code."""

    async def session() -> int:
        async with AsyncClient() as client:
            sandbox = await client.get(sandbox_id)
            return await run_shell(sandbox, command or DEFAULT_SHELL, user=user, cwd=cwd)

    raise typer.Exit(asyncio.run(session()))


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


@app.command("nodes")
def nodes(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Nodes: this server's own stats, and every node the shared state knows (up or lost)."""
    client = _client()
    own, known = client.nodes(), client.cluster_nodes()
    if as_json:
        print(json.dumps({"stats": [n.model_dump(mode="json") for n in own],
                          "cluster": [n.model_dump(mode="json") for n in known]}, indent=2))  # fmt: skip
        return
    table = Table("node", "state", "last seen", "sandboxes", "cpu committed", "memory committed", "labels",
                  "refusing")  # fmt: skip
    stats = {n.edge_id: n for n in own}
    for node in known:
        mine = stats.get(node.edge_id)
        count = sum(sum(states.values()) for states in mine.sandboxes.values()) if mine else node.load.sandboxes
        table.add_row(
            node.edge_id, node.state, f"{time.time() - node.last_seen:.0f} s ago", str(count),
            f"{node.load.cpu_committed:g}/{node.load.cpu_capacity:g}",
            f"{node.load.memory_committed_mb}/{node.load.memory_capacity_mb} MiB", _pairs(node.load.labels) or "-",
            (mine.refusing or "-") if mine else "-",
        )  # fmt: skip
    console.print(table)


def _event_line(event: Event) -> str:
    """One event as a line: id, time, kind, whose, and what (the end's reason, the finding, the node's loss)."""
    detail = event.detail
    if event.kind == "sandbox.ended":
        what = f"{detail.get('state')} ({detail.get('reason')})" + (
            f": {detail['message']}" if detail.get("message") else ""
        )
    elif event.kind == "audit":
        what = f"{detail.get('severity')} {detail.get('kind')} {json.dumps(detail.get('detail', {}))}"
    elif event.kind == "node.lost":
        what = f"{detail.get('sandboxes_lost', 0)} sandboxes lost: {detail.get('message', '')}"
    else:
        what = ""
    stamp = datetime.datetime.fromtimestamp(event.at).strftime("%H:%M:%S.%f")[:-3]
    return f"{event.id:>8}  {stamp}  {event.kind:<16} {event.sandbox_id or event.edge_id or '-'}  {what}".rstrip()


@app.command("events")
def events(
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
    after: Annotated[int, typer.Option("--after", help="Start after this event id (resume).")] = 0,
    sandbox: Annotated[str | None, typer.Option("--sandbox", help="Only this sandbox's events.")] = None,
    kind: Annotated[list[str] | None, typer.Option("--kind", "-k", help="Only this kind, repeatable.")] = None,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="key=value filter, repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON event per line.")] = False,
) -> None:
    """Sandbox and node events and audit findings, oldest first; -f follows (resume with --after ID)."""
    with _client() as client:
        try:
            for event in client.events(after_id=after, follow=follow, sandbox_id=sandbox, kinds=kind,
                                       labels=_labels(label)):  # fmt: skip
                print(event.model_dump_json() if as_json else _event_line(event), flush=True)
        except KeyboardInterrupt:
            pass


@app.command("rm")
def remove(sandbox_ids: list[str]) -> None:
    """Kill sandboxes."""
    client = _client()
    for sandbox_id in sandbox_ids:
        info = client.kill(sandbox_id)
        console.print(f"{info.id} {info.state.value} ({info.end_reason})")


images_app = typer.Typer(help="Images (name:version tags over EROFS layers) and layers.")
app.add_typer(images_app, name="images")


def _size(size_bytes: int) -> str:
    return f"{size_bytes / (1 << 20):.1f}"


@images_app.callback(invoke_without_command=True)
def images_default(ctx: typer.Context) -> None:
    """`corral images` alone lists the images."""
    if ctx.invoked_subcommand is None:
        images_ls(layers=False)


@images_app.command("ls")
def images_ls(layers: Annotated[bool, typer.Option("--layers", help="List layers instead of tags.")] = False) -> None:
    """List images (or layers) on the server."""
    client = _client()
    if layers:
        table = Table("DIGEST", "KIND", "SIZE MiB", "BUILT BY", "CREATED")
        for layer in client.images.layers():
            table.add_row(layer.digest[:19], layer.kind, _size(layer.size_bytes), str(layer.source.get("builder")),
                          _when(layer.created_at))  # fmt: skip
    else:
        table = Table("IMAGE", "LAYERS", "SIZE MiB", "CREATED", "SOURCE", "MANIFEST")
        for image in client.images.list():
            table.add_row(image.name, str(len(image.layers)), _size(image.size_bytes), _when(image.created_at),
                          image.source or "-", (image.manifest_digest or "-")[:19])  # fmt: skip
    console.print(table)


@images_app.command("inspect")
def images_inspect(ref: str) -> None:
    """Show an image's layers, bottom first, with how each was built (and a pulled image's source and config)."""
    detail = _client().images.inspect(ref)
    console.print(f"{detail.name}: {len(detail.layers)} layers, {_size(detail.size_bytes)} MiB")
    if detail.source:
        console.print(f"pulled from {detail.source}, manifest {detail.manifest_digest}", markup=False)
    config = detail.config.model_dump(exclude_defaults=True)  # env, working dir, user ... sandboxes start with
    if config:
        console.print(f"config: {json.dumps(config)}", markup=False, highlight=False)
    table = Table("#", "DIGEST", "KIND", "SIZE MiB", "SOURCE")
    for index, layer in enumerate(detail.layers):
        table.add_row(str(index), layer.digest, layer.kind, _size(layer.size_bytes), json.dumps(layer.source))
    console.print(table)


@images_app.command("tag")
def images_tag(source: str, target: str) -> None:
    """Point TARGET (name or name:version) at SOURCE's layers."""
    image = _client().images.tag(target, source=source)
    console.print(f"{image.name} -> {', '.join(d[:19] for d in image.layers)}")


@images_app.command("rm")
def images_rm(
    refs: list[str],
    prune: Annotated[bool, typer.Option(help="Also delete the image's layers that nothing else uses.")] = False,
) -> None:
    """Remove image tags (layers stay unless --prune)."""
    client = _client()
    for ref in refs:
        image = client.images.untag(ref)
        console.print(f"untagged {image.name}")
        for digest in image.layers if prune else []:
            try:
                client.images.remove_layer(digest)
                console.print(f"deleted layer {digest[:19]}")
            except CorralError as exc:
                console.print(f"kept layer {digest[:19]}: {exc.message}", style="dim")


@images_app.command("build")
def images_build(
    name: Annotated[str, typer.Argument(help="Tag for the result: name or name:version.")],
    from_dir: Annotated[str | None, typer.Option(help="A directory on the server's machine.")] = None,
    from_tar: Annotated[str | None, typer.Option(help="A rootfs tarball on the server's machine.")] = None,
    from_oci: Annotated[
        str | None, typer.Option(help="An OCI or `docker save` archive on the server's machine.")
    ] = None,
    debootstrap: Annotated[str | None, typer.Option(help="A Debian suite, e.g. bookworm.")] = None,
    package: Annotated[list[str] | None, typer.Option(help="debootstrap: extra package, repeatable.")] = None,
    git: Annotated[str | None, typer.Option(help="A git repository on the server's machine.")] = None,
    commit: Annotated[str | None, typer.Option(help="git: commit, branch or tag.")] = None,
    workspace_path: Annotated[str, typer.Option(help="git: where the checkout goes.")] = "/work",
    on: Annotated[list[str] | None, typer.Option(help="Image or layer to run commands on, repeatable.")] = None,
    run: Annotated[list[str] | None, typer.Option(help="A command to run (commands build, git setup).")] = None,
    kind: Annotated[str | None, typer.Option(help="Layer kind: base, workspace, tools or diff.")] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Build even if identical inputs were built before.")
    ] = False,
    dockerfile: Annotated[Path | None, typer.Option(help="A Dockerfile (on the server's machine) to build.")] = None,
    context: Annotated[Path | None, typer.Option(help="dockerfile: the build context (default: its dir).")] = None,
    build_arg: Annotated[list[str] | None, typer.Option(help="dockerfile: K=V for an ARG, repeatable.")] = None,
    target: Annotated[str | None, typer.Option(help="dockerfile: the stage to build (default: the last).")] = None,
) -> None:
    """Build a layer from exactly one source (or an image from a Dockerfile) and tag it NAME."""
    sources = {"dir": from_dir, "tar": from_tar, "oci": from_oci, "debootstrap": debootstrap, "git": git,
               "dockerfile": str(dockerfile.resolve()) if dockerfile else None}  # fmt: skip
    chosen = {k: v for k, v in sources.items() if v}
    if len(chosen) > 1 or (not chosen and not run):
        raise typer.BadParameter(
            "give one of --from-dir/--from-tar/--from-oci/--debootstrap/--git/--dockerfile, or --on with --run"
        )
    build_kind, source = next(iter(chosen.items())) if chosen else ("commands", None)
    if build_kind == "dockerfile":
        _build_dockerfile(name, source or "", context=context, build_args=_labels(build_arg), target=target,
                          no_cache=no_cache)  # fmt: skip
        return
    options: dict[str, object] = {"on": on or [], "commands": run or [], "layer_kind": kind, "no_cache": no_cache}
    if build_kind == "debootstrap":
        options.update(suite=source, packages=package or [])
    elif build_kind == "git":
        options.update(path=source, commit=commit, workspace_path=workspace_path)
    elif source is not None:
        options.update(path=source)
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
               TextColumn("{task.fields[line]}", markup=False))  # fmt: skip
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        bar = progress.add_task(f"building {name}", total=None, line="")

        def show(line: str) -> None:  # a build of this kind knows no step count: a spinner, the time, the last line
            console.print(line, style="dim", markup=False, highlight=False)
            progress.update(bar, line=line[:60])

        image = _client().images.build(name, build_kind, on_progress=show, **options)
    console.print(f"built {image.name}: {len(image.layers)} layers, {_size(image.size_bytes)} MiB")


_STEP_LINE = re.compile(r"Step (\d+)/(\d+) : (.*)")


def _build_dockerfile(
    name: str, dockerfile: str, *, context: Path | None, build_args: dict[str, str], target: str | None, no_cache: bool
) -> None:
    """One line per Dockerfile step ("Step 3/9 : RUN ...", "(cached)" when its layer was built before), and the
    lines of what the steps print; in a terminal, under them a bar of steps done, the current step and the time
    taken (CI logs and pipes get the lines alone)."""
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[step]}", markup=False))  # fmt: skip
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        bar = progress.add_task(f"building {name}", total=None, step="")

        def show(line: str) -> None:
            step = _STEP_LINE.match(line)
            console.print(line, style="bold" if step else "dim", markup=False, highlight=False)
            if step:
                done, total, instruction = int(step[1]) - 1, int(step[2]), step[3]
                progress.update(bar, completed=done, total=total, step=instruction[:60])

        image = _client().images.build_dockerfile(
            name, dockerfile, context=context.resolve() if context else None, build_args=build_args, target=target,
            no_cache=no_cache, on_progress=show,
        )  # fmt: skip
    console.print(f"built {image.name}: {len(image.layers)} layers, {_size(image.size_bytes)} MiB")


@images_app.command("pull")
def images_pull(
    reference: Annotated[str, typer.Argument(help="host[:port]/repository[:tag][@sha256:...] of an OCI registry.")],
) -> None:
    """Pull an image from an OCI registry into the server (layers already there are not downloaded)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=console, transient=True) as progress:  # fmt: skip
        bar = progress.add_task(f"pulling {reference}", total=None)

        def show(event: PullEvent) -> None:
            if event.message:
                progress.console.print(event.message, style="dim", markup=False, highlight=False)
            if event.bytes_total is not None:
                progress.update(bar, total=event.bytes_total, completed=event.bytes_done or 0)

        done = _client().images.pull(reference, on_progress=show)
    image = done.image
    if image is not None:
        console.print(f"pulled {image.name}: {len(image.layers)} layers ({done.layers_reused} already here), "
                      f"{(done.bytes_transferred or 0) / 1e6:.1f} MB received, manifest {image.manifest_digest}",
                      markup=False, highlight=False)  # fmt: skip


@images_app.command("import")
def images_import(
    archive: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A local file, uploaded.")],
    name: Annotated[str, typer.Argument(help="Tag for the result: name or name:version.")],
    oci: Annotated[
        bool, typer.Option("--oci", help="An OCI or `docker save` archive (default: a rootfs tar).")
    ] = False,
    kind: Annotated[str | None, typer.Option(help="Layer kind: base, workspace, tools or diff.")] = None,
) -> None:
    """Upload an archive as a new layer."""
    image = _client().images.import_archive(name, archive, format="oci" if oci else "tar", layer_kind=kind)
    console.print(f"imported {image.name}: {', '.join(d[:19] for d in image.layers)}")


@app.command()
def pause(
    sandbox_id: str,
    wait: Annotated[
        bool, typer.Option("--wait", help="Return once its memory is given back, not just frozen.")
    ] = False,
) -> None:
    """Freeze a sandbox (processes and memory kept) and give its memory back; any request resumes it."""
    result = _client().get(sandbox_id).pause(wait_reclaim=wait)
    freed = (result.memory_before_bytes - result.memory_after_bytes) / (1 << 20)
    pending = " (more on its way out)" if result.reclaim_pending else ""
    console.print(f"{sandbox_id} paused in {result.duration_ms:.0f} ms; {freed:.1f} MiB given back{pending}")


@app.command()
def resume(sandbox_id: str) -> None:
    """Resume a paused sandbox (any request to it would too)."""
    info = _client().get(sandbox_id).resume()
    console.print(f"{info.id} {info.state.value}")


@app.command()
def fork(
    sandbox_id: str,
    count: Annotated[int, typer.Option("--count", "-n", help="How many children.")] = 1,
    label: Annotated[list[str] | None, typer.Option("--label", "-l", help="key=value for the children.")] = None,
) -> None:
    """New sandboxes from this one as it is now (VMs and gVisor: memory and processes too); prints their ids."""
    for child in _client().get(sandbox_id).fork(count, labels=_labels(label)):
        print(child.id)


def _sandbox_path(spec: str) -> tuple[str, str] | None:
    """``SANDBOX_ID:/path`` as (id, path); a local path gives None."""
    sandbox_id, sep, path = spec.partition(":")
    if sep and sandbox_id.startswith("sb-") and path.startswith("/"):
        return sandbox_id, path
    return None


@app.command("cp")
def copy(
    source: Annotated[str, typer.Argument(help="SANDBOX_ID:/path or a local path.")],
    dest: Annotated[str, typer.Argument(help="SANDBOX_ID:/path or a local path.")],
) -> None:
    """Copy a file or a directory into or out of a sandbox, like `docker cp` (directories travel as tar)."""
    src, dst = _sandbox_path(source), _sandbox_path(dest)
    if (src is None) == (dst is None):
        raise typer.BadParameter("one side must be SANDBOX_ID:/absolute/path and the other a local path")
    client = _client()
    if dst is not None:  # into the sandbox
        local = Path(source)
        if not local.exists():
            raise typer.BadParameter(f"{local} does not exist")
        files = client.get(dst[0]).files
        if local.is_dir():
            buffer = io.BytesIO()
            with tarfile.open(fileobj=buffer, mode="w") as archive:
                archive.add(local, arcname=".")
            members = files.upload_tar(dst[1], buffer.getvalue())
            console.print(f"copied {members} entries to {dest}")
        else:
            remote = dst[1] + local.name if dst[1].endswith("/") else dst[1]
            info = files.write(remote, local.read_bytes(), mode=local.stat().st_mode & 0o7777)
            console.print(f"copied {info.size} bytes to {dst[0]}:{remote}")
        return
    assert src is not None
    files = client.get(src[0]).files
    local = Path(dest)
    if files.stat(src[1]).type == "dir":
        # As `docker cp`: into an existing directory as a child of it, else as that new directory.
        name = posixpath.basename(src[1].rstrip("/"))
        into = local if local.is_dir() else local.parent
        renamed = None if local.is_dir() else local.name
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(files.download_tar(src[1])), mode="r:") as archive:
            count = _extract_within(archive, into, name, renamed)
        console.print(f"copied {count} entries from {source} to {into / (renamed or name)}/")
    else:
        target = local / posixpath.basename(src[1]) if local.is_dir() else local
        target.write_bytes(files.read(src[1]))
        console.print(f"copied {target.stat().st_size} bytes to {target}")


# The checks are ours (below): where tarfile has filters, tell it so instead of letting it apply its default.
_CHECKED_HERE: dict[str, Any] = {"filter": "fully_trusted"} if hasattr(tarfile, "fully_trusted_filter") else {}


def _extract_within(archive: tarfile.TarFile, dest: Path, top: str, renamed: str | None) -> int:
    """Extract a sandbox's tar of directory ``top`` under ``dest`` (as ``renamed`` if given) and nowhere else:
    the sandbox is not trusted, and Debian 12's Python (3.11.2) has no tarfile extraction filters. Every
    member's path, resolved through what is already on disk (a symlink the archive made earlier included),
    and every link's target must stay under ``dest``; devices and FIFOs are skipped; setuid and setgid bits
    are dropped."""
    root = dest.resolve()
    count = 0
    for member in archive:
        if renamed is not None and (member.name == top or member.name.startswith(top + "/")):
            member.name = renamed + member.name[len(top) :]
        target = (root / member.name).resolve()
        if target != root and root not in target.parents:
            raise typer.BadParameter(f"the sandbox's archive has {member.name!r}, outside {dest}: nothing more copied")
        if member.issym() or member.islnk():
            base = target.parent if member.issym() else root
            linked = (base / member.linkname).resolve()
            if linked != root and root not in linked.parents:
                console.print(f"skipped {member.name}: it links outside ({member.linkname})")
                continue
        elif not (member.isfile() or member.isdir()):
            continue
        member.mode &= 0o1777
        archive.extract(member, root, set_attrs=member.isfile(), numeric_owner=True, **_CHECKED_HERE)
        count += 1
    return count


def _step_line(step: TrajectoryStep) -> str:
    request, result = step.request, step.result or {}
    if step.kind.startswith("exec") or step.kind == "start":
        cmd = request.get("cmd")
        what = shlex.join(cmd) if isinstance(cmd, list) else str(cmd)
        outcome = f"exit {result.get('exit_code')}" if "exit_code" in result else step.state
    elif step.kind == "write_file":
        what, outcome = str(request.get("path")), step.state
    else:
        what, outcome = step.step_id, step.state
    took = f"{(step.finished_at - step.started_at) * 1000:.0f} ms" if step.finished_at else "-"
    return f"{step.seq:>5}  {_when(step.started_at)}  {step.kind:<11} {outcome:<8} {took:>8}  {what}"


@app.command()
def logs(
    sandbox_id: str,
    output: Annotated[
        bool, typer.Option("--output", "-o", help="Also print each command's stdout and stderr.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON step per line.")] = False,
) -> None:
    """A sandbox's trajectory: every command and file write, in order, with results."""
    for step in _client().get(sandbox_id).trajectory():
        if as_json:
            print(step.model_dump_json())
            continue
        print(_step_line(step))
        if output and step.result:
            for stream in ("stdout", "stderr"):
                text = step.result.get(stream) or ""
                for line in text.splitlines():
                    print(f"{'':>7}{stream}: {line}")


def _top_table(client: Client) -> Table:
    table = Table("node", "sandboxes", "cpu committed", "load", "memory committed", "resident", "reclaimed",
                  "mem pressure", "refusing")  # fmt: skip
    for node in client.nodes():
        counts = ", ".join(f"{backend} {sum(states.values())}" for backend, states in node.sandboxes.items())
        table.add_row(
            node.edge_id, counts or "0", f"{node.cpu_committed:g}/{node.cpu_capacity:g}", f"{node.load_1m:.2f}",
            f"{node.memory_committed_mb}/{node.memory_capacity_mb} MiB", f"{node.memory_resident_mb:.0f} MiB",
            f"{node.memory_reclaimed_mb:.0f} MiB", f"{node.pressure.get('memory_some', 0.0):.1f}%",
            node.refusing or "-",
        )  # fmt: skip
    return table


@app.command()
def top(
    interval_s: Annotated[float, typer.Option("--interval", help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one table and exit.")] = False,
) -> None:
    """Nodes live: sandboxes, CPU and memory committed and used, reclaim, pressure (Ctrl-C ends)."""
    with _client() as client:
        if once:
            console.print(_top_table(client))
            return
        try:
            with Live(_top_table(client), console=console, refresh_per_second=4) as live:
                while True:
                    time.sleep(interval_s)
                    live.update(_top_table(client))
        except KeyboardInterrupt:
            pass


@app.command()
def snapshot(
    sandbox_id: str, name: Annotated[str | None, typer.Option(help="Tag the result as this image.")] = None
) -> None:
    """Save a sandbox's filesystem changes as a diff layer (and optionally an image)."""
    info = _client().get(sandbox_id).snapshot(name)
    console.print(f"diff {info.diff.digest} ({_size(info.diff.size_bytes)} MiB)")
    if info.image:
        console.print(f"tagged {info.image}")


@app.command("e2b-env")
def e2b_env() -> None:
    """Print the environment that points the e2b SDK at this server (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY)."""
    from corral.gateway.e2b import e2b_api_key

    with _client() as client:
        url, key = client.url, client.api_key
    console.print(f"export E2B_API_URL={url} E2B_SANDBOX_URL={url} E2B_API_KEY={e2b_api_key(key)}", highlight=False)


_TOOLCHAIN_BUILD_TIMEOUT_S = 3600.0
_TOOLCHAIN_POLL_S = 10.0


@app.command("sandbox-fusion")
def sandbox_fusion(
    build: Annotated[
        bool, typer.Option("--build", help="Build the toolchain image (C, C++, Java, Go, Node.js) now and wait.")
    ] = False,
) -> None:
    """Print this server's SandboxFusion endpoint (verl's sandbox_fusion_url is it + /run_code)."""
    import httpx

    from corral.gateway.sandbox_fusion import BUILDING, sandbox_fusion_key

    with _client() as client:
        url, key = client.url, client.api_key
    endpoint = f"{url.rstrip('/')}/sandbox-fusion/{sandbox_fusion_key(key)}"
    console.print(f"export SANDBOX_FUSION_ENDPOINT={endpoint}", highlight=False)
    console.print(f"# verl: sandbox_fusion_url: {endpoint}/run_code", highlight=False)
    if not build:
        return
    deadline = time.monotonic() + _TOOLCHAIN_BUILD_TIMEOUT_S
    call = {"language": "c", "code": "int main(void) { return 0; }", "compile_timeout": 60, "run_timeout": 10}
    while True:  # the server builds it on the first call that needs it; such calls answer SandboxError meanwhile
        answer = httpx.post(f"{endpoint}/run_code", json=call, timeout=120).json()
        if answer["status"] != "SandboxError" or not answer["message"].startswith(BUILDING):
            break
        if time.monotonic() > deadline:
            raise CorralError(f"the toolchain image was not built within {_TOOLCHAIN_BUILD_TIMEOUT_S:g} s")
        err_console.print(f"{answer['message'].split(':')[0]} ...")
        time.sleep(_TOOLCHAIN_POLL_S)
    if answer["status"] != "Success":
        raise CorralError(f"a C call on the toolchain image answered {answer['status']}: {answer['message']}")
    console.print("the toolchain image is ready: C, C++, Java, Go and Node.js calls run")


def main() -> None:
    try:
        app()
    except CorralError as exc:
        err_console.print(f"[red]error ({exc.code}):[/red] {exc.message}")
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
