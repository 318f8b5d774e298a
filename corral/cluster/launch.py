"""Processes that start a cluster node: `python -m corral.cluster.launch node|edge|netns ...`.

``node -- ray start ...`` enters a private mount namespace for the Corral node
(a fresh single-threaded process can; a Ray worker cannot) and becomes the
``ray start`` command, so the raylet and every worker it spawns (the edge
actor among them) inherit the namespace. Its environment (``CORRAL_*``) is
the node's settings, which the edge actor reads.

``edge --edge-id e1`` connects to the cluster as a short-lived driver and
creates the node's edge actor: detached, named ``edge-<id>``, restarted by
Ray without limit, and placed by the custom resource only that node offers.
It waits until the actor has started (and re-adopted), prints its pid, exits.

``--netns NAME`` runs any of them in a one-machine cluster's network
namespace (cluster/network.py); ``netns NAME -- command`` runs any command
there (the gateway). ``forward NAME PORT...`` bridges host loopback ports into
the namespace (``forward_loopback``: a registry on the host's 127.0.0.1).
``relay NAME ADDRESS SOCKET`` offers a unix socket (PostgreSQL's) on an
address in the namespace, for a node in a namespace of its own
(``relay_unix_socket``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from corral.cluster.edge_actor import ACTOR_NAMESPACE, EdgeActor, actor_name, node_resource
from corral.cluster.network import enter_netns, forward_loopback, relay_unix_socket
from corral.node import enter_node_namespace

__all__ = ["main", "EDGE_START_TIMEOUT_S"]

EDGE_START_TIMEOUT_S = 300.0  # a first start compiles the helpers


def _run_in(netns: str | None, argv: list[str], *, node: bool = False) -> None:
    if netns:
        enter_netns(netns)
    if node:
        enter_node_namespace()
    command = [arg for arg in argv if arg != "--"]
    os.execvp(command[0], command)


def _create_edge(address: str, edge_id: str) -> int:
    import ray

    ray.init(address=address, namespace=ACTOR_NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
    try:
        actor: Any  # a handle to the detached actor, found or made
        try:
            actor = ray.get_actor(actor_name(edge_id), ACTOR_NAMESPACE)
        except ValueError:
            actor = (
                ray.remote(EdgeActor)
                .options(
                    name=actor_name(edge_id),
                    namespace=ACTOR_NAMESPACE,
                    lifetime="detached",
                    max_restarts=-1,
                    max_task_retries=0,
                    num_cpus=0,
                    resources={node_resource(edge_id): 1},
                    max_concurrency=1000,
                )  # fmt: skip
                .remote()
            )
        return int(ray.get(actor.pid.remote(), timeout=EDGE_START_TIMEOUT_S))
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m corral.cluster.launch")
    commands = parser.add_subparsers(dest="command", required=True)
    node = commands.add_parser("node", help="enter a node's mount namespace, then run the command (ray start)")
    node.add_argument("--netns")
    node.add_argument("argv", nargs=argparse.REMAINDER)
    edge = commands.add_parser("edge", help="create this node's edge actor and wait for it")
    edge.add_argument("--netns")
    edge.add_argument("--address", required=True)
    edge.add_argument("--edge-id", required=True)
    netns = commands.add_parser("netns", help="run a command in a cluster's network namespace")
    netns.add_argument("name")
    netns.add_argument("argv", nargs=argparse.REMAINDER)
    forward = commands.add_parser("forward", help="relay 127.0.0.1:PORT in the namespace to the host's")
    forward.add_argument("name")
    forward.add_argument("ports", nargs="+", type=int)
    relay = commands.add_parser("relay", help="offer a unix socket on ADDRESS:<a free port> in the namespace")
    relay.add_argument("name")
    relay.add_argument("address")
    relay.add_argument("socket")
    args = parser.parse_args(argv)
    if args.command == "forward":
        forward_loopback(args.name, args.ports)
        return
    if args.command == "relay":
        relay_unix_socket(args.name, args.address, args.socket)
        return
    if args.command == "node":
        _run_in(args.netns, args.argv, node=True)
    if args.command == "netns":
        _run_in(args.name, args.argv)
    if args.netns:
        enter_netns(args.netns)
    print(_create_edge(args.address, args.edge_id), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
