"""Layers a node lacks, mounted at once and filled chunk by chunk as sandboxes read them.

Why FUSE and not fanotify: on this kernel (6.18) ``FAN_PRE_ACCESS`` events do
arrive for plain reads of a sparse file and the handler may fill the range, and
EROFS's file-backed *data* reads raise them too, but its *metadata* reads (the
superblock at mount, inodes, directories: read through the page cache of the
backing file) raise none, so the mount saw zeros and refused (measured, see
docs/images.md). A FUSE file sees every read, so EROFS is mounted file-backed
from ``<mountpoint>/layer.erofs`` served by ``corral-lazyfs`` (native/lazyfs.c).

Trust: the helper serves only chunks this process has marked present, and a
chunk is marked present only after its bytes, fetched by HTTP Range from the
layer source, hash to the chunk's entry in the layer's chunk index (made when
the layer was imported, fetched from the same source, and itself bound to the
layer: the chunks together must hash to the layer digest, checked once every
chunk is here). A chunk that fails to fetch or verify is answered as EIO to the
reader, with an audit event, and retried on the next read; a read waits at
most ``read_timeout_s``.

Node-side files, under the store's ``partial/`` (same filesystem, so a
complete layer is renamed into the store, not copied)::

    partial/<hex>.data      sparse copy of the layer, chunks written as they arrive
    partial/<hex>.present   one byte per chunk, 1 = written and verified
    partial/<hex>.chunks    the layer's chunk index and kind, as the source sent them

A restarted node resumes: chunks marked present are re-hashed from the data
file (a crash may have kept the mark but not the bytes) and only the rest is
fetched. The three files are one partial layer: the node's layer cache
(cache.py) counts them together and evicts them together (``discard``).
Once every chunk is present the file is imported into the store
(whole-file sha256 checked there) and later mounts use it directly, without
FUSE; mounts made while it was filling keep reading through the helper until
they are unmounted.

A helper outlives the server that started it (it listens on
``<mount root>/<hex>.<token>.sock``): the sandboxes of a server that died
(an edge actor killed) keep reading through it, and the next server
reattaches to every helper it finds there. A helper whose mount is this
server's (same ``st_dev`` on the mountpoint: a cluster node's shared mount
namespace) is the layer's helper again; one in another mount namespace (an
embedded server's previous one) is served as an orphan until it exits. A
helper nobody reattaches to exits after ``orphan_s``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import io
import json
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from corral.api.errors import InternalError, NotFound, ServerUnavailable
from corral.images.store import ChunkIndex, LayerStore, check_layer_file
from corral.procfs import mount_field, running

__all__ = ["LAZY_FILE_NAME", "AuditSink", "LayerSource", "OnDemandLayers", "PartialFiles", "build_lazyfs",
           "check_layer", "is_on_demand_file"]  # fmt: skip

log = logging.getLogger("corral.images")

LAZY_FILE_NAME = "layer.erofs"
HELPER_READY_TIMEOUT_S = 10.0
CHUNK_FETCH_ATTEMPTS = 2
FETCH_WORKERS = 8
_MNT_DETACH = 2
_SANDBOX_IN_CGROUP = re.compile(r"(sb-[a-z0-9]{1,16}-[0-9a-f]{16})")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)

AuditSink = Callable[[str, str, str, dict[str, Any]], None]
"""``(sandbox_id, kind, severity, detail)``: where a failed chunk is reported (the audit log)."""


def build_lazyfs(out_root: Path) -> Path | None:
    """Compile corral-lazyfs once per source version; None when libfuse3 or /dev/fuse is missing."""
    source = Path(__file__).parent / "native" / "lazyfs.c"
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    binary = out_root / "bin" / digest / "corral-lazyfs"
    if binary.exists():
        return binary
    compiler, pkg_config = shutil.which("gcc") or shutil.which("cc"), shutil.which("pkg-config")
    if compiler is None or pkg_config is None or not os.path.exists("/dev/fuse"):
        return None
    flags = subprocess.run([pkg_config, "--cflags", "--libs", "fuse3"], capture_output=True, text=True)
    if flags.returncode != 0:
        return None
    binary.parent.mkdir(parents=True, exist_ok=True)
    tmp = binary.with_name(f".corral-lazyfs.{os.getpid()}")
    subprocess.run([compiler, "-O2", "-Wall", "-o", str(tmp), str(source), *flags.stdout.split(), "-lpthread"],
                   check=True, capture_output=True)  # fmt: skip
    os.replace(tmp, binary)
    return binary


def is_on_demand_file(path: Path) -> bool:
    """True for a layer file served by corral-lazyfs (verified chunk by chunk, so never hashed whole)."""
    if path.name != LAZY_FILE_NAME:
        return False
    mountpoint = str(path.parent)
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) > 2 and mount_field(fields[1]) == mountpoint and fields[2] == "fuse.corral-lazyfs":
            return True
    return False


@dataclass(frozen=True)
class PartialFiles:
    """The files of one partial layer under a store's ``partial/`` (module docstring)."""

    data: Path
    present: Path
    index: Path

    @classmethod
    def of(cls, store_root: Path, digest: str) -> PartialFiles:
        stem = store_root / "partial" / digest.removeprefix("sha256:")
        return cls(data=stem.with_suffix(".data"), present=stem.with_suffix(".present"),
                   index=stem.with_suffix(".chunks"))  # fmt: skip

    @property
    def all(self) -> tuple[Path, Path, Path]:
        return self.data, self.present, self.index

    def remove(self) -> None:
        for path in self.all:
            path.unlink(missing_ok=True)


