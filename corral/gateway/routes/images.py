"""Images and layers: list, inspect, tag, import, build from a Dockerfile, pull from a registry; the layer
files nodes fetch."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse

from corral.api.models import (
    BuildRequest,
    ImageDetail,
    ImageInfo,
    LayerChunks,
    LayerInfo,
    PullRequest,
    TagRequest,
)
from corral.gateway.routes.deps import (
    Auth,
    CallerDep,
    Images,
    ndjson_lines,
    save_body,
)

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/images", dependencies=[Auth])
async def list_images(images: Images) -> list[ImageInfo]:
    return images.images()


@router.get("/v1/images/{ref:path}", dependencies=[Auth])
async def inspect_image(ref: str, images: Images) -> ImageDetail:
    """A local image (name:version) or a pulled one (host/repo:tag, host/repo@digest)."""
    return images.inspect(ref)


@router.delete("/v1/images/{ref:path}")
async def untag_image(ref: str, images: Images, caller: CallerDep) -> ImageInfo:
    """Remove the tag; its layers stay until `DELETE /v1/layers/{digest}`."""
    caller.require_admin("remove images")
    return images.untag(ref)


@router.get("/v1/layers", dependencies=[Auth])
async def list_layers(images: Images) -> list[LayerInfo]:
    return images.layers()


@router.get("/v1/layers/{digest}/blob", dependencies=[Auth], response_class=FileResponse)
async def layer_blob(digest: str, images: Images, caller: CallerDep) -> FileResponse:
    """The layer's EROFS file, for nodes that lack it (they check its sha256 against the digest, or each chunk
    of a ``Range: bytes=a-b`` request against the chunk index). The server key only: a job token must not read
    hidden grading layers."""
    caller.require_admin("download layers")
    path, kind = images.layer_file(digest)
    return FileResponse(path, media_type="application/octet-stream", headers={"X-Corral-Layer-Kind": kind})


@router.get("/v1/layers/{digest}/chunks", dependencies=[Auth])
async def layer_chunks(digest: str, images: Images, caller: CallerDep) -> LayerChunks:
    """The sha256 of each chunk of the layer, for nodes that mount it before they have it (docs/images.md).
    The server key only, like the blob."""
    caller.require_admin("download layers")
    return await asyncio.to_thread(images.layer_chunks, digest)


@router.delete("/v1/layers/{digest}", status_code=204)
async def remove_layer(digest: str, images: Images, caller: CallerDep) -> Response:
    caller.require_admin("delete layers")
    images.remove_layer(digest)
    return Response(status_code=204)


@router.post(
    "/v1/images/build",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "One BuildEvent per line."}},
)
async def build_image(body: BuildRequest, images: Images, caller: CallerDep) -> StreamingResponse:
    caller.require_admin("build images")
    return ndjson_lines(images.build(body))


@router.post(
    "/v1/images/pull",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "One PullEvent per line."}},
)
async def pull_image(body: PullRequest, images: Images, caller: CallerDep) -> StreamingResponse:
    """Pull an image from an OCI registry (each layer once per gateway); a create naming one pulls it too."""
    caller.require_admin("pull images")
    return ndjson_lines(images.pull(body.reference))


@router.put("/v1/images/import/{ref}")
async def import_image(
    ref: str,
    request: Request,
    images: Images,
    caller: CallerDep,
    format: Annotated[Literal["tar", "oci"], Query(description="A rootfs tar, or an OCI/docker-save archive.")] = "tar",
    layer_kind: Annotated[Literal["base", "workspace", "tools", "diff"] | None, Query()] = None,
) -> ImageInfo:
    """The request body (an archive) becomes a layer tagged ``ref``."""
    caller.require_admin("import images")
    with tempfile.NamedTemporaryFile(dir=request.app.state.upload_dir, prefix="upload-") as upload:
        await save_body(request, upload)
        return await images.import_archive(ref, Path(upload.name), fmt=format, layer_kind=layer_kind)


@router.put("/v1/images/{ref:path}")  # after import/{ref}, which it would match
async def tag_image(ref: str, body: TagRequest, images: Images, caller: CallerDep) -> ImageInfo:
    """Point ``ref`` at layers, or at another image's layers; a tag may move."""
    caller.require_admin("tag images")
    return images.tag(ref, layers=body.layers, source=body.source)
