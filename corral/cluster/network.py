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

__all__ = ["ClusterNetwork", "FORWARD_READY", "enter_netns", "forward_loopback"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


FORWARD_READY = "forwarding"
"""The line ``forward_loopback`` prints once its listeners are bound."""
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
    asyncio.run(_relay_forever(listeners))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy one direction until its end, then pass the end on (a half-close stays a half-close)."""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(_RELAY_CHUNK_BYTES):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()


async def _relay_forever(listeners: list[socket.socket]) -> None:
    def handler(port: int) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", port)
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
        digest = hashlib.sha256(str(directory.resolve()).encode()).digest()
        subnet = int.from_bytes(digest[:2], "big") & 0x3FFF  # 16,384 /30s
        base = (10 << 24) | (213 << 16) | (subnet << 2)
        return cls(name=f"crl{digest.hex()[:8]}", host_address=_dotted(base + 1), address=_dotted(base + 2))

    def exists(self) -> bool:
        return Path(f"/var/run/netns/{self.name}").exists()

    def create(self) -> None:
        if self.exists():
            self.delete()
        _ip("netns", "add", self.name)
        try:
            _ip("link", "add", f"{self.name}h", "type", "veth", "peer", "name", f"{self.name}n")
            _ip("link", "set", f"{self.name}n", "netns", self.name)
            _ip("addr", "add", f"{self.host_address}/30", "dev", f"{self.name}h")
            _ip("link", "set", f"{self.name}h", "up")
            for args in (
                ("addr", "add", f"{self.address}/30", "dev", f"{self.name}n"),
                ("link", "set", f"{self.name}n", "up"),
                ("link", "set", "lo", "up"),
            ):
                _ip("-n", self.name, *args)
        except BaseException:
            self.delete()
            raise

    def delete(self) -> None:
        subprocess.run(["ip", "link", "del", f"{self.name}h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
