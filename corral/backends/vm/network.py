"""A VM sandbox's own network namespace: its guest's NIC on a tap device there, routed out through the fabric.

The namespace gets the sandbox's fabric address on ``eth0`` (and the egress
allowlist, on the forward hook) like a container's; the guest sits behind a
point-to-point link on ``tap0`` and is masqueraded to that address. The host's
own network namespace is never touched. The guest's side of the link is the
same in every VM, so a forked guest keeps working in its child's namespace.
"""

from __future__ import annotations

import hashlib
import os
import subprocess

from corral.api.errors import InternalError
from corral.backends.common import nftables
from corral.backends.common.network import GUEST_LINK_IFNAME, clear_stale_name, is_namespace

__all__ = ["GUEST_ADDRESS", "GUEST_GATEWAY", "namespace_name", "create_guest_link", "delete_namespace", "name_again"]

GUEST_GATEWAY = "192.168.127.1"
GUEST_ADDRESS = "192.168.127.2"
_PREFIX = 30


def namespace_name(sandbox_id: str) -> str:
    return f"corral-vm-{hashlib.sha256(sandbox_id.encode()).hexdigest()[:12]}"


def _run(argv: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise InternalError(f"{' '.join(argv[:4])} failed: {done.stderr.strip()[-400:]}")


def create_guest_link(name: str) -> str:
    """The namespace (created if missing) with a tap device for QEMU and NAT towards ``eth0``; its path."""
    path = f"/run/netns/{name}"
    if not is_namespace(path):
        clear_stale_name(path)
        _run(["ip", "netns", "add", name])
    _run(
        ["ip", "-n", name, "-batch", "-"],
        f"link set lo up\ntuntap add dev {GUEST_LINK_IFNAME} mode tap\n"
        f"addr add {GUEST_GATEWAY}/{_PREFIX} dev {GUEST_LINK_IFNAME}\nlink set {GUEST_LINK_IFNAME} up\n",
    )
    _run(["nsenter", f"--net={path}", "sysctl", "-qw", "net.ipv4.ip_forward=1"])
    nat = (
        "table ip corral_nat {\n  chain postrouting {\n    type nat hook postrouting priority 100; policy accept;\n"
        '    oifname "eth0" masquerade\n  }\n}\n'
    )
    nftables.run(path, nat)
    return path


def name_again(name: str, pid: int) -> str:
    """After a server restart: ``/run/netns/<name>`` names the namespace QEMU (``pid``) runs in again, in this
    server's mount namespace (the name was a bind mount in the old server's, which ended with it); its path."""
    path, running_in = f"/run/netns/{name}", f"/proc/{pid}/ns/net"
    target = os.stat(running_in)
    if is_namespace(path):
        named = os.stat(path)
        if (named.st_ino, named.st_dev) == (target.st_ino, target.st_dev):
            return path
        raise InternalError(f"{path} names another network namespace than the one its VM (pid {pid}) runs in")
    clear_stale_name(path)
    with open(path, "x"):  # the mount point: an empty file, as ip netns add makes it
        pass
    try:
        _run(["mount", "--bind", running_in, path])
    except BaseException:
        os.unlink(path)  # not left as a stale name
        raise
    return path


def delete_namespace(name: str) -> None:
    if os.path.exists(f"/run/netns/{name}"):
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
