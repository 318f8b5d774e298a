"""extract_tar and unpack_oci_archive on real archives built with tarfile: tree shape, metadata, attacks, limits."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

import pytest

from corral.api.errors import InvalidRequest, NotFound, PayloadTooLarge
from corral.images import unpack
from corral.images.unpack import extract_tar, unpack_oci_archive

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="keeping file owners needs root")
MTIME = 1_600_000_000
LIMIT = 1 << 30

Entry = tuple[tarfile.TarInfo, bytes | None]


def _file(name: str, data: bytes = b"", *, mode: int = 0o644, uid: int = 0, gid: int = 0, mtime: int = MTIME) -> Entry:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.uid, info.gid, info.mtime = len(data), mode, uid, gid, mtime
    return info, data


def _entry(name: str, kind: bytes, *, linkname: str = "", mode: int = 0o755, mtime: int = MTIME) -> Entry:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode, info.mtime = kind, linkname, mode, mtime
    return info, None


def _dir(name: str, *, mode: int = 0o755, mtime: int = MTIME) -> Entry:
    return _entry(name, tarfile.DIRTYPE, mode=mode, mtime=mtime)


def _symlink(name: str, target: str) -> Entry:
    return _entry(name, tarfile.SYMTYPE, linkname=target, mode=0o777)


def _hardlink(name: str, target: str) -> Entry:
    return _entry(name, tarfile.LNKTYPE, linkname=target)


def _tar(entries: list[Entry], compression: str = "") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{compression}", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buffer.getvalue()


def _extract(dest: Path, entries: list[Entry], **kwargs: Any) -> int:
    dest.mkdir()
    return extract_tar(io.BytesIO(_tar(entries)), dest, max_bytes=kwargs.pop("max_bytes", LIMIT), **kwargs)


def _tree(root: Path) -> dict[str, Any]:
    """Every path under root: bytes for files, "dir" for directories, "-> target" for symlinks."""
    tree: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            tree[name] = f"-> {os.readlink(path)}"
        elif path.is_dir():
            tree[name] = "dir"
        else:
            tree[name] = path.read_bytes()
    return tree


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _write_archive(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


class _OciLayout:
    """The files of an OCI image layout archive; blobs are added by content."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {"oci-layout": b'{"imageLayoutVersion": "1.0.0"}'}

    def blob(self, data: bytes) -> dict[str, Any]:
        self.files[f"blobs/sha256/{_digest(data)[7:]}"] = data
        return {"digest": _digest(data), "size": len(data)}

    def json_blob(self, document: Any, media_type: str) -> dict[str, Any]:
        return {"mediaType": media_type, **self.blob(json.dumps(document).encode())}

    def manifest(self, layers: list[bytes], config: dict[str, Any]) -> dict[str, Any]:
        document = {
            "schemaVersion": 2,
            "config": self.json_blob(config, "application/vnd.oci.image.config.v1+json"),
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **self.blob(layer)} for layer in layers
            ],
        }
        return self.json_blob(document, "application/vnd.oci.image.manifest.v1+json")

    def write(self, path: Path, top: list[dict[str, Any]]) -> Path:
        self.files["index.json"] = json.dumps({"schemaVersion": 2, "manifests": top}).encode()
        return _write_archive(path, self.files)


CONFIG = {"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/usr/bin"], "Cmd": ["sh"], "User": "0"}}

