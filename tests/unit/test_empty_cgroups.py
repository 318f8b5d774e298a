"""remove_empty_cgroups (corral/backends/common/host.py) on this host's real cgroup hierarchies: what a runtime left of
a container's cgroups goes from every hierarchy, and a cgroup that still holds a process stays. (The hidden v2 tmpfs
of a hybrid host is checked where it exists, in a backend's own mount namespace: tests/backend_conformance.py's
``destroy`` and ``cancelled_create``.)"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.backends.common.host import _cgroup_mounts, remove_empty_cgroups


@pytest.fixture
def parent() -> Iterator[str]:
    """A cgroup path of this test's own under every hierarchy; removed afterwards with whatever is left in it."""
    path = f"/corral-test-{secrets.token_hex(4)}"
    hierarchies = _cgroup_mounts()[0]
    for root in hierarchies:
        (root / path.lstrip("/")).mkdir()
    try:
        yield path
    finally:
        for root in hierarchies:
            top = root / path.lstrip("/")
            for child in (top / "idle", top / "busy"):
                with contextlib.suppress(FileNotFoundError):
                    child.rmdir()
            top.rmdir()


def _present(cgroup_path: str) -> list[Path]:
    return [root for root in _cgroup_mounts()[0] if (root / cgroup_path.lstrip("/")).is_dir()]


def test_a_containers_left_cgroups_go_and_one_in_use_stays(parent: str) -> None:
    hierarchies = _cgroup_mounts()[0]
    assert hierarchies, "no cgroup hierarchy mounted"
    for root in hierarchies:
        for name in ("idle", "busy"):
            (root / parent.lstrip("/") / name).mkdir()
    holder = hierarchies[0]  # one hierarchy where the busy cgroup holds a process
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (holder / parent.lstrip("/") / "busy" / "cgroup.procs").write_text(str(sleeper.pid))
        remove_empty_cgroups(f"{parent}/idle")
        remove_empty_cgroups(f"{parent}/busy")
        assert _present(f"{parent}/idle") == []
        assert _present(f"{parent}/busy") == [holder]
        remove_empty_cgroups(f"{parent}/gone")  # nothing there: no error
    finally:
        sleeper.kill()
        sleeper.wait()
    # the process reaped, its cgroup is empty and goes too (the kernel may take a moment to let its task go)
    for _ in range(50):
        remove_empty_cgroups(f"{parent}/busy")
        if not _present(f"{parent}/busy"):
            break
        time.sleep(0.02)
    assert _present(f"{parent}/busy") == []
