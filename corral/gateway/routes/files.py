"""A sandbox's files. Every change (write, mkdir, remove, rename, tar upload) goes through the operations layer
(gateway/operations.py), so it is in the trajectory log and a replay reproduces the sandbox's files; reads go
straight to the edge."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from corral.api.models import (
    FileInfo,
    MkdirRequest,
    RenameRequest,
    UploadResult,
)
from corral.gateway.routes.deps import (
    Auth,
    Ops,
    PathQuery,
    Service,
    StepIdQuery,
    body_within_limit,
)

__all__ = ["router"]

router = APIRouter()


@router.get(
    "/v1/sandboxes/{sandbox_id}/files/content",
    dependencies=[Auth],
    response_class=Response,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
async def read_file(sandbox_id: str, path: PathQuery, svc: Service) -> Response:
    data = await svc.call(sandbox_id, lambda edge: edge.read_file(sandbox_id, path))
    return Response(data, media_type="application/octet-stream")


@router.put("/v1/sandboxes/{sandbox_id}/files/content", dependencies=[Auth])
async def write_file(
    sandbox_id: str,
    path: PathQuery,
    request: Request,
    ops: Ops,
    mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
    step_id: StepIdQuery = None,
) -> FileInfo:
    """The raw request body becomes the file's content (replaced atomically); logged like a command."""
    data = await body_within_limit(request)
    return await ops.write_file(sandbox_id, path, data, mode, step_id)


@router.get("/v1/sandboxes/{sandbox_id}/files/stat", dependencies=[Auth])
async def stat_file(sandbox_id: str, path: PathQuery, svc: Service) -> FileInfo:
    return await svc.call(sandbox_id, lambda edge: edge.stat(sandbox_id, path))


@router.get("/v1/sandboxes/{sandbox_id}/files/list", dependencies=[Auth])
async def list_dir(sandbox_id: str, path: PathQuery, svc: Service) -> list[FileInfo]:
    return await svc.call(sandbox_id, lambda edge: edge.list_dir(sandbox_id, path))


@router.post("/v1/sandboxes/{sandbox_id}/files/mkdir", dependencies=[Auth])
async def mkdir(sandbox_id: str, body: MkdirRequest, ops: Ops, step_id: StepIdQuery = None) -> FileInfo:
    return await ops.mkdir(sandbox_id, body, step_id)


@router.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204, dependencies=[Auth])
async def remove(
    sandbox_id: str, path: PathQuery, ops: Ops, recursive: bool = False, step_id: StepIdQuery = None
) -> Response:
    await ops.remove(sandbox_id, path, recursive, step_id)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/files/rename", dependencies=[Auth])
async def rename(sandbox_id: str, body: RenameRequest, ops: Ops, step_id: StepIdQuery = None) -> FileInfo:
    """Move ``source`` to ``dest`` (rename(2): a file there is replaced, a directory refused)."""
    return await ops.rename(sandbox_id, body, step_id)


@router.put("/v1/sandboxes/{sandbox_id}/files/tar", dependencies=[Auth])
async def upload_tar(
    sandbox_id: str, path: PathQuery, request: Request, ops: Ops, step_id: StepIdQuery = None
) -> UploadResult:
    """Extract a tar (plain or compressed) from the body into the directory ``path``."""
    return await ops.upload_tar(sandbox_id, path, await body_within_limit(request), step_id)


@router.get(
    "/v1/sandboxes/{sandbox_id}/files/tar",
    dependencies=[Auth],
    response_class=Response,
    responses={200: {"content": {"application/x-tar": {}}}},
)
async def download_tar(sandbox_id: str, path: PathQuery, svc: Service) -> Response:
    data = await svc.call(sandbox_id, lambda edge: edge.download_tar(sandbox_id, path))
    return Response(data, media_type="application/x-tar")