LAYER_1 = [
    _dir("etc/"),
    _file("etc/keep", b"keep"),
    _file("etc/gone", b"gone"),
    _dir("olddir/"),
    _file("olddir/a", b"a"),
    _dir("olddir/sub/"),
    _file("olddir/sub/b", b"b"),
    _dir("opq/"),
    _file("opq/lower", b"lower"),
    _dir("opq/lowerdir/"),
    _file("opq/lowerdir/x", b"x"),
    _file("file2dir", b"was a file"),
    _dir("dir2file/"),
    _file("dir2file/inner", b"inner"),
]
LAYER_2 = [
    _file("etc/.wh.gone"),
    _file(".wh.olddir"),
    _file(".wh.never-existed"),
    _dir("opq/"),
    _file("opq/before", b"before"),
    _file("opq/.wh..wh..opq"),
    _file("opq/new", b"new"),
    _dir("file2dir/"),
    _file("file2dir/child", b"child"),
    _file("dir2file", b"now a file"),
]
LAYER_3 = [_dir("olddir/"), _file("olddir/fresh", b"fresh"), _file("etc/gone", b"back")]
EXPECTED_TREE = {
    "dir2file": b"now a file",
    "etc": "dir",
    "etc/gone": b"back",
    "etc/keep": b"keep",
    "file2dir": "dir",
    "file2dir/child": b"child",
    "olddir": "dir",
    "olddir/fresh": b"fresh",
    "opq": "dir",
    "opq/before": b"before",
    "opq/new": b"new",
}


def _three_layers() -> list[bytes]:
    # The third layer is uncompressed: blobs are told apart by magic bytes.
    return [_tar(LAYER_1, "gz"), _tar(LAYER_2, "gz"), _tar(LAYER_3)]


# -- extract_tar ----------------------------------------------------------------------------------


@needs_root
def test_types_modes_owners_and_times_are_kept(tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    count = _extract(
        dest,
        [
            _dir("./usr/bin/", mode=0o750, mtime=MTIME - 100),
            _file("./usr/bin/passwd", b"\x7fELF", mode=0o4755),
            _file("./usr/bin/wall", b"\x7fELF", mode=0o2755, gid=5),
            _file("home/user/notes", b"mine", mode=0o600, uid=1000, gid=1000),
            _symlink("usr/bin/pw", "passwd"),
            _symlink("escape-link", "/etc/shadow"),
            _hardlink("usr/bin/passwd2", "usr/bin/passwd"),
        ],
    )
    assert count == 7
    binary = dest / "usr/bin/passwd"
    assert stat.S_IMODE(binary.stat().st_mode) == 0o4755
    assert stat.S_IMODE((dest / "usr/bin/wall").stat().st_mode) == 0o2755
    assert (dest / "usr/bin/wall").stat().st_gid == 5
    notes = (dest / "home/user/notes").stat()
    assert (notes.st_uid, notes.st_gid, stat.S_IMODE(notes.st_mode)) == (1000, 1000, 0o600)
    assert notes.st_mtime == MTIME
    bin_dir = (dest / "usr/bin").stat()
    assert stat.S_IMODE(bin_dir.st_mode) == 0o750
    assert bin_dir.st_mtime == MTIME - 100  # set after its children were created
    assert stat.S_IMODE((dest / "home").stat().st_mode) == 0o755  # implicit parent
    assert os.readlink(dest / "usr/bin/pw") == "passwd"
    assert os.readlink(dest / "escape-link") == "/etc/shadow"
    assert os.lstat(dest / "escape-link").st_mtime == MTIME
    assert os.path.samestat(binary.stat(), (dest / "usr/bin/passwd2").stat())


@pytest.mark.parametrize("compression", ["", "gz", "xz", "bz2"])
def test_streams_compressed_archives_from_a_non_seekable_source(tmp_path: Path, compression: str) -> None:
    class Pipe:
        def __init__(self, data: bytes) -> None:
            self._buffer = io.BytesIO(data)

        def read(self, size: int = -1) -> bytes:
            return self._buffer.read(min(size, 1000) if size >= 0 else size)

    data = _tar([_file("a/b", b"hello" * 1000), _dir("c/")], compression)
    (tmp_path / "dest").mkdir()
    assert extract_tar(Pipe(data), tmp_path / "dest", max_bytes=LIMIT) == 2  # type: ignore[arg-type]
    assert _tree(tmp_path / "dest") == {"a": "dir", "a/b": b"hello" * 1000, "c": "dir"}


def test_absolute_names_land_under_dest(tmp_path: Path) -> None:
    _extract(tmp_path / "dest", [_file("/etc/x", b"x"), _file("//abs/./y/../z", b"z")])
    assert _tree(tmp_path / "dest") == {"abs": "dir", "abs/z": b"z", "etc": "dir", "etc/x": b"x"}


@pytest.mark.parametrize("name", ["../escape", "a/../../escape", "/../escape"])
def test_dotdot_above_dest_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InvalidRequest, match=r"escape.*outside"):
        _extract(tmp_path / "dest", [_file(name, b"owned")])
    assert not (tmp_path / "escape").exists()


