"""LayerStore, build_erofs and the busybox base image, with real mkfs.erofs and files."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from corral.api.errors import InvalidRequest, NotFound
from corral.images import (
    LayerStore,
    build_busybox_rootfs,
    build_erofs,
    ensure_base_images,
)
from corral.images.bases import debian_mirror
from corral.images.store import CHUNK_INDEX_BYTES

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mounting EROFS and chroot need root")


def _sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _make_tree(root: Path, marker: str = "hello") -> Path:
    (root / "etc").mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "etc/motd").write_text(f"{marker}\n")
    (root / "bin/tool").write_bytes(b"\x7fELF" + os.urandom(8192))
    (root / "bin/alias").symlink_to("tool")
    return root


@pytest.fixture
def tiny_erofs(tmp_path: Path) -> Path:
    return build_erofs(_make_tree(tmp_path / "tree"), tmp_path / "out/tiny.erofs")


@pytest.fixture
def store(tmp_path: Path) -> LayerStore:
    return LayerStore(tmp_path / "store")


def _store_files(store: LayerStore) -> list[str]:
    return sorted(os.listdir(store.root / "layers"))


def test_build_erofs_is_reproducible_and_atomic(tmp_path: Path) -> None:
    tree = _make_tree(tmp_path / "tree")
    first = build_erofs(tree, tmp_path / "a.erofs")
    time.sleep(1.1)  # mkfs.erofs would stamp a new build time
    second = build_erofs(tree, tmp_path / "b.erofs")
    assert first.read_bytes() == second.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.erofs", "b.erofs", "tree"]  # no temp left
    compressed = build_erofs(tree, tmp_path / "z.erofs", compression="lz4hc")
    assert compressed.stat().st_size > 0
    with pytest.raises(InvalidRequest, match="lz4hc"):
        build_erofs(tree, tmp_path / "bad.erofs", compression="zstd")
    with pytest.raises(NotFound):
        build_erofs(tmp_path / "missing", tmp_path / "c.erofs")


def test_import_names_layer_by_sha256(store: LayerStore, tiny_erofs: Path) -> None:
    record = store.import_layer(tiny_erofs, kind="base", labels={"source": "test"})
    assert record.digest == _sha256(tiny_erofs)
    assert record.size_bytes == tiny_erofs.stat().st_size
    assert (record.kind, record.labels) == ("base", {"source": "test"})
    path = store.layer_path(record.digest)
    assert path == store.root / "layers" / f"{record.digest[7:]}.erofs"
    assert path.read_bytes() == tiny_erofs.read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o444
    assert tiny_erofs.exists()  # copied, not moved
    assert path.stat().st_ino != tiny_erofs.stat().st_ino  # and not hard-linked
    sidecar = json.loads(path.with_suffix(".json").read_text())
    assert sidecar["kind"] == "base" and sidecar["size_bytes"] == record.size_bytes
    assert store.layer(record.digest) == record


def test_import_is_idempotent(store: LayerStore, tiny_erofs: Path) -> None:
    first = store.import_layer(tiny_erofs, kind="base", labels={"n": "1"})
    again = store.import_layer(tiny_erofs, kind="diff", labels={"n": "2"})
    assert again == first  # the first record wins
    assert _store_files(store) == [f"{first.digest[7:]}.{suffix}" for suffix in ("chunks", "erofs", "json")]


def test_import_move_hands_the_file_over(store: LayerStore, tiny_erofs: Path) -> None:
    digest = _sha256(tiny_erofs)
    record = store.import_layer(tiny_erofs, kind="workspace", move=True)
    assert record.digest == digest
    assert not tiny_erofs.exists()
    assert store.verify(digest)


def test_import_rejects_bad_arguments(store: LayerStore, tiny_erofs: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="kind"):
        store.import_layer(tiny_erofs, kind="rootfs")
    with pytest.raises(NotFound):
        store.import_layer(tmp_path / "nope.erofs", kind="base")
    with pytest.raises(InvalidRequest):
        store.layer_path("sha256:../../etc/passwd")
    with pytest.raises(NotFound):
        store.layer("sha256:" + "0" * 64)


def test_tag_resolve_and_move_tag(store: LayerStore, tiny_erofs: Path, tmp_path: Path) -> None:
    base = store.import_layer(tiny_erofs, kind="base")
    other_file = build_erofs(_make_tree(tmp_path / "tree2", marker="other"), tmp_path / "other.erofs")
    tools = store.import_layer(other_file, kind="tools")

    tagged = store.tag("busybox", [base.digest])
    assert tagged.ref == "busybox:latest"
    assert store.resolve("busybox") == tagged
    assert store.resolve("busybox:latest") == tagged

    moved = store.tag("busybox", [base.digest, tools.digest])
    resolved = store.resolve("busybox")
    assert resolved.layers == (base.digest, tools.digest) == moved.layers
    assert resolved.size_bytes == base.size_bytes + tools.size_bytes

    pinned = store.tag("busybox", [base.digest], version="1.35")
    assert store.resolve("busybox:1.35") == pinned
    with pytest.raises(NotFound):
        store.tag("busybox", ["sha256:" + "1" * 64])
    with pytest.raises(InvalidRequest):
        store.tag("busybox", [])


def test_resolve_unknown_lists_available_images(store: LayerStore, tiny_erofs: Path) -> None:
    with pytest.raises(NotFound, match="no images: run scripts/setup.sh"):
        store.resolve("busybox")
    digest = store.import_layer(tiny_erofs, kind="base").digest
    store.tag("busybox", [digest])
    store.tag("debian-12", [digest])
    with pytest.raises(NotFound, match=r"ubuntu:latest not found.*available: busybox:latest, debian-12:latest"):
        store.resolve("ubuntu")


@pytest.mark.parametrize(
    "ref", ["Busybox", "a:b:c", "", ":latest", "busybox:", "../etc", ".hidden", "x:..", "a" * 129, "bu sy", "x/y"]
)
def test_malformed_ref_is_invalid_request(store: LayerStore, ref: str) -> None:
    with pytest.raises(InvalidRequest):
        store.resolve(ref)


def test_images_sorted_by_ref(store: LayerStore, tiny_erofs: Path) -> None:
    digest = store.import_layer(tiny_erofs, kind="base").digest
    for ref in ("zeta:latest", "alpha:2", "alpha:10", "debian-12:latest"):
        name, version = ref.split(":")
        store.tag(name, [digest], version=version)
    assert [image.ref for image in store.images()] == ["alpha:10", "alpha:2", "debian-12:latest", "zeta:latest"]


def test_import_records_a_digest_per_chunk(store: LayerStore, tmp_path: Path) -> None:
    """Every way a layer arrives goes through import_layer, so every layer has a chunk index; its chunks are
    cut at fixed offsets whatever size the copy loop reads in, and the last one is short."""
    data = os.urandom(3 * CHUNK_INDEX_BYTES + 1234)
    (tmp_path / "odd.erofs").write_bytes(data)
    record = store.import_layer(tmp_path / "odd.erofs", kind="tools")
    index = store.chunk_index(record.digest)
    assert (index.size_bytes, index.chunk_bytes, len(index.chunks)) == (len(data), CHUNK_INDEX_BYTES, 4)
    for n, chunk in enumerate(index.chunks):
        offset, length = index.chunk_range(n)
        assert chunk == hashlib.sha256(data[offset : offset + length]).hexdigest()
    assert index.chunk_range(3) == (3 * CHUNK_INDEX_BYTES, 1234)
    index_file = store.layer_path(record.digest).with_suffix(".chunks")
    assert json.loads(index_file.read_text())["chunks"] == list(index.chunks)
    assert [layer.digest for layer in store.layers()] == [record.digest]  # the index is not taken for a layer

    index_file.unlink()  # a layer imported before chunk indexes: made on first request, once
    assert store.chunk_index(record.digest) == index and index_file.exists()
    store.remove(record.digest)
    assert not index_file.exists()


def test_verify_detects_corruption(store: LayerStore, tiny_erofs: Path) -> None:
    digest = store.import_layer(tiny_erofs, kind="base").digest
    assert store.verify(digest)
    path = store.layer_path(digest)
    os.chmod(path, 0o644)
    data = bytearray(path.read_bytes())
    data[2000] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not store.verify(digest)


def test_concurrent_imports_give_one_file(store: LayerStore, tiny_erofs: Path) -> None:
    barrier = threading.Barrier(4)
    digests: list[str] = []
    errors: list[BaseException] = []

    def import_once() -> None:
        try:
            barrier.wait()
            digests.append(LayerStore(store.root).import_layer(tiny_erofs, kind="base").digest)
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=import_once) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors
    assert digests == [_sha256(tiny_erofs)] * 4
    hex_digest = digests[0][7:]
    assert _store_files(store) == [f"{hex_digest}.{suffix}" for suffix in ("chunks", "erofs", "json")]  # no temp files


def test_stale_temp_files_are_swept(store: LayerStore) -> None:
    stale = store.root / "layers/.import.1.abc.tmp"
    fresh = store.root / "layers/.import.2.def.tmp"
    stale.write_bytes(b"x")
    fresh.write_bytes(b"y")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    LayerStore(store.root)
    assert not stale.exists() and fresh.exists()


def test_debian_mirror_reads_deb822_and_one_line_sources(tmp_path: Path) -> None:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    assert debian_mirror("bookworm", apt_dir=apt) == "http://deb.debian.org/debian"
    (apt / "sources.list").write_text("deb [signed-by=/k.gpg arch=amd64] http://one.example/debian/ bookworm main\n")
    assert debian_mirror("bookworm", apt_dir=apt) == "http://one.example/debian"
    (apt / "sources.list.d/debian.sources").write_text(
        "Types: deb\nURIs: http://sec.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb deb-src\n# comment\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n"
    )
    assert debian_mirror("bookworm", apt_dir=apt) == "http://mirror.example/debian"
    assert debian_mirror("bookworm-security", apt_dir=apt) == "http://sec.example/debian-security"


@needs_root
def test_busybox_image_mounts_and_runs(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    build_busybox_rootfs(rootfs)
    image = build_erofs(rootfs, tmp_path / "busybox.erofs")
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(image), str(mountpoint)], check=True)
    try:
        assert os.readlink(mountpoint / "bin/sh") == "busybox"
        assert os.readlink(mountpoint / "usr/bin/env") == "../../bin/busybox"
        assert (mountpoint / "bin/sh").is_file()
        assert stat.S_IMODE((mountpoint / "tmp").stat().st_mode) == 0o1777
        assert stat.S_IMODE((mountpoint / "root").stat().st_mode) == 0o700
        assert stat.S_IMODE(mountpoint.stat().st_mode) == 0o755
        assert (mountpoint / "home/user").stat().st_uid == 1000
        assert "user:x:1000:1000:user:/home/user:/bin/sh" in (mountpoint / "etc/passwd").read_text()
        assert "127.0.0.1\tlocalhost" in (mountpoint / "etc/hosts").read_text()
        result = subprocess.run(
            ["chroot", str(mountpoint), "/bin/sh", "-c", "id -un; env true && echo ok"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        assert result.stdout.split() == ["root", "ok"], result.stderr
    finally:
        subprocess.run(["umount", str(mountpoint)], check=True)


def test_ensure_base_images_builds_once(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    messages: list[str] = []
    (first,) = ensure_base_images(store, ["busybox"], work_dir=tmp_path / "work", progress=messages.append)
    assert first.ref == "busybox:latest"
    layer = store.layer(first.layers[0])
    assert layer.kind == "base" and layer.labels["source"].startswith("BusyBox v")
    assert any("mkfs.erofs" in message for message in messages)
    assert list((tmp_path / "work").iterdir()) == []  # temp rootfs and image removed

    messages.clear()
    (again,) = ensure_base_images(store, ["busybox"], work_dir=tmp_path / "work", progress=messages.append)
    assert again == first
    assert messages == [f"busybox: present (busybox:latest {first.layers[0][:19]}, {first.size_bytes / 1e6:.1f} MB)"]
    with pytest.raises(InvalidRequest, match="unknown base image"):
        ensure_base_images(store, ["ubuntu"], work_dir=tmp_path / "work")
