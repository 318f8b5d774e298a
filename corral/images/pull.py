"""Pull images from OCI registries into the layer store: one EROFS layer per OCI layer.

Each OCI layer is unpacked on its own (whiteouts and opaque directories as
overlayfs keeps them) and packed with mkfs.erofs, so overlayfs stacks the
layers exactly as a container engine would, and a layer two images share is
one EROFS file: mounted once per node, one page cache. The OCI layer digest a
layer came from is kept in its catalogue record (``source.oci_digest``), so a
later pull of any image with that layer skips it before downloading a byte.
erofs-utils 1.5 has no ``--tar``, hence the tree in between.

A gateway pulls each reference once at a time: concurrent pulls of the same
reference (a burst of creates from an image not yet here) wait on one
future, and concurrent pulls of different images sharing a layer wait on one
download of it. A pull downloads its layers in a task of their own while the
layer before is unpacked and packed, in order. The image config becomes the
tag's ``ImageConfig`` (image_config.py), as a Dockerfile build's does, so
sandboxes created from it start with its environment, directory and user; the
tag also keeps where it came from (``ImageOrigin``: reference, manifest digest).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.api.errors import NotFound, ServerUnavailable
from corral.api.models import PullEvent
from corral.images.builders import LayerBuilder
from corral.images.catalogue import Catalogue
from corral.images.image_config import from_oci
from corral.images.registry import (
    Descriptor,
    ImageManifest,
    Reference,
    RegistryClient,
    RegistryConfig,
    parse_reference,
)
from corral.images.store import ImageOrigin, ImageRecord
from corral.images.unpack import unpack_oci_layer

__all__ = ["ImagePuller", "PullProgress", "PullResult"]

log = logging.getLogger("corral.images")

PullProgress = Callable[[PullEvent], None]
_PROGRESS_EVERY_BYTES = 1 << 20


@dataclass(frozen=True)
class PullResult:
    image: ImageRecord
    layers_pulled: int
    layers_reused: int
    bytes_transferred: int  # manifests, config and layer blobs received from the registry


class ImagePuller:
    """Pulls registry references into the catalogue; one instance per gateway."""

    def __init__(self, catalogue: Catalogue, builder: LayerBuilder, config: RegistryConfig, *,
                 max_layer_bytes: int) -> None:  # fmt: skip
        self._catalogue = catalogue
        self._builder = builder
        self._config = config
        self._max_layer_bytes = max_layer_bytes
        self._pulls: dict[str, asyncio.Task[PullResult]] = {}
        self._listeners: dict[str, list[PullProgress]] = {}
        self._layers: dict[str, asyncio.Future[str]] = {}  # OCI layer digest -> its EROFS layer digest
        self.pulls = 0  # pulls that reached a registry (a joined or skipped pull does not count)

    async def ensure(self, ref: str, progress: PullProgress | None = None) -> ImageRecord:
        """The image of registry reference ``ref``: the catalogue's, or pulled first if it is not here yet."""
        try:
            return self._catalogue.resolve(ref)
        except NotFound:
            return (await self.pull(ref, progress)).image

    async def pull(self, ref: str, progress: PullProgress | None = None) -> PullResult:
        """Pull ``ref`` (again: a tag may have moved), or wait for the pull of it already under way.

        The pull runs in a task of the puller's own, so a caller that goes away (a client that disconnects)
        does not cancel it for the others waiting on it.
        """
        reference = parse_reference(ref)
        key = str(reference)
        listeners = self._listeners.setdefault(key, [])
        if progress is not None:
            listeners.append(progress)
        try:
            task = self._pulls.get(key)
            if task is None:
                task = asyncio.get_running_loop().create_task(self._pull(reference, key))
                self._pulls[key] = task
                task.add_done_callback(lambda done: self._pull_done(key, done))
            elif progress is not None:
                progress(PullEvent(type="progress", message=f"waiting for the pull of {key} under way"))
            return await asyncio.shield(task)
        finally:
            if progress is not None:
                listeners.remove(progress)
            if not listeners and key not in self._pulls:
                self._listeners.pop(key, None)

    def _pull_done(self, key: str, task: asyncio.Task[PullResult]) -> None:
        if self._pulls.get(key) is task:
            del self._pulls[key]
        if not self._listeners.get(key):
            self._listeners.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved: whoever waited got it; nobody else has to

    async def aclose(self) -> None:
        """Cancel the pulls under way (server shutdown) and wait for them to stop."""
        tasks = list(self._pulls.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _emit(self, key: str, event: PullEvent) -> None:
        for listener in list(self._listeners.get(key, ())):
            listener(event)

    async def _pull(self, reference: Reference, key: str) -> PullResult:
        started = time.monotonic()
        self.pulls += 1
        async with RegistryClient(self._config) as registry:
            manifest = await registry.manifest(reference)
            image_config = await registry.config(manifest)
            missing = [blob for blob in manifest.layers if self._known_layer(blob.digest) is None]
            total = sum(blob.size_bytes for blob in missing)
            self._emit(key, PullEvent(
                type="progress", bytes_done=0, bytes_total=total,
                message=f"{reference}: {len(manifest.layers)} layers, {len(missing)} to download "
                        f"({total / 1e6:.1f} MB), manifest {manifest.digest[:19]}…",
            ))  # fmt: skip
            # The missing layers no other pull is fetching are this pull's; the others' are waited for.
            ours: dict[str, asyncio.Future[str]] = {}
            theirs: dict[str, asyncio.Future[str]] = {}
            for blob in missing:
                if blob.digest in self._layers:
                    theirs.setdefault(blob.digest, self._layers[blob.digest])
                elif blob.digest not in ours:
                    ours[blob.digest] = self._layers[blob.digest] = asyncio.get_running_loop().create_future()
            try:
                digests = await self._fetch_layers(registry, manifest, key, ours, theirs, total)
            finally:
                for digest, future in ours.items():
                    if not future.done():
                        future.set_exception(ServerUnavailable(f"the pull that was fetching layer {digest} failed"))
                        future.exception()  # retrieved: other pulls waiting on it get it
                    if self._layers.get(digest) is future:
                        del self._layers[digest]
            pulled = len(ours)
            origin = ImageOrigin(source=str(reference), manifest_digest=manifest.digest,
                                 index_digest=manifest.index_digest)  # fmt: skip
            image = self._catalogue.tag_pulled(reference, digests, from_oci(image_config), origin)
            transferred = registry.bytes_transferred
        log.info("pulled %s (%d layers, %d new, %.1f MB received) in %.2f s", reference, len(digests), pulled,
                 transferred / 1e6, time.monotonic() - started)  # fmt: skip
        return PullResult(image=image, layers_pulled=pulled,
                          layers_reused=len(digests) - pulled, bytes_transferred=transferred)  # fmt: skip

    def _known_layer(self, oci_digest: str) -> str | None:
        layer = self._catalogue.layer_from_oci(oci_digest)
        return layer.digest if layer is not None else None

    async def _fetch_layers(self, registry: RegistryClient, manifest: ImageManifest, key: str,
                            ours: dict[str, asyncio.Future[str]], theirs: dict[str, asyncio.Future[str]],
                            total: int) -> list[str]:  # fmt: skip
        """The image's EROFS layers, bottom first. This pull's layers are downloaded one after the other in a
        task of their own while the one before is unpacked and packed (in order: each layer's record names the
        layers below it); at most one downloaded blob waits for its turn."""
        done = [0]
        last_reported = [0]

        def on_bytes(count: int) -> None:
            done[0] += count
            if done[0] - last_reported[0] >= _PROGRESS_EVERY_BYTES:
                last_reported[0] = done[0]
                self._emit(key, PullEvent(type="progress", bytes_done=done[0], bytes_total=total))

        with self._builder.scratch("pull-") as scratch:
            downloaded: asyncio.Queue[Path] = asyncio.Queue(maxsize=1)

            async def download_ours() -> None:
                for index, digest in enumerate(ours):
                    blob = next(blob for blob in manifest.layers if blob.digest == digest)
                    path = scratch / f"{index}.blob"
                    await registry.download_blob(manifest.reference, blob, path, on_bytes=on_bytes)
                    await downloaded.put(path)

            downloads = asyncio.get_running_loop().create_task(download_ours())
            try:
                digests: list[str] = []
                for number, blob in enumerate(manifest.layers, 1):
                    where = f"layer {number}/{len(manifest.layers)} {blob.digest[:19]}…"
                    if blob.digest in ours and not ours[blob.digest].done():
                        path = await _next(downloaded, downloads)
                        source = {"builder": "registry", "oci_digest": blob.digest, "media_type": blob.media_type,
                                  "reference": str(manifest.reference)}  # fmt: skip
                        ours[blob.digest].set_result(await asyncio.to_thread(
                            self._pack, path, scratch / f"tree-{number}", blob, tuple(digests), source))  # fmt: skip
                        message = f"{where} {blob.size_bytes / 1e6:.1f} MB"
                    elif blob.digest in ours:  # the same layer twice in one image
                        message = f"{where} already here"
                    elif blob.digest in theirs:
                        message = f"{where} from a pull of another image"
                        await asyncio.shield(theirs[blob.digest])
                    else:
                        message = f"{where} already here"
                    future = ours.get(blob.digest) or theirs.get(blob.digest)
                    digest = future.result() if future is not None else self._known_layer(blob.digest)
                    if digest is None:
                        raise ServerUnavailable(f"{where} of {manifest.reference} was removed while it was pulled")
                    digests.append(digest)
                    self._emit(key, PullEvent(type="progress", layer=blob.digest, bytes_done=done[0],
                                              bytes_total=total, message=message))  # fmt: skip
                await downloads
                return digests
            finally:
                downloads.cancel()
                await asyncio.gather(downloads, return_exceptions=True)

    def _pack(self, blob_path: Path, tree: Path, blob: Descriptor, parents: tuple[str, ...],
              source: dict[str, Any]) -> str:  # fmt: skip
        tree.mkdir()
        tree.chmod(0o755)  # the layer's "/": overlayfs takes the root's mode from the top layer
        with open(blob_path, "rb") as layer_tar:
            unpack_oci_layer(layer_tar, tree, max_bytes=self._max_layer_bytes, what=f"layer {blob.digest[:19]}…")
        blob_path.unlink()
        kind = "base" if not parents else "diff"
        layer = self._builder.pack_tree(tree, kind=kind, parents=parents, source=source, progress=lambda _: None)
        return layer.digest


async def _next(downloaded: asyncio.Queue[Path], downloads: asyncio.Task[None]) -> Path:
    """The next downloaded blob, or the error that ended the downloads."""
    getter = asyncio.ensure_future(downloaded.get())
    try:
        await asyncio.wait({getter, downloads}, return_when=asyncio.FIRST_COMPLETED)
        if not getter.done() and downloads.exception() is not None:
            raise downloads.exception()  # type: ignore[misc]
        return await getter
    finally:
        getter.cancel()
