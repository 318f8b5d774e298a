"""A microvm's snapshot arrives as a tar of its overlay upper dir made by the (untrusted) guest.

Extraction must keep what an upper dir holds (whiteouts, absolute symlinks) and refuse whatever would write
outside the tree, on Debian 12's own Python 3.11.2 too, which has no tarfile extraction filters. Each case
is checked by extracting a real archive into a real directory.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from corral.api.errors import InternalError
from corral.backends.vm.backend import _CHECKED_ALREADY, guest_upper_members


def _archive(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as archive:
        for info, data in members:
            archive.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, *, data: bytes = b"", link: str = "",
            dev: tuple[int, int] = (0, 0)) -> tuple[tarfile.TarInfo, bytes | None]:  # fmt: skip
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    info.devmajor, info.devminor = dev
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o644
    if kind == tarfile.REGTYPE:
        info.size = len(data)
        return info, data
    return info, None


def _extract(blob: bytes, tree: Path) -> None:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as archive:
        archive.extractall(tree, members=guest_upper_members(archive), **_CHECKED_ALREADY)


def test_an_upper_dir_keeps_its_whiteouts_and_absolute_symlinks(tmp_path: Path) -> None:
    blob = _archive(
        _member(".", tarfile.DIRTYPE),
        _member("./etc", tarfile.DIRTYPE),
        _member("./etc/motd", data=b"hello\n"),
        _member("./etc/removed", tarfile.CHRTYPE, dev=(0, 0)),
        _member("./usr/bin/py", tarfile.SYMTYPE, link="/usr/bin/python3"),
        _member("./etc/motd2", tarfile.LNKTYPE, link="./etc/motd"),
    )
    _extract(blob, tmp_path)
    assert (tmp_path / "etc" / "motd").read_bytes() == b"hello\n"
    whiteout = os.lstat(tmp_path / "etc" / "removed")
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.readlink(tmp_path / "usr" / "bin" / "py") == "/usr/bin/python3"
    assert os.stat(tmp_path / "etc" / "motd2").st_ino == os.stat(tmp_path / "etc" / "motd").st_ino


@pytest.mark.parametrize(
    ("members", "says"),
    [
        ([_member("/etc/passwd", data=b"x")], "outside its tree"),
        ([_member("./a/../../escape", data=b"x")], "outside its tree"),
        ([_member("./out", tarfile.SYMTYPE, link="/"), _member("./out/etc/passwd", data=b"x")], "through a symlink"),
        ([_member("./f", tarfile.SYMTYPE, link="/etc/passwd"), _member("./f", data=b"x")], "through a symlink"),
        ([_member("./d", tarfile.SYMTYPE, link="/etc"), _member("./d", tarfile.DIRTYPE)], "through a symlink"),
        ([_member("./h", tarfile.LNKTYPE, link="../../etc/shadow")], "hard link outside"),
        ([_member("./disk", tarfile.BLKTYPE, dev=(8, 0))], "not a whiteout"),
        ([_member("./null", tarfile.CHRTYPE, dev=(1, 3))], "not a whiteout"),
    ],
    ids=["absolute", "dotdot", "below-symlink", "at-symlink", "dir-at-symlink", "hardlink-out", "block", "chardev"],
)
def test_what_would_leave_the_tree_is_refused(
    tmp_path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], says: str
) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    with pytest.raises(InternalError, match=says):
        _extract(_archive(*members), tree)
    assert not (tmp_path / "escape").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tree"]
