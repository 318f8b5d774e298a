"""E2B's control plane (``api.e2b.app``) over SandboxService: the same sandboxes as /v1.

A template is a Corral image: ``base`` and ``code-interpreter-v1`` are the
``e2b-base`` image (debian-12 + sudo, user ``user``; corral/gateway/e2b/template.py),
any other template id is an image ref such as ``debian-12``. E2B's ``timeout``
is the sandbox's TTL, ``metadata`` its labels, ``envVars`` its environment,
``allow_internet_access`` and ``network`` its egress rules (network.py).
Its sandboxes allow setuid programs (``corral.setuid``), so the template's
``user`` can ``sudo`` to root inside the sandbox, as on E2B.
Create options Corral cannot honour are refused (400), never ignored.
"""

from __future__ import annotations

import datetime as dt
import time
import urllib.parse
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from corral.api.errors import NotFound
from corral.api.models import CreateSandboxRequest, SandboxInfo, SandboxState
from corral.backends.base import SETUID_LABEL
from corral.gateway.e2b.common import (
    ENVD_VERSION,
    ON_TIMEOUT_LABEL,
    SANDBOX_USER,
    TEMPLATE_LABEL,
    TIMEOUT_LABEL,
    E2BError,
    E2BRoute,
    access_token,
    check_api_key,
    drop_processes,
    facade,
    home_of,
    page,
    refuse,
    rfc3339,
    services,
)
from corral.gateway.e2b.network import create_policy, network_info, update_policy

__all__ = [
    "router", "DEFAULT_TIMEOUT_S", "TEMPLATE_IMAGES", "image_of", "json_body", "live", "parse_timeout", "sandbox_shape",
]  # fmt: skip

DEFAULT_TIMEOUT_S = 300  # E2B's default sandbox timeout
MAX_TIMEOUT_S = 24 * 3600
_FAR_FUTURE = "9999-12-31T00:00:00Z"  # endAt of a sandbox without a TTL (made through /v1)
TEMPLATE_IMAGES = {"base": "e2b-base", "code-interpreter-v1": "e2b-base"}
_CREATE_FIELDS = {
    "templateID", "timeout", "metadata", "envVars", "secure", "autoPause", "autoPauseMemory", "autoResume",
    "allow_internet_access", "network", "mcp", "iam", "volumeMounts",
}  # fmt: skip
_UNSUPPORTED_CREATE_OPTIONS = {
    "mcp": "no MCP gateway",
    "iam": "no cloud IAM",
    "volumeMounts": "no volumes",
}
_LIVE_STATES = [SandboxState.CREATING.value, SandboxState.RUNNING.value, SandboxState.PAUSED.value]

router = APIRouter(include_in_schema=False, route_class=E2BRoute)


def image_of(template_id: str) -> str:
    return TEMPLATE_IMAGES.get(template_id, template_id)


def _template(info: SandboxInfo) -> str:
    return info.labels.get(TEMPLATE_LABEL, info.image)


def _metadata(info: SandboxInfo) -> dict[str, str]:
    return {k: v for k, v in info.labels.items() if not k.startswith("corral.")}


def sandbox_shape(request: Request, info: SandboxInfo) -> dict[str, Any]:
    return {
        "templateID": _template(info),
        "sandboxID": info.id,
        "clientID": "corral",
        "alias": _template(info),
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": access_token(facade(request).server_key, info.id),
        "trafficAccessToken": access_token(facade(request).server_key, info.id),
        "domain": None,
    }


def _listed(info: SandboxInfo) -> dict[str, Any]:
    end = info.ended_at or info.expires_at
    return {
        "templateID": _template(info),
        "sandboxID": info.id,
        "clientID": "corral",
        "alias": _template(info),
        "startedAt": rfc3339(info.created_at),
        "endAt": rfc3339(end) if end else _FAR_FUTURE,
        "cpuCount": max(1, round(info.cpu)),
        "memoryMB": info.memory_mb,
        "diskSizeMB": info.disk_mb or 0,
        "state": "paused" if info.state == SandboxState.PAUSED else "running",
        "metadata": _metadata(info),
        "envdVersion": ENVD_VERSION,
    }


async def live(request: Request, sandbox_id: str) -> SandboxInfo:
    """A sandbox that still exists; an ended one is E2B's 404."""
    try:
        info: SandboxInfo = await services(request).sandboxes.get(sandbox_id)
    except NotFound:
        raise E2BError(404, f"sandbox {sandbox_id} not found") from None
    if info.state.value not in _LIVE_STATES:
        raise E2BError(404, f"sandbox {sandbox_id} not found: it ended ({info.end_reason})")
    return info


async def json_body(request: Request) -> dict[str, Any]:
    body = await request.body()
    if not body.strip():
        return {}
    try:
        parsed = await request.json()
    except ValueError:
        raise E2BError(400, "the request body is not JSON") from None
    if not isinstance(parsed, dict):
        raise E2BError(400, "the request body must be a JSON object")
    return parsed


