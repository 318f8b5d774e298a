"""CPU QoS classes of container sandboxes: where their cgroup sits and its CPU weight (v1 ``cpu.shares``,
v2 ``cpu.weight``).

Two classes. ``latency`` sandboxes live in ``/corral/<id>`` with the kernel's
default weight (v1 1024 shares, v2 weight 100): what every sandbox had before
classes existed. ``batch`` sandboxes live in a tier of their own,
``/corral-batch/<id>``, a top-level cgroup marked ``cpu.idle`` (SCHED_IDLE for
the whole tier, kernel 5.15+, v1 and v2) with the lowest weight; they get weight
1 themselves. A top-level tier, not a weight under ``/corral``, because an exec's
round trip also runs in the server and the client, which are the tiers'
siblings at the root: an idle tier is preempted by anything else that wakes up,
a low-weight sibling of the sandboxes only by the sandboxes. Batch work still
takes every cycle nothing else wants; both classes keep their ``cpu`` quota as a
hard cap.

A warm pool's sandbox not yet claimed (``SandboxSpec.pool_member``) runs at ``POOL_WEIGHT``, the lowest,
whatever its class, container or VM alike (a VM's QEMU has a cgroup of its own, corral/backends/vm/cgroup.py):
pools refill while clients' sandboxes run, and a claimed sandbox's first commands must not wait on the next
one booting. The claim gives it its class's weight (``Backend.claimed``).

The weights are defined in v2 units; v1 shares follow systemd's proportional map
(weight 100 = 1024 shares). The runtime is given shares in config.json (the OCI
field) and converts them on v2 with a formula of its own version (runc and crun
1.8 map linearly, 1024 shares to weight 39), so on v2 the backend then writes
``cpu.weight`` itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

from corral.backends.common.host import CgroupLayout

__all__ = [
    "IDLE_TIERS",
    "POOL_WEIGHT",
    "QOS_WEIGHTS",
    "TIERS",
    "cgroup_path",
    "shares_to_weight",
    "start_weight",
    "weight_of",
    "weight_to_shares",
    "write_weight",
]

V1_DEFAULT_SHARES: Final = 1024
V2_DEFAULT_WEIGHT: Final = 100
V1_SHARES_RANGE: Final = (2, 262144)
V2_WEIGHT_RANGE: Final = (1, 10000)

QOS_WEIGHTS: Final = {"latency": V2_DEFAULT_WEIGHT, "batch": 1}  # v2 cpu.weight of each class
TIERS: Final = {"latency": "/corral", "batch": "/corral-batch"}  # parent cgroup of each class
IDLE_TIERS: Final = frozenset({"/corral-batch"})  # marked cpu.idle where the kernel has it, and weighted lowest
POOL_WEIGHT: Final = 1  # a warm pool's sandbox until it is claimed


def _clamp(value: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], value))


def weight_to_shares(weight: int) -> int:
    """v2 ``cpu.weight`` → v1 ``cpu.shares`` (100 → 1024)."""
    return _clamp(round(weight * V1_DEFAULT_SHARES / V2_DEFAULT_WEIGHT), V1_SHARES_RANGE)


def shares_to_weight(shares: int) -> int:
    """v1 ``cpu.shares`` → v2 ``cpu.weight`` (1024 → 100); the inverse of :func:`weight_to_shares`."""
    return _clamp(round(shares * V2_DEFAULT_WEIGHT / V1_DEFAULT_SHARES), V2_WEIGHT_RANGE)


def weight_of(qos: str) -> int:
    """The v2 weight of a QoS class."""
    try:
        return QOS_WEIGHTS[qos]
    except KeyError:
        raise ValueError(f"unknown QoS class {qos!r}: one of {', '.join(QOS_WEIGHTS)}") from None


def cgroup_path(sandbox_id: str, qos: str) -> str:
    """The sandbox's cgroup (``cgroupsPath``): ``/corral/<id>`` or ``/corral-batch/<id>``."""
    weight_of(qos)
    return f"{TIERS[qos]}/{sandbox_id}"


def start_weight(qos: str, *, pool_member: bool) -> int:
    """The v2 weight a sandbox starts with: its class's, or the lowest while it waits in a warm pool."""
    return POOL_WEIGHT if pool_member else weight_of(qos)


def write_weight(cpu_dir: Path, weight: int, layout: CgroupLayout) -> None:
    """A cgroup's CPU weight in v2 units (``cpu.weight``; on v1 ``cpu.shares`` through ``weight_to_shares``)."""
    if layout is CgroupLayout.UNIFIED:
        (cpu_dir / "cpu.weight").write_text(str(weight))
    else:
        (cpu_dir / "cpu.shares").write_text(str(weight_to_shares(weight)))
