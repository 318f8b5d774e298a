"""Layers on demand: a second node mounts a layer it has never seen and fetches only the chunks its sandboxes read.

Real parts throughout: two servers sharing PostgreSQL, the first one the layer source (chunk index and blob
routes over HTTP on loopback), the second one with an empty layer store, corral-lazyfs (FUSE) under EROFS, and
busybox sandboxes reading files. Faults are made on the source side: a chunk's bytes changed in the first
server's store, and the second server killed mid-layer and started again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import corral
from corral.embedded import EmbeddedServer
from corral.images.cache import NodeLayerCache, fetched_layers
from corral.images.lazy import PartialFiles, build_lazyfs
from corral.images.store import CHUNK_INDEX_BYTES, LayerStore

FILES, FILE_BYTES = 8, 4 << 20  # a 32 MiB tools layer of 8 random files
TIMEOUT_ENV = {"CORRAL_LAYER_READ_TIMEOUT_S": "8", "CORRAL_LAYER_CHUNK_TIMEOUT_S": "3"}


@pytest.fixture
def data_tree(tmp_path: Path) -> dict[str, str]:
    """/lazy/f<i> in the layer: random bytes (never deduped or compressible); their sha256 by name."""
    tree = tmp_path / "tree" / "lazy"
    tree.mkdir(parents=True)
    digests = {}
    for i in range(FILES):
        data = os.urandom(FILE_BYTES)
        (tree / f"f{i}").write_bytes(data)
        digests[f"f{i}"] = hashlib.sha256(data).hexdigest()
    return digests


@pytest.fixture
def source(tmp_path: Path, postgres_url: str, test_env: dict[str, str]) -> Iterator[EmbeddedServer]:
    with EmbeddedServer(tmp_path / "a", env={**test_env, "CORRAL_DATABASE_URL": postgres_url}) as first:
        yield first


def _second_env(source: EmbeddedServer, postgres_url: str, test_env: dict[str, str], node_dir: Path) -> dict[str, str]:
    return {**test_env, **TIMEOUT_ENV, "CORRAL_DATABASE_URL": postgres_url, "CORRAL_NODE_DIR": str(node_dir),
            "CORRAL_EDGE_ID": "e5", "CORRAL_LAYER_SOURCE_URL": source.url,
            "CORRAL_LAYER_SOURCE_KEY": source.api_key}  # fmt: skip


def _build(source: EmbeddedServer, tmp_path: Path, name: str) -> str:
    with source.client() as client:
        client.images.build(name, "dir", path=str(tmp_path / "tree"), no_cache=True)
        return client.images.inspect(name).layers[-1].digest


def _present_bytes(node_dir: Path, digest: str) -> int:
    marks = (node_dir / "layers" / "partial" / f"{digest[7:]}.present").read_bytes()
    return marks.count(1) * CHUNK_INDEX_BYTES


def _sha256_in(sandbox: corral.Sandbox, name: str) -> corral.ExecResult:
    return sandbox.exec(f"sha256sum /lazy/{name}", timeout_s=60)


def test_the_source_serves_chunk_digests_and_byte_ranges(server: EmbeddedServer, test_env: dict[str, str]) -> None:
    with server.client() as client:
        digest = client.images.inspect("busybox").layers[-1].digest
    store = LayerStore(Path(test_env["CORRAL_NODE_DIR"]) / "layers")
    blob = store.layer_path(digest).read_bytes()
    headers = {"Authorization": f"Bearer {server.api_key}"}
    index = httpx.get(f"{server.url}/v1/layers/{digest}/chunks", headers=headers).json()
    assert index["size_bytes"] == len(blob) and index["chunk_bytes"] == CHUNK_INDEX_BYTES
    for n in (0, len(index["chunks"]) - 1):
        start = n * CHUNK_INDEX_BYTES
        assert index["chunks"][n] == hashlib.sha256(blob[start : start + CHUNK_INDEX_BYTES]).hexdigest()
    ranged = httpx.get(f"{server.url}/v1/layers/{digest}/blob", headers={**headers, "Range": "bytes=1000-4999"})
    assert ranged.status_code == 206 and ranged.content == blob[1000:5000]
    with server.client() as client:
        job_key = client.issue_job_token("chunks-test")
    refused = httpx.get(f"{server.url}/v1/layers/{digest}/chunks", headers={"Authorization": f"Bearer {job_key}"})
    assert refused.status_code == 403  # like the blob: hidden grading layers stay hidden


def test_a_node_reads_a_layer_it_never_had_fetching_only_what_is_read(
    source: EmbeddedServer, postgres_url: str, tmp_path: Path, test_env: dict[str, str], data_tree: dict[str, str]
) -> None:
    digest = _build(source, tmp_path, "lazy-read")
    node_dir = tmp_path / "node-b"
    with EmbeddedServer(tmp_path / "b", env=_second_env(source, postgres_url, test_env, node_dir)) as second:
        with second.client() as client, client.create(environment={"base": "busybox", "tools": "lazy-read"},
                                                      ttl_s=120) as sandbox:  # fmt: skip
            assert sandbox.info.edge_id == "e5"
            assert _sha256_in(sandbox, "f2").stdout.split()[0] == data_tree["f2"]
            fetched = _present_bytes(node_dir, digest)
            layer_bytes = FILES * FILE_BYTES
            # One file of eight, plus metadata and the chunks at its edges.
            assert FILE_BYTES <= fetched <= FILE_BYTES + 1.5 * (1 << 20), fetched
            assert fetched < 0.2 * layer_bytes
            assert not (node_dir / "layers" / "layers" / f"{digest[7:]}.erofs").exists()  # not complete yet

            # Every file read: the layer is complete, checked whole, and an ordinary store file from then on.
            listing = sandbox.exec("cd /lazy && sha256sum f*", timeout_s=120).stdout
            assert {line.split()[1]: line.split()[0] for line in listing.splitlines()} == data_tree
            stored = node_dir / "layers" / "layers" / f"{digest[7:]}.erofs"
            deadline = time.monotonic() + 30
            while not stored.exists():
                assert time.monotonic() < deadline, "the complete layer never reached the node's store"
                time.sleep(0.2)
            assert "sha256:" + hashlib.sha256(stored.read_bytes()).hexdigest() == digest
            assert not (node_dir / "layers" / "partial" / f"{digest[7:]}.data").exists()
        with second.client() as client, client.create(environment={"base": "busybox", "tools": "lazy-read"},
                                                      ttl_s=120) as sandbox:  # fmt: skip
            assert _sha256_in(sandbox, "f7").stdout.split()[0] == data_tree["f7"]


def test_layer_fetch_eager_fetches_the_whole_layer_before_the_first_mount(
    source: EmbeddedServer, postgres_url: str, tmp_path: Path, test_env: dict[str, str], data_tree: dict[str, str]
) -> None:
    """The fallback and benchmark baseline: the whole blob, verified, in the node's store before the sandbox runs."""
    digest = _build(source, tmp_path, "lazy-eager")
    node_dir = tmp_path / "node-b"
    env = {**_second_env(source, postgres_url, test_env, node_dir), "CORRAL_LAYER_FETCH": "eager"}
    with EmbeddedServer(tmp_path / "b", env=env) as second, second.client() as client:
        with client.create(environment={"base": "busybox", "tools": "lazy-eager"}, ttl_s=120) as sandbox:
            stored = node_dir / "layers" / "layers" / f"{digest[7:]}.erofs"
            assert "sha256:" + hashlib.sha256(stored.read_bytes()).hexdigest() == digest
            assert not list((node_dir / "layers").glob("partial/*.present"))  # nothing went through FUSE
            assert _sha256_in(sandbox, "f3").stdout.split()[0] == data_tree["f3"]