def parse_timeout(value: Any, default: int | None) -> int | None:
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise E2BError(400, f"timeout must be a whole number of seconds >= 0, got {value!r}")
    if value > MAX_TIMEOUT_S:
        raise E2BError(400, f"timeout {value} s is over the maximum of {MAX_TIMEOUT_S} s")
    return value


def _check_create_options(body: dict[str, Any]) -> None:
    unknown = sorted(k for k, v in body.items() if k not in _CREATE_FIELDS and v not in (None, {}, []))
    if unknown:
        raise refuse(f"create option(s) {', '.join(unknown)}", "unknown to this facade")
    if body.get("autoPauseMemory") is not None and not body.get("autoPause"):
        raise E2BError(400, "autoPauseMemory is only for autoPause=true")
    # autoResume: any request to a paused Corral sandbox resumes it, whatever this says (docs/e2b.md).
    for option, why in _UNSUPPORTED_CREATE_OPTIONS.items():
        if body.get(option):
            raise refuse(option, why)


async def _create(request: Request) -> JSONResponse:
    check_api_key(request)
    body = await json_body(request)
    _check_create_options(body)
    template_id = body.get("templateID")
    if not isinstance(template_id, str) or not template_id:
        raise E2BError(400, "templateID is required: a Corral image such as 'base' or 'debian-12'")
    metadata = body.get("metadata") or {}
    env = body.get("envVars") or {}
    for name, mapping in (("metadata", metadata), ("envVars", env)):
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            raise E2BError(400, f"{name} must map strings to strings")
    if any(key.startswith("corral.") for key in metadata):
        raise E2BError(400, "metadata keys starting with 'corral.' are Corral's own")
    timeout_s = parse_timeout(body.get("timeout"), DEFAULT_TIMEOUT_S)
    labels = {**metadata, TEMPLATE_LABEL: template_id, SETUID_LABEL: "allowed"}  # sudo works, as on E2B
    if body.get("autoPause"):  # lifecycle.TimeoutPauser pauses it at its timeout
        on_timeout = "pause" if body.get("autoPauseMemory") is not False else "pause-filesystem"
        labels.update({ON_TIMEOUT_LABEL: on_timeout, TIMEOUT_LABEL: str(timeout_s)})
    network = create_policy(body, facade(request).internet_egress)
    create = CreateSandboxRequest(
        image=image_of(template_id),
        env=env,
        user=SANDBOX_USER,
        cwd=home_of(SANDBOX_USER),
        labels=labels,
        ttl_s=timeout_s or None,
        network=network,
    )
    svc = services(request).sandboxes
    try:
        info = await svc.create(create)
    except NotFound as exc:
        raise E2BError(404, f"template {template_id!r} not found: {exc.message}") from None
    if ON_TIMEOUT_LABEL in labels:
        facade(request).timeouts.follow(info.id)
    return JSONResponse(sandbox_shape(request, info), status_code=201)


router.add_api_route("/sandboxes", _create, methods=["POST"])
router.add_api_route("/v2/sandboxes", _create, methods=["POST"])


def _selector(request: Request) -> tuple[dict[str, str], list[str]]:
    labels: dict[str, str] = {}
    for raw in request.query_params.getlist("metadata"):
        for key, value in urllib.parse.parse_qsl(raw, keep_blank_values=True):
            labels[key] = value
    wanted = [s for raw in request.query_params.getlist("state") for s in raw.split(",") if s]
    bad = [s for s in wanted if s not in ("running", "paused")]
    if bad:
        raise E2BError(400, f"unknown state filter {', '.join(bad)}: use running or paused")
    states = []
    for state in wanted or ["running", "paused"]:
        states += [SandboxState.CREATING.value, SandboxState.RUNNING.value] if state == "running" else [state]
    return labels, states


def _started_after(text: str | None) -> dt.datetime | None:
    """``startedAfter`` (RFC 3339, with ``Z`` or an offset)."""
    if not text:
        return None
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise E2BError(400, f"startedAfter {text!r} is not an RFC 3339 time (e.g. 2026-12-01T09:00:00Z)") from None
    if moment.tzinfo is None:
        raise E2BError(400, f"startedAfter {text!r} has no time zone: add Z or an offset such as +02:00")
    return moment


@router.get("/v2/sandboxes")
@router.get("/sandboxes")
async def list_sandboxes(request: Request) -> JSONResponse:
    check_api_key(request)
    labels, states = _selector(request)
    if request.query_params.get("template"):
        labels[TEMPLATE_LABEL] = request.query_params["template"]
    infos = await services(request).sandboxes.list(states=states, labels=labels)
    started_after = _started_after(request.query_params.get("startedAfter"))
    if started_after is not None:  # compared as shown (startedAt: microseconds, rounded), not as stored (a float)
        infos = [info for info in infos if dt.datetime.fromtimestamp(info.created_at, dt.UTC) >= started_after]
    order = request.query_params.get("order", "desc").lower()  # the API spec's default: newest first
    if order not in ("asc", "desc"):
        raise E2BError(400, f"order {order!r} is neither asc nor desc")
    infos.sort(key=lambda info: (info.created_at, info.id), reverse=order == "desc")
    shown, headers = page(request, infos)
    return JSONResponse([_listed(info) for info in shown], headers=headers)


