"""The node-wide, content-addressed store of EROFS layers and image tags.

Every Corral server on a node shares one store directory, so nothing here
keeps state in memory and every write is atomic on disk (temp file, fsync,
rename or link). Concurrent importers of the same bytes end up with one file;
readers never see a half-written layer, sidecar or tag.

Layout under ``root``::

    layers/<hex>.erofs        the layer, read-only, named by sha256 of its bytes
    layers/<hex>.json         sidecar: kind, size, created_at, labels
    layers/<hex>.chunks       chunk index: sha256 of every CHUNK_INDEX_BYTES of the layer (on-demand loading)
    images/<name>/<version>.json   a tag: the layer digests, bottom first
    .build.lock               taken by ensure_base_images() (bases.py)

Temp files start with a dot and end in ``.tmp``; leftovers of crashed writers
are swept when a store is opened. A layer that does not fit on the store's disk
(ENOSPC, EDQUOT) leaves nothing (its temp file goes, and the ``.erofs`` is linked
in last) and is refused as CapacityExhausted naming the free space, so a create
that pulls it can be retried once room is made.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.api.errors import CapacityExhausted, InternalError, InvalidRequest, NotFound
from corral.api.models import ImageConfig

__all__ = [
    "CHUNK_INDEX_BYTES",
    "LAYER_KINDS",
    "DEFAULT_VERSION",
    "ChunkIndex",
    "ImageOrigin",
    "ImageRecord",
    "LayerRecord",
    "LayerStore",
]

LAYER_KINDS = ("base", "workspace", "tools", "diff")
DEFAULT_VERSION = "latest"
STALE_TMP_AGE_S = 3600.0
_CHUNK_BYTES = 1 << 20
CHUNK_INDEX_BYTES = 256 << 10
"""The unit a node fetches and verifies a layer it lacks in (docs/images.md, "Layers on demand", says why 256 KiB)."""
_DIGEST_RE = re.compile(r"^sha256:([0-9a-f]{64})$")
_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
# A leading dot is refused: names are path components, and "." / ".." or a
# dotfile would escape or collide with our temp files.
_NAME_RE = re.compile(r"^[a-z0-9_-][a-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class LayerRecord:
    digest: str
    size_bytes: int
    kind: str
    created_at: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkIndex:
    """The sha256 (hex) of every ``chunk_bytes`` of a layer, in order; the last chunk may be shorter."""

    digest: str
    size_bytes: int
    chunk_bytes: int
    chunks: tuple[str, ...]

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        """Offset and length of chunk number ``chunk``."""
        offset = chunk * self.chunk_bytes
        return offset, min(self.chunk_bytes, self.size_bytes - offset)

    def to_json(self) -> dict[str, Any]:
        return {"digest": self.digest, "size_bytes": self.size_bytes, "chunk_bytes": self.chunk_bytes,
                "chunks": list(self.chunks)}  # fmt: skip

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ChunkIndex:
        index = cls(
            digest=str(data["digest"]),
            size_bytes=int(data["size_bytes"]),
            chunk_bytes=int(data["chunk_bytes"]),
            chunks=tuple(str(chunk) for chunk in data["chunks"]),
        )
        expected = -(-index.size_bytes // index.chunk_bytes) if index.chunk_bytes > 0 else -1
        if expected != len(index.chunks) or not all(_HEX64_RE.match(chunk) for chunk in index.chunks):
            raise InternalError(f"the chunk index of {index.digest} does not describe {index.size_bytes} bytes")
        return index


@dataclass(frozen=True)
class ImageOrigin:
    """Where a pulled image came from. Its config is the image's ``config`` like any other image's; which OCI
    layer each of its layers was made from is in the layer's record (``source.oci_digest``)."""

    source: str  # the registry reference pulled, e.g. 127.0.0.1:5000/ns/img:tag
    manifest_digest: str  # of the image manifest (linux/amd64's, when the reference named an index)
    index_digest: str | None

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "manifest_digest": self.manifest_digest, "index_digest": self.index_digest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ImageOrigin:
        return cls(source=str(data["source"]), manifest_digest=str(data["manifest_digest"]),
                   index_digest=data.get("index_digest"))  # fmt: skip