@pytest.mark.parametrize("target", ["OUTSIDE", ".."])
def test_writing_through_an_extracted_symlink_is_refused(tmp_path: Path, target: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = str(outside) if target == "OUTSIDE" else target
    with pytest.raises(InvalidRequest, match="link/file.*'link'.*symlink"):
        _extract(tmp_path / "dest", [_symlink("link", target), _file("link/file", b"owned")])
    assert list(outside.iterdir()) == []
    assert not (tmp_path / "file").exists()


def test_symlinked_parent_is_refused_for_directories_and_hardlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("s")
    with pytest.raises(InvalidRequest, match="symlink"):
        _extract(tmp_path / "d1", [_symlink("link", str(outside)), _dir("link/sub/")])
    with pytest.raises(InvalidRequest, match="symlink"):
        _extract(tmp_path / "d2", [_symlink("link", str(outside)), _hardlink("stolen", "link/secret")])
    assert [path.name for path in outside.iterdir()] == ["secret"]


def test_a_directory_replaced_by_a_symlink_cannot_be_written_through(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    entries = [_file("a/b/f", b"f"), _symlink("a/b", str(outside)), _file("a/b/g", b"owned")]
    with pytest.raises(InvalidRequest, match="a/b/g.*'a/b'.*symlink"):
        _extract(tmp_path / "dest", entries)
    assert list(outside.iterdir()) == []


def test_a_symlink_member_is_replaced_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    _extract(
        dest, [_symlink("x", str(outside / "target")), _file("x", b"mine"), _symlink("d", str(outside)), _dir("d/")]
    )
    assert _tree(dest) == {"d": "dir", "x": b"mine"}
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("target", ["/etc/passwd", "missing", "dir"])
def test_hardlink_to_anything_but_an_extracted_file_is_refused(tmp_path: Path, target: str) -> None:
    with pytest.raises(InvalidRequest, match="hardlink 'link'.*not a file extracted before it"):
        _extract(tmp_path / "dest", [_dir("dir/"), _hardlink("link", target)])


def test_device_nodes_and_fifos_are_skipped(tmp_path: Path) -> None:
    messages: list[str] = []
    count = _extract(
        tmp_path / "dest",
        [
            _dir("dev/"),
            _entry("dev/null", tarfile.CHRTYPE),
            _entry("dev/sda", tarfile.BLKTYPE),
            _entry("run/fifo", tarfile.FIFOTYPE),
            _file("ok", b"ok"),
        ],
        progress=messages.append,
    )
    assert count == 2
    assert _tree(tmp_path / "dest") == {"dev": "dir", "ok": b"ok"}
    assert messages == ["skipped device node dev/null", "skipped device node dev/sda", "skipped fifo run/fifo"]


def test_total_file_bytes_over_the_limit_raise(tmp_path: Path) -> None:
    entries = [_file("a", b"x" * 600), _file("b", b"x" * 600)]
    with pytest.raises(PayloadTooLarge, match="more than 1000 bytes.*'b'"):
        _extract(tmp_path / "dest", entries, max_bytes=1000)
    assert not (tmp_path / "dest/b").exists()
    assert _extract(tmp_path / "ok", entries, max_bytes=1200) == 2


def test_member_count_over_the_limit_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unpack, "MAX_MEMBERS", 5)
    assert _extract(tmp_path / "ok", [_file(f"f{index}") for index in range(5)]) == 5
    with pytest.raises(PayloadTooLarge, match="more than 5 members"):
        _extract(tmp_path / "dest", [_file(f"f{index}") for index in range(6)])


def test_too_deep_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="deep"):
        _extract(tmp_path / "dest", [_file("d/" * (unpack.MAX_PATH_DEPTH + 1) + "f")])