def _corrupt(path: Path, offset: int) -> bytes:
    """Flip one byte of a stored layer at ``offset`` (the source's copy); returns the original byte."""
    with open(path, "r+b") as f:
        f.seek(offset)
        original = f.read(1)
        f.seek(offset)
        f.write(bytes([original[0] ^ 0xFF]))
    return original


def _offset_of(store_file: Path, content_head: bytes) -> int:
    offset = store_file.read_bytes().find(content_head)
    assert offset > 0
    return offset


def test_a_chunk_that_does_not_verify_is_eio_and_an_event_never_bad_bytes(
    source: EmbeddedServer, postgres_url: str, tmp_path: Path, test_env: dict[str, str], data_tree: dict[str, str]
) -> None:
    digest = _build(source, tmp_path, "lazy-corrupt")
    store_file = LayerStore(Path(test_env["CORRAL_NODE_DIR"]) / "layers").layer_path(digest)
    head = (tmp_path / "tree" / "lazy" / "f5").read_bytes()[:64]
    offset = _offset_of(store_file, head) + FILE_BYTES // 2
    original = _corrupt(store_file, offset)
    node_dir = tmp_path / "node-b"
    try:
        with EmbeddedServer(tmp_path / "b", env=_second_env(source, postgres_url, test_env, node_dir)) as second:
            with second.client() as client, client.create(environment={"base": "busybox", "tools": "lazy-corrupt"},
                                                          ttl_s=120) as sandbox:  # fmt: skip
                started = time.monotonic()
                result = _sha256_in(sandbox, "f5")
                # No hash printed at all: the reader never got the bad bytes, only the error.
                assert (result.exit_code, result.stdout) == (1, ""), result
                assert "Input/output error" in result.stderr, result
                assert time.monotonic() - started < 20  # bounded: two tries per chunk, then EIO
                events = [e for e in sandbox.audit_events() if e.kind == "layer_chunk_unavailable"]
                assert events and events[0].detail["layer"] == digest
                assert "does not match the chunk index" in events[0].detail["error"]
                assert _sha256_in(sandbox, "f4").stdout.split()[0] == data_tree["f4"]  # other chunks still serve
                _corrupt(store_file, offset)  # the source is fixed: the next read fetches the chunk again
                assert _sha256_in(sandbox, "f5").stdout.split()[0] == data_tree["f5"]
    finally:
        with open(store_file, "r+b") as f:
            f.seek(offset)
            f.write(original)


