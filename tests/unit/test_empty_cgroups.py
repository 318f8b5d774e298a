"""remove_empty_cgroups (corral/backends/common/host.py) on this host's real cgroup hierarchies: what a runtime left of
a container's cgroups goes from every hierarchy, and a cgroup that still holds a process stays; a VM's cgroup is
removed with the same wait. (The hidden v2 tmpfs
of a hybrid host is checked where it exists, in a backend's own mount namespace: tests/backend_conformance.py's
``destroy`` and ``cancelled_create``.)"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.backends.common.host import CgroupLayout, _cgroup_mounts, detect_cgroup_layout, remove_empty_cgroups
from corral.backends.vm.cgroup import VmCgroup


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
        begun = time.monotonic()
        remove_empty_cgroups(f"{parent}/busy", settle_s=0.3)
        assert 0.3 <= time.monotonic() - begun < 5  # waited for it, then left it
        assert _present(f"{parent}/idle") == []
        assert _present(f"{parent}/busy") == [holder]
        remove_empty_cgroups(f"{parent}/gone")  # nothing there: no error
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_cgroup_whose_processes_are_still_exiting_goes_once_they_have(parent: str) -> None:
    """As after a runtime's delete that gave up while the processes it killed were still on their way out."""
    hierarchies = _cgroup_mounts()[0]
    for root in hierarchies:
        (root / parent.lstrip("/") / "busy").mkdir()
    holder = hierarchies[0]
    leaving = subprocess.Popen(["sleep", "0.5"])
    try:
        (holder / parent.lstrip("/") / "busy" / "cgroup.procs").write_text(str(leaving.pid))
        begun = time.monotonic()
        remove_empty_cgroups(f"{parent}/busy", settle_s=10)
        waited_s = time.monotonic() - begun
        assert _present(f"{parent}/busy") == []
        assert 0.2 < waited_s < 5, waited_s  # it waited for the process's exit, not its whole settle time
    finally:
        leaving.kill()
        leaving.wait()


def test_a_vm_cgroup_goes_once_its_killed_qemus_threads_have_left() -> None:
    """A VM's cgroup (corral/backends/vm/cgroup.py) is removed with the same wait: a SIGKILLed process whose threads
    are still exiting holds it a moment; one that does not leave within the settle time keeps it (False)."""
    layout = detect_cgroup_layout()  # a hybrid host's VMs use its v1 controllers, as the test above's hierarchies
    cgroup = VmCgroup(
        CgroupLayout.LEGACY if layout is CgroupLayout.HYBRID else layout, f"sb-test-{secrets.token_hex(4)}"
    )
    cgroup.create(0.5, 64)
    threads = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                                "for _ in range(4): threading.Thread(target=time.sleep, args=(60,)).start()\n"
                                "time.sleep(60)"])  # fmt: skip
    try:
        cgroup.add(threads.pid)
        assert cgroup.remove(0.2) is False and cgroup.pids() == [threads.pid]  # in use: kept
        cgroup.kill_all()
        assert cgroup.remove(10) is True
        assert not cgroup.memory_dir.exists() and cgroup.cpu_quota() is None
    finally:
        threads.kill()
        threads.wait()
        cgroup.remove(10)