@dataclass(frozen=True)
class ImageRecord:
    name: str
    version: str
    layers: tuple[str, ...]
    created_at: float
    size_bytes: int
    config: ImageConfig = field(default_factory=ImageConfig)  # env, working dir, user ... (image_config.py)
    origin: ImageOrigin | None = None  # a registry pull's provenance; None for images built or imported here

    @property
    def ref(self) -> str:
        # A registry image pulled by digest has the digest as its version: host/repo@sha256:...
        return f"{self.name}{'@' if self.version.startswith('sha256:') else ':'}{self.version}"


def check_layer_file(digest: str, path: Path) -> None:
    """Refuse a layer file whose bytes do not hash to its digest (it is never used then)."""
    with open(path, "rb") as f:
        hex_digest, _ = _hash_stream(f)
    if f"sha256:{hex_digest}" != digest:
        raise InternalError(
            f"layer {digest} is corrupt: {path} hashes to sha256:{hex_digest[:12]}…; it will not be used. "
            "Rebuild or re-import it (corral images rm, then build or import again)."
        )


class LayerStore:
    """Layers and tags in one directory; safe for many processes at once."""

    def __init__(self, root: Path, *, inspect_only: bool = False) -> None:
        """``inspect_only``: only look (create no directories, sweep nothing), as ``setup.sh --check`` does."""
        self.root = Path(root)
        self._layers = self.root / "layers"
        self._images = self.root / "images"
        if inspect_only:
            return
        self._layers.mkdir(parents=True, exist_ok=True)
        self._images.mkdir(parents=True, exist_ok=True)
        self._sweep_stale_tmp()

    # -- layers ---------------------------------------------------------

    def import_layer(
        self,
        erofs_file: Path,
        *,
        kind: str,
        labels: dict[str, str] | None = None,
        move: bool = False,
    ) -> LayerRecord:
        """Add a layer file; return its record (the existing one if already stored).

        The digest is computed over the bytes as they land in our own temp
        file, so a caller rewriting its file mid-import cannot make the name
        lie. ``move=True`` hands the file over (renamed in when on the same
        filesystem, else copied and removed); without it the file is copied,
        never hard-linked, so later writes to the caller's file cannot change
        a stored layer.
        """
        if kind not in LAYER_KINDS:
            raise InvalidRequest(f"unknown layer kind {kind!r}; use one of {', '.join(LAYER_KINDS)}")
        labels = _checked_labels(labels)
        source = Path(erofs_file)
        if not source.is_file():
            raise NotFound(f"layer file {source} does not exist")

        tmp = _tmp_path(self._layers, "import")
        chunks = _ChunkHasher(CHUNK_INDEX_BYTES)
        try:
            hex_digest, size_bytes = self._stage(source, tmp, move=move, chunks=chunks)
            os.chmod(tmp, 0o444)
            digest = f"sha256:{hex_digest}"
            index = ChunkIndex(digest, size_bytes, CHUNK_INDEX_BYTES, chunks.finish())
            _link_json_if_absent(self._layers / f"{hex_digest}.chunks", index.to_json())
            sidecar = {
                "digest": digest,
                "size_bytes": size_bytes,
                "kind": kind,
                "created_at": time.time(),
                "labels": labels,
            }
            # Sidecar first: whoever sees <hex>.erofs can rely on <hex>.json.
            # Both are linked, not renamed, so the first importer's record wins.
            _link_json_if_absent(self._layers / f"{hex_digest}.json", sidecar)
            _link_if_absent(tmp, self._layers / f"{hex_digest}.erofs")
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            st = os.statvfs(self._layers)
            raise CapacityExhausted(
                f"the layer cache's disk is full: a {source.stat().st_size >> 20} MiB layer does not fit in "
                f"{(st.f_bavail * st.f_frsize) >> 20} MiB free at {self._layers}; nothing of it was kept. Free "
                "space there (delete unused images, or set CORRAL_LAYER_DISK_BUDGET_MB so unused layers are evicted) "
                "and retry"
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)
        return self.layer(digest)

    def layer_path(self, digest: str) -> Path:
        """Path of a stored layer; raises NotFound if it is not in the store."""
        path = self._layers / f"{_hex_of(digest)}.erofs"
        if not path.is_file():
            raise NotFound(f"layer {digest} is not in the store at {self.root}")
        return path

    def chunk_index(self, digest: str) -> ChunkIndex:
        """The layer's chunk digests, made at import (or now, once, for a layer imported before indexes)."""
        path = self.layer_path(digest)
        index_path = path.with_suffix(".chunks")
        try:
            return ChunkIndex.from_json(_read_json(index_path))
        except FileNotFoundError:
            pass
        chunks = _ChunkHasher(CHUNK_INDEX_BYTES)
        with open(path, "rb") as f:
            hex_digest, size_bytes = _hash_stream(f, chunks=chunks)
        if f"sha256:{hex_digest}" != digest:
            raise InternalError(f"layer {digest} is corrupt: {path} no longer hashes to its name; re-import it")
        index = ChunkIndex(digest, size_bytes, CHUNK_INDEX_BYTES, chunks.finish())
        _link_json_if_absent(index_path, index.to_json())
        return index

    def layer(self, digest: str) -> LayerRecord:
        path = self.layer_path(digest)
        try:
            data = _read_json(path.with_suffix(".json"))
        except FileNotFoundError:
            raise InternalError(
                f"layer {digest} has no sidecar {path.with_suffix('.json')}: re-import the layer file"
            ) from None
        return LayerRecord(
            digest=digest,
            size_bytes=int(data["size_bytes"]),
            kind=str(data["kind"]),
            created_at=float(data["created_at"]),
            labels={str(k): str(v) for k, v in data.get("labels", {}).items()},
        )

    def layers(self) -> list[LayerRecord]:
        """Every layer in the store, oldest first."""
        records = []
        for sidecar in self._layers.glob("*.json"):
            digest = f"sha256:{sidecar.stem}"
            try:
                records.append(self.layer(digest))
            except (NotFound, InternalError, FileNotFoundError):
                continue  # half-imported or removed meanwhile
        return sorted(records, key=lambda record: record.created_at)

    def remove(self, digest: str) -> None:
        """Delete a layer's file and sidecar (the caller checks nothing uses it)."""
        hex_digest = _hex_of(digest)
        (self._layers / f"{hex_digest}.erofs").unlink(missing_ok=True)
        (self._layers / f"{hex_digest}.json").unlink(missing_ok=True)
        (self._layers / f"{hex_digest}.chunks").unlink(missing_ok=True)

    def verify(self, digest: str) -> bool:
        """Re-hash a stored layer: False means its bytes no longer match the name."""
        with open(self.layer_path(digest), "rb") as f:
            hex_digest, _ = _hash_stream(f)
        return f"sha256:{hex_digest}" == digest

    # -- images ---------------------------------------------------------

    def tag(self, name: str, layers: Sequence[str], *, version: str = DEFAULT_VERSION) -> ImageRecord:
        """Point ``name:version`` at ``layers`` (bottom first); moves an existing tag."""
        check_name(name, "image name")
        check_name(version, "image version")
        if isinstance(layers, str) or not layers:
            raise InvalidRequest("an image needs a non-empty sequence of layer digests, bottom first")
        size_bytes = sum(self.layer(digest).size_bytes for digest in layers)
        record = ImageRecord(
            name=name,
            version=version,
            layers=tuple(layers),
            created_at=time.time(),
            size_bytes=size_bytes,
        )
        image_dir = self._images / name
        image_dir.mkdir(exist_ok=True)
        _write_json_atomic(
            image_dir / f"{version}.json",
            {
                "name": name,
                "version": version,
                "layers": list(record.layers),
                "created_at": record.created_at,
                "size_bytes": size_bytes,
            },
        )
        return record

    def resolve(self, ref: str) -> ImageRecord:
        """``"name"`` or ``"name:version"`` to its record; ``"name"`` means ``name:latest``."""
        name, version = parse_ref(ref)
        try:
            return _image_from_json(_read_json(self._images / name / f"{version}.json"))
        except FileNotFoundError:
            pass
        available = ", ".join(image.ref for image in self.images())
        hint = f"available: {available}" if available else "the store has no images: run scripts/setup.sh"
        raise NotFound(f"image {name}:{version} not found in {self.root}; {hint}")

    def images(self) -> list[ImageRecord]:
        records: list[ImageRecord] = []
        if not self._images.is_dir():
            return records
        for image_dir in self._images.iterdir():
            if not image_dir.is_dir() or not _NAME_RE.match(image_dir.name):
                continue
            for tag_file in image_dir.glob("*.json"):
                if _NAME_RE.match(tag_file.stem):
                    try:
                        records.append(_image_from_json(_read_json(tag_file)))
                    except FileNotFoundError:
                        continue  # untagged between listing and reading
        return sorted(records, key=lambda image: image.ref)

    # -- internals ------------------------------------------------------

    def _stage(self, source: Path, tmp: Path, *, move: bool, chunks: _ChunkHasher) -> tuple[str, int]:
        """Put the source bytes at ``tmp`` (ours alone) and hash them, whole and per chunk."""
        if move:
            try:
                os.rename(source, tmp)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
            else:
                with open(tmp, "rb") as f:
                    return _hash_stream(f, chunks=chunks)
        with open(source, "rb") as src, open(tmp, "xb") as dst:
            hex_digest, size_bytes = _hash_stream(src, copy_to=dst, chunks=chunks)
            dst.flush()
            os.fsync(dst.fileno())
        if move:
            source.unlink()
        return hex_digest, size_bytes

    def _sweep_stale_tmp(self) -> None:
        cutoff = time.time() - STALE_TMP_AGE_S
        for tmp in [*self._layers.glob(".*.tmp"), *self._images.glob("*/.*.tmp")]:
            try:
                if tmp.lstat().st_mtime < cutoff:
                    tmp.unlink()
            except FileNotFoundError:
                continue  # another process swept it first