def test_a_restarted_node_resumes_a_partial_layer(
    source: EmbeddedServer, postgres_url: str, tmp_path: Path, test_env: dict[str, str], data_tree: dict[str, str]
) -> None:
    digest = _build(source, tmp_path, "lazy-resume")
    node_dir = tmp_path / "node-b"
    second = EmbeddedServer(tmp_path / "b", env=_second_env(source, postgres_url, test_env, node_dir))
    second.start()
    try:
        with second.client() as client:
            sandbox = client.create(environment={"base": "busybox", "tools": "lazy-resume"}, ttl_s=120)
            assert _sha256_in(sandbox, "f1").stdout.split()[0] == data_tree["f1"]
        before = _present_bytes(node_dir, digest)
        assert second.process is not None
        helpers = _lazyfs_helpers(tmp_path)
        assert helpers, "no corral-lazyfs serves the layer"
        second.process.kill()  # mid-layer, without a word
        second.process.wait()
        assert _lazyfs_helpers(tmp_path) == helpers  # outlives its server: the sandbox's mount is still served
        # The source's copy of f1 goes bad: a restarted node can only read f1 from the chunks it kept.
        store_file = LayerStore(Path(test_env["CORRAL_NODE_DIR"]) / "layers").layer_path(digest)
        head = (tmp_path / "tree" / "lazy" / "f1").read_bytes()[:64]
        offset = _offset_of(store_file, head) + FILE_BYTES // 2
        original = _corrupt(store_file, offset)
        try:
            second.start()
            assert _present_bytes(node_dir, digest) == before  # the map survived (and its chunks re-verified)
            with second.client() as client:
                # The sandbox from before the kill, re-adopted, reads what it never read: its mount's helper (in the
                # killed server's mount namespace) asks the new server, which reattached to it.
                adopted = client.get(sandbox.id)
                assert adopted.info.state == corral.SandboxState.RUNNING
                assert _sha256_in(adopted, "f6").stdout.split()[0] == data_tree["f6"]
                with client.create(environment={"base": "busybox", "tools": "lazy-resume"}, ttl_s=60) as fresh:
                    assert _sha256_in(fresh, "f1").stdout.split()[0] == data_tree["f1"]
                    assert _sha256_in(fresh, "f6").stdout.split()[0] == data_tree["f6"]
            assert FILE_BYTES <= _present_bytes(node_dir, digest) - before <= FILE_BYTES + (1 << 20)
            # A graceful restart lets the helpers of layers in use go rather than stopping them.
            second.stop()  # SIGTERM: the server only, its sandboxes keep running
            second.start()
            with second.client() as client:
                adopted = client.get(sandbox.id)
                assert _sha256_in(adopted, "f3").stdout.split()[0] == data_tree["f3"]
                adopted.kill()
        finally:
            with open(store_file, "r+b") as f:
                f.seek(offset)
                f.write(original)
    finally:
        if not second.running():
            second.start()
        second.shutdown()
    assert not _lazyfs_helpers(tmp_path), "a corral-lazyfs outlived the server that reattached to it"


