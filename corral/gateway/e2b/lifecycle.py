"""E2B's snapshots and forks over Corral's: a snapshot is a tagged image, a fork is Corral's fork.

``create_snapshot`` packs the sandbox's changes as a diff layer (Corral's
``snapshot``) and tags the stack as an image named ``e2b-snapshot-<name>``
(or ``e2b-snapshot-<sandbox id>:<diff digest>`` without a name); the
snapshot id is that image ref, so ``Sandbox.create(snapshot_id)`` is an
ordinary create from an image, ``list_snapshots`` lists those images (the
diff layer records the sandbox it came from) and ``delete_snapshot`` untags
one (its layers go when the disk budget wants the room). A snapshot keeps
the filesystem only: memory and processes are kept by pause and, for VM and
gVisor sandboxes, by fork. ``fork`` is Corral's fork (files for crun and runc
containers; memory and processes too for VM and gVisor sandboxes); a paused
parent is paused again afterwards, as E2B leaves it untouched.

``lifecycle={"on_timeout": "pause"}`` (``autoPause``): Corral's reaper kills a
sandbox at the end of its TTL and skips paused ones, so ``TimeoutPauser``
(a task the facade owns) pauses these sandboxes just before that, having
first set their TTL to one more period of their timeout: a resume (``connect``
or any request) starts that period afresh, since paused time does not count.
What it keeps is in labels, so a server restart loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from corral.api.errors import CorralError, NotFound
from corral.api.models import ForkRequest, ImageInfo, SandboxInfo, SandboxState
from corral.gateway.e2b.common import (
    ON_TIMEOUT_LABEL,
    TIMEOUT_LABEL,
    E2BError,
    E2BRoute,
    check_api_key,
    drop_processes,
    page,
    refuse,
    services,
)
from corral.gateway.e2b.control import DEFAULT_TIMEOUT_S, json_body, live, parse_timeout, sandbox_shape

__all__ = ["router", "SNAPSHOT_PREFIX", "MAX_FORK_COUNT", "DEFAULT_FORK_TIMEOUT_S", "TimeoutPauser"]

log = logging.getLogger(__name__)

SNAPSHOT_PREFIX = "e2b-snapshot-"
MAX_FORK_COUNT = 20  # the SDK's limit
DEFAULT_FORK_TIMEOUT_S = 15  # the API spec's default for forks
_SNAPSHOT_NAME = re.compile(r"^[a-z0-9_-][a-z0-9._-]{0,100}(:[a-z0-9_-][a-z0-9._-]{0,100})?$")
PAUSE_POLL_S = 0.5
PAUSE_RESCAN_S = 60.0
PAUSE_LEAD_S = 1.5  # paused this long before its TTL ends at most, so the reaper (which kills) never gets there
_FILES_ONLY = "a Corral snapshot keeps the filesystem (a layer); memory and processes are kept by pause()"

router = APIRouter(include_in_schema=False, route_class=E2BRoute)


def _snapshot_ref(name: str) -> str:
    if not _SNAPSHOT_NAME.match(name):
        raise E2BError(400, f"snapshot name {name!r} must be lower-case letters, digits, '.', '_' or '-' (':tag' ok)")
    ref = name if name.startswith(SNAPSHOT_PREFIX) else SNAPSHOT_PREFIX + name
    return ref if ":" in ref else f"{ref}:latest"


def _snapshot(ref: str) -> dict[str, Any]:
    return {"snapshotID": ref, "names": [ref]}


@router.post("/sandboxes/{sandbox_id}/snapshots")
async def create_snapshot(sandbox_id: str, request: Request) -> JSONResponse:
    check_api_key(request)
    body = await json_body(request)
    if body.get("memory") is True:  # unset (the SDK's default) is taken as a filesystem snapshot
        raise refuse("create_snapshot(mode='full')", f"{_FILES_ONLY}; pass mode='filesystem'")
    await live(request, sandbox_id)
    images, operations = services(request).images, services(request).operations
    name = body.get("name")
    if name:
        snap = await operations.snapshot(sandbox_id, _snapshot_ref(str(name)))
        assert snap.image is not None  # a snapshot given a name is tagged with it
        ref = snap.image
    else:
        snap = await operations.snapshot(sandbox_id, None)
        ref = images.tag(f"{SNAPSHOT_PREFIX}{sandbox_id}:{snap.diff.digest.removeprefix('sha256:')[:12]}",
                         layers=snap.layers, source=None).name  # fmt: skip
    return JSONResponse(_snapshot(ref), status_code=201)


def _matches(image: ImageInfo, name: str) -> bool:
    """``name``: a snapshot id, or the name given at create, optionally tag-qualified."""
    wanted = name if name.startswith(SNAPSHOT_PREFIX) else SNAPSHOT_PREFIX + name
    return image.name == wanted or image.name.partition(":")[0] == wanted


@router.get("/snapshots")
async def list_snapshots(request: Request) -> JSONResponse:
    check_api_key(request)
    images = services(request).images
    sources = {layer.digest: layer.source for layer in images.layers()}
    sandbox_id = request.query_params.get("sandboxID")
    name = request.query_params.get("name")
    found = [image for image in images.images() if image.name.startswith(SNAPSHOT_PREFIX)]
    if sandbox_id:
        found = [i for i in found if sources.get(i.layers[-1], {}).get("sandbox") == sandbox_id]
    if name:
        found = [i for i in found if _matches(i, name)]
    found.sort(key=lambda image: (image.created_at, image.name), reverse=True)
    shown, headers = page(request, found)
    return JSONResponse([_snapshot(image.name) for image in shown], headers=headers)


@router.delete("/templates/{template_id:path}")
async def delete_snapshot(template_id: str, request: Request) -> Response:
    """``delete_snapshot``: untag the snapshot's image. Other templates are Corral images, removed through
    Corral's own API."""
    check_api_key(request)
    if not template_id.startswith(SNAPSHOT_PREFIX):
        raise refuse(f"deleting template {template_id!r}", "templates are Corral images: `corral images rm`")
    try:
        services(request).images.untag(template_id)
    except NotFound:
        raise E2BError(404, f"snapshot {template_id} not found") from None
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork(sandbox_id: str, request: Request) -> JSONResponse:
    check_api_key(request)
    body = await json_body(request)
    count = body.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_FORK_COUNT:
        raise E2BError(400, f"count must be a whole number from 1 to {MAX_FORK_COUNT}, got {count!r}")
    ttl_s = parse_timeout(body.get("timeout"), DEFAULT_FORK_TIMEOUT_S)
    parent = await live(request, sandbox_id)
    svc, operations = services(request).sandboxes, services(request).operations
    children = await operations.fork(sandbox_id, ForkRequest(count=count))
    if parent.state == SandboxState.PAUSED and (await svc.get(sandbox_id)).state != SandboxState.PAUSED:
        await operations.pause(sandbox_id)  # packing its files resumed it; E2B leaves the parent as it was
    results = []
    for child in children:
        await operations.set_ttl(child.id, ttl_s or None)
        results.append({"sandbox": sandbox_shape(request, await svc.get(child.id))})
    return JSONResponse(results, status_code=201)


