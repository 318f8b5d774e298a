"""fncall: short isolated calls from the pre-warmed pools (gateway/fncall.py), and run_code's tests."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response

from corral.api.models import (
    FnCallBatch,
    FnCallRequest,
    FnCallResult,
    PoolStats,
    RunCodeRequest,
    RunCodeResult,
)
from corral.gateway.fncall import FnCallService
from corral.gateway.routes.deps import (
    Auth,
    FnCalls,
    json_body,
    parsed_body,
)

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/fncall", dependencies=[Auth], response_model=FnCallResult, openapi_extra=json_body(FnCallRequest))
async def fncall(request: Request) -> Response:
    """One short call in a pre-warmed, isolated sandbox: a command, or Python whose main() returns JSON."""
    # A hot route (gateway/hot_routes.py): the body is parsed and the result serialized by pydantic's core (same
    # document, same errors), the service taken from the app's state, not a dependency.
    fncalls: FnCallService = request.app.state.service.fncall
    result = await fncalls.call(await parsed_body(request, FnCallRequest))
    return Response(result.model_dump_json(), media_type="application/json")


@router.post("/v1/fncall/batch", dependencies=[Auth])
async def fncall_batch(body: FnCallBatch, fncalls: FnCalls) -> list[FnCallResult | dict[str, Any]]:
    """Many calls at once; each result is a FnCallResult or an error body, in order."""
    return await fncalls.batch(body.calls)


@router.get("/v1/fncall/pools", dependencies=[Auth])
async def fncall_pools(fncalls: FnCalls) -> list[PoolStats]:
    """Each pool's warm size, target and hit rate."""
    return fncalls.stats()


@router.post("/v1/run_code", dependencies=[Auth])
async def run_code(body: RunCodeRequest, fncalls: FnCalls) -> RunCodeResult:
    """Run a python or bash program against tests (stdin, expected stdout), one isolated call per test."""
    return await fncalls.run_code(body)
