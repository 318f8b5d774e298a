"""Health and the Prometheus scrape."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Response

from corral.gateway.metrics import CONTENT_TYPE, Levels
from corral.gateway.routes.deps import (
    CallerDep,
    FnCalls,
    Images,
    Service,
)

__all__ = ["router"]

router = APIRouter()


@router.get("/healthz", include_in_schema=False)
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(svc: Service, images: Images, fncalls: FnCalls, caller: CallerDep) -> Response:
    """Prometheus text format: this gateway's counters and histograms, and each node's levels as read now
    (docs/observability.md). The server key only: it shows every job's numbers."""
    caller.require_admin("read the server's metrics")
    layers = await asyncio.to_thread(images.layers)
    levels = Levels(
        nodes=await svc.node_stats(),
        edges=await svc.edge_metric_families(),
        pools=fncalls.stats(),
        layer_cache_bytes=sum(layer.size_bytes for layer in layers),
        layer_count=len(layers),
    )
    return Response(await asyncio.to_thread(svc.metrics.render, levels), media_type=CONTENT_TYPE)
