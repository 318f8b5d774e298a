"""E2B's template builds (``Template().from_image(...).run_cmd(...)``, ``Template.build``) as Corral Dockerfile builds.

The SDK's protocol, kept here: ``POST /v3/templates`` names the template and
gets a build id; for each ``copy`` it asks ``GET /templates/{id}/files/{hash}``
whether the files (a tar of the sources, by the SDK's own hash) are there, and
if not PUTs them to the URL it is given; ``POST /v2/templates/{id}/builds/{build}``
starts the build with the steps; ``GET .../status?logsOffset=`` is polled for
log lines until ``ready`` or ``error`` (with the failed step and its log tail).

The steps become a Dockerfile (``FROM`` the image or template, ``RUN``,
``COPY`` from the uploaded archives, ``ENV``, ``WORKDIR``, ``USER``) built by
ImageService like any other (corral/gateway/dockerfile_build.py: the same
builder sandboxes, layer cache and image config), tagged as the template's
name (``latest`` and each tag), so ``Sandbox.create(name)`` starts from it.
Builds run as tasks the facade owns; their state lives as long as the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hmac
import json
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from corral.api.errors import CorralError, NotFound
from corral.api.models import BuildEvent, BuildRequest
from corral.gateway.e2b.common import E2BError, E2BRoute, check_api_key, facade, refuse, services, signed_token
from corral.gateway.e2b.control import image_of, json_body
from corral.images.store import DEFAULT_VERSION, check_name
from corral.images.unpack import extract_tar

if TYPE_CHECKING:
    from corral.gateway.images import ImageService

__all__ = ["TemplateBuilds", "router"]

MAX_UPLOAD_BYTES = 1 << 30
LOG_PAGE = 100  # the API's most log entries per status answer
REASON_LOG_TAIL = 20  # log entries a failed build's reason carries
KEPT_BUILDS = 256  # finished builds whose status (and logs) can still be asked for
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_UNSUPPORTED_START = {
    "fromImageRegistry": "registry credentials: push the image to a registry Corral pulls from, or build it here",
    "startCmd": "no start command: Corral starts no process in a new sandbox (run it with commands.run)",
    "readyCmd": "no start command to wait for",
}

router = APIRouter(include_in_schema=False, route_class=E2BRoute)


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")


@dataclass
class _Build:
    template_id: str
    build_id: str
    tags: list[str]
    status: str = "waiting"  # waiting (files may still come) | building | ready | error
    logs: list[dict[str, Any]] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    task: asyncio.Task[None] | None = None

    def log(self, message: str, level: str = "info") -> None:
        for line in message.splitlines() or [""]:
            self.logs.append({"timestamp": _now(), "level": level, "message": line})


@dataclass
class _Dockerfile:
    text: str
    steps: list[str]  # per Dockerfile instruction (from 1): the E2B step it came from ("base", "1", ...)


class TemplateBuilds:
    """The template builds of one server: their state, uploaded files and running tasks (closed with the app)."""

    def __init__(self, work_dir: Callable[[], Path]) -> None:
        """``work_dir``: makes the directory for uploads and Dockerfiles, on the first build (a server that builds
        no template leaves nothing in the builder's work dir)."""
        self._make_dir = work_dir
        self._made: Path | None = None
        self._builds: dict[str, _Build] = {}

    def files(self, template_id: str) -> Path:
        """Where a template's uploads go; the id is a template name, so it names no other directory."""
        try:
            check_name(template_id, "template id")
        except CorralError as exc:
            raise E2BError(400, exc.message) from None
        return self._dir() / template_id / "files"

    def _dir(self) -> Path:
        if self._made is None:
            self._made = self._make_dir()
        return self._made

    def new(self, template_id: str, tags: list[str]) -> _Build:
        finished = [key for key, old in self._builds.items() if old.status in ("ready", "error")]
        for key in finished[: max(0, len(self._builds) - KEPT_BUILDS + 1)]:  # oldest first (insertion order)
            del self._builds[key]
        build = _Build(template_id, str(uuid.uuid4()), tags)
        self._builds[build.build_id] = build
        self.files(template_id).mkdir(parents=True, exist_ok=True)
        return build

    def get(self, template_id: str, build_id: str) -> _Build:
        build = self._builds.get(build_id)
        if build is None or build.template_id != template_id:
            raise E2BError(404, f"build {build_id} of template {template_id} not found")
        return build

    def start(self, build: _Build, images: ImageService, dockerfile: _Dockerfile, no_cache: bool) -> None:
        build.status = "building"
        build.task = asyncio.get_running_loop().create_task(self._run(build, images, dockerfile, no_cache))

    async def _run(self, build: _Build, images: ImageService, dockerfile: _Dockerfile, no_cache: bool) -> None:
        """One Dockerfile build per tag: the first runs the steps, the others are build-cache hits that tag the
        same layers and image config."""
        path = self._dir() / build.template_id / f"{build.build_id}.Dockerfile"
        try:
            path.write_text(dockerfile.text)
        except OSError as exc:
            self._follow(build, BuildEvent(type="error", error={"message": f"cannot write the Dockerfile: {exc}"}),
                         dockerfile, "base")  # fmt: skip
            return
        step = "base"
        for version in build.tags:  # the context holds each upload as <hash>/, which COPY <hash>/<src> reads
            request = BuildRequest(name=f"{build.template_id}:{version}", kind="dockerfile", no_cache=no_cache,
                                   dockerfile=str(path), context=str(self.files(build.template_id)))  # fmt: skip
            async for event in images.build(request):
                step = self._follow(build, event, dockerfile, step)
            if build.status == "error":
                return
        build.status = "ready"

    @staticmethod
    def _follow(build: _Build, event: BuildEvent, dockerfile: _Dockerfile, step: str) -> str:
        """Log one build event; returns the E2B step now running."""
        if event.step is not None and 0 < event.step <= len(dockerfile.steps):
            step = dockerfile.steps[event.step - 1]
        if event.type == "progress" and event.message is not None:
            build.log(event.message)
        elif event.type == "error":
            message = (event.error or {}).get("message", "the build failed")
            build.log(message, level="error")
            build.reason = {"message": message, "step": step, "logEntries": build.logs[-REASON_LOG_TAIL:]}
            build.status = "error"
        return step

    async def close(self) -> None:
        tasks = [build.task for build in self._builds.values() if build.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _builds(request: Request) -> TemplateBuilds:
    builds: TemplateBuilds = facade(request).templates
    return builds


def _upload_token(request: Request, template_id: str, files_hash: str) -> str:
    return signed_token(facade(request).server_key, f"template-files:{template_id}:{files_hash}")


def _template_name(body: dict[str, Any]) -> tuple[str, list[str]]:
    """The Corral image name and versions of ``name[:tag]`` and ``tags`` (``latest`` when none is given)."""
    raw = body.get("name") or body.get("alias")
    if not isinstance(raw, str) or not raw:
        raise E2BError(400, "name is required: the template's name, e.g. 'my-template'")
    name, _, tag = raw.partition(":")
    tags = body.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) and t for t in tags):
        raise E2BError(400, f"tags must be a list of names, not {tags!r}")
    versions = list(dict.fromkeys([DEFAULT_VERSION, *([tag] if tag else []), *tags]))
    try:
        check_name(name, "template name")
        for version in versions:
            check_name(version, "template tag")
    except CorralError as exc:
        raise E2BError(400, exc.message) from None
    return name, versions


