"""Images and layers behind the HTTP API: list, inspect, tag, remove, build,
import, pull from a registry, and snapshot a sandbox as a layer.

Builds that need no sandbox run in worker threads (corral/images/builders.py);
`commands` builds and git setup steps run in a builder sandbox created
through SandboxService, and keep only what the commands changed (the
sandbox's upper directory, whiteouts included) as the new layer. Every build
is cached by its inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from corral.api.errors import CorralError, InternalError, InvalidRequest, error_from_response
from corral.api.models import (
    BuildEvent,
    BuildRequest,
    CreateSandboxRequest,
    ExecRequest,
    ForkRequest,
    ImageConfig,
    ImageDetail,
    ImageInfo,
    LayerChunks,
    LayerInfo,
    NetworkPolicy,
    PullEvent,
    SandboxInfo,
    SnapshotInfo,
)
from corral.backends.base import Capability
from corral.edge.protocol import edge_of
from corral.gateway.dockerfile_build import DockerfileBuild
from corral.gateway.service import SandboxService
from corral.images.bases import ensure_base_images
from corral.images.builders import LayerBuilder, Progress
from corral.images.catalogue import Catalogue, CatalogueLayer, input_key
from corral.images.pull import ImagePuller
from corral.images.store import ImageRecord, parse_ref
from corral.state.records import SandboxRecord

__all__ = ["ImageService"]

log = logging.getLogger(__name__)
_DEFAULT_LAYER_KIND = {"debootstrap": "base", "oci": "base", "git": "workspace"}
_BUILDER_MEMORY_MB = 2048
_FAILED_OUTPUT_LINES = 40


def image_info(image: ImageRecord) -> ImageInfo:
    return ImageInfo(name=image.ref, layers=list(image.layers), size_bytes=image.size_bytes,
                     created_at=image.created_at, config=image.config, **_origin_fields(image))  # fmt: skip


def _origin_fields(image: ImageRecord) -> dict[str, Any]:
    """ImageInfo/ImageDetail's source and manifest_digest: a pulled image's, else none."""
    if image.origin is None:
        return {}
    return {"source": image.origin.source, "manifest_digest": image.origin.manifest_digest}


def layer_info(layer: CatalogueLayer) -> LayerInfo:
    return LayerInfo(
        digest=layer.digest,
        size_bytes=layer.size_bytes,
        kind=layer.kind,
        parents=list(layer.parents),
        source=layer.source,
        labels=layer.labels,
        created_at=layer.created_at,
    )


Event = TypeVar("Event", BuildEvent, PullEvent)


async def _event_stream(run: Callable[[], Awaitable[Event]], events: asyncio.Queue[Event],
                        failed: Callable[[dict[str, str]], Event], what: str) -> AsyncIterator[Event]:  # fmt: skip
    """Run ``run`` in a task (it puts progress events on ``events``); yield them, then its final event, or the
    error event ``failed`` makes of what it raised. The task is cancelled if the consumer goes away."""

    async def settle() -> None:
        try:
            events.put_nowait(await run())  # in order after every progress event put from the loop's thread
        except CorralError as exc:
            events.put_nowait(failed(exc.to_body()["error"]))
        except Exception as exc:
            log.exception("%s failed", what)
            events.put_nowait(failed(InternalError(f"{what} failed: {exc!r}").to_body()["error"]))

    task = asyncio.get_running_loop().create_task(settle())
    try:
        while True:
            event = await events.get()
            yield event
            if event.type != "progress":
                return
    finally:
        if not task.done():
            task.cancel()


class ImageService:
    def __init__(
        self,
        catalogue: Catalogue,
        builder: LayerBuilder,
        sandboxes: SandboxService,
        *,
        puller: ImagePuller | None = None,
    ) -> None:
        """``puller``: pulls registry references into the catalogue (``pull``, and a Dockerfile's FROM of one).
        The disk budget is the sandbox service's (``enforce_layer_budget``), which pulls on create too."""
        self._catalogue = catalogue
        self._builder = builder
        self._sandboxes = sandboxes
        self._puller = puller
        self._enforce_budget = sandboxes.enforce_layer_budget

    # -- catalogue --------------------------------------------------------

    def images(self) -> list[ImageInfo]:
        return [image_info(image) for image in self._catalogue.images()]

    def inspect(self, ref: str) -> ImageDetail:
        image = self._catalogue.resolve(ref)
        return ImageDetail(
            name=image.ref,
            layers=[layer_info(self._catalogue.layer(d)) for d in image.layers],
            size_bytes=image.size_bytes,
            created_at=image.created_at,
            config=image.config,
            **_origin_fields(image),
        )

    def layer_file(self, digest: str) -> tuple[Path, str]:
        """The stored file of a layer and its kind (NotFound if this store does not have it)."""
        layer = self._catalogue.layer(digest)
        return self._catalogue.store.layer_path(layer.digest), layer.kind

    def layer_chunks(self, digest: str) -> LayerChunks:
        """The layer's chunk index (made at import; for an older layer, once, now)."""
        layer = self._catalogue.layer(digest)
        index = self._catalogue.store.chunk_index(layer.digest)
        return LayerChunks(**index.to_json(), kind=layer.kind)

    def layers(self) -> list[LayerInfo]:
        return [layer_info(layer) for layer in self._catalogue.layers()]

    def tag(self, ref: str, *, layers: list[str] | None, source: str | None) -> ImageInfo:
        if (layers is None) == (source is None):
            raise InvalidRequest("give either `layers` (digests, bottom first) or `source` (an image ref) to tag")
        source_image = self._catalogue.resolve(source) if source else None
        digests = list(source_image.layers) if source_image else list(layers or [])
        name, version = parse_ref(ref)
        config, origin = (source_image.config, source_image.origin) if source_image else (None, None)
        return image_info(self._catalogue.tag(name, digests, version=version, config=config, origin=origin))

    def untag(self, ref: str) -> ImageInfo:
        return image_info(self._catalogue.untag(ref))

    # -- pulls ------------------------------------------------------------

    async def pull(self, reference: str) -> AsyncIterator[PullEvent]:
        """Pull a registry image (joining a pull of it under way), yielding progress, then ``done`` or ``error``."""
        if self._puller is None:
            raise InternalError("this server was started without a registry puller")
        puller = self._puller
        events: asyncio.Queue[PullEvent] = asyncio.Queue()

        async def run() -> PullEvent:
            result = await puller.pull(reference, events.put_nowait)
            self._enforce_budget()
            return PullEvent(
                type="done", image=image_info(result.image), layers_pulled=result.layers_pulled,
                layers_reused=result.layers_reused, bytes_transferred=result.bytes_transferred,
            )  # fmt: skip

        async for event in _event_stream(run, events, lambda error: PullEvent(type="error", error=error),
                                         f"pull of {reference}"):  # fmt: skip
            yield event

    async def _pull_base(self, reference: str, progress: Progress) -> ImageRecord:
        """A Dockerfile's FROM of a registry image: the catalogue's copy, else pulled now (its lines as progress).
        The disk budget is enforced when the build ends, not here: it would evict the build's earlier stages."""
        assert self._puller is not None  # only handed to builds when there is one
        return await self._puller.ensure(reference, lambda event: progress(event.message) if event.message else None)

    def remove_layer(self, digest: str) -> None:
        self._catalogue.remove_layer(digest, in_use=digest in self._sandboxes.layers_in_use())

    # -- builds -----------------------------------------------------------

    async def build(self, request: BuildRequest) -> AsyncIterator[BuildEvent]:
        """Run a build, yielding progress, then exactly one ``done`` or ``error`` event."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[BuildEvent] = asyncio.Queue()

        loop_thread = threading.get_ident()

        def emit(event: BuildEvent) -> None:
            if threading.get_ident() == loop_thread:
                events.put_nowait(event)  # in order with the final event put by run()
            else:
                loop.call_soon_threadsafe(events.put_nowait, event)

        def progress(message: str) -> None:
            emit(BuildEvent(type="progress", message=message))

        async def run() -> BuildEvent:
            if request.kind == "dockerfile":
                pull_base = self._pull_base if self._puller is not None else None
                build = DockerfileBuild(self, self._catalogue, self._sandboxes, request, emit=emit, puller=pull_base)
                image, cached = await build.run()
                self._enforce_budget(progress)
            else:
                image, cached = await self._build(request, progress)
            return BuildEvent(type="done", image=image_info(image), cached=cached)

        async for event in _event_stream(run, events, lambda error: BuildEvent(type="error", error=error),
                                         f"build of {request.name}"):  # fmt: skip
            yield event

    async def _build(self, request: BuildRequest, progress: Progress) -> tuple[ImageRecord, bool]:
        name, version = parse_ref(request.name)
        kind = request.layer_kind or _DEFAULT_LAYER_KIND.get(request.kind, "tools")
        on = self._sandboxes.stack(request.on) if request.on else []
        if request.kind == "commands":
            if not request.commands or not on:
                raise InvalidRequest("a commands build needs `on` (what to run on) and `commands`")
            inputs: dict[str, Any] = {"builder": "commands", "on": on, "commands": request.commands, "env": request.env}
        else:
            inputs = await asyncio.to_thread(
                self._builder.inputs, request.kind, path=request.path, commit=request.commit,
                workspace_path=request.workspace_path, suite=request.suite, packages=request.packages,
            )  # fmt: skip
            if request.kind == "git" and request.commands:
                if not on:
                    raise InvalidRequest("git setup commands need `on`: the base image to run them on")
                inputs["setup"] = {"on": on, "commands": request.commands, "env": request.env}
        key = input_key({**inputs, "layer_kind": kind})
        cached = None if request.no_cache else self._catalogue.cached_build(key)
        if cached is not None:
            progress(f"cached: identical inputs were built before ({key[:19]}…)")
            cached_layers, cached_config = cached
            return self._catalogue.tag(name, cached_layers, version=version, config=cached_config), True

        config = None
        if request.kind == "commands":
            diff = await self._run_in_builder(on, request, kind=kind, source=inputs, progress=progress)
            stack = [*on, diff.digest]
        else:
            tree_layer, config = await asyncio.to_thread(self._build_tree, inputs, request, kind, progress)
            stack = [tree_layer.digest]
            if "setup" in inputs:
                base = [*on, tree_layer.digest]
                diff = await self._run_in_builder(base, request, kind=kind, source=inputs["setup"], progress=progress)
                stack = [*base, diff.digest]
        self._catalogue.remember_build(key, stack, config)
        image = self._catalogue.tag(name, stack, version=version, config=config)
        self._enforce_budget(progress)
        return image, False

    def _build_tree(
        self, inputs: dict[str, Any], request: BuildRequest, kind: str, progress: Progress
    ) -> tuple[CatalogueLayer, ImageConfig | None]:
        with self._builder.scratch("tree-") as scratch:
            tree, config = self._builder.make_tree(inputs, scratch, packages=request.packages, progress=progress)
            return self._builder.pack_tree(tree, kind=kind, parents=(), source=inputs, progress=progress), config

    async def _run_in_builder(
        self, on: list[str], request: BuildRequest, *, kind: str, source: dict[str, Any], progress: Progress
    ) -> CatalogueLayer:
        """Run the commands in a sandbox on ``on``; its changes become the layer."""
        ttl_s = request.timeout_s * len(request.commands) + 600
        async with self.builder_sandbox(on, label=request.name, env=request.env, network=request.network,
                                        ttl_s=ttl_s) as sandbox_id:  # fmt: skip
            for command in request.commands:
                progress(f"$ {command}")
                step = ExecRequest(cmd=command, timeout_s=request.timeout_s)
                await self.run_step(sandbox_id, step, f"build command {command}", progress)
            return await self.pack_sandbox(sandbox_id, on, kind=kind, source=source, progress=progress)

    @contextlib.asynccontextmanager
    async def builder_sandbox(
        self,
        on: list[str],
        *,
        label: str,
        env: dict[str, str],
        network: NetworkPolicy | None,
        ttl_s: float,
        user: str | None = None,
    ) -> AsyncIterator[str]:
        """A sandbox on the layers ``on`` for a build step, killed afterwards whatever happens; yields its id."""
        sandbox = await self._sandboxes.create(
            CreateSandboxRequest(layers=on, env=env, user=user, memory_mb=_BUILDER_MEMORY_MB,
                                 labels={"corral.builder": label}, ttl_s=ttl_s, network=network)
        )  # fmt: skip
        try:
            yield sandbox.id
        finally:
            await self._sandboxes.kill(sandbox.id)

    async def pack_sandbox(
        self, sandbox_id: str, on: list[str], *, kind: str, source: dict[str, Any], progress: Progress
    ) -> CatalogueLayer:
        """A builder sandbox's changes (its upper directory, whiteouts included) as a layer on ``on``."""
        with self._builder.scratch("diff-") as scratch:
            image = scratch / "diff.erofs"
            await self._sandboxes.call(sandbox_id, lambda edge: edge.pack_diff(sandbox_id, image))
            return await asyncio.to_thread(
                self._builder.pack_file, image, kind=kind, parents=tuple(on), source=source, progress=progress
            )

    async def run_step(self, sandbox_id: str, request: ExecRequest, what: str, progress: Progress) -> None:
        """Run one build command, its output lines going to ``progress``; a failure raises InvalidRequest naming
        ``what``, with the last lines of the output."""
        tail: list[str] = []
        async for event in self._sandboxes.stream(sandbox_id, lambda edge: edge.exec_stream(sandbox_id, request)):
            if event.type in ("stdout", "stderr") and event.data:
                for line in event.data.splitlines():
                    progress(f"  {line}")
                    tail = [*tail[-_FAILED_OUTPUT_LINES + 1 :], line]
            elif event.type == "exit" and event.result is not None:
                result = event.result
                output = "\n".join(tail)
                if result.timed_out:
                    raise InvalidRequest(f"{what} timed out after {request.timeout_s:g}s; its last output:\n{output}")
                if result.exit_code != 0:
                    raise InvalidRequest(f"{what} failed (exit {result.exit_code}); its last output:\n{output}")

    def scratch(self, prefix: str) -> contextlib.AbstractContextManager[Path]:
        """An empty directory in the builder's work dir, removed afterwards whatever happens."""
        return self._builder.scratch(prefix)

    async def ensure_base_image(self, name: str) -> ImageInfo:
        """One of corral/images/bases.py's images, built into the node's store if it is missing (in a thread; once
        per node, under the store's build lock), then known here."""

        def build() -> None:
            with self._builder.scratch("base-") as work_dir:
                ensure_base_images(
                    self._catalogue.store, [name], work_dir=work_dir, progress=lambda line: log.info("images: %s", line)
                )
            self._catalogue.sync_from_store()

        await asyncio.to_thread(build)
        return image_info(self._catalogue.resolve(name))

    def build_layer_tree(
        self, make_tree: Callable[[Path], None], *, kind: str, parents: tuple[str, ...], source: dict[str, Any],
        progress: Progress,
    ) -> CatalogueLayer:  # fmt: skip
        """A layer from a tree that ``make_tree`` fills in an empty scratch directory (runs in a thread)."""
        with self._builder.scratch("tree-") as scratch:
            make_tree(scratch)
            return self._builder.pack_tree(scratch, kind=kind, parents=parents, source=source, progress=progress)

    async def import_archive(self, name: str, archive: Path, *, fmt: str, layer_kind: str | None) -> ImageInfo:
        """An uploaded tar or OCI archive (saved at ``archive``) becomes a tagged layer."""
        request = BuildRequest(name=name, kind=fmt, path=str(archive), layer_kind=layer_kind)
        async for event in self.build(request):
            if event.type == "done" and event.image is not None:
                return event.image
            if event.type == "error" and event.error is not None:
                raise error_from_response(0, {"error": event.error})
        raise InternalError("the import ended without a result")

    # -- snapshots and forks ----------------------------------------------

    async def fork(self, sandbox_id: str, request: ForkRequest) -> list[SandboxInfo]:
        """New sandboxes from this one now: same limits, env, user, TTL length and guard settings (protected and
        sensitive paths, disk limit). Containers get its filesystem; VMs and gVisor (runsc) containers get its memory,
        processes and disks too (a checkpoint restored once per child)."""
        parent = await self._sandboxes.record(sandbox_id)
        if self._sandboxes.has_capability(parent, Capability.CHECKPOINTS):
            children = await self._fork_checkpointed(sandbox_id, parent, request)
        elif request.checkpoint is not None:
            raise InvalidRequest(
                "only VM and runsc sandboxes have checkpoints; a crun or runc container forks from its files"
            )
        else:
            snap = await self.snapshot(sandbox_id, None)
            child = parent.to_request(labels={**request.labels, "corral.forked_from": sandbox_id}, layers=snap.layers)
            children = list(await asyncio.gather(*(self._sandboxes.create(child) for _ in range(request.count))))
        self._sandboxes.metrics.operations.labels("forked").inc(len(children))
        return children

    async def _fork_checkpointed(
        self, sandbox_id: str, parent: SandboxRecord, request: ForkRequest
    ) -> list[SandboxInfo]:
        # The same devices as the checkpoint it restores: a VM with a NIC needs one in its children too.
        child = parent.to_request(labels={**request.labels, "corral.forked_from": sandbox_id}, network=parent.network)
        node = edge_of(sandbox_id)  # the checkpoint is files on the parent's node: the children start there
        if request.checkpoint is not None:
            named = request.checkpoint
            saved = await self._sandboxes.call(sandbox_id, lambda edge: edge.checkpoint_dir(sandbox_id, named))
            return [await self._sandboxes.create(child, restore_from=str(saved), on_edge=node)
                    for _ in range(request.count)]  # fmt: skip
        with self._builder.scratch("vm-fork-") as scratch:
            checkpoint = scratch / "checkpoint"
            # Where it was written: ``checkpoint`` itself, or a scratch dir on the parent's node (a Ray edge).
            written = await self._sandboxes.call(sandbox_id, lambda edge: edge.checkpoint(sandbox_id, checkpoint))
            try:
                return [await self._sandboxes.create(child, restore_from=str(written), on_edge=node)
                        for _ in range(request.count)]  # fmt: skip
            finally:
                if written != checkpoint:
                    await self._sandboxes.call(sandbox_id, lambda edge: edge.discard_checkpoint(written))

    # -- snapshots --------------------------------------------------------

    async def snapshot(self, sandbox_id: str, name: str | None) -> SnapshotInfo:
        """The sandbox's changes so far as a diff layer on top of its own layers."""
        info = await self._sandboxes.get(sandbox_id)
        parents = await self._sandboxes.layers_of(sandbox_id)
        with self._builder.scratch("snap-") as scratch:
            image = scratch / "diff.erofs"
            await self._sandboxes.call(sandbox_id, lambda edge: edge.pack_diff(sandbox_id, image))
            diff = await asyncio.to_thread(
                self._builder.pack_file, image, kind="diff", parents=tuple(parents),
                source={"builder": "pack_diff", "sandbox": sandbox_id, "image": info.image}, progress=lambda _: None,
            )  # fmt: skip
        stack = [*parents, diff.digest]
        tagged = None
        if name:
            image_name, version = parse_ref(name)
            tagged = self._catalogue.tag(image_name, stack, version=version).ref
        self._enforce_budget(keep=frozenset(stack))  # an untagged snapshot is not garbage yet
        return SnapshotInfo(diff=layer_info(diff), layers=stack, image=tagged)
