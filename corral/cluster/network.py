"""The network a one-machine cluster lives in: a network namespace of its own, reached over a veth pair.

Ray will not put a node on a loopback address (it swaps 127.0.0.1 for the
machine's outward address), so a cluster of several raylets on one machine
gets a namespace with one veth: the cluster's processes (head, raylets, edge
actors, gateway) use the inner address, clients reach the gateway from the
host through the pair, and the namespace has no default route, so nothing in
it can reach any other address.

A service the host offers only on its own loopback (a registry on
127.0.0.1:5000 in the tests, or a developer's) is then out of the gateway's
reach: the namespace has its own loopback. ``forward_loopback`` bridges named
ports: it listens on 127.0.0.1:<port> inside the namespace and connects to
127.0.0.1:<port> outside, so a reference like ``127.0.0.1:5000/ns/img:tag``
means the same registry to the host and to the gateway, and no traffic leaves
either loopback.

A node can also get a namespace of its own (``NodeNetwork``), joined to the
cluster's by a veth pair of its own, the way another machine would be: its
own address, a route to the cluster's address and nothing else, the state
database reached over TCP (``relay_unix_socket``: PostgreSQL's unix socket
offered on the cluster's address). Its link can then be cut and restored
(``cut``/``restore``: blackhole routes at both ends, so packets in flight are
dropped silently, as in a partition, and established connections survive
a short one).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import hashlib
import os
import socket
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClusterNetwork", "FORWARD_READY", "NodeNetwork", "enter_netns", "forward_loopback", "relay_unix_socket"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


FORWARD_READY = "forwarding"
"""The line ``forward_loopback`` prints once its listeners are bound (``relay_unix_socket`` adds its port)."""
_RELAY_CHUNK_BYTES = 1 << 16


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {path}: {os.strerror(errno)}")
    finally:
        os.close(fd)


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the named network namespace."""
    _setns(f"/var/run/netns/{name}")


def forward_loopback(netns: str, ports: list[int]) -> None:
    """Serve forever: connections to 127.0.0.1:<port> inside ``netns`` are relayed to 127.0.0.1:<port> in the
    namespace this (single-threaded) process started in. A socket keeps the namespace it was made in, so the
    listeners are bound inside and the process steps back out before it connects anywhere."""
    home_fd = os.open("/proc/self/ns/net", os.O_RDONLY)  # held open: the way back
    try:
        enter_netns(netns)
        listeners = []
        for port in ports:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", port))
            listener.listen(128)
            listeners.append(listener)
        _setns(f"/proc/self/fd/{home_fd}")
    finally:
        os.close(home_fd)
    print(FORWARD_READY, flush=True)
    asyncio.run(_relay_forever(listeners, lambda port: asyncio.open_connection("127.0.0.1", port)))


def relay_unix_socket(netns: str, address: str, socket_path: str) -> None:
    """Serve forever: TCP connections to ``address`` (a free port on it) inside ``netns`` are relayed to the unix
    socket ``socket_path``. Prints ``FORWARD_READY`` and the port once bound. A node in a namespace of its own
    reaches a database that listens on a unix socket only (the tests' PostgreSQL) over the network this way."""
    enter_netns(netns)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, 0))
    listener.listen(128)
    print(FORWARD_READY, listener.getsockname()[1], flush=True)
    asyncio.run(_relay_forever([listener], lambda _: asyncio.open_unix_connection(socket_path)))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until its end, then pass the end on (a half-close stays a half-close)."""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(_RELAY_CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


_Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _relay_forever(listeners: list[socket.socket], upstream: Callable[[int], Awaitable[_Streams]]) -> None:
    """Relay each connection to a listener to ``upstream(the listener's port)``."""

    def handler(port: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                upstream_reader, upstream_writer = await upstream(port)
            except OSError:
                writer.close()
                return
            try:
                await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))
            finally:
                for end in (writer, upstream_writer):
                    with contextlib.suppress(OSError):
                        end.close()

        return relay

    servers = [await asyncio.start_server(handler(s.getsockname()[1]), sock=s) for s in listeners]
    await asyncio.gather(*(server.serve_forever() for server in servers))


def _dotted(value: int) -> str:
    return ".".join(str(value >> shift & 0xFF) for shift in (24, 16, 8, 0))


def _named_slot(key: str, prefix: str, second_octet: int) -> tuple[str, str, str]:
    """A namespace name (``prefix`` + 8 hex digits, room for a veth suffix in 15 characters) and the two
    addresses of a /30 in 10.<second_octet>.0.0/16 (16,384 of them), both derived from ``key``."""
    digest = hashlib.sha256(key.encode()).digest()
    subnet = int.from_bytes(digest[:2], "big") & 0x3FFF
    base = (10 << 24) | (second_octet << 16) | (subnet << 2)
    return f"{prefix}{digest.hex()[:8]}", _dotted(base + 1), _dotted(base + 2)


