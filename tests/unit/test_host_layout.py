"""Cgroup layout detection from real mount tables of the three kinds of host."""

from __future__ import annotations

from corral.backends.common.host import CgroupLayout, detect_cgroup_layout

PURE_V2 = """\
sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0
cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid,nodev,noexec,relatime,nsdelegate,memory_recursiveprot 0 0
"""
HYBRID = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""
HYBRID_HIDDEN = HYBRID + "tmpfs /sys/fs/cgroup/unified tmpfs rw,relatime,size=65536k,mode=755 0 0\n"
LEGACY = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
"""


def test_pure_v2() -> None:
    assert detect_cgroup_layout(PURE_V2) is CgroupLayout.UNIFIED


def test_hybrid() -> None:
    assert detect_cgroup_layout(HYBRID) is CgroupLayout.HYBRID


def test_hybrid_with_v2_hidden_behaves_as_legacy() -> None:
    assert detect_cgroup_layout(HYBRID_HIDDEN) is CgroupLayout.LEGACY


def test_legacy() -> None:
    assert detect_cgroup_layout(LEGACY) is CgroupLayout.LEGACY


def test_this_host_is_detected() -> None:
    assert detect_cgroup_layout() in set(CgroupLayout)
