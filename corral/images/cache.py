"""A node's cache of layers fetched from the layer source, kept under a disk budget.

What it holds: the copies of layers this node got from the layer source
(``CORRAL_LAYER_SOURCE_URL``), complete ones (store files labelled
``fetched_from``) and partial ones still filling on demand (lazy.py's
``partial/<hex>.data``, ``.present`` and ``.chunks``). Every one of them can be
fetched again, which is what sets them apart from the layers a gateway holds.

One budget or two: two settings, because they bound different things.
``CORRAL_LAYER_DISK_BUDGET_MB`` bounds the gateway's layers, the originals:
``Catalogue.evict`` forgets an evicted layer (its catalogue row and build cache
entries go), so it spares every tagged layer. ``CORRAL_LAYER_CACHE_BUDGET_MB``
bounds this node's copies: evicting one deletes only local bytes, so tags do
not protect it, only use does. Unset, the cache budget is the disk budget, so
one number bounds a node's layer disk as before; set both where a gateway's
disk and a node's cache differ in size (a big store, small local disks).

Counted as on disk: ``st_blocks``, not ``st_size``, so a sparse partial layer
counts the chunks that are here (plus its map and index).

Never evicted, because something uses it: a layer a sandbox of this node
runs on (the caller's set, from the sandbox records: a VM reads its layer
files without a mount), a layer with an EROFS mount in this process's mount
namespace (an idle mount is reused by the next sandbox; a partial layer
evicted under it would read EIO), and a layer held by a create in flight
(``hold``: fetched, not yet recorded). The rest go least recently used first:
last handed out by this process, else (a restarted node) the file's mtime.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from corral.images.lazy import PartialFiles
from corral.images.store import LayerStore

__all__ = ["CachedLayer", "NodeLayerCache", "fetched_layers", "mounted_layers"]

log = logging.getLogger("corral.images")

_HEX_IN_PATH = re.compile(r"([0-9a-f]{64})")
_BLOCK_BYTES = 512  # st_blocks' unit


@dataclass(frozen=True)
class CachedLayer:
    digest: str
    disk_bytes: int  # allocated on disk (st_blocks): a partial layer's present chunks, map and index
    last_used: float  # unix time
    partial: bool


def mounted_layers() -> set[str]:
    """Digests of the layers with an EROFS mount in this process's mount namespace (the mount's source is the
    store's ``<hex>.erofs`` or an on-demand ``<hex>/layer.erofs``)."""
    digests = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        _, _, after = line.partition(" - ")
        fields = after.split()
        if len(fields) >= 2 and fields[0] == "erofs":
            match = _HEX_IN_PATH.search(fields[1])
            if match:
                digests.add(f"sha256:{match.group(1)}")
    return digests


def _disk_bytes(paths: Iterable[Path]) -> int:
    total = 0
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            total += path.stat().st_blocks * _BLOCK_BYTES
    return total


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def fetched_layers(store: LayerStore, last_used: Mapping[str, float] | None = None) -> list[CachedLayer]:
    """Every layer this node fetched from the layer source, complete or partial, with what it takes on disk.
    ``last_used``: when this process last handed each out (else the file's mtime)."""
    last_used = last_used or {}

    def entry(digest: str, files: Iterable[Path], stamp: Path, *, partial: bool) -> CachedLayer:
        used = last_used.get(digest) or _mtime(stamp)
        return CachedLayer(digest=digest, disk_bytes=_disk_bytes(files), last_used=used, partial=partial)

    cached = []
    for record in store.layers():
        if "fetched_from" in record.labels:
            stem = store.root / "layers" / record.digest.removeprefix("sha256:")
            files = [stem.with_suffix(suffix) for suffix in (".erofs", ".json", ".chunks")]
            cached.append(entry(record.digest, files, files[0], partial=False))
    for data in (store.root / "partial").glob("*.data"):
        digest = f"sha256:{data.stem}"
        partial = PartialFiles.of(store.root, digest)
        cached.append(entry(digest, partial.all, partial.present, partial=True))
    return cached


class NodeLayerCache:
    """The node's fetched layers under ``budget_bytes`` (module docstring). Thread-safe."""

    def __init__(self, store: LayerStore, budget_bytes: int, *, discard: Callable[[str], bool] | None = None) -> None:
        """``discard``: forgets a layer the on-demand loader may still know and deletes its partial files (False
        while it cannot go yet); without one (eager fetching), partial files left by an earlier run are deleted."""
        self._store = store
        self.budget_bytes = budget_bytes
        self._discard = discard or _remove_partial(store)
        self._held: Counter[str] = Counter()
        self._last_used: dict[str, float] = {}
        self._lock = threading.Lock()
        self._evicting = threading.Lock()

    @contextlib.contextmanager
    def hold(self, digests: Iterable[str]) -> Iterator[None]:
        """Keep these layers while a create that fetched them runs (until its sandbox is recorded)."""
        held = list(dict.fromkeys(digests))
        with self._lock:
            self._held.update(held)
            self._last_used.update((digest, time.time()) for digest in held)
        try:
            yield
        finally:
            with self._lock:
                self._held.subtract(held)
                self._held += Counter()  # drops the zero counts

    def used(self, digest: str) -> None:
        """Record that a sandbox was just handed this layer (least recently used goes first)."""
        self._last_used[digest] = time.time()

    def layers(self) -> list[CachedLayer]:
        """Every fetched layer on this node, complete or partial, with what it takes on disk."""
        return fetched_layers(self._store, self._last_used)

    def evict(self, in_use: Callable[[], set[str]]) -> list[str]:
        """Delete fetched layers nothing uses, least recently used first, until the cache fits its budget.

        ``in_use``: the layers this node's sandboxes run on (asked only when over budget). Returns the digests
        evicted; an eviction already running makes this one a no-op."""
        if not self._evicting.acquire(blocking=False):
            return []
        try:
            cached = self.layers()
            total = sum(layer.disk_bytes for layer in cached)
            if total <= self.budget_bytes:
                return []
            with self._lock:
                keep = in_use() | mounted_layers() | set(self._held)
            evicted = []
            candidates = sorted(
                (layer for layer in cached if layer.digest not in keep), key=lambda layer: layer.last_used
            )
            for layer in candidates:
                if total <= self.budget_bytes:
                    break
                if not self._discard(layer.digest):
                    continue
                if not layer.partial:
                    self._store.remove(layer.digest)
                total -= layer.disk_bytes
                self._last_used.pop(layer.digest, None)
                evicted.append(layer.digest)
                log.info("evicted %s layer %s (%.1f MB on disk) from the node's cache: %.1f of %.1f MB used",
                         "partial" if layer.partial else "fetched", layer.digest[:19], layer.disk_bytes / 1e6,
                         total / 1e6, self.budget_bytes / 1e6)  # fmt: skip
            if total > self.budget_bytes:
                log.warning("the node's layer cache holds %.1f MB, over its %.1f MB budget: the rest is in use",
                            total / 1e6, self.budget_bytes / 1e6)  # fmt: skip
            return evicted
        finally:
            self._evicting.release()


def _remove_partial(store: LayerStore) -> Callable[[str], bool]:
    def remove(digest: str) -> bool:
        PartialFiles.of(store.root, digest).remove()
        return True

    return remove
