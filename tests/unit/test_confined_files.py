"""ConfinedTree on a real filesystem: behaviour, confinement and fd hygiene."""

from __future__ import annotations

import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from corral.api.errors import Conflict, InvalidRequest, NotFound, PayloadTooLarge
from corral.backends.container.files import ConfinedTree

SECRET = b"host secret, never readable from a sandbox"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "root"
    path.mkdir()
    (tmp_path / "secret").write_bytes(SECRET)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_bytes(b"keep")
    return path


@pytest.fixture
def tree(root: Path) -> ConfinedTree:
    with ConfinedTree(root) as confined:
        yield confined


def _outside_snapshot(tmp_path: Path) -> dict[str, bytes | None]:
    """Everything under tmp_path except the sandbox root, with file contents."""
    snapshot: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(tmp_path):
        if Path(dirpath) == tmp_path:
            dirnames[:] = [d for d in dirnames if d != "root"]
        for name in filenames + dirnames:
            full = Path(dirpath, name)
            snapshot[str(full)] = full.read_bytes() if full.is_file() and not full.is_symlink() else None
    return snapshot


def _open_fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- basic operations --------------------------------------------------------


def test_write_read_round_trip(tree: ConfinedTree, root: Path) -> None:
    info = tree.write("/work/a.py", b"print('hi')\n")
    assert info.path == "/work/a.py" and info.name == "a.py" and info.type == "file"
    assert info.size == 12 and info.mode == 0o644
    assert tree.read("work/a.py", max_bytes=100) == b"print('hi')\n"
    assert (root / "work" / "a.py").read_bytes() == b"print('hi')\n"


def test_write_replaces_atomically_with_mode(tree: ConfinedTree, root: Path) -> None:
    tree.write("/f", b"old")
    with open(root / "f", "rb") as old_reader:
        info = tree.write("/f", b"new contents", mode=0o600)
        assert old_reader.read() == b"old"  # the old inode is untouched: a rename, not an overwrite
    assert info.mode == 0o600 and info.size == 12
    assert stat.S_IMODE(os.stat(root / "f").st_mode) == 0o600
    assert tree.read("/f", max_bytes=100) == b"new contents"
    assert sorted(os.listdir(root)) == ["f"]  # no temporary left behind


def test_write_strips_setuid(tree: ConfinedTree) -> None:
    assert tree.write("/s", b"x", mode=0o4755).mode == 0o755


