"""What every route module shares: authentication, the services as dependencies, query shapes, request bodies
within the upload limit, and NDJSON streams.

A route module imports these and declares its routes on an ``APIRouter`` of its own; create_app (gateway/app.py)
includes them all. The services and limits live on ``app.state`` (set by create_app and its lifespan)."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator, Callable, Sequence
from typing import IO, Annotated, Any, TypeVar

from fastapi import Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ValidationError

from corral.api.errors import CorralError, InvalidRequest, PayloadTooLarge
from corral.gateway.auth import Caller
from corral.gateway.fncall import FnCallService
from corral.gateway.images import ImageService
from corral.gateway.operations import Operations
from corral.gateway.service import SandboxService
from corral.gateway.trajectory import Trajectories
from corral.logs import current_sandbox

__all__ = [
    "Auth", "CallerDep", "FnCalls", "Images", "Logs", "Ops", "PathQuery", "Service", "StepIdQuery", "body_within_limit",
    "json_body", "label_pairs", "ndjson", "ndjson_grouped", "ndjson_lines", "parsed_body", "save_body",
]  # fmt: skip

M = TypeVar("M", bound=BaseModel)


class _Authenticate(HTTPBearer):
    """The caller, checked against the sandbox in the path (a job token reaches only its job's sandboxes).

    The bearer scheme itself rather than a dependency on it: every request solves one dependency for its
    caller instead of two (FastAPI's solving is a real share of a short request's CPU), and the document
    names the same scheme."""

    async def __call__(self, request: Request) -> Caller:  # type: ignore[override]
        credentials: HTTPAuthorizationCredentials | None = await super().__call__(request)
        services = request.app.state.service
        caller: Caller = services.tokens.caller(credentials.credentials if credentials else None)
        sandbox_id = request.path_params.get("sandbox_id")
        if sandbox_id is not None:
            current_sandbox.set(sandbox_id)  # on every log line written while serving this request
        job = caller.job
        if job is not None and sandbox_id is not None and not services.tokens.known_owner(sandbox_id, job):
            caller.check_owner(sandbox_id, (await services.sandboxes.record(sandbox_id)).labels)
            services.tokens.remember_owner(sandbox_id, job)
        return caller


_authenticate = _Authenticate(auto_error=False, scheme_name="HTTPBearer")


async def _service(request: Request) -> SandboxService:
    return request.app.state.service.sandboxes  # type: ignore[no-any-return]


async def _image_service(request: Request) -> ImageService:
    return request.app.state.service.images  # type: ignore[no-any-return]


async def _fncall(request: Request) -> FnCallService:
    return request.app.state.service.fncall  # type: ignore[no-any-return]


async def _operations(request: Request) -> Operations:
    return request.app.state.service.operations  # type: ignore[no-any-return]


async def _trajectories(request: Request) -> Trajectories:
    return request.app.state.service.trajectories  # type: ignore[no-any-return]


Auth = Depends(_authenticate)
CallerDep = Annotated[Caller, Depends(_authenticate)]
Service = Annotated[SandboxService, Depends(_service)]
Images = Annotated[ImageService, Depends(_image_service)]
Ops = Annotated[Operations, Depends(_operations)]  # every request that changes a sandbox goes through it
Logs = Annotated[Trajectories, Depends(_trajectories)]
FnCalls = Annotated[FnCallService, Depends(_fncall)]
PathQuery = Annotated[str, Query(description="Absolute path inside the sandbox.")]
StepIdQuery = Annotated[
    str | None,
    Query(min_length=1, max_length=256, description="The client's step id: a resend is answered from the log."),
]


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its body with ``parsed_body``: the document FastAPI writes for a
    body parameter of that model (its schema, required, and the 422 of a body that does not match). The schema
    is named by reference, so the model must be in the document through another route (ExecRequest: exec/stream;
    FnCallRequest: fncall/batch): ``test_sdk_contract.py::test_every_reference_in_the_api_document_resolves``."""
    return {
        "requestBody": {
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
            "required": True,
        },
        "responses": {
            "422": {
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HTTPValidationError"}}},
                "description": "Validation Error",
            }
        },
    }


async def parsed_body(request: Request, model: type[M]) -> M:
    """The JSON body as ``model``, parsed by pydantic's core in one step, for the hottest routes (exec, fncall):
    FastAPI's generic body solving and response validation cost more than such a route's own work. A body that
    does not match gets FastAPI's 422, its errors located under ``body`` as FastAPI locates them."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc


def label_pairs(items: list[str] | None) -> dict[str, str]:
    """``label=key=value`` query parameters as a dict."""
    labels = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"label filter {item!r} must look like key=value")
        labels[key] = value
    return labels


async def save_body(request: Request, sink: IO[bytes]) -> None:
    """Stream an upload to a file, within the size limit (CORRAL_MAX_FILE_BYTES, ``app.state.max_file_bytes``)."""
    max_file_bytes: int = request.app.state.max_file_bytes
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


def _line(event: BaseModel) -> bytes:
    return event.model_dump_json(exclude_none=True).encode() + b"\n"


def ndjson_lines(
    events: AsyncIterator[BaseModel], on_error: Callable[[CorralError], BaseModel] | None = None
) -> StreamingResponse:
    """One model per line, as they come (a build's or a pull's progress: their errors are events too).
    ``on_error``: the last line for an error after the status was sent (say it in the stream, not by cutting it)."""

    async def lines() -> AsyncIterator[bytes]:
        try:
            async for event in events:
                yield _line(event)
        except CorralError as exc:
            if on_error is None:
                raise
            yield _line(on_error(exc))

    return StreamingResponse(lines(), media_type="application/x-ndjson")


async def ndjson_grouped(groups: AsyncIterator[Sequence[BaseModel]]) -> StreamingResponse:
    """One model per line, a group's lines in one write (a 32,000 batch: 63 writes, not one a line). The first
    group is awaited here, as in ``ndjson``."""
    first = await anext(groups)

    async def chunks() -> AsyncIterator[bytes]:
        yield b"".join(map(_line, first))
        async for group in groups:
            yield b"".join(map(_line, group))

    return StreamingResponse(chunks(), media_type="application/x-ndjson")


async def ndjson(
    events: AsyncIterator[BaseModel], on_error: Callable[[CorralError], BaseModel] | None = None
) -> StreamingResponse:
    """One model per line. The first is awaited here, so errors before it (an unknown sandbox or image, bad
    limits) still get their status instead of a 200 with a broken stream; ``on_error`` as for ndjson_lines."""
    first = await anext(events)

    async def rest() -> AsyncIterator[BaseModel]:
        yield first
        async for event in events:
            yield event

    return ndjson_lines(rest(), on_error)