def test_dest_must_exist_empty_and_input_must_be_a_tar(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="not a directory"):
        extract_tar(io.BytesIO(_tar([])), tmp_path / "missing", max_bytes=LIMIT)
    (tmp_path / "full").mkdir()
    (tmp_path / "full/x").write_text("x")
    with pytest.raises(InvalidRequest, match="not empty"):
        extract_tar(io.BytesIO(_tar([])), tmp_path / "full", max_bytes=LIMIT)
    (tmp_path / "dest").mkdir()
    with pytest.raises(InvalidRequest, match="cannot read the uploaded archive as a tar archive"):
        extract_tar(io.BytesIO(b"this is not a tar file" * 100), tmp_path / "dest", max_bytes=LIMIT)


# -- OCI layout archives -------------------------------------------------------------------------


def test_oci_layout_applies_layers_with_whiteouts_and_opaque_dirs(tmp_path: Path) -> None:
    layers = _three_layers()
    layout = _OciLayout()
    manifest = layout.manifest(layers, CONFIG)
    archive = layout.write(tmp_path / "image.tar", [{**manifest, "annotations": {unpack._REF_NAME: "demo:1"}}])
    (tmp_path / "dest").mkdir()
    messages: list[str] = []
    info = unpack_oci_archive(archive, tmp_path / "dest", max_bytes=LIMIT, progress=messages.append)
    assert _tree(tmp_path / "dest") == EXPECTED_TREE
    assert info.layer_digests == tuple(_digest(layer) for layer in layers)
    assert info.config == CONFIG
    assert info.repo_tags == ("demo:1",)
    assert [message.split(" ")[:2] for message in messages] == [["layer", "1/3"], ["layer", "2/3"], ["layer", "3/3"]]
    assert messages[0].startswith(f"layer 1/3 {info.layer_digests[0][:19]}…")


def test_whiteout_then_recreate_in_a_later_layer(tmp_path: Path) -> None:
    layout = _OciLayout()
    layers = [_tar([_file("d/sub/old", b"old")]), _tar([_file(".wh.d")]), _tar([_file("d/sub/new", b"new")])]
    archive = layout.write(tmp_path / "image.tar", [layout.manifest(layers, CONFIG)])
    (tmp_path / "dest").mkdir()
    unpack_oci_archive(archive, tmp_path / "dest", max_bytes=LIMIT)
    assert _tree(tmp_path / "dest") == {"d": "dir", "d/sub": "dir", "d/sub/new": b"new"}


def test_manifest_list_picks_linux_amd64(tmp_path: Path) -> None:
    layout = _OciLayout()
    arm = layout.manifest([_tar([_file("arch", b"arm64")], "gz")], {"architecture": "arm64"})
    amd = layout.manifest([_tar([_file("arch", b"amd64")], "gz")], CONFIG)
    nested = layout.json_blob(
        {
            "schemaVersion": 2,
            "manifests": [
                {**arm, "platform": {"os": "linux", "architecture": "arm64"}},
                {**amd, "platform": {"os": "linux", "architecture": "amd64"}},
            ],
        },
        "application/vnd.oci.image.index.v1+json",
    )
    archive = layout.write(tmp_path / "image.tar", [nested])
    (tmp_path / "dest").mkdir()
    info = unpack_oci_archive(archive, tmp_path / "dest", max_bytes=LIMIT)
    assert _tree(tmp_path / "dest") == {"arch": b"amd64"}
    assert info.config == CONFIG
    assert info.repo_tags == ()