def check_layer(digest: str, path: Path) -> None:
    """The check before a layer's first mount: its whole sha256, except for an on-demand file, whose every
    chunk is checked as it arrives (hashing it whole would fetch all of it)."""
    if not is_on_demand_file(path):
        check_layer_file(digest, path)


class LayerSource:
    """The layer store a node fetches from: a Corral gateway's chunk index and blob routes (HTTP Range)."""

    def __init__(self, url: str, api_key: str, *, timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self._client = httpx.Client(
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 5.0)),
            limits=httpx.Limits(max_connections=FETCH_WORKERS),
        )

    def chunk_index(self, digest: str) -> tuple[ChunkIndex, str]:
        """The layer's chunk index and kind."""
        url = f"{self.url}/v1/layers/{digest}/chunks"
        try:
            response = self._client.get(url)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"cannot fetch the chunk index of layer {digest} from {url}: {exc!r}") from exc
        if response.status_code == 404:
            raise NotFound(f"layer {digest} is neither on this node nor in the layer store {url}")
        if response.status_code != 200:
            raise ServerUnavailable(f"the layer store answered {response.status_code} for {url}")
        data = response.json()
        index = ChunkIndex.from_json(data)
        if index.digest != digest:
            raise InternalError(f"the layer store sent the chunk index of {index.digest} for {digest}: refused")
        return index, str(data.get("kind", "base"))

    def read_range(self, digest: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the layer from ``offset`` (raises ServerUnavailable on any failure)."""
        url = f"{self.url}/v1/layers/{digest}/blob"
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        try:
            response = self._client.get(url, headers=headers)
        except httpx.HTTPError as exc:
            raise ServerUnavailable(f"cannot fetch {url} {headers['Range']}: {exc!r}") from exc
        if response.status_code != 206 or len(response.content) != length:
            raise ServerUnavailable(
                f"the layer store answered {response.status_code} with {len(response.content)} bytes "
                f"for {url} {headers['Range']}"
            )
        return response.content

    def close(self) -> None:
        self._client.close()


@dataclass
class _Filling:
    """One layer being filled: its files, its helper, and what is present."""

    index: ChunkIndex
    kind: str
    files: PartialFiles
    mountpoint: Path
    present: bytearray
    helper: _Helper | None = None  # the helper of this server's mount
    orphans: list[_Helper] = field(default_factory=list)  # helpers of earlier servers' mounts, served till they exit
    data_fd: int = -1
    present_fd: int = -1
    in_flight: dict[int, concurrent.futures.Future[bool]] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)
    finishing: bool = False
    complete: bool = False  # imported into the store: new mounts use the store's file

    @property
    def file(self) -> Path:
        return self.mountpoint / LAZY_FILE_NAME

    def missing(self) -> int:
        return self.present.count(0)

    def helpers(self) -> list[_Helper]:
        return [*([self.helper] if self.helper is not None else []), *self.orphans]


@dataclass(eq=False)
class _Helper:
    """One corral-lazyfs process, spoken to over its socket: started by this server, or by an earlier one."""

    sock: socket.socket
    reader: io.BufferedReader
    pid: int
    dev: int  # st_dev of its mount, as it saw it
    process: subprocess.Popen[bytes] | None = None  # None: not this server's child
    write_lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, line: bytes) -> None:
        with self.write_lock, contextlib.suppress(OSError):  # the helper is gone: nobody to tell
            self.sock.sendall(line)

    def let_go(self) -> None:
        """Disconnect and leave it running: it serves what is present and waits for the next server."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # its serving thread sees the end and closes it

    def stop(self) -> None:
        """Tell it to unmount and exit, and wait for it (killed if it does not within 5 s)."""
        self.send(b"Q\n")
        if self.process is not None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        else:
            deadline = time.monotonic() + 5
            while running(self.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            if running(self.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # its serving thread sees the end and closes it


class OnDemandLayers:
    """The node's layers that are mounted before they are here (one corral-lazyfs helper each).

    Thread-safe and independent of any event loop: chunk fetches run on this
    object's own threads, so a blocked event loop (a mount(2) reading the
    superblock, say) never stalls the reads it is waiting for.
    """

    def __init__(
        self,
        store: LayerStore,
        source: LayerSource,
        *,
        helper: Path,
        mount_root: Path,
        read_timeout_s: float,
        orphan_s: float = 900.0,
        audit: AuditSink | None = None,
        node_name: str = "node",
    ) -> None:
        """Reattaches at once to the helpers an earlier server left running (module docstring)."""
        self._store = store
        self._source = source
        self._helper = helper
        self._mount_root = mount_root
        self._read_timeout_s = read_timeout_s
        self._orphan_s = orphan_s
        self._audit = audit
        self._node_name = node_name
        (store.root / "partial").mkdir(parents=True, exist_ok=True)
        self._layers: dict[str, _Filling] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(FETCH_WORKERS, thread_name_prefix="corral-chunks")
        self.fetched_bytes = 0  # chunk bytes written since start (the node's cache checks its budget as it grows)
        self._complete_orphans: dict[_Helper, str] = {}  # earlier servers' helpers of layers complete here now
        self._reattach()

    def open(self, digest: str) -> Path:
        """A path to the layer now: the store's file if it is complete, else the helper's file (blocking)."""
        with contextlib.suppress(NotFound):
            return self._store.layer_path(digest)
        with self._lock:
            filling = self._layers.get(digest)
            if filling is None:
                filling = self._layers[digest] = self._start(digest)
            elif filling.helper is None and not filling.complete:  # only orphans so far (reattached) or it exited
                self._spawn_helper(digest, filling)
        if filling.complete:
            return self._store.layer_path(digest)
        return filling.file

    def path(self, digest: str) -> Path | None:
        """The helper's file of a layer being filled (None if none is, or only earlier servers' helpers serve it:
        ``open`` starts one of this server's)."""
        filling = self._layers.get(digest)
        return filling.file if filling is not None and filling.helper is not None and not filling.complete else None

    def discard(self, digest: str) -> bool:
        """Forget a layer no sandbox has mounted and delete its partial files, together (the node's layer cache
        evicts it; a later ``open`` starts afresh). False while it is being imported into the store."""
        with self._lock:
            filling = self._layers.get(digest)
            if filling is not None:
                if filling.finishing and not filling.complete:
                    return False
                del self._layers[digest]
        if filling is not None:
            self._stop_helper(filling)
            with filling.lock:
                in_flight = list(filling.in_flight.values())
            concurrent.futures.wait(in_flight)  # each bounded by the chunk timeout; they write through data_fd
            _close_files(filling)
        PartialFiles.of(self._store.root, digest).remove()
        return True

    def close(self, keep_serving: Collection[str] | None = ()) -> None:
        """Stop the helpers and the fetch threads. The helpers of the layers in ``keep_serving`` (those of the
        sandboxes left running; None: not known, every layer) are only let go: their mounts stay readable, and
        the next server reattaches to them (a mount of this server's that nobody uses any more ends its
        helper: it is detached here)."""
        kept = (lambda digest: True) if keep_serving is None else keep_serving.__contains__
        with self._lock:
            fillings, self._layers = list(self._layers.values()), {}
            complete_orphans, self._complete_orphans = self._complete_orphans, {}
        for filling in fillings:
            if kept(filling.index.digest):
                _libc.umount2(os.fsencode(filling.mountpoint), _MNT_DETACH)
                for helper in filling.helpers():
                    helper.let_go()
            else:
                self._stop_helper(filling)
        for helper, digest in complete_orphans.items():
            helper.let_go() if kept(digest) else helper.stop()
        self._source.close()  # fetches in flight fail now rather than at their timeout
        self._pool.shutdown(wait=True, cancel_futures=True)
        for filling in fillings:  # only now: a fetch thread must never write through a reused descriptor
            _close_files(filling)

    # -- starting ---------------------------------------------------------

    def _start(self, digest: str) -> _Filling:
        filling = self._filling(digest)
        if filling.complete:
            return filling
        try:
            self._spawn_helper(digest, filling)
        except BaseException:
            _close_files(filling)
            raise
        log.info("layer %s mounted on demand (%d of %d chunks here)", digest[:19],
                 len(filling.present) - filling.missing(), len(filling.present))  # fmt: skip
        return filling

    def _filling(self, digest: str) -> _Filling:
        """A layer's partial files opened and its present map resumed; imported at once if nothing is missing."""
        files = PartialFiles.of(self._store.root, digest)
        index, kind = self._chunk_index(digest, files)
        with open(files.data, "ab") as f:
            f.truncate(index.size_bytes)
        filling = _Filling(
            index=index,
            kind=kind,
            files=files,
            mountpoint=self._mount_root / digest.removeprefix("sha256:"),
            present=self._resumed_present(index, files),
        )
        try:
            filling.data_fd = os.open(filling.files.data, os.O_RDWR | os.O_CLOEXEC)
            filling.present_fd = os.open(filling.files.present, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            os.pwrite(filling.present_fd, bytes(filling.present), 0)
            if filling.missing() == 0:
                self._complete(digest, filling)
        except BaseException:
            _close_files(filling)
            raise
        return filling

    def _chunk_index(self, digest: str, files: PartialFiles) -> tuple[ChunkIndex, str]:
        """The layer's chunk index and kind: kept beside a partial layer (a restart resumes without the source),
        else fetched and kept. Trusted no more than the source: the finished layer must hash to its digest."""
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, InternalError):
            data = json.loads(files.index.read_text())
            index = ChunkIndex.from_json(data)
            if index.digest == digest:
                return index, str(data["kind"])
        index, kind = self._source.chunk_index(digest)
        tmp = files.index.with_name(f".{files.index.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**index.to_json(), "kind": kind}))
        os.replace(tmp, files.index)
        return index, kind

    def _resumed_present(self, index: ChunkIndex, files: PartialFiles) -> bytearray:
        """The present map a restart resumes from: every mark re-checked against the bytes in the data file."""
        present = bytearray(len(index.chunks))
        try:
            marks = files.present.read_bytes()
        except FileNotFoundError:
            return present
        with open(files.data, "rb") as data:
            for chunk, mark in enumerate(marks[: len(present)]):
                if mark == 1:
                    offset, length = index.chunk_range(chunk)
                    data.seek(offset)
                    present[chunk] = hashlib.sha256(data.read(length)).hexdigest() == index.chunks[chunk]
        return present

    def _spawn_helper(self, digest: str, filling: _Filling) -> None:
        mountpoint = filling.mountpoint
        mountpoint.mkdir(parents=True, exist_ok=True)
        while _mount_dev(mountpoint) is not None:  # an earlier server's, whose helper did not answer: dead
            if _libc.umount2(os.fsencode(mountpoint), _MNT_DETACH) != 0:
                break
        index = filling.index
        path = self._mount_root / f"{digest.removeprefix('sha256:')}.{secrets.token_hex(4)}.sock"
        argv = [str(self._helper), str(mountpoint), str(filling.files.data), str(index.size_bytes),
                str(index.chunk_bytes), str(filling.files.present), str(int(self._read_timeout_s * 1000)),
                str(path), str(int(self._orphan_s * 1000))]  # fmt: skip
        # A process group of its own: Ray ends a dead worker's group (RAY_process_group_cleanup_enabled), and the
        # helper must outlive its edge. Its session stays the node's, so stopping the node ends it.
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, close_fds=True,
                                   process_group=0)  # fmt: skip
        deadline = time.monotonic() + HELPER_READY_TIMEOUT_S
        helper = None
        while helper is None:
            try:
                helper = _connect(path, max(0.01, deadline - time.monotonic()))
            except (FileNotFoundError, ConnectionRefusedError):  # not listening yet
                if process.poll() is None and time.monotonic() < deadline:
                    time.sleep(0.005)
                    continue
            except (OSError, ValueError):
                pass
            if helper is None:
                process.kill()
                process.wait()
                raise InternalError(f"corral-lazyfs did not mount layer {digest} on {mountpoint} "
                                    f"(exit status {process.returncode})")  # fmt: skip
        helper.process = process
        filling.helper = helper
        self._serve_in_thread(digest, filling, helper)

    def _reattach(self) -> None:
        """Connect to the helpers earlier servers left under the mount root, and serve them (module docstring)."""
        if not self._mount_root.is_dir():
            return
        for path in sorted(self._mount_root.glob("*.sock")):
            digest = "sha256:" + path.name.partition(".")[0]
            try:
                helper = _connect(path, HELPER_READY_TIMEOUT_S)
            except ConnectionRefusedError:  # its helper is gone
                path.unlink(missing_ok=True)
                continue
            except (OSError, ValueError) as exc:  # there, but not answering: left alone
                log.warning("layer %s: the helper at %s did not answer (%s)", digest[:19], path, exc)
                continue
            try:
                with contextlib.suppress(NotFound):
                    self._store.layer_path(digest)
                    self._complete_orphans[helper] = digest  # every chunk is here now: each is answered present
                    self._serve_in_thread(digest, None, helper)
                    log.info("layer %s: reattached to helper %d (the layer is complete)", digest[:19], helper.pid)
                    continue
                filling = self._layers.get(digest)
                if filling is None:
                    filling = self._layers[digest] = self._filling(digest)
                mountpoint = filling.mountpoint
                if filling.helper is None and _mount_dev(mountpoint) == helper.dev:
                    filling.helper = helper  # its mount is ours: new mounts of the layer read through it too
                else:
                    filling.orphans.append(helper)
                self._serve_in_thread(digest, filling, helper)
                log.info("layer %s: reattached to helper %d (%s, %d of %d chunks here)", digest[:19], helper.pid,
                         "this server's mount" if filling.helper is helper else "another mount namespace",
                         len(filling.present) - filling.missing(), len(filling.present))  # fmt: skip
            except Exception:
                log.exception("layer %s: could not reattach to the helper at %s; stopping it", digest[:19], path)
                helper.stop()

    def _serve_in_thread(self, digest: str, filling: _Filling | None, helper: _Helper) -> None:
        threading.Thread(target=self._serve, args=(digest, filling, helper), name=f"corral-lazyfs-{digest[7:19]}",
                         daemon=True).start()  # fmt: skip

    # -- serving ----------------------------------------------------------

    def _serve(self, digest: str, filling: _Filling | None, helper: _Helper) -> None:
        """Answer one helper's requests until it exits: each missing chunk fetched once, in parallel (``filling``
        None: the layer is complete, every chunk is present)."""
        try:
            for line in helper.reader:
                fields = line.split()
                if len(fields) < 3 or fields[0] != b"F":
                    continue
                reader_pid = int(fields[1])
                for chunk in map(int, fields[2:]):
                    if filling is None:
                        helper.send(b"O %d\n" % chunk)
                        continue
                    if not 0 <= chunk < len(filling.present):
                        continue
                    with filling.lock:
                        if filling.present[chunk]:
                            helper.send(b"O %d\n" % chunk)
                            continue
                        future = filling.in_flight.get(chunk)
                        if future is None:
                            future = filling.in_flight[chunk] = self._pool.submit(
                                self._fetch_chunk, digest, filling, chunk, reader_pid
                            )
                    future.add_done_callback(functools.partial(self._answer_fetch, helper, chunk))
        except (OSError, ValueError):  # its socket was shut down (stopped) or broke
            pass
        finally:
            with self._lock:
                if filling is not None:
                    if filling.helper is helper:
                        filling.helper = None
                    with contextlib.suppress(ValueError):
                        filling.orphans.remove(helper)
                self._complete_orphans.pop(helper, None)
            helper.reader.close()  # the socket's file: the descriptor closes only once both are closed
            helper.sock.close()

    @staticmethod
    def _answer_fetch(helper: _Helper, chunk: int, done: concurrent.futures.Future[bool]) -> None:
        ok = not done.cancelled() and done.exception() is None and done.result()
        helper.send(b"%s %d\n" % (b"O" if ok else b"E", chunk))

    def _fetch_chunk(self, digest: str, filling: _Filling, chunk: int, reader_pid: int) -> bool:
        """Fetch, verify, write and mark one chunk; False (and an audit event) if it cannot be had."""
        offset, length = filling.index.chunk_range(chunk)
        error = ""
        try:
            for _attempt in range(CHUNK_FETCH_ATTEMPTS):
                try:
                    data = self._source.read_range(digest, offset, length)
                except ServerUnavailable as exc:
                    error = str(exc)
                    continue
                if hashlib.sha256(data).hexdigest() != filling.index.chunks[chunk]:
                    error = f"chunk {chunk} (bytes {offset}-{offset + length - 1}) does not match the chunk index"
                    continue
                os.pwrite(filling.data_fd, data, offset)
                with filling.lock:
                    os.pwrite(filling.present_fd, b"\x01", chunk)
                    filling.present[chunk] = 1
                    done = filling.missing() == 0
                with self._lock:
                    self.fetched_bytes += length
                if done:
                    self._pool.submit(self._complete_logged, digest, filling)
                return True
            log.warning("layer %s: %s; the reading process gets EIO", digest[:19], error)
            self._report(reader_pid, "layer_chunk_unavailable", {
                "layer": digest, "chunk": chunk, "offset": offset, "length": length, "error": error,
                "source": self._source.url,
            })  # fmt: skip
            return False
        finally:
            with filling.lock:
                filling.in_flight.pop(chunk, None)

    def _report(self, reader_pid: int, kind: str, detail: dict[str, Any]) -> None:
        if self._audit is None:
            return
        sandbox_id = _sandbox_of(reader_pid) or self._node_name
        try:
            self._audit(sandbox_id, kind, "warning", {**detail, "pid": reader_pid})
        except Exception:  # the audit store being down must not turn an EIO into a hang
            log.exception("could not record %s for %s", kind, sandbox_id)

    # -- finishing --------------------------------------------------------

    def _complete(self, digest: str, filling: _Filling) -> None:
        """Every chunk is here: the whole file is checked once and becomes an ordinary layer of the store."""
        with filling.lock:
            if filling.finishing:
                return
            filling.finishing = True
        started = time.monotonic()
        record = self._store.import_layer(
            filling.files.data, kind=filling.kind, labels={"fetched_from": self._source.url}, move=True
        )
        if record.digest != digest:  # every chunk matched, so the chunk index itself lied
            self._store.remove(record.digest)
            self._report(0, "layer_corrupt", {"layer": digest, "hashes_to": record.digest})
            raise InternalError(f"layer {digest} was assembled from its chunks but hashes to {record.digest}")
        filling.files.remove()  # the data file is the store's now; the map and index are done with
        filling.complete = True
        if filling.helper is not None:  # mounts on top keep it alive; new ones use the store's file
            _libc.umount2(os.fsencode(filling.mountpoint), _MNT_DETACH)
        log.info("layer %s is complete on this node (verified in %.2f s)", digest[:19], time.monotonic() - started)

    def _complete_logged(self, digest: str, filling: _Filling) -> None:
        try:
            self._complete(digest, filling)
        except Exception:  # on a pool thread: nobody else would see it; mounts keep reading through the helper
            log.exception("layer %s: every chunk is here but it could not become a store layer", digest[:19])

    def _stop_helper(self, filling: _Filling) -> None:
        helpers = filling.helpers()
        if not helpers:
            return
        _libc.umount2(os.fsencode(filling.mountpoint), _MNT_DETACH)
        for helper in helpers:
            helper.stop()


def _close_files(filling: _Filling) -> None:
    for fd in (filling.data_fd, filling.present_fd):
        if fd >= 0:
            os.close(fd)
    filling.data_fd = filling.present_fd = -1


def _connect(path: Path, timeout_s: float) -> _Helper:
    """A connection to the helper listening at ``path``, after its greeting (through /proc/self/fd: a deep data
    dir makes the path longer than a socket address may be)."""
    dir_fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.settimeout(timeout_s)
        sock.connect(f"/proc/self/fd/{dir_fd}/{path.name}")
        reader = sock.makefile("rb")
        hello = reader.readline().split()
        if len(hello) != 2 or hello[0] != b"R":
            raise ValueError(f"corral-lazyfs at {path} greeted with {hello!r}")
        pid, _uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    finally:
        os.close(dir_fd)
    return _Helper(sock=sock, reader=reader, pid=pid, dev=int(hello[1]))


def _mount_dev(mountpoint: Path) -> int | None:
    """The device of what is mounted on ``mountpoint`` in this mount namespace (the top mount), None if nothing:
    read from mountinfo, as a stat would hang or fail on a mount whose helper is gone."""
    dev = None
    target = str(mountpoint)
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" ", 5)
        if len(fields) > 4 and mount_field(fields[4]) == target:
            major, _, minor = fields[2].partition(":")
            dev = os.makedev(int(major), int(minor))
    return dev


def _sandbox_of(pid: int) -> str | None:
    """The sandbox a process belongs to, read from its cgroup path (which names the sandbox)."""
    try:
        match = _SANDBOX_IN_CGROUP.search(Path(f"/proc/{pid}/cgroup").read_text())
    except OSError:
        return None
    return match.group(1) if match else None
