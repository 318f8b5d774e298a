"""`corral cluster`: a Corral cluster on Ray (docs/cluster.md).

``up``, ``status`` and ``down`` run a whole cluster on this machine (each node
its own raylet); ``join`` and ``leave`` run on each machine of a real one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.sdk._config import default_config_path

cluster_app = typer.Typer(help="A Corral cluster on Ray: one edge actor per node, gateways, shared PostgreSQL.")
console = Console(width=None if sys.stdout.isatty() else 160)

DEFAULT_DIR = Path("/var/lib/corral/cluster")
DirOption = Annotated[Path, typer.Option("--dir", help="Where the cluster keeps its state, logs and node data.")]


def _labels(items: list[str] | None) -> dict[str, str]:
    pairs = [item.partition("=") for item in items or []]
    bad = [key for key, sep, _ in pairs if not sep or not key]
    if bad:
        raise typer.BadParameter(f"labels look like key=value, got {bad}")
    return {key: value for key, _, value in pairs}


@cluster_app.command("up")
def up(
    nodes: Annotated[
        int,
        typer.Option(
            min=0, help="Nodes (raylets, each with an edge) to start; 0: add them later with `corral cluster join`."
        ),
    ] = 3,
    directory: DirOption = DEFAULT_DIR,
    database_url: Annotated[
        str | None, typer.Option(help="Shared PostgreSQL; default: start one in the cluster dir.")
    ] = None,
    forward_port: Annotated[
        list[int] | None,
        typer.Option(
            help="A port of this machine's 127.0.0.1 (a local registry) the cluster reaches at its own "
            "127.0.0.1:PORT; repeatable."
        ),
    ] = None,
) -> None:
    """Start a cluster on this machine: PostgreSQL, a Ray head, a gateway and N nodes, each its own raylet."""
    from corral.cluster.local import LocalCluster

    cluster = LocalCluster(directory, database_url=database_url, forward_ports=forward_port)
    if (directory / "cluster.json").exists():  # safe to run twice
        if cluster.running():
            console.print(f"a cluster is already up in {directory}: `corral cluster status --dir {directory}`")
            return
        console.print(f"[red]a cluster is recorded in {directory} but its gateway does not answer: "
                      f"`corral cluster down --dir {directory}` first[/red]")  # fmt: skip
        raise typer.Exit(1)
    started = time.monotonic()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("starting", total=None)
        state = cluster.up(nodes, progress=lambda what: bar.update(task, description=what))
    config = default_config_path()
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps({"url": state.gateway_url, "api_key": state.api_key}, indent=2) + "\n")
    os.chmod(config, 0o600)
    console.print(f"cluster up in {time.monotonic() - started:.1f} s: {nodes} node(s), Ray at {state.ray_address}")
    console.print(f"gateway {state.gateway_url}; client config (URL and API key) written to {config}")


@cluster_app.command("status")
def status(directory: DirOption = DEFAULT_DIR) -> None:
    """Nodes as the gateway sees them (state, last heartbeat, load) and the cluster's processes."""
    from corral.cluster.local import LocalCluster

    cluster = LocalCluster(directory)
    state = cluster.state = _load(directory)
    console.print(f"Ray {state.ray_address}; gateway {state.gateway_url} (pid {state.gateway_pid})")
    table = Table("node", "state", "last seen", "sandboxes", "cpu committed", "memory committed", "edge pid")
    for node in cluster.cluster_nodes():
        load = node["load"]
        edge_pid = cluster.edge_pid(node["edge_id"]) if node["edge_id"] in state.nodes else None
        table.add_row(
            node["edge_id"], node["state"], f"{time.time() - node['last_seen']:.0f} s ago", str(load["sandboxes"]),
            f"{load['cpu_committed']:g}/{load['cpu_capacity']:g}",
            f"{load['memory_committed_mb']}/{load['memory_capacity_mb']} MiB", str(edge_pid or "-"),
        )  # fmt: skip
    console.print(table)


@cluster_app.command("down")
def down(directory: DirOption = DEFAULT_DIR) -> None:
    """Kill the cluster's sandboxes and stop everything `up` started."""
    from corral.cluster.local import LocalCluster

    cluster = LocalCluster(directory)
    cluster.state = _load(directory)
    cluster.down()
    console.print(f"cluster in {directory} is down")


@cluster_app.command("join")
def join(
    address: Annotated[str, typer.Option(help="The Ray head's GCS address, host:port.")],
    edge_id: Annotated[str, typer.Option(help="This node's edge id (unique in the cluster, e.g. e7).")],
    gateway_url: Annotated[str, typer.Option(help="A gateway's URL: the shared layer store.")],
    database_url: Annotated[str, typer.Option(help="The cluster's PostgreSQL (SQLAlchemy URL).")],
    api_key: Annotated[str, typer.Option(envvar="CORRAL_API_KEY", help="The cluster's API key.")],
    data_dir: Annotated[Path, typer.Option(help="This node's data dir.")] = Path("/var/lib/corral/server"),
    label: Annotated[list[str] | None, typer.Option(help="A node label key=value (repeatable).")] = None,
) -> None:
    """Join this machine to a cluster: its raylet (in a Corral node's mount namespace) and its edge actor."""
    from corral.cluster.local import join_node, node_env
    from corral.config import Settings

    env = node_env(
        edge_id=edge_id, data_dir=data_dir, node_dir=Settings().node_dir, database_url=database_url,
        gateway_url=gateway_url, api_key=api_key, labels=_labels(label),
    )  # fmt: skip
    process, pid = join_node(address, edge_id, env, data_dir / "logs")
    (data_dir / "node.json").write_text(json.dumps({"edge_id": edge_id, "session": process.pid}) + "\n")
    console.print(f"node {edge_id} joined {address}: raylet session {process.pid}, edge actor pid {pid}")


@cluster_app.command("leave")
def leave(
    data_dir: Annotated[Path, typer.Option(help="This node's data dir.")] = Path("/var/lib/corral/server"),
) -> None:
    """Stop this machine's raylet and edge (its sandboxes are marked lost by the gateways)."""
    from corral.cluster.local import stop_session

    node = json.loads((data_dir / "node.json").read_text())
    stop_session(int(node["session"]))
    (data_dir / "node.json").unlink()
    console.print(f"node {node['edge_id']} left the cluster")


def _load(directory: Path):  # type: ignore[no-untyped-def]
    from corral.cluster.local import ClusterState

    try:
        return ClusterState.load(directory)
    except FileNotFoundError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
