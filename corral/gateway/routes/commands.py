"""Commands in a sandbox: exec (waited, or streamed), background commands and their stdin, signals and
terminal size. Everything but reading a command's state goes through the operations layer (gateway/operations.py:
logged, resend-safe with ``step_id``, audited)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from corral.api.errors import CorralError
from corral.api.models import (
    CommandInfo,
    ExecEvent,
    ExecRequest,
    ExecResult,
    PtySize,
)
from corral.gateway.operations import Operations
from corral.gateway.routes.deps import (
    Auth,
    Ops,
    Service,
    StepIdQuery,
    body_within_limit,
    json_body,
    ndjson,
    parsed_body,
)

__all__ = ["router"]

router = APIRouter()


class SignalRequest(BaseModel):
    signal: int = 9


@router.post(
    "/v1/sandboxes/{sandbox_id}/exec",
    dependencies=[Auth],
    response_model=ExecResult,
    openapi_extra=json_body(ExecRequest),
)
async def exec_command(sandbox_id: str, request: Request) -> Response:
    """Run a command and wait; with ``step_id``, a step sent again is answered from the trajectory log."""
    # The hottest route of all (gateway/hot_routes.py): body and result through pydantic's core, the operations
    # layer taken from the app's state, not a dependency.
    ops: Operations = request.app.state.service.operations
    result = await ops.exec(sandbox_id, await parsed_body(request, ExecRequest))
    return Response(result.model_dump_json(), media_type="application/json")


@router.post(
    "/v1/sandboxes/{sandbox_id}/exec/stream",
    dependencies=[Auth],
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "One ExecEvent per line."}},
)
async def exec_stream(sandbox_id: str, body: ExecRequest, ops: Ops) -> StreamingResponse:
    return await ndjson(ops.exec_stream(sandbox_id, body), _error_event)


def _error_event(exc: CorralError) -> ExecEvent:
    """The last line of an exec stream that failed after it began (the agent or the edge gone)."""
    return ExecEvent(type="error", error=exc.to_body()["error"])


@router.post("/v1/sandboxes/{sandbox_id}/commands", status_code=201, dependencies=[Auth])
async def start_command(sandbox_id: str, body: ExecRequest, ops: Ops) -> CommandInfo:
    return await ops.start(sandbox_id, body)


@router.get("/v1/sandboxes/{sandbox_id}/commands/{command_id}", dependencies=[Auth])
async def get_command(
    sandbox_id: str, command_id: str, svc: Service, wait_s: Annotated[float, Query(ge=0, le=3600)] = 0
) -> CommandInfo:
    return await svc.call(sandbox_id, lambda edge: edge.command(sandbox_id, command_id, wait_s))


@router.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/stdin", status_code=204, dependencies=[Auth])
async def command_stdin(
    sandbox_id: str, command_id: str, request: Request, ops: Ops, step_id: StepIdQuery = None
) -> Response:
    """Raw body bytes go to the command's stdin; an empty body closes it."""
    await ops.stdin(sandbox_id, command_id, await body_within_limit(request), step_id)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/signal", status_code=204, dependencies=[Auth])
async def command_signal(
    sandbox_id: str, command_id: str, body: SignalRequest, ops: Ops, step_id: StepIdQuery = None
) -> Response:
    await ops.signal(sandbox_id, command_id, body.signal, step_id)
    return Response(status_code=204)


@router.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/resize", status_code=204, dependencies=[Auth])
async def command_resize(
    sandbox_id: str, command_id: str, body: PtySize, ops: Ops, step_id: StepIdQuery = None
) -> Response:
    """A pty command's new window size (exec/stream or commands started with ``pty``)."""
    await ops.resize(sandbox_id, command_id, body.rows, body.cols, step_id)
    return Response(status_code=204)
