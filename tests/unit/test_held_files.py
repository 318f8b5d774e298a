"""HeldFiles (corral/procfs.py): kernel files kept open and read with pread say what the kernel says now, a
cgroup re-made at the same path is read from its new file, and no more than the limit stay open."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from corral.procfs import HeldFiles


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_held_file_reads_what_the_kernel_says_now() -> None:
    held = HeldFiles(limit=4)
    before = _open_fds()
    first = held.read("/proc/uptime")
    time.sleep(0.05)
    second = held.read("/proc/uptime")
    assert float(second.split()[0]) > float(first.split()[0])
    assert _open_fds() == before + 1  # one fd, kept
    held.forget("/proc/uptime")
    assert _open_fds() == before


def test_a_cgroup_made_again_at_the_same_path_is_read_from_its_new_file() -> None:
    root = Path("/sys/fs/cgroup/pids") if Path("/sys/fs/cgroup/pids").is_dir() else Path("/sys/fs/cgroup")
    cgroup = root / f"corral-test-held-{uuid.uuid4().hex[:8]}"
    held = HeldFiles(limit=4)
    try:
        cgroup.mkdir()
        (cgroup / "pids.max").write_text("17")
        assert held.read(f"{cgroup}/pids.max").strip() == "17"
        (cgroup / "pids.max").write_text("19")
        assert held.read(f"{cgroup}/pids.max").strip() == "19"  # the same fd, read afresh
        cgroup.rmdir()
        cgroup.mkdir()
        (cgroup / "pids.max").write_text("23")
        assert held.read(f"{cgroup}/pids.max").strip() == "23"  # the old file reads ENODEV: opened again
    finally:
        held.forget(str(cgroup))
        if cgroup.exists():
            cgroup.rmdir()


def test_at_most_the_limit_stay_open_and_forget_closes_by_path(tmp_path: Path) -> None:
    paths = []
    for name in ("a", "b", "c"):
        (tmp_path / name).write_text(name)
        paths.append(str(tmp_path / name))
    held = HeldFiles(limit=2)
    before = _open_fds()
    assert [held.read(path) for path in paths] == ["a", "b", "c"]
    assert _open_fds() == before + 2  # "a", read first, closed for "c"
    assert held.read(paths[0]) == "a"  # opened again
    held.forget(str(tmp_path))
    assert _open_fds() == before
