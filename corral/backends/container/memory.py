"""A container sandbox's memory cgroup: usage, OOM kills, and reclaim while paused.

A paused sandbox is frozen, so none of its pages are touched until it
resumes: the edge pushes them out. Page cache is simply dropped; anonymous
memory goes to compressed swap (zram) when the node has swap. Running
sandboxes never swap (swappiness 0 and a memory+swap limit equal to the
memory limit on v1, ``memory.swap.max`` 0 on v2); pausing lifts that for the
frozen cgroup, and resuming restores it and prefetches what went to swap.
"""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import threading
from pathlib import Path

from corral.backends.base import ReclaimResult
from corral.backends.common.host import CgroupLayout
from corral.procfs import held_files, read_small

__all__ = ["CgroupMemory", "ensure_zram_swap", "prefetch_swapped", "swap_total_bytes"]

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
        return read_small(f"{self._dir}/{name}")  # before every command (oom_kills): os-level

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
            for line in held_files.read(f"{self._dir}/{name}").splitlines():  # before and after every command
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

    def pids(self) -> list[int]:
        try:
            return [int(pid) for pid in self._read("cgroup.procs").split()]
        except OSError:
            return []

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


_SYS_PROCESS_MADVISE = 440  # x86_64
_MADV_WILLNEED = 3
_IOV_MAX = 1024
_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _private_writable_ranges(pid: int) -> list[tuple[int, int]]:
    """Anonymous-memory candidates: private writable mappings (heap, stacks, anonymous regions)."""
    ranges = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 2 and fields[1].startswith("rw") and fields[1].endswith("p"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end - start))
    return ranges


def prefetch_swapped(pids: list[int]) -> int:
    """Ask the kernel to read a resumed sandbox's swapped-out memory back now (MADV_WILLNEED through
    process_madvise: swap read-ahead into the swap cache), so first touches are minor faults instead of
    one swap-in each. Returns bytes advised."""
    advised = 0
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # gone already
        try:
            ranges = _private_writable_ranges(pid)
            for offset in range(0, len(ranges), _IOV_MAX):
                chunk = ranges[offset : offset + _IOV_MAX]
                iov = (_IoVec * len(chunk))(*[_IoVec(start, length) for start, length in chunk])
                result = _libc.syscall(_SYS_PROCESS_MADVISE, pidfd, iov, len(chunk), _MADV_WILLNEED, 0)
                if result > 0:
                    advised += result
        except OSError:
            continue
        finally:
            os.close(pidfd)
    return advised