class TimeoutPauser:
    """Pauses the sandboxes created with ``autoPause`` when their timeout comes, instead of the reaper killing
    them; ``pause-filesystem`` ones (``autoPauseMemory=false``) lose their processes first.

    It follows the ids it is told of at create, not every sandbox each round (a control plane tracks
    hundreds of thousands); a look through the labels at start and every ``PAUSE_RESCAN_S`` finds those
    made before a restart or through another gateway."""

    def __init__(self, sandboxes: Any, operations: Any) -> None:
        self._sandboxes = sandboxes
        self._operations = operations  # its pauses are steps of the sandboxes' trajectories
        self._followed: set[str] = set()
        self._rescan_at = 0.0

    def follow(self, sandbox_id: str) -> None:
        self._followed.add(sandbox_id)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PAUSE_POLL_S)
            try:
                await self.pause_due(time.time())
            except Exception:
                log.exception("pausing E2B sandboxes at their timeout failed; retrying")

    async def pause_due(self, now: float) -> None:
        if now >= self._rescan_at:
            self._rescan_at = now + PAUSE_RESCAN_S
            for on_timeout in ("pause", "pause-filesystem"):
                labels = {ON_TIMEOUT_LABEL: on_timeout}
                self._followed |= {info.id for info in await self._sandboxes.list(states=["running"], labels=labels)}
        for sandbox_id in list(self._followed):
            try:
                info = await self._sandboxes.get(sandbox_id)
            except NotFound:
                info = None
            if info is None or info.state in (SandboxState.ENDED, SandboxState.LOST):
                self._followed.discard(sandbox_id)
            elif info.state == SandboxState.RUNNING and info.expires_at is not None:
                if info.expires_at - now <= PAUSE_LEAD_S:
                    await self._pause(info, keep_memory=info.labels.get(ON_TIMEOUT_LABEL) == "pause")

    async def _pause(self, info: SandboxInfo, *, keep_memory: bool) -> None:
        period_s = int(info.labels.get(TIMEOUT_LABEL) or DEFAULT_TIMEOUT_S)
        try:
            await self._operations.set_ttl(info.id, period_s)  # first: from now on the reaper cannot reach it
            if not keep_memory:
                await drop_processes(self._operations, info.id)
            await self._operations.pause(info.id)
        except CorralError as exc:  # it ended meanwhile, or its node is away: the next round sees
            log.warning("could not pause E2B sandbox %s at its timeout: %s", info.id, exc.message)
        else:
            log.info("paused E2B sandbox %s at its timeout (autoPause)", info.id)
