"""A cgroup per VM sandbox: its QEMU process (every vCPU and I/O thread) capped at the sandbox's ``cpu`` and
at its guest memory plus QEMU's own overhead, on cgroup v1 and v2.

vCPUs alone do not limit CPU (one TCG vCPU can take a whole host core) and guest RAM does not count QEMU's
heap or its TCG code cache; the cgroup bounds both, like a container's. Its CPU weight is the kernel's default,
but a warm pool's guest boots and waits at the lowest until it is claimed (corral/backends/common/qos.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from corral.backends.common import qos
from corral.backends.common.host import CgroupLayout, remove_cgroup_dir

__all__ = ["VmCgroup", "QEMU_OVERHEAD_MB", "CFS_PERIOD_US", "KILLED_QEMU_EXIT_S"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
TIER = "corral-vm"
CFS_PERIOD_US = 100_000
QEMU_OVERHEAD_MB = 512  # heap, TCG code cache, device buffers: above the guest's own RAM
KILLED_QEMU_EXIT_S = 10.0  # for a SIGKILLed QEMU's threads to leave its cgroup


class VmCgroup:
    def __init__(self, layout: CgroupLayout, sandbox_id: str, root: Path = CGROUP_ROOT) -> None:
        self._layout = layout
        relative = Path(TIER) / sandbox_id
        if layout is CgroupLayout.UNIFIED:
            self._dirs = {"cpu": root / relative, "memory": root / relative}
        else:
            self._dirs = {controller: root / controller / relative for controller in ("cpu", "memory")}

    @property
    def memory_dir(self) -> Path:
        return self._dirs["memory"]

    def create(self, cpu: float, memory_mb: int, *, weight: int | None = None) -> None:
        """Make the cgroup with its limits (QEMU joins it with ``add`` once it runs); ``weight``: a CPU weight
        (v2 units) other than the kernel's default."""
        quota = max(1000, int(cpu * CFS_PERIOD_US))
        limit = (memory_mb + QEMU_OVERHEAD_MB) << 20
        for directory in set(self._dirs.values()):
            directory.mkdir(parents=True, exist_ok=True)
        if self._layout is CgroupLayout.UNIFIED:
            parent = self._dirs["cpu"].parent
            (parent / "cgroup.subtree_control").write_text("+cpu +memory")
            (self._dirs["cpu"] / "cpu.max").write_text(f"{quota} {CFS_PERIOD_US}")
            (self._dirs["memory"] / "memory.max").write_text(str(limit))
        else:
            (self._dirs["cpu"] / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (self._dirs["cpu"] / "cpu.cfs_quota_us").write_text(str(quota))
            (self._dirs["memory"] / "memory.limit_in_bytes").write_text(str(limit))
        if weight is not None:
            self.set_weight(weight)

    def set_weight(self, weight: int) -> None:
        """Its CPU weight, in v2 units."""
        qos.write_weight(self._dirs["cpu"], weight, self._layout)

    def add(self, pid: int) -> None:
        """Move a process, all its threads with it, into the cgroup."""
        for directory in set(self._dirs.values()):
            (directory / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(pid) for pid in (self._dirs["memory"] / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def kill_all(self) -> None:
        """SIGKILL what is still in it: its QEMU only, whether or not its pid is known (a start that failed
        before QEMU's pid file was read, or after QEMU died by itself and its leader became a zombie)."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, settle_s: float = 0.0) -> bool:
        """Delete the cgroup (a no-op if it is gone), waiting up to ``settle_s`` for a killed QEMU to leave it (a
        SIGKILLed process's leader is a zombie, listed in cgroup.procs, while its vCPU threads still exit: the
        cgroup is busy until they are gone); False if it still held a process then."""
        deadline = time.monotonic() + settle_s
        return all([remove_cgroup_dir(directory, deadline=deadline) for directory in set(self._dirs.values())])

    def cpu_quota(self) -> float | None:
        """The cap in cores, as the kernel has it."""
        try:
            if self._layout is CgroupLayout.UNIFIED:
                quota, period = (self._dirs["cpu"] / "cpu.max").read_text().split()
            else:
                quota = (self._dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip()
                period = (self._dirs["cpu"] / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
        return None if quota in ("max", "-1") else int(quota) / int(period)
