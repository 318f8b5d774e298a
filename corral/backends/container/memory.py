"""A container sandbox's memory cgroup: usage, OOM kills, and reclaim while paused.

A paused sandbox is frozen, so none of its pages are touched until it
resumes: the edge pushes them out. Page cache is simply dropped; anonymous
memory goes to compressed swap (zram) when the node has swap. Running
sandboxes never swap (swappiness 0 and a memory+swap limit equal to the
memory limit on v1, ``memory.swap.max`` 0 on v2); pausing lifts that for the
frozen cgroup, and resuming restores it (pages come back on first touch).
"""

from __future__ import annotations

import errno
import subprocess
import threading
from pathlib import Path

from corral.backends.base import ReclaimResult
from corral.backends.container.host import CgroupLayout

__all__ = ["CgroupMemory", "ensure_zram_swap", "swap_total_bytes"]

_CGROUP_ROOT = Path("/sys/fs/cgroup")
_UNLIMITED_V1 = "-1"
RECLAIM_CHUNK_BYTES = 16 << 20
_RECLAIM_FLOOR_BYTES = 1 << 20


def swap_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("SwapTotal:"):
            return int(line.split()[1]) * 1024
    return 0


def ensure_zram_swap(size_mb: int, device: str = "zram0") -> str:
    """Make compressed swap available for paused sandboxes; say what was done.

    Uses an unused zram device (lz4, highest priority); leaves existing swap
    alone. Host-wide and left in place at exit, like any swap device.
    """
    if size_mb <= 0:
        return "swap for paused sandboxes: off (CORRAL_PAUSE_SWAP_MB=0)"
    if swap_total_bytes() > 0:
        return f"swap for paused sandboxes: using the node's existing swap ({swap_total_bytes() >> 20} MiB)"
    block = Path("/sys/block") / device
    if not block.exists():
        subprocess.run(["modprobe", "zram"], capture_output=True, check=False)
    if not block.exists() or int((block / "disksize").read_text()) != 0:
        return f"swap for paused sandboxes: none (no free /dev/{device}); paused sandboxes keep anonymous memory"
    try:
        (block / "comp_algorithm").write_text("lz4")
    except OSError:
        pass  # keep the kernel's default compressor
    (block / "disksize").write_text(str(size_mb << 20))
    for command in (["mkswap", f"/dev/{device}"], ["swapon", "-p", "32767", f"/dev/{device}"]):
        run = subprocess.run(command, capture_output=True, text=True, check=False)
        if run.returncode != 0:
            return f"swap for paused sandboxes: none ({' '.join(command)} failed: {run.stderr.strip()})"
    return f"swap for paused sandboxes: {size_mb} MiB of zram on /dev/{device}"


class CgroupMemory:
    """The memory controller of one sandbox's cgroup (``/corral/<id>``)."""

    def __init__(self, layout: CgroupLayout, cgroup_path: str) -> None:
        self._layout = layout
        relative = cgroup_path.lstrip("/")
        self._dir = _CGROUP_ROOT / relative if layout is CgroupLayout.UNIFIED else _CGROUP_ROOT / "memory" / relative

    def _read(self, name: str) -> str:
        return (self._dir / name).read_text()

    def _write(self, name: str, value: str) -> None:
        (self._dir / name).write_text(value)

    def usage_bytes(self) -> int:
        try:
            name = "memory.current" if self._layout is CgroupLayout.UNIFIED else "memory.usage_in_bytes"
            return int(self._read(name))
        except OSError:
            return 0

    def oom_kills(self) -> int:
        """How many processes the kernel OOM-killed in this cgroup so far."""
        name, key = (
            ("memory.events", "oom_kill")
            if self._layout is CgroupLayout.UNIFIED
            else ("memory.oom_control", "oom_kill")
        )
        try:
            for line in self._read(name).splitlines():
                field, _, value = line.partition(" ")
                if field == key:
                    return int(value)
        except OSError:
            pass
        return 0

    def reclaim(self, stop: threading.Event, chunk_bytes: int = RECLAIM_CHUNK_BYTES) -> ReclaimResult:
        """Push out what can go (the cgroup must be frozen): page cache, and anonymous pages to swap.

        Works in chunks so that a resume (``stop``) waits for one chunk at most, not the whole reclaim.
        """
        before = self.usage_bytes()
        if self._layout is CgroupLayout.UNIFIED:
            self._write("memory.swap.max", "max")
            while not stop.is_set() and self.usage_bytes() > _RECLAIM_FLOOR_BYTES:
                try:
                    self._write("memory.reclaim", str(chunk_bytes))
                except OSError as exc:
                    if exc.errno in (errno.EAGAIN, errno.EBUSY):
                        break  # nothing more the kernel can take
                    raise
            return ReclaimResult(before, self.usage_bytes())
        self._write("memory.memsw.limit_in_bytes", _UNLIMITED_V1)
        self._write("memory.swappiness", "100")
        limit = self._read("memory.limit_in_bytes").strip()
        try:
            while not stop.is_set():
                usage = self.usage_bytes()
                if usage <= _RECLAIM_FLOOR_BYTES:
                    break
                try:  # a limit below the usage makes the kernel reclaim down to it, or give up (EBUSY)
                    self._write("memory.limit_in_bytes", str(max(_RECLAIM_FLOOR_BYTES, usage - chunk_bytes)))
                except OSError as exc:
                    if exc.errno in (errno.EBUSY, errno.EINTR):
                        break
                    raise
        finally:
            self._write("memory.limit_in_bytes", limit)
        return ReclaimResult(before, self.usage_bytes())

    def stop_swapping(self) -> None:
        """Before resuming: no new swap-outs (what is in swap comes back when touched)."""
        if self._layout is CgroupLayout.UNIFIED:
            try:
                self._write("memory.swap.max", "0")
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
        else:
            self._write("memory.swappiness", "0")