def _netns_exists(name: str) -> bool:
    return Path(f"/var/run/netns/{name}").exists()


def _create_joined_netns(
    name: str, outer_suffix: str, outer_netns: str | None, outer_address: str, inner_address: str, *,
    delete: Callable[[], None], routes: list[tuple[str, ...]] | None = None,
) -> None:  # fmt: skip
    """The network namespace ``name`` (made anew: ``delete`` removes a leftover, and a half-made one) joined to
    ``outer_netns`` (None: this process's) by a veth pair, ``<name><outer_suffix>`` outside with
    ``outer_address`` and ``<name>n`` inside with ``inner_address`` (a /30 each), both up, loopback up inside,
    then ``routes`` (``ip`` arguments) inside."""
    if _netns_exists(name):
        delete()
    outer = ("-n", outer_netns) if outer_netns else ()
    outer_dev, inner_dev = f"{name}{outer_suffix}", f"{name}n"
    try:
        _ip("netns", "add", name)
        _ip(*outer, "link", "add", outer_dev, "type", "veth", "peer", "name", inner_dev, "netns", name)
        _ip(*outer, "addr", "add", f"{outer_address}/30", "dev", outer_dev)
        _ip(*outer, "link", "set", outer_dev, "up")
        for args in (("addr", "add", f"{inner_address}/30", "dev", inner_dev), ("link", "set", inner_dev, "up"),
                     ("link", "set", "lo", "up"), *(routes or [])):  # fmt: skip
            _ip("-n", name, *args)
    except BaseException:
        delete()
        raise


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@dataclass(frozen=True)
class ClusterNetwork:
    name: str  # the namespace, and the stem of the veth names
    host_address: str  # the host's end of the pair
    address: str  # the cluster's address inside the namespace

    @classmethod
    def for_directory(cls, directory: Path) -> ClusterNetwork:
        """A namespace and a /30 in 10.213.0.0/16 named after the cluster's directory."""
        name, host_address, address = _named_slot(str(directory.resolve()), "crl", 213)
        return cls(name=name, host_address=host_address, address=address)

    def exists(self) -> bool:
        return _netns_exists(self.name)

    def create(self) -> None:
        _create_joined_netns(self.name, "h", None, self.host_address, self.address, delete=self.delete)

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", f"{self.name}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


@dataclass(frozen=True)
class NodeNetwork:
    """A node's namespace of its own, joined to the cluster's (``cluster``) by a veth pair: ``address`` is the
    node's end, ``peer_address`` the cluster namespace's. Inside, one route: to the cluster's address."""

    name: str  # the namespace, and the stem of the veth names
    address: str
    peer_address: str
    cluster: ClusterNetwork

    @classmethod
    def for_node(cls, cluster: ClusterNetwork, edge_id: str) -> NodeNetwork:
        """A namespace and a /30 in 10.214.0.0/16 named after the cluster's namespace and the node."""
        name, peer_address, address = _named_slot(f"{cluster.name}/{edge_id}", "crn", 214)
        return cls(name=name, address=address, peer_address=peer_address, cluster=cluster)

    def exists(self) -> bool:
        return _netns_exists(self.name)

    def create(self) -> None:
        route = ("route", "add", f"{self.cluster.address}/32", "via", self.peer_address, "dev", f"{self.name}n")
        _create_joined_netns(self.name, "c", self.cluster.name, self.peer_address, self.address, delete=self.delete,
                             routes=[route])  # fmt: skip

    def cut(self) -> None:
        """Drop every packet between the node and the cluster, both ways, without a word to either end."""
        _ip("-n", self.cluster.name, "route", "replace", "blackhole", f"{self.address}/32")
        _ip("-n", self.name, "route", "replace", "blackhole", f"{self.cluster.address}/32")

    def restore(self) -> None:
        """Undo ``cut``: the routes as ``create`` left them."""
        _ip("-n", self.name, "route", "replace", f"{self.cluster.address}/32", "via", self.peer_address,
            "dev", f"{self.name}n")  # fmt: skip
        subprocess.run(["ip", "-n", self.cluster.name, "route", "del", "blackhole", f"{self.address}/32"],
                       capture_output=True)  # fmt: skip

    def is_cut(self) -> bool:
        routes = subprocess.run(["ip", "-n", self.name, "route", "show", f"{self.cluster.address}/32"],
                                capture_output=True, text=True)  # fmt: skip
        return routes.stdout.startswith("blackhole")

    def delete(self) -> None:
        subprocess.run(["ip", "-n", self.cluster.name, "link", "del", f"{self.name}c"], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
