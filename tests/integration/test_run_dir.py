"""The node's run directory: the runtime's state and the bundles live on a tmpfs (a disk filesystem paid for every
create's and delete's dozen small files), survive a restart of the server with its containers, and go with the
last container of a server that stopped."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import corral
from corral.backends.common.host import ensure_run_tmpfs, fs_type_at, run_dir_of, runtime_dirs_of, runtime_state_root
from corral.embedded import EmbeddedServer
from tests.conftest import restartable_server


def test_the_run_tmpfs_is_mounted_once(tmp_path: Path) -> None:
    root = tmp_path / "run" / "corral"
    assert fs_type_at(root) != "tmpfs"
    try:
        assert ensure_run_tmpfs(root) is True
        assert fs_type_at(root) == "tmpfs"
        (root / "kept").write_text("state")
        assert ensure_run_tmpfs(root) is False  # a second server finds it: nothing mounted over it
        assert (root / "kept").read_text() == "state"
    finally:
        while fs_type_at(root) == "tmpfs":
            subprocess.run(["umount", str(root)], check=True, capture_output=True, timeout=30)


def _wait_gone(path: Path, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while path.exists():
        assert time.monotonic() < deadline, f"{path} is still there"
        time.sleep(0.05)


def test_a_sandbox_keeps_its_runtime_state_on_a_tmpfs_until_it_ends(server: EmbeddedServer,
                                                                     client: corral.Client) -> None:  # fmt: skip
    sandbox = client.create("busybox")
    state = runtime_state_root(server.data_dir, "crun") / sandbox.id
    bundle = runtime_dirs_of(server.data_dir) / sandbox.id / "bundle"
    try:
        assert (state / "status").is_file() and (bundle / "config.json").is_file()
        assert fs_type_at(state) == "tmpfs" and fs_type_at(bundle) == "tmpfs"
        assert sandbox.exec("echo up").stdout == "up\n"
    finally:
        sandbox.kill()
    _wait_gone(state)
    _wait_gone(bundle.parent)


def test_a_restart_adopts_from_the_run_dir_and_the_last_stop_removes_it(tmp_path: Path,
                                                                        test_env: dict[str, str]) -> None:  # fmt: skip
    data_dir = tmp_path / "server"
    run_dir = run_dir_of(data_dir)
    with restartable_server(data_dir, test_env) as server, server.client() as client:
        sandbox = client.create("busybox")
        sandbox.exec("echo kept > /kept")
        server.stop()  # the sandbox goes on; its state stays where the next server looks
        assert (runtime_state_root(data_dir, "crun") / sandbox.id / "status").is_file()
        server.start()
        assert client.get(sandbox.id).info.state.value == "running"
        assert sandbox.exec("cat /kept").stdout == "kept\n"
        sandbox.kill()
        _wait_gone(runtime_dirs_of(data_dir) / sandbox.id)
        server.stop()  # no container left: nothing of this server stays on the host's tmpfs
        assert not run_dir.exists()


def test_a_stop_keeps_the_run_dir_while_runtime_state_is_left_in_it(tmp_path: Path,
                                                                    test_env: dict[str, str]) -> None:  # fmt: skip
    """A container whose delete failed keeps its runtime state for the next start's orphan sweep: the stop that
    finds such state (planted here) leaves the run dir, and what is in it, alone."""
    data_dir = tmp_path / "server"
    run_dir = run_dir_of(data_dir)
    left = run_dir / "crun" / "sb-e0-00000000deadbeef"
    try:
        with restartable_server(data_dir, test_env) as server, server.client() as client:
            client.create("busybox").kill()  # the crun root exists now
            left.mkdir(parents=True)
            (left / "status").write_text("{}")
            server.stop()
            assert (left / "status").read_text() == "{}"
            left.joinpath("status").unlink()
            left.rmdir()
            server.start()
            server.stop()
            assert not run_dir.exists()  # nothing left at this stop: the server removed it
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
