"""The leftover check's loop devices (corral/testing/leftovers.py): a device of this data dir's file counts, one
of an earlier file of the same name (a run before this one, whose temp dir was made anew) does not."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from corral.testing.leftovers import _loop_devices


@pytest.fixture
def attach() -> Iterator[Callable[[Path], str]]:
    devices: list[str] = []

    def attach_file(path: Path) -> str:
        path.write_bytes(b"\0" * (1 << 20))
        device = subprocess.run(["losetup", "--find", "--show", str(path)], capture_output=True, text=True,
                                check=True).stdout.strip()  # fmt: skip
        devices.append(device)
        return device

    yield attach_file
    for device in devices:
        subprocess.run(["losetup", "--detach", device], capture_output=True)


def test_a_device_of_an_earlier_file_of_the_same_name_is_not_this_servers(
    tmp_path: Path, attach: Callable[[Path], str]
) -> None:
    data_dir = tmp_path / "server"
    data_dir.mkdir()
    image = data_dir / "writable.img"
    earlier = attach(image)
    image.unlink()  # the earlier run's dir removed ...
    assert _loop_devices(data_dir, server_running=False) == [f"{earlier} {image}"]  # ... its device still counts
    now = attach(image)  # ... and made anew: this run's file, this run's device
    assert _loop_devices(data_dir, server_running=False) == [f"{now} {image}"]
    assert _loop_devices(data_dir, server_running=True) == []  # the pool's own, while its server runs
