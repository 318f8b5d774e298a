"""What ended sandboxes may have left on the host: the one check that fault tests and the density bench share.

A container sandbox is a crun container (its state under ``runtime_state_root(data_dir, "crun")``), the processes in its
cgroups, the overlay of its own mount namespace over erofs layers, cgroups under ``corral/`` or
``corral-batch/`` of each controller, a veth in the node's router namespace when it had a network (a VM sandbox's
own network namespace has a name under /run/netns), and a
subvolume of the node's btrfs pool (``<data_dir>/writable.img`` on one loop device), and its directories (on
disk and in the node's run dir). After its sandboxes
end, none of that may remain but the node's own shared parts: the router namespace and, while the server
runs, the pool's one loop device. A process of a sandbox is found by its cgroup, so a mount or network
namespace no process holds any more is gone with it; the namespaces that outlive processes are bind
mounts, which the mount tables show.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Collection
from dataclasses import dataclass, fields
from pathlib import Path

from corral.backends.common.host import runtime_dirs_of, runtime_state_root, vm_sockets_of
from corral.backends.common.network import sandbox_veth_name
from corral.backends.vm.network import namespace_name
from corral.procfs import mount_field

__all__ = ["Leftovers", "find_leftovers"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
_CGROUP_TIERS = ("corral", "corral-batch", "corral-vm")  # containers by CPU class; VMs
_TOOL_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Leftovers:
    """What of the given sandboxes (or of the server's data dir) is still on the host; empty lists if nothing."""

    containers: list[str]
    processes: list[int]
    cgroups: list[str]
    mounts: list[str]
    veths: list[str]
    netns_names: list[str]
    loop_devices: list[str]
    sandbox_dirs: list[str]

    def counts(self) -> dict[str, int]:
        return {field.name: len(getattr(self, field.name)) for field in fields(self)}

    def __bool__(self) -> bool:
        return any(self.counts().values())


def _containers(data_dir: Path) -> list[str]:
    state_root = runtime_state_root(data_dir, "crun")
    crun = shutil.which("crun")
    if crun is None or not state_root.is_dir():
        return []
    listing = subprocess.run([crun, "--root", str(state_root), "list", "-q"], capture_output=True, text=True,
                             stdin=subprocess.DEVNULL, timeout=_TOOL_TIMEOUT_S)  # fmt: skip
    return listing.stdout.split()


def _processes(ids: set[str]) -> list[int]:
    """Processes in a cgroup of one of ``ids`` (agents, commands, and whatever they forked)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            lines = (entry / "cgroup").read_text().splitlines()
        except OSError:  # it exited meanwhile
            continue
        if any(part in ids for line in lines for part in line.rsplit(":", 1)[-1].split("/")):
            found.append(int(entry.name))
    return found


def _cgroups(ids: set[str]) -> list[str]:
    return sorted(str(path) for tier in _CGROUP_TIERS for pattern in (f"{tier}/*", f"*/{tier}/*")
                  for path in CGROUP_ROOT.glob(pattern) if path.name in ids)  # fmt: skip


def _mounts(data_dir: Path, ids: set[str], server_pid: int | None) -> list[str]:
    """Overlay, erofs and bind mounts of these sandboxes or of this data dir, on the host and, while it runs,
    in the server's namespace (where the layers are mounted: those are the node's, not a sandbox's, unless
    they name a sandbox)."""
    found = [line for line in Path("/proc/mounts").read_text().splitlines()
             if str(data_dir) in mount_field(line) or any(sandbox_id in line for sandbox_id in ids)]  # fmt: skip
    if server_pid is not None:
        try:
            server_mounts = Path(f"/proc/{server_pid}/mounts").read_text().splitlines()
        except OSError:
            server_mounts = []
        found += [line for line in server_mounts if any(sandbox_id in line for sandbox_id in ids)]
    return found


def _veths(ids: set[str], server_pid: int | None) -> list[str]:
    """Sandbox ends of the router namespaces' veth pairs that belong to one of ``ids``. A server names its router
    namespace by a mount in its own mount namespace (from the host's its name is an empty file), so while it runs
    the names are read through its root, ``/proc/<pid>/root/run/netns``; once it stopped, its router namespace
    ended with it, and with it every veth inside."""
    wanted = {sandbox_veth_name(sandbox_id): sandbox_id for sandbox_id in ids}
    names = Path(f"/proc/{server_pid}/root/run/netns") if server_pid is not None else Path("/run/netns")
    try:
        namespaces = sorted(names.glob("corral-*"))
    except OSError:  # the server ended meanwhile
        namespaces = []
    found = []
    for namespace in namespaces:
        links = subprocess.run(["nsenter", f"--net={namespace}", "ip", "-o", "link", "show"], capture_output=True,
                               text=True, timeout=_TOOL_TIMEOUT_S).stdout  # fmt: skip
        for line in links.splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            if name in wanted:
                found.append(f"{namespace.name}/{name} ({wanted[name]})")
    return found


def _netns_names(ids: set[str]) -> list[str]:
    """Names of VM sandboxes' network namespaces under /run/netns: a server's are mounts in its own mount namespace,
    so from here a name is its file, which its sandbox's end (or the cleanup after its server) removes."""
    return sorted(path for path in (f"/run/netns/{namespace_name(i)}" for i in ids) if os.path.lexists(path))


def _loop_devices(data_dir: Path, server_running: bool) -> list[str]:
    """Loop devices backed by files in ``data_dir``; the pool's own one only once the server is down. One whose
    file was deleted while a file of that name exists now is an earlier file's: a run before this one with the same
    data dir path (pytest's fixed base temp dir, made anew each run), not this server's."""
    listing = subprocess.run(["losetup", "--list", "--noheadings", "--output", "NAME,BACK-FILE"], capture_output=True,
                             text=True, timeout=_TOOL_TIMEOUT_S).stdout  # fmt: skip
    pool = str(data_dir / "writable.img")
    found = []
    for line in listing.splitlines():
        name, _, backing = line.strip().partition(" ")
        backing = backing.strip()
        if backing.endswith(" (deleted)"):
            backing = backing.removesuffix(" (deleted)")
            if os.path.exists(backing):
                continue
        if backing.startswith(f"{data_dir}/") and not (server_running and backing == pool):
            found.append(f"{name} {backing}")
    return found


def _sandbox_dirs(data_dir: Path, ids: set[str]) -> list[str]:
    """Their directories: on disk (a writable layer without a quota, gVisor's checkpoints, a VM's disk) and in the
    node's run dir (bundle, pid file, runtime log; a VM's sockets)."""
    roots = (data_dir / "sandboxes", data_dir / "vms", runtime_dirs_of(data_dir), vm_sockets_of(data_dir))
    candidates = [root / sandbox_id for root in roots for sandbox_id in ids]
    return sorted(str(path) for path in candidates if path.exists())


def find_leftovers(data_dir: Path, sandbox_ids: Collection[str], *, server_pid: int | None = None) -> Leftovers:
    """What of ``sandbox_ids`` (all ended) and of the server with ``data_dir`` remains on the host.

    ``server_pid``: the server's process while it still runs (its mount namespace is searched for mounts and its
    router namespace for veths, and the pool's loop device is its own); None once it stopped."""
    ids = set(sandbox_ids)
    return Leftovers(
        containers=_containers(data_dir),
        processes=_processes(ids),
        cgroups=_cgroups(ids),
        mounts=_mounts(data_dir, ids, server_pid),
        veths=_veths(ids, server_pid),
        netns_names=_netns_names(ids),
        loop_devices=_loop_devices(data_dir, server_pid is not None),
        sandbox_dirs=_sandbox_dirs(data_dir, ids),
    )