@router.post("/v3/templates")
@router.post("/v2/templates")
async def request_build(request: Request) -> JSONResponse:
    check_api_key(request)
    name, versions = _template_name(await json_body(request))
    build = _builds(request).new(name, versions)
    shown_tags = [v for v in versions if v != DEFAULT_VERSION] or ["default"]
    return JSONResponse({"templateID": name, "buildID": build.build_id, "public": False, "names": [name],
                         "aliases": [name], "tags": shown_tags}, status_code=202)  # fmt: skip


@router.get("/templates/aliases/{alias}")
async def alias(alias: str, request: Request) -> JSONResponse:
    check_api_key(request)
    try:
        services(request).images.inspect(image_of(alias))
    except NotFound:
        raise E2BError(404, f"template {alias} not found") from None
    return JSONResponse({"templateID": alias, "public": False})


@router.get("/templates/{template_id}/files/{files_hash}")
async def file_link(template_id: str, files_hash: str, request: Request) -> JSONResponse:
    """Whether a ``copy``'s files are here; if not, where to PUT them (a URL signed for that upload alone)."""
    check_api_key(request)
    if not _HASH_RE.match(files_hash):
        raise E2BError(400, f"files hash {files_hash!r} is not a sha256 in hex")
    if (_builds(request).files(template_id) / files_hash).is_dir():
        return JSONResponse({"present": True}, status_code=201)  # the API's status for both answers
    url = request.url_for("upload_files", template_id=template_id, files_hash=files_hash)
    token = _upload_token(request, template_id, files_hash)
    return JSONResponse({"present": False, "url": f"{url}?token={token}"}, status_code=201)


@router.put("/e2b/template-files/{template_id}/{files_hash}", name="upload_files")
async def upload_files(template_id: str, files_hash: str, request: Request) -> Response:
    """The SDK's upload of a ``copy``'s sources (a tar, gzipped or not), unpacked as that hash's tree."""
    expected = _upload_token(request, template_id, files_hash)
    if not _HASH_RE.match(files_hash) or not hmac.compare_digest(request.query_params.get("token", ""), expected):
        raise E2BError(401, "this upload URL is not valid: ask GET /templates/{id}/files/{hash} for one")
    files = _builds(request).files(template_id)
    if not files.is_dir():
        raise E2BError(404, f"template {template_id} has no build waiting for files")
    staging = files / f".{files_hash}.{uuid.uuid4().hex}"
    archive = staging.with_suffix(".tar")
    try:
        received = 0
        with archive.open("wb") as out:
            async for chunk in request.stream():
                received += len(chunk)
                if received > MAX_UPLOAD_BYTES:  # the archive itself is bounded too, not only what it unpacks to
                    raise E2BError(413, f"the uploaded files are over {MAX_UPLOAD_BYTES} bytes")
                out.write(chunk)
        staging.mkdir()
        with archive.open("rb") as source:
            await asyncio.to_thread(extract_tar, source, staging, max_bytes=MAX_UPLOAD_BYTES)
        staging.rename(files / files_hash)
    except CorralError as exc:
        raise E2BError(400, f"the uploaded files are not a tar archive Corral can unpack: {exc.message}") from None
    finally:
        archive.unlink(missing_ok=True)
        await asyncio.to_thread(shutil.rmtree, staging, True)  # gone unless it became the hash's tree
    return Response(status_code=200)