def test_missing_blob_is_not_found(tmp_path: Path) -> None:
    layout = _OciLayout()
    layer = _tar([_file("f", b"f")], "gz")
    manifest = layout.manifest([layer], CONFIG)
    del layout.files[f"blobs/sha256/{_digest(layer)[7:]}"]
    (tmp_path / "dest").mkdir()
    with pytest.raises(NotFound, match=f"layer {_digest(layer)}"):
        unpack_oci_archive(layout.write(tmp_path / "image.tar", [manifest]), tmp_path / "dest", max_bytes=LIMIT)


def test_corrupt_layer_blob_is_refused_before_it_is_applied(tmp_path: Path) -> None:
    layout = _OciLayout()
    layer = _tar([_file("f", b"f")], "gz")
    manifest = layout.manifest([layer], CONFIG)
    layout.files[f"blobs/sha256/{_digest(layer)[7:]}"] = _tar([_file("evil", b"evil")], "gz")
    (tmp_path / "dest").mkdir()
    with pytest.raises(InvalidRequest, match=f"layer {_digest(layer)} is corrupt: digest mismatch"):
        unpack_oci_archive(layout.write(tmp_path / "image.tar", [manifest]), tmp_path / "dest", max_bytes=LIMIT)
    assert _tree(tmp_path / "dest") == {}


def test_symlink_attack_across_layers_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    layout = _OciLayout()
    manifest = layout.manifest([_tar([_symlink("etc", str(outside))]), _tar([_file("etc/passwd", b"x")])], CONFIG)
    (tmp_path / "dest").mkdir()
    with pytest.raises(InvalidRequest, match="etc/passwd.*symlink"):
        unpack_oci_archive(layout.write(tmp_path / "image.tar", [manifest]), tmp_path / "dest", max_bytes=LIMIT)
    assert list(outside.iterdir()) == []


def test_layer_size_limit_counts_all_layers(tmp_path: Path) -> None:
    layout = _OciLayout()
    manifest = layout.manifest([_tar([_file("a", b"x" * 600)]), _tar([_file("a", b"y" * 600)])], CONFIG)
    (tmp_path / "dest").mkdir()
    with pytest.raises(PayloadTooLarge):
        unpack_oci_archive(layout.write(tmp_path / "image.tar", [manifest]), tmp_path / "dest", max_bytes=1000)


@pytest.mark.skipif(unpack._zstandard is not None, reason="zstandard is installed")
def test_zstd_layer_without_the_module_says_so(tmp_path: Path) -> None:
    layout = _OciLayout()
    manifest = layout.manifest([unpack._ZSTD_MAGIC + b"\x00" * 100], CONFIG)
    (tmp_path / "dest").mkdir()
    with pytest.raises(InvalidRequest, match="zstd-compressed.*zstandard"):
        unpack_oci_archive(layout.write(tmp_path / "image.tar", [manifest]), tmp_path / "dest", max_bytes=LIMIT)


@pytest.mark.parametrize(
    ("files", "error", "message"),
    [
        ({"oci-layout": b"{}"}, InvalidRequest, "neither manifest.json"),
        ({"index.json": b"{not json"}, InvalidRequest, "index.json.*not valid JSON"),
        ({"index.json": b'{"manifests": []}'}, InvalidRequest, "index.json has no manifests"),
        ({"index.json": b'{"manifests": [{"digest": "md5:00"}]}'}, InvalidRequest, "unsupported digest"),
        ({"index.json": json.dumps({"manifests": [{"digest": _digest(b"x")}]}).encode()}, NotFound, _digest(b"x")),
        ({"manifest.json": b'{"Layers": []}'}, InvalidRequest, "non-empty list"),
        ({"manifest.json": b'[{"Config": "c.json", "Layers": []}]'}, NotFound, "c.json"),
    ],
)
def test_malformed_archives_say_what_is_wrong(
    tmp_path: Path, files: dict[str, bytes], error: type[Exception], message: str
) -> None:
    (tmp_path / "dest").mkdir()
    with pytest.raises(error, match=message):
        unpack_oci_archive(_write_archive(tmp_path / "image.tar", files), tmp_path / "dest", max_bytes=LIMIT)