def test_a_helper_nobody_comes_back_for_exits_after_its_orphan_time(
    source: EmbeddedServer, postgres_url: str, tmp_path: Path, test_env: dict[str, str], data_tree: dict[str, str]
) -> None:
    _build(source, tmp_path, "lazy-orphan")
    env = {**_second_env(source, postgres_url, test_env, tmp_path / "node-b"), "CORRAL_LAYER_HELPER_ORPHAN_S": "2"}
    second = EmbeddedServer(tmp_path / "b", env=env)
    second.start()
    try:
        with second.client() as client:
            sandbox = client.create(environment={"base": "busybox", "tools": "lazy-orphan"}, ttl_s=60)
            assert _sha256_in(sandbox, "f0").stdout.split()[0] == data_tree["f0"]
        helpers = _lazyfs_helpers(tmp_path)
        assert helpers
        assert second.process is not None
        second.process.kill()
        second.process.wait()
        killed = time.monotonic()
        time.sleep(1)
        assert _lazyfs_helpers(tmp_path) == helpers, "a helper ended with its server, before its orphan time"
        while _lazyfs_helpers(tmp_path):
            assert time.monotonic() - killed < 15, "a helper with no server outlived its orphan time"
            time.sleep(0.2)
    finally:
        if not second.running():
            second.start()
        second.shutdown()


def _lazyfs_helpers(under: Path) -> set[int]:
    """The corral-lazyfs processes (not zombies) whose mountpoint is under ``under``, by pid."""
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            stat = (proc / "stat").read_text()
            if argv[0].endswith(b"/corral-lazyfs") and argv[1].startswith(bytes(under)) and ") Z" not in stat:
                pids.add(int(proc.name))
    return pids


def _node_cache_metric(server: EmbeddedServer) -> float:
    """``corral_node_layer_cache_bytes`` of the server's one node, as /metrics says."""
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30).text
    values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == "corral_node_layer_cache_bytes"]  # fmt: skip
    assert len(values) == 1, values
    return values[0]


def _erofs_mounted(server: EmbeddedServer, digest: str) -> bool:
    """Whether the server (in its own mount namespace) has an EROFS mount of this layer."""
    assert server.process is not None
    mountinfo = Path(f"/proc/{server.process.pid}/mountinfo").read_text()
    return any(" - erofs " in line and digest[7:] in line for line in mountinfo.splitlines())


def test_a_node_over_its_cache_budget_evicts_an_unused_partial_layer_and_keeps_a_mounted_one(
    source: EmbeddedServer, postgres_url: str, tmp_path: Path, test_env: dict[str, str], data_tree: dict[str, str]
) -> None:
    digest_a = _build(source, tmp_path, "cache-a")
    other = tmp_path / "other"
    (other / "lazy").mkdir(parents=True)
    digests_b = {}
    for i in range(FILES):
        data = os.urandom(FILE_BYTES)
        (other / "lazy" / f"f{i}").write_bytes(data)
        digests_b[f"f{i}"] = hashlib.sha256(data).hexdigest()
    with source.client() as client:
        client.images.build("cache-b", "dir", path=str(other), no_cache=True)
        digest_b = client.images.inspect("cache-b").layers[-1].digest
    node_dir = tmp_path / "node-b"
    env = {**_second_env(source, postgres_url, test_env, node_dir), "CORRAL_LAYER_CACHE_BUDGET_MB": "10",
           "CORRAL_LAYER_IDLE_UNMOUNT_S": "0"}  # fmt: skip
    files_a = PartialFiles.of(node_dir / "layers", digest_a)
    with EmbeddedServer(tmp_path / "b", env=env) as second, second.client() as client:
        with client.create(environment={"base": "busybox", "tools": "cache-a"}, ttl_s=120) as sandbox:
            assert _sha256_in(sandbox, "f0").stdout.split()[0] == data_tree["f0"]
        assert all(path.exists() for path in files_a.all)
        deadline = time.monotonic() + 20
        while _erofs_mounted(second, digest_a):  # unused now: unmounted at the next housekeeping round
            assert time.monotonic() < deadline, "layer A stayed mounted"
            time.sleep(0.2)
        with client.create(environment={"base": "busybox", "tools": "cache-b"}, ttl_s=120) as reader:
            assert reader.exec("cat /lazy/f0 /lazy/f1 > /dev/null", timeout_s=60).exit_code == 0
            b_bytes = _present_bytes(node_dir, digest_b)
            assert b_bytes >= 2 * FILE_BYTES
            cache = {layer.digest: layer for layer in NodeLayerCache(LayerStore(node_dir / "layers"), 0).layers()}
            # A sparse partial layer counts what is on disk, not its size.
            assert b_bytes <= cache[digest_b].disk_bytes < b_bytes + (2 << 20) < FILES * FILE_BYTES
            assert sum(layer.disk_bytes for layer in cache.values()) > 10 << 20  # over budget now
            # The next create checks the budget: A (unused, unmounted) goes, files together; B is mounted: kept.
            with client.create(environment={"base": "busybox", "tools": "cache-b"}, ttl_s=120) as second_reader:
                assert not any(path.exists() for path in files_a.all)
                assert _present_bytes(node_dir, digest_b) == b_bytes
                on_disk = sum(layer.disk_bytes for layer in fetched_layers(LayerStore(node_dir / "layers")))
                assert abs(_node_cache_metric(second) - on_disk) <= CHUNK_INDEX_BYTES, "/metrics must show the cache"
                assert _sha256_in(second_reader, "f1").stdout.split()[0] == digests_b["f1"]
                assert _sha256_in(reader, "f2").stdout.split()[0] == digests_b["f2"]
        # Evicted means fetched again, correctly, from nothing: only what this sandbox reads is here.
        with client.create(environment={"base": "busybox", "tools": "cache-a"}, ttl_s=120) as sandbox:
            assert _sha256_in(sandbox, "f0").stdout.split()[0] == data_tree["f0"]
            assert _sha256_in(sandbox, "f5").stdout.split()[0] == data_tree["f5"]
            assert 2 * FILE_BYTES <= _present_bytes(node_dir, digest_a) <= 2 * FILE_BYTES + (1 << 20) + (1 << 19)