def _words(args: Any, step: int, at_least: int) -> list[str]:
    if not isinstance(args, list) or len(args) < at_least or not all(isinstance(a, str) for a in args):
        raise E2BError(400, f"step {step}: args must be a list of at least {at_least} strings, not {args!r}")
    return args


def _dockerfile(body: dict[str, Any]) -> _Dockerfile:
    """The build's steps as a Dockerfile, each line remembering the E2B step it came from."""
    for option, why in _UNSUPPORTED_START.items():
        if body.get(option):
            raise refuse(option, why)
    base = body.get("fromImage") or (image_of(body["fromTemplate"]) if body.get("fromTemplate") else None)
    if not isinstance(base, str) or not base:
        raise E2BError(400, "a template needs fromImage or fromTemplate")
    lines, steps = [f"FROM {base}"], ["base"]
    user = None  # the user set so far (USER); a step's own user applies to that step only
    for number, raw in enumerate(body.get("steps") or [], start=1):
        kind = raw.get("type") if isinstance(raw, dict) else None
        args = raw.get("args") if isinstance(raw, dict) else None
        if kind == "RUN":
            command, *as_user = _words(args, number, 1)
            own = as_user[0] if as_user and as_user[0] else None
            step_lines = [f"USER {own}", f"RUN {command}", f"USER {user or 'root'}"] if own else [f"RUN {command}"]
        elif kind == "COPY":
            src, dest, *rest = _words(args, number, 2)
            owner, mode = (rest + ["", ""])[:2]
            files_hash = raw.get("filesHash")
            if not isinstance(files_hash, str) or not _HASH_RE.match(files_hash):
                raise E2BError(400, f"step {number}: COPY needs the filesHash of its uploaded files")
            flags = [f"--chown={owner}"] * bool(owner) + [f"--chmod={mode}"] * bool(mode)
            step_lines = [" ".join(["COPY", *flags, json.dumps([f"{files_hash}/{src}", dest])])]
        elif kind == "ENV":
            pairs = _words(args, number, 2)
            values = zip(pairs[::2], pairs[1::2], strict=False)
            step_lines = ["ENV " + " ".join(f"{key}={json.dumps(value)}" for key, value in values)]
        elif kind in ("WORKDIR", "USER"):
            (value,) = _words(args, number, 1)[:1]
            user = value if kind == "USER" else user
            step_lines = [f"{kind} {value}"]
        else:
            raise refuse(f"template step {kind!r}", "Corral maps RUN, COPY, ENV, WORKDIR and USER")
        lines += step_lines
        steps += [str(number)] * len(step_lines)
    return _Dockerfile(text="\n".join(lines) + "\n", steps=steps)


@router.post("/v2/templates/{template_id}/builds/{build_id}")
async def start_build(template_id: str, build_id: str, request: Request) -> Response:
    check_api_key(request)
    body = await json_body(request)
    build = _builds(request).get(template_id, build_id)
    if build.status != "waiting":
        raise E2BError(409, f"build {build_id} has already started")
    dockerfile = _dockerfile(body)
    for number, raw in enumerate(body.get("steps") or [], start=1):
        if raw.get("type") == "COPY" and not (_builds(request).files(template_id) / raw["filesHash"]).is_dir():
            raise E2BError(400, f"step {number}: the files of COPY {raw['args'][0]} were not uploaded")
    _builds(request).start(build, services(request).images, dockerfile, no_cache=bool(body.get("force")))
    return Response(status_code=202)


@router.get("/templates/{template_id}/builds/{build_id}/status")
async def build_status(template_id: str, build_id: str, request: Request) -> JSONResponse:
    check_api_key(request)
    build = _builds(request).get(template_id, build_id)
    try:
        offset = max(0, int(request.query_params.get("logsOffset", "0")))
    except ValueError:
        raise E2BError(400, "logsOffset must be a whole number") from None
    entries = build.logs[offset : offset + LOG_PAGE]
    answer: dict[str, Any] = {"templateID": template_id, "buildID": build_id, "status": build.status,
                              "logEntries": entries, "logs": [entry["message"] for entry in entries]}  # fmt: skip
    if build.reason is not None:
        answer["reason"] = build.reason
    return JSONResponse(answer)