@router.get("/sandboxes/{sandbox_id}")
async def get_info(sandbox_id: str, request: Request) -> JSONResponse:
    check_api_key(request)
    info = await live(request, sandbox_id)
    paused_on_timeout = ON_TIMEOUT_LABEL in info.labels  # and any request resumes it: autoResume
    lifecycle = {"onTimeout": "pause" if paused_on_timeout else "kill", "autoResume": paused_on_timeout}
    internet, network = network_info(info.network)
    shape = {**_listed(info), **sandbox_shape(request, info), "lifecycle": lifecycle}
    return JSONResponse({**shape, "allowInternetAccess": internet, "network": network})


@router.delete("/sandboxes/{sandbox_id}")
async def kill(sandbox_id: str, request: Request) -> Response:
    check_api_key(request)
    await live(request, sandbox_id)
    await facade(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/timeout")
async def set_timeout(sandbox_id: str, request: Request) -> Response:
    check_api_key(request)
    body = await json_body(request)
    await live(request, sandbox_id)
    timeout_s = parse_timeout(body.get("timeout"), None)
    if timeout_s is None:
        raise E2BError(400, "timeout is required (seconds from now)")
    await services(request).operations.set_ttl(sandbox_id, timeout_s or None)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/pause")
async def pause(sandbox_id: str, request: Request) -> Response:
    """``memory=False`` (``mode="filesystem"``): only the files are kept, as after a cold boot; a Corral pause
    keeps memory and processes, so they are dropped first."""
    check_api_key(request)
    body = await json_body(request)
    info = await live(request, sandbox_id)
    if info.state == SandboxState.PAUSED:
        raise E2BError(409, f"sandbox {sandbox_id} is already paused")
    if body.get("memory") is False:
        await drop_processes(services(request).operations, sandbox_id)
    await services(request).operations.pause(sandbox_id)
    return Response(status_code=204)


async def _connect(sandbox_id: str, request: Request) -> JSONResponse:
    """Resume a paused sandbox (201), with its memory unless ``memory=False``, or just hand back a running one
    (200); a timeout only extends the TTL."""
    check_api_key(request)
    body = await json_body(request)
    timeout_s = parse_timeout(body.get("timeout"), None)
    svc, operations = services(request).sandboxes, services(request).operations
    resumed = (await live(request, sandbox_id)).state == SandboxState.PAUSED
    if resumed:  # first: a resume moves the TTL on by the time spent paused
        await operations.resume(sandbox_id)
        if body.get("memory") is False:  # on_resume="reboot": a cold boot (a no-op for a running sandbox)
            await drop_processes(operations, sandbox_id)
    info = await svc.get(sandbox_id)
    if timeout_s and info.expires_at is not None and info.expires_at < time.time() + timeout_s:
        info = await operations.set_ttl(sandbox_id, timeout_s)
    return JSONResponse(sandbox_shape(request, info), status_code=201 if resumed else 200)


router.add_api_route("/sandboxes/{sandbox_id}/connect", _connect, methods=["POST"])
router.add_api_route("/v2/sandboxes/{sandbox_id}/connect", _connect, methods=["POST"])
router.add_api_route("/sandboxes/{sandbox_id}/resume", _connect, methods=["POST"])


@router.get("/sandboxes/{sandbox_id}/metrics")
async def metrics(sandbox_id: str, request: Request) -> JSONResponse:
    """One sample, taken now, from inside the sandbox (corral/gateway/e2b/metrics.py); none while paused, and
    none when the ``start``/``end`` window (Unix seconds) does not hold the current second."""
    check_api_key(request)
    info = await live(request, sandbox_id)
    if info.state == SandboxState.PAUSED:
        return JSONResponse([])  # sampling runs a command, which would resume it
    start, end = (_unix_s(request, name) for name in ("start", "end"))
    now_s = int(time.time())
    if (start is not None and start > now_s) or (end is not None and end < now_s - 1):  # -1: the client's clock
        return JSONResponse([])  # rounds down too
    sample = await facade(request).metrics(info)
    return JSONResponse([sample])


def _unix_s(request: Request, name: str) -> int | None:
    text = request.query_params.get(name)
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise E2BError(400, f"{name}={text!r} is not a Unix time in seconds") from None


@router.put("/sandboxes/{sandbox_id}/network")
async def update_network(sandbox_id: str, request: Request) -> Response:
    """``Sandbox.update_network``: the egress rules replaced at once (network.py), in the sandbox's own
    namespace; a sandbox without network is plugged in."""
    check_api_key(request)
    body = await json_body(request)
    await live(request, sandbox_id)
    policy = update_policy(body, facade(request).internet_egress)
    await services(request).operations.set_network(sandbox_id, policy)
    return Response(status_code=204)
