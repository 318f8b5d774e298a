"""E2B's ``get_metrics``: one sample of a sandbox's CPU, memory and disk, read inside it, now.

The sandbox sees no cgroup files, so the sample comes from its own /proc:
memory used is the sum of its processes' resident memory (shared pages
counted once per process), CPU use their CPU time over a short interval
(processes that exit within it are missed), disk what ``df`` says of its
root (awk prints ``%.0f``: mawk's ``%d`` stops at 2^31 - 1, which clamped disks over 2 GiB). ``memCache``
is not known (0). The command runs directly on the edge, outside
the trajectory log: it is the platform looking, not the agent acting.
"""

from __future__ import annotations

import time
from typing import Any

from corral.api.errors import CorralError
from corral.api.models import ExecRequest, SandboxInfo
from corral.gateway.e2b.common import rfc3339
from corral.gateway.service import SandboxService

__all__ = ["sample"]

_INTERVAL_S = 0.2
_SCRIPT = f"""
ticks() {{ for f in /proc/[0-9]*/stat; do sed 's/.*) //' "$f" 2>/dev/null; done \\
  | awk '{{s += $12 + $13}} END {{printf "%.0f", s}}'; }}
a=$(ticks); sleep {_INTERVAL_S}; b=$(ticks)
echo cpu $a $b $(getconf CLK_TCK 2>/dev/null || echo 100)
awk '/^VmRSS:/ {{s += $2}} END {{printf "mem %.0f\\n", s * 1024}}' /proc/[0-9]*/status 2>/dev/null
df -kP / | awk 'NR == 2 {{printf "disk %.0f %.0f\\n", $3 * 1024, $2 * 1024}}'
"""


async def sample(sandboxes: SandboxService, info: SandboxInfo) -> dict[str, Any]:
    request = ExecRequest(cmd=["/bin/sh", "-c", _SCRIPT], timeout_s=10)
    result = await sandboxes.call(info.id, lambda edge: edge.exec(info.id, request))
    if result.exit_code != 0:
        raise CorralError(f"could not read the sandbox's metrics: {result.stderr.strip() or result.exit_code}")
    values = {name: [int(n) for n in numbers] for name, *numbers in map(str.split, result.stdout.splitlines())}
    before, after, hz = values.get("cpu", [0, 0, 100])
    cpu_s = (after - before) / max(hz, 1)
    disk = values.get("disk", [0, 0])
    now = time.time()
    return {
        "timestamp": rfc3339(now),
        "timestampUnix": int(now),
        "cpuCount": max(1, round(info.cpu)),
        "cpuUsedPct": round(min(100.0, 100 * cpu_s / _INTERVAL_S / max(info.cpu, 1e-9)), 2),
        "memUsed": (values.get("mem") or [0])[0],
        "memTotal": info.memory_mb << 20,
        "memCache": 0,
        "diskUsed": disk[0] if len(disk) == 2 else 0,
        "diskTotal": disk[1] if len(disk) == 2 else 0,
    }
