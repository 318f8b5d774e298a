"""A node's network namespace of its own (cluster/network.py, ``NodeNetwork``) and the relay that offers a unix
socket on the cluster's address (``relay_unix_socket``), on real namespaces and veth pairs, without Ray: the
node reaches the cluster's address and nothing else; a cut drops packets both ways without a word (an open
connection gets no answer, and survives), a restore lets them through again. The whole cluster's use of it is
tests/cluster/test_cluster_faults.py's network-cut test."""

from __future__ import annotations

import contextlib
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.cluster.network import FORWARD_READY, ClusterNetwork, NodeNetwork

pytestmark = pytest.mark.skipif(subprocess.run(["ip", "-V"], capture_output=True).returncode != 0,
                                reason="needs iproute2")  # fmt: skip

# Runs in the node's namespace: connects to argv[1]:argv[2], then for each line on stdin sends it and prints
# what comes back within argv[3] seconds (or "silence"); "connect HOST PORT" tries a new connection instead.
_CLIENT = """
import socket, sys
address, port, wait_s = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conn = socket.create_connection((address, port), timeout=5)
print("connected", flush=True)
for line in sys.stdin:
    if line.startswith("connect "):
        _, host, other = line.split()
        try:
            socket.create_connection((host, int(other)), timeout=wait_s).close()
            print("reached", flush=True)
        except OSError as exc:
            print(f"unreachable {type(exc).__name__}", flush=True)
        continue
    conn.sendall(line.encode())
    conn.settimeout(wait_s)
    try:
        print("got " + " ".join(conn.recv(1024).decode().split()), flush=True)
    except TimeoutError:
        print("silence", flush=True)
"""


def _launch(*args: str) -> list[str]:
    return [sys.executable, "-m", "corral.cluster.launch", *args]


@contextlib.contextmanager
def _networks(directory: Path) -> Iterator[tuple[ClusterNetwork, NodeNetwork]]:
    cluster = ClusterNetwork.for_directory(directory)
    node = NodeNetwork.for_node(cluster, "n1")
    cluster.create()
    try:
        node.create()
        yield cluster, node
    finally:
        node.delete()
        cluster.delete()
    assert not cluster.exists() and not node.exists()


def _echo_server(path: Path) -> socket.socket:
    """A unix socket that echoes each connection's data (the database's socket, for the relay)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(1024):
                conn.sendall(data)

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=serve, args=(server.accept()[0],), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return server


def _ask(client: subprocess.Popen[str], line: str, timeout_s: float = 30) -> str:
    assert client.stdin is not None and client.stdout is not None
    client.stdin.write(line + "\n")
    client.stdin.flush()
    ready, _, _ = select.select([client.stdout], [], [], timeout_s)
    assert ready, f"the client in the node's namespace did not answer {line!r}"
    return client.stdout.readline().strip()


def test_a_cut_drops_both_ways_silently_and_a_restore_lets_the_open_connection_go_on(tmp_path: Path) -> None:
    server = _echo_server(tmp_path / "db.sock")
    relay = client = None
    try:
        with _networks(tmp_path) as (cluster, node):
            relay = subprocess.Popen(_launch("relay", cluster.name, cluster.address, str(tmp_path / "db.sock")),
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
            assert relay.stdout is not None
            ready = relay.stdout.readline().split()
            assert ready[0] == FORWARD_READY, ready
            port = ready[1]
            client = subprocess.Popen(
                _launch("netns", node.name, "--", sys.executable, "-c", _CLIENT, cluster.address, port, "1.5"),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert client.stdout is not None
            assert client.stdout.readline().strip() == "connected"
            assert _ask(client, "before") == "got before"  # through the veth and the relay to the socket
            assert _ask(client, f"connect {cluster.host_address} {port}").startswith("unreachable")  # nothing else
            assert not node.is_cut()
            node.cut()
            assert node.is_cut()
            assert _ask(client, "during") == "silence"  # dropped, and no error on the open connection
            assert _ask(client, f"connect {cluster.address} {port}").startswith("unreachable")
            node.restore()
            assert not node.is_cut()
            started = time.monotonic()
            answer = _ask(client, "after")
            while answer == "silence" and time.monotonic() - started < 20:  # TCP's next retransmission
                answer = _ask(client, "after")
            assert answer.startswith("got during"), answer  # the same connection: what was sent arrives
            assert _ask(client, f"connect {cluster.address} {port}") == "reached"
    finally:
        for process in (client, relay):
            if process is not None:
                process.kill()
                process.wait()
        server.close()