def _helper_connection(path: Path) -> tuple[socket.socket, IO[bytes]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(path))
    return sock, sock.makefile("rb")


def test_a_server_that_connects_takes_over_the_helper_from_one_that_hangs(tmp_path: Path) -> None:
    """The helper alone (no Corral server): the first "server" connects, is asked for the chunk a read waits on
    and never answers (hung, or its end held by a process that outlived it); a second one connects, is greeted
    and asked again at once, its answer ends the read, and the first one's connection is closed."""
    helper = build_lazyfs(tmp_path / "build")
    assert helper is not None, "corral-lazyfs did not build (libfuse3, pkg-config, /dev/fuse: scripts/setup.sh)"
    chunk_bytes, chunks = 4096, 4
    data, present, mountpoint, sockets = tmp_path / "data", tmp_path / "present", tmp_path / "mnt", tmp_path / "s"
    data.write_bytes(b"\0" * chunk_bytes * chunks)
    present.write_bytes(bytes(chunks))
    mountpoint.mkdir()
    sockets.mkdir(mode=0o700)
    argv = [str(helper), str(mountpoint), str(data), str(chunk_bytes * chunks), str(chunk_bytes), str(present),
            "10000", str(sockets / "h.sock"), "60000"]  # fmt: skip
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not (sockets / "h.sock").exists():
            assert time.monotonic() < deadline and process.poll() is None, "the helper did not listen"
            time.sleep(0.01)
        old, old_lines = _helper_connection(sockets / "h.sock")
        assert old_lines.readline().startswith(b"R ")
        with concurrent.futures.ThreadPoolExecutor(1) as reader:
            read = reader.submit(lambda: (mountpoint / "layer.erofs").open("rb").read(chunk_bytes))
            asked = old_lines.readline()
            wanted = asked.split()[2:]  # chunk 0, and what the kernel reads ahead
            assert asked.split()[0] == b"F" and wanted[0] == b"0", asked
            new, new_lines = _helper_connection(sockets / "h.sock")
            assert new_lines.readline().startswith(b"R ")  # before the change: only once the first one closed
            assert new_lines.readline() == asked  # the waiting read, asked of the new server
            assert old_lines.read() == b""  # the old connection is closed
            with data.open("r+b") as file:
                file.write(b"chunk zero".ljust(chunk_bytes, b"."))
            new.sendall(b"".join(b"O %s\n" % chunk for chunk in wanted))
            assert read.result(timeout=10) == b"chunk zero".ljust(chunk_bytes, b".")
        old.close()
        new.close()
    finally:
        process.terminate()  # its signal handler unmounts
        process.wait(timeout=10)
        if os.path.ismount(mountpoint):
            subprocess.run(["umount", "-l", str(mountpoint)], check=False)
