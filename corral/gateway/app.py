"""The HTTP API (FastAPI on uvicorn): parse, authenticate, hand to the service.

Handlers stay thin: every request is validated into a model from
corral.sdk._models before it reaches SandboxService, and every CorralError
becomes its status with a ``{"error": {"code", "message"}}`` body. The
OpenAPI document is served at /openapi.json.
"""

from __future__ import annotations

import asyncio
import io
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Annotated, Any, Literal

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field, ValidationError
from sqlalchemy.exc import DBAPIError

from corral.gateway.auth import Caller
from corral.gateway.e2b import include_e2b
from corral.gateway.e2b.network import InternetEgress
from corral.gateway.event_stream import follow_events
from corral.gateway.fncall import FnCallService
from corral.gateway.images import ImageService
from corral.gateway.metrics import CONTENT_TYPE, Levels
from corral.gateway.request_timing import RequestTiming
from corral.gateway.sandbox_fusion import include_sandbox_fusion
from corral.gateway.service import SandboxService
from corral.gateway.trajectory import Trajectories
from corral.images.bases import TOOLCHAIN_IMAGE
from corral.logs import current_sandbox
from corral.sdk._exceptions import CorralError, InvalidRequest, PayloadTooLarge
from corral.sdk._models import (
    AuditEvent,
    BatchCreateRequest,
    BuildRequest,
    BulkRequest,
    BulkResult,
    CheckpointInfo,
    ClusterNode,
    CommandInfo,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    FnCallBatch,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    GradeRequest,
    GradeResult,
    ImageDetail,
    ImageInfo,
    LayerChunks,
    LayerInfo,
    MkdirRequest,
    NetworkPolicy,
    NetworkStatus,
    NodeStats,
    PauseResult,
    PoolStats,
    PtySize,
    PullRequest,
    RenameRequest,
    ReplayRequest,
    ReplayResult,
    RunCodeRequest,
    RunCodeResult,
    SandboxInfo,
    SetTtlRequest,
    SnapshotInfo,
    SnapshotRequest,
    TagRequest,
    TrajectoryStep,
    UploadResult,
)
from corral.state.db import EVENT_KINDS, database_unreachable, unreachable_error
from corral.state.events import EventFilter

__all__ = ["create_app"]

DASHBOARD_DIR = Path(__file__).with_name("dashboard")

_bearer = HTTPBearer(auto_error=False)
_ERROR_RESPONSES = {
    status: {"description": description}
    for status, description in [
        (400, "invalid request"), (401, "missing or wrong API key"), (404, "unknown sandbox, image or path"),
        (409, "wrong state"), (410, "the sandbox ended"), (413, "payload too large"), (503, "no capacity"),
    ]
}  # fmt: skip


async def _authenticate(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> Caller:
    """The caller, checked against the sandbox in the path (a job token reaches only its job's sandboxes)."""
    services = request.app.state.service
    caller: Caller = services.tokens.caller(credentials.credentials if credentials else None)
    sandbox_id = request.path_params.get("sandbox_id")
    if sandbox_id is not None:
        current_sandbox.set(sandbox_id)  # on every log line written while serving this request
    if caller.job is not None and sandbox_id is not None:
        caller.check_owner(sandbox_id, services.sandboxes.record(sandbox_id)["labels"])
    return caller


async def _service(request: Request) -> SandboxService:
    return request.app.state.service.sandboxes  # type: ignore[no-any-return]


async def _image_service(request: Request) -> ImageService:
    return request.app.state.service.images  # type: ignore[no-any-return]


async def _fncall(request: Request) -> FnCallService:
    return request.app.state.service.fncall  # type: ignore[no-any-return]


async def _trajectories(request: Request) -> Trajectories:
    return request.app.state.service.trajectories  # type: ignore[no-any-return]


Auth = Depends(_authenticate)
CallerDep = Annotated[Caller, Depends(_authenticate)]
Service = Annotated[SandboxService, Depends(_service)]
Images = Annotated[ImageService, Depends(_image_service)]
Logged = Annotated[Trajectories, Depends(_trajectories)]
FnCalls = Annotated[FnCallService, Depends(_fncall)]
PathQuery = Annotated[str, Query(description="Absolute path inside the sandbox.")]
StepIdQuery = Annotated[
    str | None,
    Query(min_length=1, max_length=256, description="The client's step id: a resend is answered from the log."),
]


_FNCALL_BODY = {
    "requestBody": {
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/FnCallRequest"}}},
        "required": True,
    },
    "responses": {
        "422": {
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}},
            "description": "Validation Error",
        }
    },
}


