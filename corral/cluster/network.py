"""The network a one-machine cluster lives in: a network namespace of its own, reached over a veth pair.

Ray will not put a node on a loopback address (it swaps 127.0.0.1 for the
machine's outward address), so a cluster of several raylets on one machine
gets a namespace with one veth: the cluster's processes (head, raylets, edge
actors, gateway) use the inner address, clients reach the gateway from the
host through the pair, and the namespace has no default route, so nothing in
it can reach any other address.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClusterNetwork", "enter_netns"]

_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def enter_netns(name: str) -> None:
    """Move this (single-threaded) process into the named network namespace."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if _libc.setns(fd, _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"setns into network namespace {name}: {os.strerror(errno)}")
    finally:
        os.close(fd)


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
