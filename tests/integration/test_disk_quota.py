"""Writable layers are bounded by default (issue 19): the node default, a create's disk_mb over it, the
disk_full event, and the quota pool's subvolumes gone after a kill and after a restart (adoption).

One server of this module's own, with an 8 MiB default so a `dd` reaches it in a moment."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.api.models import AuditEvent
from corral.backends.common.host import runtime_state_root
from corral.embedded import EmbeddedServer
from tests.conftest import restartable_server

DEFAULT_MB = 8
FILL = "dd if=/dev/zero of=/big bs=1M count=256 2>&1; echo rc=$?"


@pytest.fixture(scope="module")
def quota_server(tmp_path_factory: pytest.TempPathFactory, test_env: dict[str, str]) -> Iterator[EmbeddedServer]:
    data_dir = tmp_path_factory.mktemp("quota") / "server"
    with restartable_server(data_dir, {**test_env, "CORRAL_SANDBOX_DISK_MB": str(DEFAULT_MB)}) as proc:
        yield proc
    image = str(data_dir / "writable.img")
    attached = subprocess.run(["losetup", "-j", image], capture_output=True, text=True, timeout=30).stdout
    if attached:  # still held: free it so the run leaves no loop device, then fail the test that left it
        subprocess.run(["losetup", "-d", attached.split(":")[0]], capture_output=True, timeout=30)
    assert not attached, f"the quota pool's loop device outlived its server: {attached}"


def _layer(server: EmbeddedServer, sandbox_id: str) -> Path:
    """The sandbox's subvolume, seen through the server's mount namespace (the pool is mounted only there)."""
    assert server.process is not None
    return Path(f"/proc/{server.process.pid}/root") / (server.data_dir / "writable" / sandbox_id).relative_to("/")


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _disk_full(client: corral.Client, sandbox_id: str) -> list[AuditEvent]:
    deadline = time.monotonic() + 10
    while True:
        events = [e for e in client.audit_events() if e.sandbox_id == sandbox_id and e.kind == "disk_full"]
        if events or time.monotonic() > deadline:
            return events
        time.sleep(0.2)


def test_the_default_limit_holds_and_the_host_keeps_its_space(quota_server: EmbeddedServer) -> None:
    with quota_server.client() as client, client.create("busybox") as sandbox:
        free_before = _free_bytes(quota_server.data_dir)
        filled = sandbox.exec(FILL)
        assert "Disk quota exceeded" in filled.stdout and not filled.stdout.strip().endswith("rc=0")
        written = int(sandbox.exec("stat -c %s /big").stdout)
        assert (DEFAULT_MB - 1) << 20 <= written <= DEFAULT_MB << 20
        assert free_before - _free_bytes(quota_server.data_dir) < 128 << 20  # not the 256 MiB dd asked for
        [event] = _disk_full(client, sandbox.id)
        assert event.severity == "warning" and event.detail["total_bytes"] == DEFAULT_MB << 20
        sandbox.exec("rm /big")
        assert sandbox.exec("echo fine > /f && cat /f").stdout == "fine\n"  # usable again once space is freed


def test_disk_mb_overrides_the_default(quota_server: EmbeddedServer) -> None:
    with quota_server.client() as client, client.create("busybox", disk_mb=48) as sandbox:
        assert sandbox.exec("dd if=/dev/zero of=/a bs=1M count=32 2>&1; echo rc=$?").stdout.strip().endswith("rc=0")
        assert "Disk quota exceeded" in sandbox.exec(FILL).stdout
        assert 40 << 20 <= int(sandbox.exec("du -k -c /a /big | tail -1 | cut -f1").stdout) << 10 <= 48 << 20
        layer = _layer(quota_server, sandbox.id)
        assert (layer / "upper" / "a").stat().st_size == 32 << 20
    assert not layer.exists()  # the kill removed its subvolume (its space and qgroup go in the background)


def test_metadata_counts_so_the_number_of_files_is_bounded_too(quota_server: EmbeddedServer) -> None:
    long_name = "n" * 200  # a long name makes each file cost more metadata, so the limit comes sooner
    fill = f"mkdir /d; i=0; while true > /d/{long_name}$i; do i=$((i+1)); done 2>/dev/null; echo $i"
    with quota_server.client() as client, client.create("busybox", disk_mb=8) as sandbox:
        made = sandbox.exec(fill, timeout_s=60)
        assert 2_000 < int(made.stdout) < 30_000, made  # empty files: inodes and names in the subvolume's metadata
        assert "Disk quota exceeded" in sandbox.exec("touch /d/more 2>&1").stdout


def test_limits_survive_a_restart_and_go_with_the_sandbox(quota_server: EmbeddedServer) -> None:
    with quota_server.client() as client:
        kept, killed_while_down = client.create("busybox"), client.create("busybox", disk_mb=16)
        kept.exec("echo kept > /kept")
        lost = _layer(quota_server, killed_while_down.id).relative_to(f"/proc/{quota_server.process.pid}/root")
    quota_server.stop()
    subprocess.run(["crun", "--root", str(runtime_state_root(quota_server.data_dir, "crun")), "delete", "--force",
                    killed_while_down.id], capture_output=True, timeout=30, check=True)  # fmt: skip
    quota_server.start()
    with quota_server.client() as client:
        handle = client.connect(kept)
        assert handle.exec("cat /kept").stdout == "kept\n"
        assert "Disk quota exceeded" in handle.exec(FILL).stdout  # the same limit, on the same filesystem
        assert not (_layer(quota_server, kept.id).parent / lost.name).exists()  # an orphan's layer is removed
        handle.kill()
        assert not _layer(quota_server, kept.id).exists()


def test_below_the_free_space_floor_creates_are_refused_naming_the_writers(
    quota_server: EmbeddedServer, test_env: dict[str, str]
) -> None:
    with quota_server.client() as client:
        small, big = client.create("busybox", disk_mb=64), client.create("busybox", disk_mb=64)
        small.exec("dd if=/dev/zero of=/f bs=1M count=2")
        big.exec("dd if=/dev/zero of=/f bs=1M count=40")
    quota_server.stop()  # the same node again with a floor above its free space: it adopts both sandboxes
    floor_mb = (_free_bytes(quota_server.data_dir) >> 20) + (1 << 20)
    with restartable_server(quota_server.data_dir, {**test_env, "CORRAL_DISK_FLOOR_MB": str(floor_mb)}) as floored:
        with floored.client() as client:
            with pytest.raises(corral.CapacityExhausted) as refused:
                client.create("busybox")
            message = str(refused.value)
            assert "the data disk is short" in message and f"{floor_mb} MiB kept in reserve" in message
            assert f"biggest writers: {big.id} (40 MiB), {small.id} (2 MiB)" in message
            for sandbox in (small, big):
                client.connect(sandbox).kill()