class SignalRequest(BaseModel):
    signal: int = 9


class NetworkPeer(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,40}$")
    netns_path: str = Field(description="e.g. /proc/<pid>/ns/net of a process in that namespace")
    address: str = Field(description="Its address on the sandbox network, e.g. 10.88.200.2")


class JobToken(BaseModel):
    job: str
    token: str = Field(description="Shown once; use it as the bearer key.")


def _label_pairs(items: list[str] | None) -> dict[str, str]:
    """``label=key=value`` query parameters as a dict."""
    labels = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"label filter {item!r} must look like key=value")
        labels[key] = value
    return labels


def create_app(  # type: ignore[no-untyped-def]
    service_factory,
    max_file_bytes: int,
    upload_dir: Path,
    *,
    internet_egress: InternetEgress = "public",
    sandbox_fusion_open: bool = False,
    sandbox_fusion_image: str = TOOLCHAIN_IMAGE,
) -> FastAPI:
    """``service_factory`` is an async context manager yielding the Services; ``internet_egress`` is what an
    E2B internet grant gives (CORRAL_INTERNET_EGRESS); ``sandbox_fusion_*``: CORRAL_SANDBOX_FUSION_OPEN and _IMAGE."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with service_factory() as service:
            app.state.service = service
            yield

    app = FastAPI(title="Corral", version="0.1.0", lifespan=lifespan, responses=_ERROR_RESPONSES)  # type: ignore[arg-type]
    app.add_middleware(RequestTiming)

    @app.exception_handler(CorralError)
    async def corral_error(_request: Request, exc: CorralError) -> JSONResponse:
        return JSONResponse(exc.to_body(), status_code=exc.status)

    @app.exception_handler(DBAPIError)
    async def database_error(request: Request, exc: DBAPIError) -> JSONResponse:
        """The state database gone (a restart): a retryable 502 naming it, not a 500 with a traceback."""
        if not database_unreachable(exc):
            raise exc
        error = unreachable_error(exc)
        return JSONResponse(error.to_body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        error = InvalidRequest(f"invalid request: {problems}")
        return JSONResponse(error.to_body(), status_code=error.status)

    async def save_body(request: Request, sink: IO[bytes]) -> None:
        """Stream an upload to a file, within the size limit."""
        declared = request.headers.get("content-length")
        if declared is not None and int(declared) > max_file_bytes:
            raise PayloadTooLarge(
                f"upload of {declared} bytes is over the limit of {max_file_bytes} (CORRAL_MAX_FILE_BYTES)"
            )
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_file_bytes:
                raise PayloadTooLarge(f"upload is over the limit of {max_file_bytes} bytes (CORRAL_MAX_FILE_BYTES)")
            sink.write(chunk)
        sink.flush()

    async def body_within_limit(request: Request) -> bytes:
        buffer = io.BytesIO()
        await save_body(request, buffer)
        return buffer.getvalue()

    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
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

    @app.post("/v1/fncall", dependencies=[Auth], response_model=FnCallResult, openapi_extra=_FNCALL_BODY)
    async def fncall(request: Request, fncalls: FnCalls) -> Response:
        """One short call in a pre-warmed, isolated sandbox: a command, or Python whose main() returns JSON."""
        # The hottest route: the body is parsed and the result serialized by pydantic's core in one step
        # each, instead of FastAPI's generic body solving and response validation (same document, same errors).
        try:
            body = FnCallRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc
        result = await fncalls.call(body)
        return Response(result.model_dump_json(), media_type="application/json")

    @app.post("/v1/fncall/batch", dependencies=[Auth])
    async def fncall_batch(body: FnCallBatch, fncalls: FnCalls) -> list[FnCallResult | dict[str, Any]]:
        """Many calls at once; each result is a FnCallResult or an error body, in order."""
        return await fncalls.batch(body.calls)

    @app.get("/v1/fncall/pools", dependencies=[Auth])
    async def fncall_pools(fncalls: FnCalls) -> list[PoolStats]:
        """Each pool's warm size, target and hit rate."""
        return fncalls.stats()

    @app.post("/v1/run_code", dependencies=[Auth])
    async def run_code(body: RunCodeRequest, fncalls: FnCalls) -> RunCodeResult:
        """Run a python or bash program against tests (stdin, expected stdout), one isolated call per test."""
        return await fncalls.run_code(body)

    @app.get("/v1/images", dependencies=[Auth])
    async def list_images(images: Images) -> list[ImageInfo]:
        return images.images()

    @app.get("/v1/images/{ref:path}", dependencies=[Auth])
    async def inspect_image(ref: str, images: Images) -> ImageDetail:
        """A local image (name:version) or a pulled one (host/repo:tag, host/repo@digest)."""
        return images.inspect(ref)

    @app.delete("/v1/images/{ref:path}")
    async def untag_image(ref: str, images: Images, caller: CallerDep) -> ImageInfo:
        """Remove the tag; its layers stay until `DELETE /v1/layers/{digest}`."""
        caller.require_admin("remove images")
        return images.untag(ref)

    @app.get("/v1/layers", dependencies=[Auth])
    async def list_layers(images: Images) -> list[LayerInfo]:
        return images.layers()

    @app.get("/v1/layers/{digest}/blob", dependencies=[Auth], response_class=FileResponse)
    async def layer_blob(digest: str, images: Images, caller: CallerDep) -> FileResponse:
        """The layer's EROFS file, for nodes that lack it (they check its sha256 against the digest, or each chunk
        of a ``Range: bytes=a-b`` request against the chunk index). The server key only: a job token must not read
        hidden grading layers."""
        caller.require_admin("download layers")
        path, kind = images.layer_file(digest)
        return FileResponse(path, media_type="application/octet-stream", headers={"X-Corral-Layer-Kind": kind})

    @app.get("/v1/layers/{digest}/chunks", dependencies=[Auth])
    async def layer_chunks(digest: str, images: Images, caller: CallerDep) -> LayerChunks:
        """The sha256 of each chunk of the layer, for nodes that mount it before they have it (docs/images.md).
        The server key only, like the blob."""
        caller.require_admin("download layers")
        return await asyncio.to_thread(images.layer_chunks, digest)

    @app.delete("/v1/layers/{digest}", status_code=204)
    async def remove_layer(digest: str, images: Images, caller: CallerDep) -> Response:
        caller.require_admin("delete layers")
        images.remove_layer(digest)
        return Response(status_code=204)

    @app.post(
        "/v1/images/build",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": "One BuildEvent per line."}},
    )
    async def build_image(body: BuildRequest, images: Images, caller: CallerDep) -> StreamingResponse:
        caller.require_admin("build images")

        async def lines() -> AsyncIterator[bytes]:
            async for event in images.build(body):
                yield event.model_dump_json(exclude_none=True).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post(
        "/v1/images/pull",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": "One PullEvent per line."}},
    )
    async def pull_image(body: PullRequest, images: Images, caller: CallerDep) -> StreamingResponse:
        """Pull an image from an OCI registry (each layer once per gateway); a create naming one pulls it too."""
        caller.require_admin("pull images")

        async def lines() -> AsyncIterator[bytes]:
            async for event in images.pull(body.reference):
                yield event.model_dump_json(exclude_none=True).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.put("/v1/images/import/{ref}")
    async def import_image(
        ref: str,
        request: Request,
        images: Images,
        caller: CallerDep,
        format: Annotated[
            Literal["tar", "oci"], Query(description="A rootfs tar, or an OCI/docker-save archive.")
        ] = "tar",
        layer_kind: Annotated[Literal["base", "workspace", "tools", "diff"] | None, Query()] = None,
    ) -> ImageInfo:
        """The request body (an archive) becomes a layer tagged ``ref``."""
        caller.require_admin("import images")
        with tempfile.NamedTemporaryFile(dir=upload_dir, prefix="upload-") as upload:
            await save_body(request, upload)
            return await images.import_archive(ref, Path(upload.name), fmt=format, layer_kind=layer_kind)

    @app.put("/v1/images/{ref:path}")  # after import/{ref}, which it would match
    async def tag_image(ref: str, body: TagRequest, images: Images, caller: CallerDep) -> ImageInfo:
        """Point ``ref`` at layers, or at another image's layers; a tag may move."""
        caller.require_admin("tag images")
        return images.tag(ref, layers=body.layers, source=body.source)

    @app.post("/v1/sandboxes/{sandbox_id}/snapshot")
    async def snapshot_sandbox(
        sandbox_id: str, body: SnapshotRequest, images: Images, caller: CallerDep
    ) -> SnapshotInfo:
        """Its changes so far become a diff layer; create from ``layers`` to continue from here."""
        if body.name:
            caller.require_admin("tag a snapshot as an image")
        return await images.snapshot(sandbox_id, body.name)

    @app.post("/v1/sandboxes", status_code=201)
    async def create_sandbox(body: CreateSandboxRequest, svc: Service, caller: CallerDep) -> SandboxInfo:
        return await svc.create(body.model_copy(update={"labels": caller.check_labels(body.labels)}))

    @app.get("/v1/sandboxes")
    async def list_sandboxes(
        svc: Service,
        caller: CallerDep,
        state: Annotated[list[str] | None, Query(description="Filter by state; default creating and running.")] = None,
        label: Annotated[list[str] | None, Query(description="key=value; all must match.")] = None,
    ) -> list[SandboxInfo]:
        return svc.list(states=state, labels=caller.check_labels(_label_pairs(label)))

    @app.get("/v1/sandboxes/{sandbox_id}", dependencies=[Auth])
    async def get_sandbox(sandbox_id: str, svc: Service) -> SandboxInfo:
        return svc.get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", dependencies=[Auth])
    async def kill_sandbox(sandbox_id: str, svc: Service) -> SandboxInfo:
        return await svc.kill(sandbox_id)

    @app.get("/v1/cluster/nodes", dependencies=[Auth])
    async def cluster_nodes(svc: Service) -> list[ClusterNode]:
        """Every node the shared state knows (all gateways' edges): up or lost, last heartbeat, load."""
        return svc.cluster_nodes()

    @app.get("/v1/nodes", dependencies=[Auth])
    async def node_stats(svc: Service) -> list[NodeStats]:
        """Per node: sandboxes per backend and state, CPU and memory committed vs used vs reclaimed, pressure."""
        return await svc.node_stats()

    @app.post("/v1/sandboxes/{sandbox_id}/checkpoints", status_code=201, dependencies=[Auth])
    async def save_checkpoint(sandbox_id: str, logged: Logged) -> CheckpointInfo:
        """VM sandboxes: keep the whole state (memory, processes, disk) on its node until the sandbox ends."""
        return await logged.checkpoint(sandbox_id)

    @app.get("/v1/sandboxes/{sandbox_id}/checkpoints", dependencies=[Auth])
    async def list_checkpoints(sandbox_id: str, svc: Service) -> list[CheckpointInfo]:
        return await svc.list_checkpoints(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/checkpoints/{checkpoint_id}/restore", dependencies=[Auth])
    async def restore_checkpoint(sandbox_id: str, checkpoint_id: str, logged: Logged) -> SandboxInfo:
        """Rewind this sandbox to one of its checkpoints; fork with ``checkpoint`` for new sandboxes from it."""
        return await logged.restore(sandbox_id, checkpoint_id)

    @app.post("/v1/sandboxes/{sandbox_id}/shutdown", dependencies=[Auth])
    async def shutdown_sandbox(sandbox_id: str, svc: Service, timeout_s: float = 10.0) -> SandboxInfo:
        """Stop it cleanly (VMs: sync and power off; containers: SIGTERM to every process), wait at most
        ``timeout_s``, then destroy it; it ends with reason ``shutdown``."""
        return await svc.shutdown(sandbox_id, timeout_s)

    @app.post("/v1/sandboxes/{sandbox_id}/ttl", dependencies=[Auth])
    async def set_ttl(sandbox_id: str, body: SetTtlRequest, svc: Service) -> SandboxInfo:
        return svc.set_ttl(sandbox_id, body.ttl_s)

    @app.post("/v1/sandboxes/{sandbox_id}/pause", dependencies=[Auth])
    async def pause_sandbox(sandbox_id: str, svc: Service, wait_reclaim: bool = False) -> PauseResult:
        """Freeze it (processes and memory kept) and reclaim its memory; any request resumes it.

        Returns once frozen; the memory goes out in the background unless ``wait_reclaim``."""
        return await svc.pause(sandbox_id, wait_reclaim)

    @app.post("/v1/sandboxes/{sandbox_id}/resume", dependencies=[Auth])
    async def resume_sandbox(sandbox_id: str, svc: Service) -> SandboxInfo:
        return await svc.resume(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/grade", dependencies=[Auth])
    async def grade_sandbox(sandbox_id: str, body: GradeRequest, request: Request) -> GradeResult:
        """Grade its final state in a separate sandbox: hidden layers added, trusted tools on top."""
        graded: GradeResult = await request.app.state.service.grader.grade(sandbox_id, body)
        return graded

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, dependencies=[Auth])
    async def fork_sandbox(sandbox_id: str, body: ForkRequest, images: Images) -> list[SandboxInfo]:
        """``count`` new sandboxes starting from this one's filesystem as it is now."""
        return await images.fork(sandbox_id, body)

    @app.post(
        "/v1/sandboxes/batch",
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": "One BatchEvent per line."}},
    )
    async def create_batch(body: BatchCreateRequest, svc: Service, caller: CallerDep) -> StreamingResponse:
        """``count`` sandboxes alike; each line says one is ready (or failed), with progress and a final done."""
        fields = body.model_dump(exclude={"count", "concurrency", "per_node"}, exclude_unset=True)
        request = CreateSandboxRequest.model_validate({**fields, "labels": caller.check_labels(body.labels)})
        events = svc.create_many(request, body.count, concurrency=body.concurrency, per_node=body.per_node)
        first = await anext(events)  # a request that cannot start (unknown image, bad limits) gets its status

        async def lines() -> AsyncIterator[bytes]:
            yield first.model_dump_json(exclude_none=True).encode() + b"\n"
            async for event in events:
                yield event.model_dump_json(exclude_none=True).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/bulk")
    async def bulk_action(body: BulkRequest, svc: Service, caller: CallerDep) -> BulkResult:
        """Pause, resume, kill or set the TTL of every live sandbox matching a label selector."""
        return await svc.bulk(body.model_copy(update={"labels": caller.check_labels(body.labels)}))

    @app.post("/v1/jobs/{job}/token", status_code=201)
    async def issue_job_token(job: str, caller: CallerDep, request: Request) -> JobToken:
        """A token that reaches only sandboxes labelled job=<job> (a restarted trainer reconnects with it)."""
        caller.require_admin("issue job tokens")
        return JobToken(job=job, token=request.app.state.service.tokens.issue(job))

    @app.delete("/v1/jobs/{job}/token")
    async def revoke_job_tokens(job: str, caller: CallerDep, request: Request) -> dict[str, int]:
        caller.require_admin("revoke job tokens")
        return {"revoked": request.app.state.service.tokens.revoke(job)}

    @app.put("/v1/sandboxes/{sandbox_id}/network", dependencies=[Auth])
    async def set_network(sandbox_id: str, body: NetworkPolicy, svc: Service) -> NetworkStatus:
        """Replace the egress allowlist while it runs (a sandbox without network is plugged in)."""
        return await svc.set_network(sandbox_id, body)

    @app.post("/v1/network/peers", status_code=204)
    async def attach_network_peer(body: NetworkPeer, svc: Service, caller: CallerDep) -> Response:
        """Plug a network namespace of this machine (a package mirror, an uplink) into every edge's sandbox
        network at ``address`` (10.88.0.0/16); sandboxes reach it only where their allowlist says so."""
        caller.require_admin("change the sandbox network")
        await svc.attach_network_peer(body.name, body.netns_path, body.address)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/audit", dependencies=[Auth])
    async def sandbox_audit(
        sandbox_id: str, svc: Service, after_id: Annotated[int, Query(ge=0)] = 0
    ) -> list[AuditEvent]:
        """Its audit events (each exec and file write is in its trajectory log)."""
        svc.get(sandbox_id)
        return [AuditEvent.model_validate(e) for e in svc.audit_trail.events(sandbox_id=sandbox_id, after_id=after_id)]

    @app.get("/v1/audit")
    async def audit_stream(
        svc: Service,
        caller: CallerDep,
        after_id: Annotated[int, Query(ge=0)] = 0,
        severity: Annotated[Literal["info", "warning", "critical"] | None, Query()] = None,
        wait_s: Annotated[float, Query(ge=0, le=300, description="Wait this long for new events if none.")] = 0,
    ) -> list[AuditEvent]:
        """Events of every sandbox after ``after_id``, oldest first: poll with the last id to follow the stream."""
        caller.require_admin("read every sandbox's audit events")
        events = svc.audit_trail.events(after_id=after_id, severity=severity)
        if not events and wait_s > 0:
            await svc.audit_trail.wait(wait_s)
            events = svc.audit_trail.events(after_id=after_id, severity=severity)
        return [AuditEvent.model_validate(e) for e in events]

    @app.get(
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
        wanted = EventFilter(sandbox_id=sandbox_id, kinds=kind, labels=_label_pairs(label), job=caller.job)
        if from_now:
            after_id = await asyncio.to_thread(svc.events.last_id)
        return StreamingResponse(follow_events(svc.events, after_id, wanted, follow),
                                 media_type="application/x-ndjson")  # fmt: skip

    @app.get("/v1/sandboxes/{sandbox_id}/network", dependencies=[Auth])
    async def network_status(sandbox_id: str, svc: Service) -> NetworkStatus:
        """Its address, allowlist, and how many packets the policy dropped."""
        return await svc.network_status(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", dependencies=[Auth])
    async def exec_command(sandbox_id: str, body: ExecRequest, logged: Logged) -> ExecResult:
        """Run a command and wait; with ``step_id``, a step sent again is answered from the trajectory log."""
        return await logged.exec(sandbox_id, body)

    @app.post(
        "/v1/sandboxes/{sandbox_id}/exec/stream",
        dependencies=[Auth],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": "One ExecEvent per line."}},
    )
    async def exec_stream(sandbox_id: str, body: ExecRequest, logged: Logged) -> StreamingResponse:
        events = logged.exec_stream(sandbox_id, body)
        first = await anext(events)  # errors before the first event still get a proper status

        async def lines() -> AsyncIterator[bytes]:
            yield first.model_dump_json(exclude_none=True).encode() + b"\n"
            try:
                async for event in events:
                    yield event.model_dump_json(exclude_none=True).encode() + b"\n"
            except CorralError as exc:  # the status is sent already: the error ends the stream as its last line
                broke = ExecEvent(type="error", error=exc.to_body()["error"])
                yield broke.model_dump_json(exclude_none=True).encode() + b"\n"

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/{sandbox_id}/commands", status_code=201, dependencies=[Auth])
    async def start_command(sandbox_id: str, body: ExecRequest, logged: Logged) -> CommandInfo:
        return await logged.start(sandbox_id, body)

    @app.get("/v1/sandboxes/{sandbox_id}/commands/{command_id}", dependencies=[Auth])
    async def get_command(
        sandbox_id: str, command_id: str, svc: Service, wait_s: Annotated[float, Query(ge=0, le=3600)] = 0
    ) -> CommandInfo:
        return await svc.call(sandbox_id, lambda edge: edge.command(sandbox_id, command_id, wait_s))

    @app.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/stdin", status_code=204, dependencies=[Auth])
    async def command_stdin(sandbox_id: str, command_id: str, request: Request, svc: Service) -> Response:
        """Raw body bytes go to the command's stdin; an empty body closes it."""
        data = await body_within_limit(request)
        await svc.call(sandbox_id, lambda edge: edge.command_stdin(sandbox_id, command_id, data))
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/signal", status_code=204, dependencies=[Auth])
    async def command_signal(sandbox_id: str, command_id: str, body: SignalRequest, svc: Service) -> Response:
        await svc.call(sandbox_id, lambda edge: edge.command_signal(sandbox_id, command_id, body.signal))
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/commands/{command_id}/resize", status_code=204, dependencies=[Auth])
    async def command_resize(sandbox_id: str, command_id: str, body: PtySize, svc: Service) -> Response:
        """A pty command's new window size (exec/stream or commands started with ``pty``)."""
        await svc.call(sandbox_id, lambda edge: edge.command_resize(sandbox_id, command_id, body.rows, body.cols))
        return Response(status_code=204)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/content",
        dependencies=[Auth],
        response_class=Response,
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    async def read_file(sandbox_id: str, path: PathQuery, svc: Service) -> Response:
        data = await svc.call(sandbox_id, lambda edge: edge.read_file(sandbox_id, path))
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files/content", dependencies=[Auth])
    async def write_file(
        sandbox_id: str,
        path: PathQuery,
        request: Request,
        logged: Logged,
        mode: Annotated[int, Query(ge=0, le=0o7777)] = 0o644,
        step_id: StepIdQuery = None,
    ) -> FileInfo:
        """The raw request body becomes the file's content (replaced atomically); logged like a command."""
        data = await body_within_limit(request)
        return await logged.write_file(sandbox_id, path, data, mode, step_id)

    @app.get("/v1/sandboxes/{sandbox_id}/trajectory", dependencies=[Auth])
    async def trajectory(
        sandbox_id: str,
        logged: Logged,
        after_seq: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int | None, Query(ge=1, le=10000)] = None,
    ) -> list[TrajectoryStep]:
        """The sandbox's log of commands and file writes, in order."""
        return logged.steps(sandbox_id, after_seq=after_seq, limit=limit)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/trajectory.jsonl",
        dependencies=[Auth],
        response_class=StreamingResponse,
        responses={200: {"content": {"application/x-ndjson": {}}, "description": "One step per line."}},
    )
    async def export_trajectory(sandbox_id: str, logged: Logged) -> StreamingResponse:
        lines = logged.export_jsonl(sandbox_id)
        return StreamingResponse((line.encode() for line in lines), media_type="application/x-ndjson")

    @app.get("/v1/sandboxes/{sandbox_id}/trajectory/provenance", dependencies=[Auth])
    async def provenance(sandbox_id: str, path: PathQuery, logged: Logged) -> list[TrajectoryStep]:
        """The steps that changed ``path``, oldest first."""
        return logged.provenance(sandbox_id, path)

    @app.post("/v1/sandboxes/{sandbox_id}/trajectory/replay", status_code=201, dependencies=[Auth])
    async def replay_trajectory(sandbox_id: str, body: ReplayRequest, logged: Logged) -> ReplayResult:
        """Re-run the logged steps in a fresh sandbox from the same layers; report where results differ."""
        return await logged.replay(sandbox_id, body)

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat", dependencies=[Auth])
    async def stat_file(sandbox_id: str, path: PathQuery, svc: Service) -> FileInfo:
        return await svc.call(sandbox_id, lambda edge: edge.stat(sandbox_id, path))

    @app.get("/v1/sandboxes/{sandbox_id}/files/list", dependencies=[Auth])
    async def list_dir(sandbox_id: str, path: PathQuery, svc: Service) -> list[FileInfo]:
        return await svc.call(sandbox_id, lambda edge: edge.list_dir(sandbox_id, path))

    # Every file change goes through the trajectory log (Logged), so a replay reproduces the sandbox's files.
    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir", dependencies=[Auth])
    async def mkdir(sandbox_id: str, body: MkdirRequest, logged: Logged, step_id: StepIdQuery = None) -> FileInfo:
        return await logged.mkdir(sandbox_id, body, step_id)

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204, dependencies=[Auth])
    async def remove(
        sandbox_id: str, path: PathQuery, logged: Logged, recursive: bool = False, step_id: StepIdQuery = None
    ) -> Response:
        await logged.remove(sandbox_id, path, recursive, step_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/files/rename", dependencies=[Auth])
    async def rename(sandbox_id: str, body: RenameRequest, logged: Logged, step_id: StepIdQuery = None) -> FileInfo:
        """Move ``source`` to ``dest`` (rename(2): a file there is replaced, a directory refused)."""
        return await logged.rename(sandbox_id, body, step_id)

    @app.put("/v1/sandboxes/{sandbox_id}/files/tar", dependencies=[Auth])
    async def upload_tar(
        sandbox_id: str, path: PathQuery, request: Request, logged: Logged, step_id: StepIdQuery = None
    ) -> UploadResult:
        """Extract a tar (plain or compressed) from the body into the directory ``path``."""
        return await logged.upload_tar(sandbox_id, path, await body_within_limit(request), step_id)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files/tar",
        dependencies=[Auth],
        response_class=Response,
        responses={200: {"content": {"application/x-tar": {}}}},
    )
    async def download_tar(sandbox_id: str, path: PathQuery, svc: Service) -> Response:
        data = await svc.call(sandbox_id, lambda edge: edge.download_tar(sandbox_id, path))
        return Response(data, media_type="application/x-tar")

    app.mount("/ui", StaticFiles(directory=DASHBOARD_DIR, html=True), name="dashboard")

    @app.get("/", include_in_schema=False)
    async def dashboard_home() -> RedirectResponse:
        """The web dashboard (corral/gateway/dashboard): it asks for the key and uses this same API."""
        return RedirectResponse("/ui/")

    include_e2b(
        app, max_file_bytes, internet_egress
    )  # E2B's API and envd protocol on the same port (corral/gateway/e2b)
    # SandboxFusion's /run_code and /run_jupyter (corral/gateway/sandbox_fusion.py)
    include_sandbox_fusion(app, open_access=sandbox_fusion_open, toolchain_image=sandbox_fusion_image)
    return app
