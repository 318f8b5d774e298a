"""What the node itself says about its memory, swap, CPU and pressure (/proc, PSI).

Read by the edge for node stats, for admission (refuse before the node swaps
itself to death) and for pressure-driven reclaim of idle sandboxes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["HostReadings", "read_host"]

_PROC = Path("/proc")


@dataclass(frozen=True)
class HostReadings:
    memory_total_mb: int
    memory_available_mb: int
    swap_total_mb: int
    swap_used_mb: int
    load_1m: float
    cpu_some_avg10: float  # PSI: % of the last 10 s some task waited for CPU
    memory_some_avg10: float  # some task stalled on memory
    memory_full_avg10: float  # every task stalled on memory: the node is thrashing
    io_some_avg10: float


def _meminfo(proc: Path) -> dict[str, int]:
    values: dict[str, int] = {}
    for line in (proc / "meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0])  # kB
    return values


def _psi(proc: Path, resource: str) -> tuple[float, float]:
    """(some avg10, full avg10) in percent; zeros when the kernel has no PSI."""
    some = full = 0.0
    try:
        text = (proc / "pressure" / resource).read_text()
    except OSError:
        return some, full
    for line in text.splitlines():
        kind, *fields = line.split()
        avg10 = next((float(f.split("=", 1)[1]) for f in fields if f.startswith("avg10=")), 0.0)
        if kind == "some":
            some = avg10
        elif kind == "full":
            full = avg10
    return some, full


def read_host(proc: Path = _PROC) -> HostReadings:
    mem = _meminfo(proc)
    memory_some, memory_full = _psi(proc, "memory")
    return HostReadings(
        memory_total_mb=mem.get("MemTotal", 0) // 1024,
        memory_available_mb=mem.get("MemAvailable", 0) // 1024,
        swap_total_mb=mem.get("SwapTotal", 0) // 1024,
        swap_used_mb=(mem.get("SwapTotal", 0) - mem.get("SwapFree", 0)) // 1024,
        load_1m=os.getloadavg()[0] if proc == _PROC else float((proc / "loadavg").read_text().split()[0]),
        cpu_some_avg10=_psi(proc, "cpu")[0],
        memory_some_avg10=memory_some,
        memory_full_avg10=memory_full,
        io_some_avg10=_psi(proc, "io")[0],
    )
