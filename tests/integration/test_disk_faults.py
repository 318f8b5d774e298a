"""A node's disks running full (issue 19): the data disk filled to its floor while sandboxes write.

Each test gives a server a data disk of its own: an ext4 on a loop device, made in the test's tmp dir, a
few hundred MiB, so filling it takes a moment; it is unmounted (and its loop device freed) even when the
test fails, after the server and its sandboxes are gone."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.bench.registry import Registry, image_blobs, layer_tar, push, start_registry, tree_members, write_layout
from corral.embedded import EmbeddedServer, linked_node_dir
from corral.images.bases import build_busybox_rootfs
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
                sandbox.set_ttl(3600, step_id=f"ttl-{index}")  # a life step is logged too
                acknowledged[sandbox.id] += [step_id, f"ttl-{index}"]
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


CACHE_DISK_MB = 48
BIG_LAYER_MB = 16  # random bytes: gzip does not shrink them, so the layer costs the cache its full size


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    if shutil.which("docker-registry") is None or shutil.which("skopeo") is None:
        pytest.skip("needs docker-registry and skopeo (apt)")
    started = start_registry(tmp_path / "registry")
    try:
        yield started
    finally:
        started.stop()


def test_layer_cache_disk_full_during_a_pull_fails_clearly_and_leaves_no_partial_layer(
    tmp_path: Path, test_env: dict[str, str], registry: Registry
) -> None:
    """A create whose image is pulled while the layer cache's disk has no room for its big layer: a clear
    error, no layer file or record of it half made, and once space is freed the same create succeeds."""
    tree = tmp_path / "rootfs"
    build_busybox_rootfs(tree)
    big = os.urandom(BIG_LAYER_MB << 20)
    blobs = image_blobs([layer_tar(tree_members(tree)), layer_tar({"data": None, "data/big": big})], {})
    push(write_layout(tmp_path / "layout", "v1", blobs), "v1", registry, "ns/big")
    ref = f"{registry.address}/ns/big:v1"
    with small_disk(tmp_path / "cache", CACHE_DISK_MB) as cache:
        node_dir = linked_node_dir(cache / "node", parts=("bin",))  # no layers: the pull fills this disk
        filler = cache / "filler"
        with open(filler, "wb") as f:  # leave less room than the big layer needs
            f.truncate(0)
            os.posix_fallocate(f.fileno(), 0, (_free_mb(cache) - BIG_LAYER_MB // 2) << 20)
        env = {**test_env, "CORRAL_NODE_DIR": str(node_dir), "CORRAL_INSECURE_REGISTRIES": registry.address}
        with EmbeddedServer(tmp_path / "server", env=env) as server, server.client() as client:
            with pytest.raises(
                corral.CapacityExhausted, match=f"the layer cache.s disk is full: a {BIG_LAYER_MB} MiB layer"
            ) as full:
                client.create(ref)
            assert "nothing of it was kept" in str(full.value) and "retry" in str(full.value)
            stored = {p.name for p in (node_dir / "layers" / "layers").iterdir()}
            assert not {name for name in stored if name.endswith(".tmp")}, stored  # no partial file
            assert {name.removesuffix(".erofs") for name in stored if name.endswith(".erofs")} == {
                layer.digest.removeprefix("sha256:") for layer in client.images.layers()
            }  # none without a record
            with pytest.raises(corral.NotFound):
                client.images.inspect(ref)
            filler.unlink()
            with client.create(ref) as sandbox:
                assert sandbox.exec("md5sum /data/big").stdout.split()[0] == hashlib.md5(big).hexdigest()