def test_archive_that_is_not_a_tar_or_missing(tmp_path: Path) -> None:
    (tmp_path / "dest").mkdir()
    (tmp_path / "junk.tar").write_bytes(b"junk" * 1000)
    with pytest.raises(InvalidRequest, match="cannot read image archive junk.tar as a tar archive"):
        unpack_oci_archive(tmp_path / "junk.tar", tmp_path / "dest", max_bytes=LIMIT)
    with pytest.raises(NotFound):
        unpack_oci_archive(tmp_path / "missing.tar", tmp_path / "dest", max_bytes=LIMIT)


# -- docker save archives ------------------------------------------------------------------------


def _docker_save(path: Path, layers: list[bytes], *, blob_names: bool, corrupt_diff_id: bool = False) -> Path:
    diff_ids = [_digest(layer) for layer in layers]
    if corrupt_diff_id:
        diff_ids[1] = _digest(b"other")
    config = json.dumps({**CONFIG, "rootfs": {"type": "layers", "diff_ids": diff_ids}}).encode()
    files: dict[str, bytes] = {}
    if blob_names:  # docker >= 25
        layer_paths = [f"blobs/sha256/{_digest(layer)[7:]}" for layer in layers]
        config_path = f"blobs/sha256/{_digest(config)[7:]}"
    else:  # legacy: <v1 id>/layer.tar, where the id is not the layer's digest
        layer_paths = [f"{hashlib.sha256(b'v1 %d' % index).hexdigest()}/layer.tar" for index in range(len(layers))]
        config_path = f"{_digest(config)[7:]}.json"
    files.update(zip(layer_paths, layers, strict=True))
    files[config_path] = config
    entry = {"Config": config_path, "RepoTags": ["demo:latest", "demo:1"], "Layers": layer_paths}
    files["manifest.json"] = json.dumps([entry]).encode()
    return _write_archive(path, files)


@pytest.mark.parametrize("blob_names", [False, True])
def test_docker_save_archive(tmp_path: Path, blob_names: bool) -> None:
    layers = [_tar(LAYER_1), _tar(LAYER_2), _tar(LAYER_3)]  # docker save writes layers uncompressed
    archive = _docker_save(tmp_path / "image.tar", layers, blob_names=blob_names)
    (tmp_path / "dest").mkdir()
    info = unpack_oci_archive(archive, tmp_path / "dest", max_bytes=LIMIT)
    assert _tree(tmp_path / "dest") == EXPECTED_TREE
    assert info.repo_tags == ("demo:latest", "demo:1")
    assert info.config["config"] == CONFIG["config"]
    assert info.layer_digests == tuple(_digest(layer) for layer in layers)


def test_docker_save_layer_not_matching_its_diff_id_is_corrupt(tmp_path: Path) -> None:
    layers = [_tar(LAYER_1), _tar(LAYER_2)]
    archive = _docker_save(tmp_path / "image.tar", layers, blob_names=False, corrupt_diff_id=True)
    (tmp_path / "dest").mkdir()
    with pytest.raises(InvalidRequest, match="layer .*/layer.tar is corrupt: digest mismatch"):
        unpack_oci_archive(archive, tmp_path / "dest", max_bytes=LIMIT)


def test_docker_save_gzip_layer_is_detected_by_magic(tmp_path: Path) -> None:
    layer = gzip.compress(_tar([_file("z", b"zipped")]))
    archive = _docker_save(tmp_path / "image.tar", [layer], blob_names=False)
    (tmp_path / "dest").mkdir()
    unpack_oci_archive(archive, tmp_path / "dest", max_bytes=LIMIT)
    assert _tree(tmp_path / "dest") == {"z": b"zipped"}