def _tmp_path(directory: Path, stem: str) -> Path:
    return directory / f".{stem}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"


class _ChunkHasher:
    """sha256 of each fixed-size chunk of a byte stream fed in pieces of any size."""

    def __init__(self, chunk_bytes: int) -> None:
        self._chunk_bytes = chunk_bytes
        self._current = hashlib.sha256()
        self._filled = 0
        self._done: list[str] = []

    def update(self, data: memoryview) -> None:
        while data:
            take = min(len(data), self._chunk_bytes - self._filled)
            self._current.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self._chunk_bytes:
                self._done.append(self._current.hexdigest())
                self._current, self._filled = hashlib.sha256(), 0

    def finish(self) -> tuple[str, ...]:
        if self._filled:
            self._done.append(self._current.hexdigest())
            self._current, self._filled = hashlib.sha256(), 0
        return tuple(self._done)


def _hash_stream(
    src: io.BufferedIOBase, copy_to: io.BufferedIOBase | None = None, chunks: _ChunkHasher | None = None
) -> tuple[str, int]:
    digest = hashlib.sha256()
    size_bytes = 0
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    while n := src.readinto(buffer):
        digest.update(view[:n])
        if chunks is not None:
            chunks.update(view[:n])
        if copy_to is not None:
            copy_to.write(view[:n])
        size_bytes += n
    return digest.hexdigest(), size_bytes


