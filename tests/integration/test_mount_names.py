"""Mount points whose paths hold a space or a backslash: /proc's mount tables write those as octal escapes
(``\\040``, ``\\134``), and every reader of them must undo that to find the mount (a data dir may be named so)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.backends.common.host import fs_type_at
from corral.images.bases import _mounts_below
from corral.images.lazy import _mount_dev
from corral.procfs import mount_field


def test_mount_fields_are_unescaped() -> None:
    assert mount_field("/var/lib/my\\040corral\\134x\\011y") == "/var/lib/my corral\\x\ty"
    assert mount_field("/plain/path") == "/plain/path"


@pytest.fixture
def odd_mount(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mounted (in this process's mount namespace) at a path with a space and a backslash."""
    point = tmp_path / "data dir" / "with\\slash"
    point.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "corral-test", str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=True)


def test_readers_of_the_mount_tables_find_a_mount_whose_path_has_a_space(odd_mount: Path) -> None:
    assert fs_type_at(odd_mount) == "tmpfs" and fs_type_at(odd_mount / "inside") == "tmpfs"
    assert _mount_dev(odd_mount) == os.stat(odd_mount).st_dev
    assert str(odd_mount) in _mounts_below(odd_mount.parent.parent)
