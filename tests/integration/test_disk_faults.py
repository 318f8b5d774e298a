"""A node's disks running full (issue 19): the data disk filled to its floor while sandboxes write.

Each test gives a server a data disk of its own: an ext4 on a loop device, made in the test's tmp dir, a
few hundred MiB, so filling it takes a moment; it is unmounted (and its loop device freed) even when the
test fails, after the server and its sandboxes are gone."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from tests.conftest import restartable_server

DISK_MB = 512
FLOOR_MB = 192  # creates stop below it; the writable layers can never take the last FLOOR_MB / 2
WRITERS = 3
FILL = "dd if=/dev/zero of=/fill bs=1M count=2048 2>&1; echo rc=$?"  # more than the whole disk


@contextlib.contextmanager
def small_disk(mountpoint: Path, size_mb: int) -> Iterator[Path]:
    """An ext4 of ``size_mb`` mounted at ``mountpoint`` (no blocks reserved for root: free is free)."""
    image = mountpoint.with_suffix(".img")
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True, capture_output=True, timeout=60)
    mountpoint.mkdir()
    subprocess.run(["mount", "-o", "loop", str(image), str(mountpoint)], check=True, capture_output=True, timeout=60)
    try:
        yield mountpoint
    finally:  # lazily: the server's and its containers' mount namespaces may still be letting go of it
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=60)
        image.unlink(missing_ok=True)


def _free_mb(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_bavail * st.f_frsize) >> 20


def test_data_disk_filled_to_the_floor_keeps_the_state_and_the_trajectories(
    tmp_path: Path, test_env: dict[str, str]
) -> None:
    """Sandboxes whose quota (the 10 GiB default) is larger than the whole disk write until they cannot: the
    writable layers stop short of the reserve, every record and acknowledged trajectory step is there, and
    creates are refused with the floor's reason."""
    with small_disk(tmp_path / "disk", DISK_MB) as disk:
        env = {**test_env, "CORRAL_DISK_FLOOR_MB": str(FLOOR_MB)}
        with restartable_server(disk / "server", env) as server, server.client() as client:
            writers = [client.create("busybox", labels={"fault": "disk"}) for _ in range(WRITERS)]
            acknowledged: dict[str, list[str]] = {sandbox.id: [] for sandbox in writers}
            for round_number in range(2):  # the first round fills the disk; the second writes to a full one
                for sandbox in writers:
                    step_id = f"fill-{round_number}"
                    filled = sandbox.exec(FILL, step_id=step_id, timeout_s=120)
                    assert "No space left on device" in filled.stdout and "rc=0" not in filled.stdout, filled
                    acknowledged[sandbox.id].append(step_id)
            free_mb = _free_mb(disk)
            assert free_mb >= FLOOR_MB // 2 - 16, free_mb  # the reserve held (less btrfs's rounding)
            for index, sandbox in enumerate(writers):  # the trajectory log and the records still take writes
                step_id = f"after-{index}"
                assert sandbox.exec(f"echo {step_id}", step_id=step_id).stdout == f"{step_id}\n"
                acknowledged[sandbox.id].append(step_id)
                sandbox.set_ttl(3600)
            with pytest.raises(corral.CapacityExhausted) as refused:
                client.create("busybox")
            assert "the data disk is short" in str(refused.value) and f"{FLOOR_MB} MiB kept in reserve" in str(
                refused.value
            )
            for sandbox in writers:
                steps = sandbox.trajectory()
                assert [s.step_id for s in steps] == acknowledged[sandbox.id]
                assert all(s.state == "done" for s in steps), steps
            with contextlib.closing(sqlite3.connect(f"file:{server.data_dir / 'corral.db'}?mode=ro", uri=True)) as db:
                on_disk = db.execute("SELECT sandbox_id, step_id FROM trajectory_steps ORDER BY seq").fetchall()
                expiry = dict(db.execute("SELECT id, expires_at FROM sandboxes").fetchall())
            assert sorted(on_disk) == sorted((i, s) for i, steps in acknowledged.items() for s in steps)
            assert all(expiry[sandbox.id] > time.time() + 3000 for sandbox in writers), expiry  # set_ttl's write