def _hex_of(digest: str) -> str:
    match = _DIGEST_RE.match(digest) if isinstance(digest, str) else None
    if match is None:
        raise InvalidRequest(f"malformed layer digest {digest!r}; expected 'sha256:' and 64 hex digits")
    return match.group(1)


def check_name(value: str, what: str) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise InvalidRequest(
            f"malformed {what} {value!r}: use 1-128 characters from [a-z0-9._-], not starting with '.'"
        )


def parse_ref(ref: str) -> tuple[str, str]:
    if not isinstance(ref, str) or ref.count(":") > 1:
        raise InvalidRequest(f"malformed image reference {ref!r}; expected 'name' or 'name:version'")
    name, _, version = ref.partition(":")
    if not version and ":" in ref:
        raise InvalidRequest(f"malformed image reference {ref!r}: empty version after ':'")
    version = version or DEFAULT_VERSION
    check_name(name, "image name")
    check_name(version, "image version")
    return name, version


def _checked_labels(labels: dict[str, str] | None) -> dict[str, str]:
    labels = dict(labels or {})
    for key, value in labels.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise InvalidRequest(f"layer labels must map str to str, got {key!r}: {value!r}")
    return labels


def _image_from_json(data: dict[str, Any]) -> ImageRecord:
    return ImageRecord(
        name=str(data["name"]),
        version=str(data["version"]),
        layers=tuple(str(digest) for digest in data["layers"]),
        created_at=float(data["created_at"]),
        size_bytes=int(data["size_bytes"]),
    )


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise InternalError(f"{path} is not a JSON object: the store is corrupt")
    return data


def _write_tmp_json(directory: Path, data: dict[str, Any]) -> Path:
    tmp = _tmp_path(directory, "json")
    with open(tmp, "x", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    tmp = _write_tmp_json(path.parent, data)
    try:
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def _link_json_if_absent(path: Path, data: dict[str, Any]) -> None:
    if path.exists():
        return
    tmp = _write_tmp_json(path.parent, data)
    try:
        _link_if_absent(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _link_if_absent(tmp: Path, path: Path) -> None:
    """Publish ``tmp`` as ``path`` unless someone already did (first one wins)."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        return
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
