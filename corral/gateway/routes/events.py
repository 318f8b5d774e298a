"""What happens to sandboxes and nodes (the NDJSON event stream) and audit findings."""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from corral.api.errors import InvalidRequest
from corral.api.models import (
    AuditEvent,
)
from corral.gateway.event_stream import follow_events
from corral.gateway.routes.deps import (
    Auth,
    CallerDep,
    Service,
    label_pairs,
)
from corral.state.db import EVENT_KINDS
from corral.state.events import EventFilter

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/sandboxes/{sandbox_id}/audit", dependencies=[Auth])
async def sandbox_audit(sandbox_id: str, svc: Service, after_id: Annotated[int, Query(ge=0)] = 0) -> list[AuditEvent]:
    """Its audit events (each exec and file write is in its trajectory log)."""
    await svc.get(sandbox_id)
    events = await svc.database.run(svc.audit_trail.events, sandbox_id=sandbox_id, after_id=after_id)
    return [AuditEvent.model_validate(e) for e in events]


@router.get("/v1/audit")
async def audit_stream(
    svc: Service,
    caller: CallerDep,
    after_id: Annotated[int, Query(ge=0)] = 0,
    severity: Annotated[Literal["info", "warning", "critical"] | None, Query()] = None,
    wait_s: Annotated[float, Query(ge=0, le=300, description="Wait this long for new events if none.")] = 0,
) -> list[AuditEvent]:
    """Events of every sandbox after ``after_id``, oldest first: poll with the last id to follow the stream."""
    caller.require_admin("read every sandbox's audit events")
    events = await svc.database.run(svc.audit_trail.events, after_id=after_id, severity=severity)
    if not events and wait_s > 0:
        await svc.audit_trail.wait(wait_s)
        events = await svc.database.run(svc.audit_trail.events, after_id=after_id, severity=severity)
    return [AuditEvent.model_validate(e) for e in events]


@router.get(
    "/v1/events",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "One Event per line."}},
)
async def event_stream(
    svc: Service,
    caller: CallerDep,
    after_id: Annotated[int, Query(ge=0, description="Resume after this event id (0: from the oldest kept).")] = 0,
    follow: Annotated[bool, Query(description="Keep the stream open and send new events as they happen.")] = False,
    sandbox_id: Annotated[str | None, Query(description="Only this sandbox's events.")] = None,
    kind: Annotated[list[str] | None, Query(description="Only these kinds (repeat the parameter).")] = None,
    label: Annotated[list[str] | None, Query(description="Only sandboxes with these labels, key=value.")] = None,
    from_now: Annotated[bool, Query(description="Start after the newest event (instead of after_id).")] = False,
) -> StreamingResponse:
    """What happens to sandboxes and nodes, and audit findings, oldest first, NDJSON. Node events need the
    server's key; a job token sees its own job's sandboxes. A blank line is sent every 15 s of quiet."""
    unknown = sorted(set(kind or []) - set(EVENT_KINDS))
    if unknown:
        raise InvalidRequest(f"unknown event kind {unknown[0]!r}: one of {', '.join(EVENT_KINDS)}")
    wanted = EventFilter(sandbox_id=sandbox_id, kinds=kind, labels=label_pairs(label), job=caller.job)
    if from_now:
        after_id = await asyncio.to_thread(svc.events.last_id)
    return StreamingResponse(follow_events(svc.events, after_id, wanted, follow),
                             media_type="application/x-ndjson")  # fmt: skip
