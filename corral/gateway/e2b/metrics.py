"""E2B's ``get_metrics``: one sample of a sandbox's CPU, memory and disk, read inside it, now.

The sandbox's own cgroup (v1 or v2 files, as the container sees them) gives
memory used and CPU time; CPU use is CPU time over a short interval; ``df``
gives the disk of its root. The command runs directly on the edge, outside
the trajectory log: it is the platform looking, not the agent acting.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from corral.gateway.service import SandboxService
from corral.sdk._exceptions import CorralError
from corral.sdk._models import ExecRequest, SandboxInfo

__all__ = ["sample"]

_INTERVAL_S = 0.2
_SCRIPT = f"""
read_cpu() {{ cat /sys/fs/cgroup/cpuacct/cpuacct.usage 2>/dev/null \\
  || awk '/^usage_usec/ {{print $2 * 1000}}' /sys/fs/cgroup/cpu.stat 2>/dev/null || echo 0; }}
a=$(read_cpu); sleep {_INTERVAL_S}; b=$(read_cpu)
echo cpu $a $b
echo mem $(cat /sys/fs/cgroup/memory/memory.usage_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.current 2>/dev/null || echo 0)
echo cache $(awk '$1 == "cache" || $1 == "file" {{print $2; exit}}' /sys/fs/cgroup/memory/memory.stat /sys/fs/cgroup/memory.stat 2>/dev/null || echo 0)
df -kP / | awk 'NR == 2 {{print "disk", $3 * 1024, $2 * 1024}}'
"""


async def sample(sandboxes: SandboxService, info: SandboxInfo) -> dict[str, Any]:
    request = ExecRequest(cmd=["/bin/sh", "-c", _SCRIPT], timeout_s=10)
    result = await sandboxes.call(info.id, lambda edge: edge.exec(info.id, request))
    if result.exit_code != 0:
        raise CorralError(f"could not read the sandbox's metrics: {result.stderr.strip() or result.exit_code}")
    values: dict[str, list[int]] = {}
    for line in result.stdout.splitlines():
        name, *numbers = line.split()
        values[name] = [int(float(n)) for n in numbers if n.replace(".", "", 1).isdigit()]
    cpu = values.get("cpu", [0, 0])
    cpu_ns = cpu[1] - cpu[0] if len(cpu) == 2 else 0
    disk = values.get("disk", [0, 0])
    now = time.time()
    return {
        "timestamp": dt.datetime.fromtimestamp(now, dt.UTC).isoformat().replace("+00:00", "Z"),
        "timestampUnix": int(now),
        "cpuCount": max(1, round(info.cpu)),
        "cpuUsedPct": round(100 * cpu_ns / (_INTERVAL_S * 1e9) / max(info.cpu, 1e-9), 2),
        "memUsed": (values.get("mem") or [0])[0],
        "memTotal": info.memory_mb << 20,
        "memCache": (values.get("cache") or [0])[0],
        "diskUsed": disk[0] if len(disk) == 2 else 0,
        "diskTotal": disk[1] if len(disk) == 2 else 0,
    }