def test_write_make_parents(tree: ConfinedTree, root: Path) -> None:
    tree.write("/a/b/c/file", b"x")
    assert (root / "a" / "b" / "c" / "file").read_bytes() == b"x"
    assert stat.S_IMODE(os.stat(root / "a" / "b").st_mode) == 0o755
    with pytest.raises(NotFound, match="/x/y/file"):
        tree.write("/x/y/file", b"x", make_parents=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_write_chowns_file_and_new_parents(tree: ConfinedTree, root: Path) -> None:
    info = tree.write("/home/u/file", b"x", uid=1234, gid=5678)
    assert (info.uid, info.gid) == (1234, 5678)
    assert (os.stat(root / "home").st_uid, os.stat(root / "home" / "u").st_gid) == (1234, 5678)


def test_list_sorted_with_types(tree: ConfinedTree, root: Path) -> None:
    (root / "d").mkdir()
    (root / "d" / "zeta").write_bytes(b"z")
    (root / "d" / "alpha").mkdir()
    (root / "d" / "link").symlink_to("/etc")
    os.mkfifo(root / "d" / "pipe")
    infos = tree.list("/d")
    assert [(i.name, i.type) for i in infos] == [
        ("alpha", "dir"),
        ("link", "symlink"),
        ("pipe", "other"),
        ("zeta", "file"),
    ]
    assert infos[1].path == "/d/link" and infos[1].link_target == "/etc"
    with pytest.raises(InvalidRequest, match="not a directory"):
        tree.list("/d/zeta")


def test_stat_does_not_follow_symlink(tree: ConfinedTree, root: Path) -> None:
    (root / "target").write_bytes(b"12345")
    (root / "link").symlink_to("target")
    info = tree.stat("/link")
    assert info.type == "symlink" and info.link_target == "target" and info.size == len("target")
    assert tree.stat("/target").size == 5
    root_info = tree.stat("/")
    assert (root_info.path, root_info.name, root_info.type) == ("/", "/", "dir")
    with pytest.raises(NotFound, match="no such file or directory in sandbox: /missing"):
        tree.stat("/missing")


def test_mkdir_parents_and_conflict(tree: ConfinedTree, root: Path) -> None:
    info = tree.mkdir("/p/q/r", mode=0o700)
    assert info.type == "dir" and info.mode == 0o700
    assert tree.mkdir("/p/q/r").type == "dir"  # exists: fine with parents
    with pytest.raises(Conflict):
        tree.mkdir("/p/q/r", parents=False)
    with pytest.raises(NotFound):
        tree.mkdir("/nope/x", parents=False)
    tree.write("/p/file", b"")
    with pytest.raises(Conflict, match="not a directory"):
        tree.mkdir("/p/file")
    for bad in ("/p/..", "/p/.", "/", ""):
        with pytest.raises(InvalidRequest):
            tree.mkdir(bad)


def test_remove_file_dir_and_recursive(tree: ConfinedTree, root: Path) -> None:
    tree.write("/d/sub/f", b"x")
    tree.write("/d/g", b"y")
    tree.write("/lone", b"z")
    tree.mkdir("/empty")
    tree.remove("/lone")
    tree.remove("/empty")
    with pytest.raises(Conflict, match="recursive=True"):
        tree.remove("/d")
    tree.remove("/d", recursive=True)
    assert os.listdir(root) == []
    with pytest.raises(NotFound):
        tree.remove("/d")
    for bad in ("/", "/..", "/tmp/."):
        with pytest.raises(InvalidRequest):
            tree.remove(bad, recursive=True)


def test_recursive_remove_of_symlink_removes_only_the_link(tree: ConfinedTree, root: Path) -> None:
    tree.write("/real/f", b"x")
    (root / "link").symlink_to("real")
    tree.remove("/link", recursive=True)
    assert (root / "real" / "f").read_bytes() == b"x"
    assert not (root / "link").is_symlink()


def test_recursive_remove_bounds_depth(tree: ConfinedTree, root: Path) -> None:
    os.makedirs(root / "/".join(["d"] * 300))
    before = _open_fd_count()
    with pytest.raises(InvalidRequest, match="deeper than 256"):
        tree.remove("/d", recursive=True)
    assert _open_fd_count() == before


def test_recursive_remove_does_not_follow_symlinks_out(tree: ConfinedTree, root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    tree.mkdir("/d/inner")
    (root / "d" / "abs").symlink_to(outside)
    (root / "d" / "inner" / "rel").symlink_to("../../../outside")
    tree.remove("/d", recursive=True)
    assert not (root / "d").exists()
    assert (outside / "keep.txt").read_bytes() == b"keep"


# -- confinement -------------------------------------------------------------


def test_dotdot_paths_stay_in_root(tree: ConfinedTree, tmp_path: Path) -> None:
    before = _outside_snapshot(tmp_path)
    with pytest.raises(NotFound):
        tree.read("../../etc/passwd", max_bytes=1 << 20)
    with pytest.raises(NotFound):
        tree.read("/../secret", max_bytes=1 << 20)
    assert tree.write("/../../x", b"inside").path == "/x"
    assert (tmp_path / "root" / "x").read_bytes() == b"inside"
    assert _outside_snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["relative", "absolute", "via-root-link"])
def test_symlinks_cannot_read_host_files(tree: ConfinedTree, root: Path, tmp_path: Path, kind: str) -> None:
    secret = tmp_path / "secret"
    if kind == "relative":
        (root / "evil").symlink_to("../secret")
        path = "/evil"
    elif kind == "absolute":
        (root / "evil").symlink_to(secret)
        path = "/evil"
    else:
        (root / "evil").symlink_to("/")
        path = "/evil/" + str(secret).lstrip("/")
    with pytest.raises(NotFound):
        tree.read(path, max_bytes=1 << 20)
    with pytest.raises(NotFound):
        tree.open_read(path)


@pytest.mark.parametrize("link", ["../..", "ABSOLUTE", "/"])
def test_symlinks_cannot_write_outside(tree: ConfinedTree, root: Path, tmp_path: Path, link: str) -> None:
    (root / "evil").symlink_to(str(tmp_path) if link == "ABSOLUTE" else link)
    (root / "evil_secret").symlink_to(tmp_path / "secret")
    before = _outside_snapshot(tmp_path)
    for path in ("/evil/secret", "/evil/outside/keep.txt", "/evil/new.txt"):
        try:
            tree.write(path, b"pwned")
        except (NotFound, InvalidRequest):
            pass
    tree.write("/evil_secret", b"pwned")  # replaces the link itself
    if link != "ABSOLUTE":  # the absolute target is missing inside the root
        tree.mkdir("/evil/newdir")
    assert _outside_snapshot(tmp_path) == before
    assert (tmp_path / "secret").read_bytes() == SECRET
    assert tree.stat("/evil_secret").type == "file"


def test_read_over_limit(tree: ConfinedTree) -> None:
    tree.write("/big", b"x" * 1000)
    assert len(tree.read("/big", max_bytes=1000)) == 1000
    with pytest.raises(PayloadTooLarge, match="1000|999"):
        tree.read("/big", max_bytes=999)


def test_read_refuses_non_regular(tree: ConfinedTree, root: Path) -> None:
    tree.mkdir("/dir")
    os.mkfifo(root / "fifo")
    with pytest.raises(InvalidRequest, match="is a directory"):
        tree.read("/dir", max_bytes=10)
    with pytest.raises(InvalidRequest, match="not a regular file"):
        tree.read("/fifo", max_bytes=10)  # must not block on the fifo


def test_bad_paths(tree: ConfinedTree) -> None:
    with pytest.raises(InvalidRequest, match="NUL"):
        tree.read("/a\x00b", max_bytes=10)
    with pytest.raises(InvalidRequest, match="longer"):
        tree.stat("/" + "a" * 5000)
    tree.write("/file", b"")
    with pytest.raises(InvalidRequest, match="not a directory"):
        tree.write("/file/child", b"")
    with pytest.raises(InvalidRequest):
        tree.write("/", b"")
    tree.mkdir("/dir")
    with pytest.raises(InvalidRequest, match="is a directory"):
        tree.write("/dir", b"")


def test_refuses_procfs_and_sysfs() -> None:
    with ConfinedTree("/") as host:
        with pytest.raises(InvalidRequest, match="procfs or sysfs"):
            host.read("/proc/self/status", max_bytes=1 << 20)
        with pytest.raises(InvalidRequest, match="procfs or sysfs"):
            host.list("/proc")
        with pytest.raises(InvalidRequest, match="procfs or sysfs"):
            host.stat("/proc/self/status")
        if os.path.ismount("/sys"):
            with pytest.raises(InvalidRequest, match="procfs or sysfs"):
                host.list("/sys/kernel")
        buffer = io.BytesIO()
        host.write_tar("/proc", buffer)  # the mount point is stored, its contents are not
        buffer.seek(0)
        assert tarfile.open(fileobj=buffer).getnames() == ["proc"]


def test_missing_root() -> None:
    with pytest.raises(NotFound, match="sandbox root"):
        ConfinedTree("/nonexistent/corral-root")


def test_close_is_idempotent(root: Path) -> None:
    confined = ConfinedTree(root)
    confined.close()
    confined.close()


# -- tar ---------------------------------------------------------------------


def test_tar_round_trip_keeps_symlinks_and_modes(tree: ConfinedTree, root: Path) -> None:
    tree.write("/src/bin/run", b"#!/bin/sh\n", mode=0o755)
    tree.write("/src/data.txt", b"data" * 1000, mode=0o600)
    tree.mkdir("/src/private", mode=0o700)
    (root / "src" / "abs").symlink_to("/etc/passwd")
    (root / "src" / "rel").symlink_to("bin/run")
    os.utime(root / "src" / "data.txt", (1_000_000, 1_000_000))
    buffer = io.BytesIO()
    tree.write_tar("/src", buffer)
    buffer.seek(0)
    assert sorted(tarfile.open(fileobj=buffer).getnames())[0] == "src"
    buffer.seek(0)
    count = tree.extract_tar("/dest", buffer, max_bytes=1 << 20)
    assert count == 7
    copy = root / "dest" / "src"
    assert (copy / "bin" / "run").read_bytes() == b"#!/bin/sh\n"
    assert stat.S_IMODE(os.stat(copy / "bin" / "run").st_mode) == 0o755
    assert stat.S_IMODE(os.stat(copy / "data.txt").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(copy / "private").st_mode) == 0o700
    assert os.stat(copy / "data.txt").st_mtime == 1_000_000
    assert os.readlink(copy / "abs") == "/etc/passwd"
    assert os.readlink(copy / "rel") == "bin/run"


def test_write_tar_of_single_file(tree: ConfinedTree) -> None:
    tree.write("/a/b.txt", b"hello")
    buffer = io.BytesIO()
    tree.write_tar("/a/b.txt", buffer)
    buffer.seek(0)
    with tarfile.open(fileobj=buffer) as tar:
        assert tar.getnames() == ["b.txt"]
        assert tar.extractfile("b.txt").read() == b"hello"


def _tar_bytes(members: list[tuple[tarfile.TarInfo, bytes]], mode: str = "w") -> io.BytesIO:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:
        for info, data in members:
            info.size = len(data) if info.isreg() else 0
            tar.addfile(info, io.BytesIO(data) if info.isreg() else None)
    buffer.seek(0)
    return buffer


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, linkname, mode
    return info


def test_write_tar_of_root_has_no_prefix(tree: ConfinedTree) -> None:
    tree.write("/a/b", b"1")
    tree.write("/c", b"2")
    buffer = io.BytesIO()
    tree.write_tar("/", buffer)
    buffer.seek(0)
    assert sorted(tarfile.open(fileobj=buffer).getnames()) == ["a", "a/b", "c"]


def test_extract_gzip_with_hardlink_and_skipped_fifo(tree: ConfinedTree, root: Path) -> None:
    archive = _tar_bytes(
        [
            (_member("x/a", mode=0o4755), b"A"),
            (_member("x/hard", tarfile.LNKTYPE, "x/a"), b""),
            (_member("x/fifo", tarfile.FIFOTYPE), b""),
            (_member("/abs.txt"), b"abs"),
        ],
        mode="w:gz",
    )
    assert tree.extract_tar("/d", archive, max_bytes=100) == 3
    assert os.stat(root / "d" / "x" / "hard").st_ino == os.stat(root / "d" / "x" / "a").st_ino
    assert stat.S_IMODE(os.stat(root / "d" / "x" / "a").st_mode) == 0o755
    assert not (root / "d" / "x" / "fifo").exists()
    assert (root / "d" / "abs.txt").read_bytes() == b"abs"


@pytest.mark.parametrize(
    ("name", "kind", "linkname"),
    [
        ("../escape", tarfile.REGTYPE, ""),
        ("a/../../escape", tarfile.REGTYPE, ""),
        ("hard", tarfile.LNKTYPE, "../outside/keep.txt"),
    ],
)
def test_extract_rejects_escaping_members(
    tree: ConfinedTree,
    tmp_path: Path,
    name: str,
    kind: bytes,
    linkname: str,
) -> None:
    before = _outside_snapshot(tmp_path)
    with pytest.raises(InvalidRequest, match="outside"):
        tree.extract_tar("/d", _tar_bytes([(_member(name, kind, linkname), b"pwned")]), max_bytes=100)
    assert _outside_snapshot(tmp_path) == before
    assert not (tmp_path / "root" / "escape").exists()


def test_extract_through_symlink_member_stays_in_root(tree: ConfinedTree, tmp_path: Path) -> None:
    before = _outside_snapshot(tmp_path)
    archive = _tar_bytes(
        [
            (_member("up", tarfile.SYMTYPE, "../../.."), b""),
            (_member("abs", tarfile.SYMTYPE, str(tmp_path)), b""),
            (_member("up/pwned.txt"), b"pwned"),
            (_member("abs/secret"), b"pwned"),
        ]
    )
    with pytest.raises(InvalidRequest):  # "abs" resolves to a missing <root>/<tmp_path>, made via a symlink
        tree.extract_tar("/d", archive, max_bytes=100)
    assert _outside_snapshot(tmp_path) == before
    assert tree.read("/pwned.txt", max_bytes=100) == b"pwned"


def test_extract_over_limit(tree: ConfinedTree, root: Path) -> None:
    archive = _tar_bytes([(_member("a"), b"x" * 60), (_member("b"), b"y" * 60)])
    with pytest.raises(PayloadTooLarge):
        tree.extract_tar("/d", archive, max_bytes=100)
    assert not (root / "d" / "b").exists()
    assert [n for n in os.listdir(root / "d") if n.startswith(".corral-")] == []


def test_extract_not_a_tar(tree: ConfinedTree) -> None:
    with pytest.raises(InvalidRequest, match="tar"):
        tree.extract_tar("/d", io.BytesIO(b"definitely not a tar archive" * 40), max_bytes=100)


# -- fd hygiene --------------------------------------------------------------


def test_no_fd_leak_on_errors(tree: ConfinedTree, root: Path) -> None:
    tree.write("/f", b"x" * 100)
    tree.write("/d/g", b"")
    os.mkfifo(root / "fifo")
    (root / "loop").symlink_to("loop")
    failing = [
        lambda: tree.read("/missing", max_bytes=10),
        lambda: tree.read("/f", max_bytes=10),
        lambda: tree.read("/d", max_bytes=10),
        lambda: tree.read("/fifo", max_bytes=10),
        lambda: tree.read("/loop", max_bytes=10),
        lambda: tree.write("/f/x", b""),
        lambda: tree.write("/nope/x", b"", make_parents=False),
        lambda: tree.list("/f"),
        lambda: tree.mkdir("/d", parents=False),
        lambda: tree.remove("/d"),
        lambda: tree.remove("/missing/x"),
        lambda: tree.extract_tar("/e", _tar_bytes([(_member("../x"), b"")]), max_bytes=10),
        lambda: tree.extract_tar("/e", _tar_bytes([(_member("big"), b"x" * 20)]), max_bytes=10),
    ]
    with ConfinedTree("/") as host:
        failing.append(lambda: host.read("/proc/self/status", max_bytes=10))
        failing.append(lambda: host.remove("/proc/self", recursive=True))
        before = _open_fd_count()
        for _ in range(3):
            for operation in failing:
                with pytest.raises((NotFound, InvalidRequest, Conflict, PayloadTooLarge)):
                    operation()
        assert _open_fd_count() == before
    before = _open_fd_count()
    with tree.open_read("/f") as reader:
        assert reader.read() == b"x" * 100
    tree.remove("/d", recursive=True)
    assert _open_fd_count() == before


@pytest.mark.skipif(os.geteuid() != 0, reason="restoring owners needs root")
def test_extract_tar_keeps_owners_and_setuid_only_when_asked(tree: ConfinedTree, root: Path) -> None:
    def members() -> io.BytesIO:
        infos = [_member("d", tarfile.DIRTYPE, mode=0o2750), _member("d/su", mode=0o4755),
                 _member("d/link", tarfile.SYMTYPE, linkname="su")]  # fmt: skip
        for info in infos:
            info.uid, info.gid = 1234, 2345
        return _tar_bytes([(info, b"#!/bin/sh\n") for info in infos])

    tree.extract_tar("/upload", members(), max_bytes=1 << 20)  # an API upload: the server's owner, no setuid
    uploaded = [os.lstat(root / "upload" / name) for name in ("d", "d/su")]
    assert [(stat.S_IMODE(st.st_mode), st.st_uid) for st in uploaded] == [(0o750, 0), (0o755, 0)]
    tree.extract_tar("/build", members(), max_bytes=1 << 20, keep_owners=True)  # an image build's COPY
    built = [os.lstat(root / "build" / name) for name in ("d", "d/su", "d/link")]
    kept = [(stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) for st in built[:2]]
    assert kept == [(0o2750, 1234, 2345), (0o4755, 1234, 2345)]
    assert (built[2].st_uid, built[2].st_gid) == (1234, 2345) and stat.S_ISLNK(built[2].st_mode)
