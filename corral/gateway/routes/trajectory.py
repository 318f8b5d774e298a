"""A sandbox's trajectory log: its steps, the JSONL export, which steps changed a path, and replay."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from corral.api.models import (
    ReplayRequest,
    ReplayResult,
    TrajectoryStep,
)
from corral.gateway.routes.deps import (
    Auth,
    Logs,
    PathQuery,
)

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/sandboxes/{sandbox_id}/trajectory", dependencies=[Auth])
async def trajectory(
    sandbox_id: str,
    logs: Logs,
    after_seq: Annotated[int, Query(ge=0)] = 0,
    limit: Annotated[int | None, Query(ge=1, le=10000)] = None,
) -> list[TrajectoryStep]:
    """The sandbox's log of commands and file writes, in order."""
    return await logs.steps(sandbox_id, after_seq=after_seq, limit=limit)


@router.get(
    "/v1/sandboxes/{sandbox_id}/trajectory.jsonl",
    dependencies=[Auth],
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "One step per line."}},
)
async def export_trajectory(sandbox_id: str, logs: Logs) -> StreamingResponse:
    lines = await logs.export_jsonl(sandbox_id)
    return StreamingResponse((line.encode() for line in lines), media_type="application/x-ndjson")


@router.get("/v1/sandboxes/{sandbox_id}/trajectory/provenance", dependencies=[Auth])
async def provenance(sandbox_id: str, path: PathQuery, logs: Logs) -> list[TrajectoryStep]:
    """The steps that changed ``path``, oldest first."""
    return await logs.provenance(sandbox_id, path)


@router.post("/v1/sandboxes/{sandbox_id}/trajectory/replay", status_code=201, dependencies=[Auth])
async def replay_trajectory(sandbox_id: str, body: ReplayRequest, logs: Logs) -> ReplayResult:
    """Re-run the logged steps in a fresh sandbox from the same layers; report where results differ."""
    return await logs.replay(sandbox_id, body)
