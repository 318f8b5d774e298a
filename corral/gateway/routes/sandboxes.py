"""A sandbox's life: create (one or a batch), list, get, kill, pause and resume, TTL, shutdown,
checkpoints, snapshot, fork, grade, its network; bulk actions by label. A change to an existing sandbox goes
through the operations layer (gateway/operations.py: logged in its trajectory, resend-safe with ``step_id``)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from corral.api.models import (
    BatchCreateRequest,
    BulkRequest,
    BulkResult,
    CheckpointInfo,
    CreateSandboxRequest,
    ForkRequest,
    GradeRequest,
    GradeResult,
    NetworkPolicy,
    NetworkStatus,
    PauseResult,
    SandboxInfo,
    SetTtlRequest,
    SnapshotInfo,
    SnapshotRequest,
)
from corral.gateway.routes.deps import (
    Auth,
    CallerDep,
    Ops,
    Service,
    StepIdQuery,
    label_pairs,
    ndjson_grouped,
)
from corral.gateway.service import SandboxService

__all__ = ["router"]

router = APIRouter()


@router.post("/v1/sandboxes/{sandbox_id}/snapshot")
async def snapshot_sandbox(
    sandbox_id: str, body: SnapshotRequest, ops: Ops, caller: CallerDep, step_id: StepIdQuery = None
) -> SnapshotInfo:
    """Its changes so far become a diff layer; create from ``layers`` to continue from here."""
    if body.name:
        caller.require_admin("tag a snapshot as an image")
    return await ops.snapshot(sandbox_id, body.name, step_id)


@router.post("/v1/sandboxes", status_code=201)
async def create_sandbox(request: Request, body: CreateSandboxRequest, caller: CallerDep) -> SandboxInfo:
    # A hot route (gateway/hot_routes.py; a warm pool's claim is one): the service taken from the app's state, not
    # a dependency.
    svc: SandboxService = request.app.state.service.sandboxes
    return await svc.create(body.model_copy(update={"labels": caller.check_labels(body.labels)}))


@router.get("/v1/sandboxes")
async def list_sandboxes(
    svc: Service,
    caller: CallerDep,
    state: Annotated[list[str] | None, Query(description="Filter by state; default creating and running.")] = None,
    label: Annotated[list[str] | None, Query(description="key=value; all must match.")] = None,
) -> list[SandboxInfo]:
    return await svc.list(states=state, labels=caller.check_labels(label_pairs(label)))


@router.get("/v1/sandboxes/{sandbox_id}", dependencies=[Auth])
async def get_sandbox(sandbox_id: str, svc: Service) -> SandboxInfo:
    return await svc.get(sandbox_id)


@router.delete("/v1/sandboxes/{sandbox_id}", dependencies=[Auth])
async def kill_sandbox(sandbox_id: str, ops: Ops, step_id: StepIdQuery = None) -> SandboxInfo:
    return await ops.kill(sandbox_id, step_id)


@router.post("/v1/sandboxes/{sandbox_id}/checkpoints", status_code=201, dependencies=[Auth])
async def save_checkpoint(sandbox_id: str, ops: Ops) -> CheckpointInfo:
    """VM sandboxes: keep the whole state (memory, processes, disk) on its node until the sandbox ends."""
    return await ops.checkpoint(sandbox_id)


@router.get("/v1/sandboxes/{sandbox_id}/checkpoints", dependencies=[Auth])
async def list_checkpoints(sandbox_id: str, svc: Service) -> list[CheckpointInfo]:
    return await svc.list_checkpoints(sandbox_id)


@router.post("/v1/sandboxes/{sandbox_id}/checkpoints/{checkpoint_id}/restore", dependencies=[Auth])
async def restore_checkpoint(sandbox_id: str, checkpoint_id: str, ops: Ops) -> SandboxInfo:
    """Rewind this sandbox to one of its checkpoints; fork with ``checkpoint`` for new sandboxes from it."""
    return await ops.restore(sandbox_id, checkpoint_id)


@router.post("/v1/sandboxes/{sandbox_id}/shutdown", dependencies=[Auth])
async def shutdown_sandbox(
    sandbox_id: str, ops: Ops, timeout_s: float = 10.0, step_id: StepIdQuery = None
) -> SandboxInfo:
    """Stop it cleanly (VMs: sync and power off; containers: SIGTERM to every process), wait at most
    ``timeout_s``, then destroy it; it ends with reason ``shutdown``."""
    return await ops.shutdown(sandbox_id, timeout_s, step_id)


@router.post("/v1/sandboxes/{sandbox_id}/ttl", dependencies=[Auth])
async def set_ttl(sandbox_id: str, body: SetTtlRequest, ops: Ops, step_id: StepIdQuery = None) -> SandboxInfo:
    return await ops.set_ttl(sandbox_id, body.ttl_s, step_id)


@router.post("/v1/sandboxes/{sandbox_id}/pause", dependencies=[Auth])
async def pause_sandbox(
    sandbox_id: str, ops: Ops, wait_reclaim: bool = False, step_id: StepIdQuery = None
) -> PauseResult:
    """Freeze it (processes and memory kept) and reclaim its memory; any request resumes it.

    Returns once frozen; the memory goes out in the background unless ``wait_reclaim``."""
    return await ops.pause(sandbox_id, wait_reclaim, step_id)


@router.post("/v1/sandboxes/{sandbox_id}/resume", dependencies=[Auth])
async def resume_sandbox(sandbox_id: str, ops: Ops, step_id: StepIdQuery = None) -> SandboxInfo:
    return await ops.resume(sandbox_id, step_id)


@router.post("/v1/sandboxes/{sandbox_id}/grade", dependencies=[Auth])
async def grade_sandbox(sandbox_id: str, body: GradeRequest, request: Request) -> GradeResult:
    """Grade its final state in a separate sandbox: hidden layers added, trusted tools on top."""
    graded: GradeResult = await request.app.state.service.grader.grade(sandbox_id, body)
    return graded


@router.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, dependencies=[Auth])
async def fork_sandbox(sandbox_id: str, body: ForkRequest, ops: Ops, step_id: StepIdQuery = None) -> list[SandboxInfo]:
    """``count`` new sandboxes starting from this one's filesystem as it is now; with ``step_id``, a resend
    answers the same children."""
    return await ops.fork(sandbox_id, body, step_id)


@router.post(
    "/v1/sandboxes/batch",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "One BatchEvent per line."}},
)
async def create_batch(body: BatchCreateRequest, svc: Service, caller: CallerDep) -> StreamingResponse:
    """``count`` sandboxes alike; each line says one is ready (or failed), with progress and a final done."""
    fields = body.model_dump(exclude={"count", "concurrency", "per_node"}, exclude_unset=True)
    request = CreateSandboxRequest.model_validate({**fields, "labels": caller.check_labels(body.labels)})
    return await ndjson_grouped(
        svc.create_many_grouped(request, body.count, concurrency=body.concurrency, per_node=body.per_node)
    )


@router.post("/v1/sandboxes/bulk")
async def bulk_action(body: BulkRequest, ops: Ops, caller: CallerDep) -> BulkResult:
    """Pause, resume, kill or set the TTL of every live sandbox matching a label selector (each a step in
    its own trajectory)."""
    return await ops.bulk(body.model_copy(update={"labels": caller.check_labels(body.labels)}))


@router.put("/v1/sandboxes/{sandbox_id}/network", dependencies=[Auth])
async def set_network(sandbox_id: str, body: NetworkPolicy, ops: Ops, step_id: StepIdQuery = None) -> NetworkStatus:
    """Replace the egress allowlist while it runs (a sandbox without network is plugged in)."""
    return await ops.set_network(sandbox_id, body, step_id)


@router.get("/v1/sandboxes/{sandbox_id}/network", dependencies=[Auth])
async def network_status(sandbox_id: str, svc: Service) -> NetworkStatus:
    """Its address, allowlist, and how many packets the policy dropped."""
    return await svc.network_status(sandbox_id)
