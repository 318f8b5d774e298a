"""The node's run directory: which filesystem a path is on (from a mount table), one run dir per data dir, and
where a runtime's state is (the run dir, or an older server's on disk while it holds containers)."""

from __future__ import annotations

from pathlib import Path

from corral.backends.common.host import fs_type_at, run_dir_of, runtime_state_root

MOUNTS = """\
/dev/vda / ext4 rw,relatime 0 0
tmpfs /run tmpfs rw,nosuid,nodev,mode=755 0 0
tmpfs /dev/shm tmpfs rw,relatime 0 0
/dev/vdb /run/big ext4 rw,relatime 0 0
tmpfs /run/big tmpfs rw,relatime 0 0
/dev/vdc /mnt/with\\040space xfs rw,relatime 0 0
"""


def test_the_nearest_mount_decides_and_the_last_of_two_on_one_point() -> None:
    assert fs_type_at(Path("/run/corral"), MOUNTS) == "tmpfs"  # /run's
    assert fs_type_at(Path("/runner/x"), MOUNTS) == "ext4"  # a name that starts like /run is not under it
    assert fs_type_at(Path("/var/lib/corral"), MOUNTS) == "ext4"
    assert fs_type_at(Path("/run/big/x"), MOUNTS) == "tmpfs"  # mounted over the ext4 there
    assert fs_type_at(Path("/mnt/with space/a"), MOUNTS) == "xfs"  # mountinfo escapes the space
    assert fs_type_at(Path("/"), MOUNTS) == "ext4"


def test_a_run_dir_per_data_dir_whatever_its_spelling(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    root = tmp_path / "run"
    assert run_dir_of(first, root) != run_dir_of(second, root)
    assert run_dir_of(first, root).parent == root
    assert run_dir_of(tmp_path / "x" / ".." / "a", root) == run_dir_of(first, root)


def test_runtime_state_stays_where_an_older_server_left_containers(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    assert runtime_state_root(data_dir, "crun") == run_dir_of(data_dir) / "crun"  # nothing on disk
    old = data_dir / "run" / "crun"
    old.mkdir(parents=True)
    assert runtime_state_root(data_dir, "crun") == run_dir_of(data_dir) / "crun"  # an empty old root: moved on
    (old / "sb-e0-0123456789abcdef").mkdir()  # a container an older server started
    assert runtime_state_root(data_dir, "crun") == old
    assert runtime_state_root(data_dir, "runsc") == run_dir_of(data_dir) / "runsc"  # per runtime
