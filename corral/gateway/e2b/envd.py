"""envd, the in-sandbox daemon E2B's SDK talks to, served by the gateway for every sandbox.

Requests carry ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port: 49983`` and the
sandbox's ``X-Access-Token``. ``process.Process`` and ``filesystem.Filesystem``
are Connect RPC with the JSON codec: unary calls are plain JSON, server
streams are ``[flags:1][length:4][json]`` frames ending with an end-stream
frame (flags 0x02) that carries any error. ``/files`` is plain HTTP.
Commands go through the trajectory log and the audit like /v1 exec; file
writes through the log like /v1 file writes.
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import json
import posixpath
import stat
import struct
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import UploadFile

from corral.api.errors import Conflict, CorralError, InvalidRequest, NotFound, PayloadTooLarge, SandboxGone
from corral.api.models import ExecRequest, FileInfo, SandboxState
from corral.gateway.e2b import pty
from corral.gateway.e2b.common import (
    END_STREAM,
    ConnectStream,
    E2BError,
    StreamAborted,
    Target,
    basic_user,
    facade,
    frame,
    from_corral,
    gone,
    rfc3339,
    services,
    target,
)
from corral.gateway.e2b.links import Link, Resolver
from corral.gateway.e2b.metadata import FileMetadata
from corral.gateway.e2b.processes import NO_TIMEOUT_S, OUTPUT_CAP_BYTES, Event, Process
from corral.gateway.e2b.signed import files_target
from corral.gateway.e2b.watch import Watchers

__all__ = ["router", "end_frame", "entry"]

router = APIRouter(include_in_schema=False)
_STREAM_TYPE = ConnectStream.media_type
_DEFAULT_KEEPALIVE_S = 50.0
_CONNECT_CODES = {
    400: "invalid_argument",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    409: "already_exists",
    410: "not_found",
    413: "resource_exhausted",
    502: "unavailable",
    503: "unavailable",
    504: "deadline_exceeded",
}
_FILE_TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY"}  # a symlink shows its target's type
_OWNERS = {0: "root", 1000: "user", 65534: "nobody"}
_SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGINT": 2, "SIGNAL_SIGHUP": 1}


# -- Connect framing ---------------------------------------------------------


def _code_and_message(error: CorralError) -> tuple[str, str]:
    if error.status == 410:  # what E2B's proxy says of a sandbox that is gone: the SDK's SandboxNotRunningException
        return "unavailable", f"The sandbox was not found: {error.message}"
    return _CONNECT_CODES.get(error.status, "internal"), error.message


def end_frame(error: CorralError | None = None, code: str | None = None) -> bytes:
    if error is None:
        return frame({}, END_STREAM)
    default_code, message = _code_and_message(error)
    return frame({"error": {"code": code or default_code, "message": message}}, END_STREAM)


def _connect_error(exc: CorralError) -> JSONResponse:
    code, message = _code_and_message(exc)
    return JSONResponse({"code": code, "message": message}, 502 if exc.status == 410 else exc.status)


async def _message(request: Request) -> dict[str, Any]:
    """The request message: plain JSON (unary) or the first enveloped frame (server stream)."""
    body = await request.body()
    if request.headers.get("content-type", "").startswith(_STREAM_TYPE):
        if len(body) < 5:
            raise InvalidRequest("empty Connect stream request")
        flags, length = struct.unpack(">BI", body[:5])
        if flags & 0x01:
            raise InvalidRequest(
                "compressed Connect messages are not supported (send connect-accept-encoding identity)"
            )
        body = body[5 : 5 + length]
    if not body.strip():
        return {}
    try:
        message = json.loads(body)
    except ValueError:
        raise InvalidRequest("the request message is not JSON (the JSON codec is required)") from None
    if not isinstance(message, dict):
        raise InvalidRequest("the request message must be a JSON object")
    return message


def _deadline_s(request: Request) -> float | None:
    header = request.headers.get("connect-timeout-ms")
    return int(header) / 1000 if header and header.isdigit() and int(header) > 0 else None


def _stream(body: AsyncIterator[bytes]) -> ConnectStream:
    return ConnectStream(body)


async def _single(chunk: bytes) -> AsyncIterator[bytes]:
    yield chunk


# -- entries ----------------------------------------------------------------


def _permissions(info: FileInfo) -> str:
    """Go's ``FileMode.String()``, which envd sends: ``L`` marks a symlink where ``ls`` writes ``l``."""
    if info.type == "symlink":
        return "L" + stat.filemode(stat.S_IMODE(info.mode))[1:]
    kind = {"file": stat.S_IFREG, "dir": stat.S_IFDIR}.get(info.type, 0)
    return stat.filemode(kind | stat.S_IMODE(info.mode))


def entry(info: FileInfo, link: Link | None = None) -> dict[str, Any]:
    """envd's EntryInfo; a symlink (``link`` says where it leads) has its target's type and mode."""
    shown = link.info if link is not None else info
    result: dict[str, Any] = {
        "name": info.name,
        "type": _FILE_TYPES.get(shown.type, "FILE_TYPE_UNSPECIFIED") if shown else "FILE_TYPE_UNSPECIFIED",
        "path": info.path,
        "size": str(info.size),
        "mode": stat.S_IMODE(shown.mode) if shown else 0,
        "permissions": _permissions(info),
        "owner": _OWNERS.get(info.uid, str(info.uid)),
        "group": _OWNERS.get(info.gid, str(info.gid)),
        "modifiedTime": rfc3339(info.mtime),
    }
    if link is not None:
        result.update(symlinkTarget=link.target, isSymlink=True)
    return result


async def _entry(resolver: Resolver, info: FileInfo) -> dict[str, Any]:
    return entry(info, await resolver.follow(info) if info.type == "symlink" else None)


# -- process.Process ----------------------------------------------------------


def _selector(message: dict[str, Any]) -> tuple[int | None, str | None]:
    selector = message.get("process") or {}
    pid = selector.get("pid")
    return (int(pid) if pid is not None else None), selector.get("tag")


def _end_event(event: Event) -> dict[str, Any]:
    result = event.result
    assert result is not None
    code = result.exit_code if result.exit_code is not None else -1
    end: dict[str, Any] = {}
    if code >= 0:
        end.update(exited=True, status=f"exit status {code}")
        if code:
            end["exitCode"] = code
    else:
        end.update(exitCode=-1, status=f"signal: {-code}")
    if result.oom_killed:
        end["error"] = "out of memory: the command was killed (raise the sandbox's memory)"
    return {"event": {"end": end}}


async def _follow(
    process: Process, queue: asyncio.Queue[Event], deadline_s: float | None, keepalive_s: float
) -> AsyncIterator[bytes]:
    """Frames of one subscriber: start, data and keepalives, then end (or the deadline's error)."""
    stop_at = time.monotonic() + deadline_s if deadline_s else None
    try:
        yield frame({"event": {"start": {"pid": process.pid}}})
        while True:
            wait_s = keepalive_s if stop_at is None else min(keepalive_s, stop_at - time.monotonic())
            try:
                event = await asyncio.wait_for(queue.get(), timeout=max(0.0, wait_s))
            except TimeoutError:
                if stop_at is not None and time.monotonic() >= stop_at:
                    yield end_frame(
                        CorralError(f"the stream's deadline of {deadline_s:g} s passed"), "deadline_exceeded"
                    )
                    return
                yield frame({"event": {"keepalive": {}}})
                continue
            if not event.is_end:
                payload = base64.b64encode(event.data).decode()
                stream = "pty" if process.pty_marker else event.stream
                yield frame({"event": {"data": {stream: payload}}})
            elif isinstance(event.error, SandboxGone):
                raise StreamAborted  # killed, or ended: the connection drops, as through E2B's proxy
            elif event.error is not None:
                yield end_frame(event.error)
                return
            elif event.result is not None and event.result.timed_out:
                yield end_frame(
                    CorralError(f"the command ran past its timeout of {deadline_s or 0:g} s and was killed"),
                    "deadline_exceeded",
                )
                return
            else:
                yield frame(_end_event(event))
                yield end_frame()
                return
    finally:
        process.subscribers.discard(queue)


def _keepalive_s(request: Request) -> float:
    header = request.headers.get("keepalive-ping-interval", "")
    return float(header) if header.replace(".", "", 1).isdigit() and float(header) > 0 else _DEFAULT_KEEPALIVE_S


async def _start(request: Request, where: Target, message: dict[str, Any]) -> ConnectStream:
    config = message.get("process") or {}
    cmd = config.get("cmd")
    if not cmd:
        raise InvalidRequest("process.cmd is required")
    argv = [cmd, *(config.get("args") or [])]
    envs = config.get("envs") or {}
    cwd = where.path(config["cwd"]) if config.get("cwd") else where.home
    deadline_s = _deadline_s(request)
    env = {"HOME": where.home, "USER": where.user, "LOGNAME": where.user, **envs}
    marker = None
    if message.get("pty"):
        marker = pty.new_marker()
        argv = pty.pty_argv(cmd, argv[1:], message["pty"])
        env[pty.PTY_MARKER_ENV] = marker
    exec_request = ExecRequest(
        cmd=argv,
        env=env,
        cwd=cwd,
        user=where.user,
        timeout_s=min(deadline_s or NO_TIMEOUT_S, NO_TIMEOUT_S),
        stdin="" if message.get("stdin") or marker else None,
        output_cap_bytes=OUTPUT_CAP_BYTES,
    )
    table = facade(request).processes
    process, queue = await table.start(
        where.sandbox_id, exec_request, tag=message.get("tag"), config=config, pty_marker=marker
    )
    return _stream(_follow(process, queue, deadline_s, _keepalive_s(request)))


async def _connect(request: Request, where: Target, message: dict[str, Any]) -> ConnectStream:
    pid, tag = _selector(message)
    process = facade(request).processes.find(where.sandbox_id, pid, tag)
    queue = process.subscribe()
    return _stream(_follow(process, queue, _deadline_s(request), _keepalive_s(request)))


async def _command_id(request: Request, where: Target, message: dict[str, Any]) -> str:
    pid, tag = _selector(message)
    process = facade(request).processes.find(where.sandbox_id, pid, tag)
    command_id: str | None = process.command_id
    if command_id is None:
        raise NotFound(f"process {process.pid} has not started yet")
    return command_id


async def _frames(request: Request) -> AsyncIterator[dict[str, Any]]:
    """The messages of a client stream, as their frames arrive."""
    buffer = b""
    async for chunk in request.stream():
        buffer += chunk
        while len(buffer) >= 5:
            flags, length = struct.unpack(">BI", buffer[:5])
            if len(buffer) < 5 + length:
                break
            body, buffer = buffer[5 : 5 + length], buffer[5 + length :]
            if flags & END_STREAM:
                return
            yield json.loads(body) if body.strip() else {}


async def _stream_input(request: Request, where: Target) -> ConnectStream:
    """StreamInput (``commands.stream_stdin``): a start frame naming the process, then data frames for its stdin."""
    command_id = None
    async for message in _frames(request):
        if "start" in message:
            command_id = await _command_id(request, where, message["start"])
        elif "data" in message:
            given = message["data"].get("input") or {}
            if command_id is None:
                raise InvalidRequest("StreamInput needs its start event before data")
            data = base64.b64decode(given.get("stdin") or given.get("pty") or "")
            if data:
                await services(request).operations.stdin(where.sandbox_id, command_id, data)
    return _stream(_single(frame({}) + end_frame()))


@router.post("/process.Process/{method}")
async def process_rpc(method: str, request: Request) -> Response:
    streaming = method in ("Start", "Connect", "StreamInput")
    try:
        where = await target(request, basic_user(request))
        message = await _message(request)
        if method == "Start":
            return await _start(request, where, message)
        if method == "Connect":
            return await _connect(request, where, message)
        if method == "List":
            processes = [
                {"config": p.config, "pid": p.pid, **({"tag": p.tag} if p.tag else {})}
                for p in facade(request).processes.list(where.sandbox_id)
            ]
            return JSONResponse({"processes": processes})
        if method == "SendSignal":
            signo = _SIGNALS.get(str(message.get("signal")))
            if signo is None:
                raise InvalidRequest(f"signal {message.get('signal')!r} is not supported; use one of {list(_SIGNALS)}")
            command_id = await _command_id(request, where, message)
            await services(request).operations.signal(where.sandbox_id, command_id, signo)
            return JSONResponse({})
        if method == "SendInput":
            given = message.get("input") or {}
            data = base64.b64decode(given.get("stdin") or given.get("pty") or "")
            command_id = await _command_id(request, where, message)
            if data:  # an empty write would close stdin in Corral
                await services(request).operations.stdin(where.sandbox_id, command_id, data)
            return JSONResponse({})
        if method == "StreamInput":
            return await _stream_input(request, where)
        if method == "Update":
            pid, tag = _selector(message)
            process = facade(request).processes.find(where.sandbox_id, pid, tag)
            if process.pty_marker is None:
                raise InvalidRequest(f"process {process.pid} is not a PTY session")
            user = process.user or where.user
            await pty.resize(
                services(request).operations, where.sandbox_id, process.pty_marker, user, message.get("pty") or {}
            )
            return JSONResponse({})
        if method == "CloseStdin":
            command_id = await _command_id(request, where, message)
            await services(request).operations.stdin(where.sandbox_id, command_id, b"")
            return JSONResponse({})
        raise NotFound(f"process.Process/{method} is not supported by Corral's E2B facade")
    except E2BError as exc:
        return exc.response()
    except CorralError as exc:
        if streaming:
            return _stream(_single(end_frame(exc)))
        return _connect_error(exc)


# -- filesystem.Filesystem ----------------------------------------------------


async def _edge(request: Request, where: Target, operation):  # type: ignore[no-untyped-def]
    return await services(request).sandboxes.call(where.sandbox_id, operation)


async def _run_as_user(request: Request, where: Target, argv: list[str], what: str) -> None:
    """mkdir and mv run in the sandbox as the request's user, so ownership and permissions are as in E2B; through
    the trajectory log, as every file change is, so a replay makes them again."""
    command = ExecRequest(cmd=argv, user=where.user, cwd="/", timeout_s=60)
    result = await services(request).operations.exec(where.sandbox_id, command)
    if result.exit_code != 0:
        detail = (result.stderr or result.stdout).strip()
        if "Permission denied" in detail:
            raise E2BError(403, f"{what}: {detail}")
        raise InvalidRequest(f"{what} failed: {detail or 'exit ' + str(result.exit_code)}")


def _resolver(request: Request, where: Target) -> Resolver:
    return Resolver(lambda path: _edge(request, where, lambda e: e.stat(where.sandbox_id, path)))


async def _list(
    request: Request, where: Target, resolver: Resolver, shown: str, real: str, depth: int
) -> list[dict[str, Any]]:
    """The entries of directory ``real`` as if under ``shown`` (the path as asked); links are not descended into."""
    infos = await _edge(request, where, lambda edge: edge.list_dir(where.sandbox_id, real))
    entries = []
    for info in infos:
        info = info.model_copy(update={"path": posixpath.join(shown, info.name)})
        entries.append(await _entry(resolver, info))
        if info.type == "dir" and depth > 1:
            entries += await _list(request, where, resolver, info.path, posixpath.join(real, info.name), depth - 1)
    return entries


async def _filesystem(request: Request, method: str, where: Target, message: dict[str, Any]) -> Response:
    sandbox_id = where.sandbox_id
    metadata: FileMetadata = facade(request).metadata
    if method == "Stat":
        resolver = _resolver(request, where)
        found = await _entry(resolver, await resolver.stat(where.path(message.get("path", ""))))
        return JSONResponse({"entry": (await metadata.annotate(sandbox_id, [found]))[0]})
    if method == "ListDir":
        path = where.path(message.get("path", ""))
        depth = int(message.get("depth") or 1)
        resolver = _resolver(request, where)
        real, info = await resolver.resolve(path)  # a link to a directory lists the directory
        if info.type != "dir":
            raise InvalidRequest(f"path {path} is not a directory")
        listed = await _list(request, where, resolver, posixpath.normpath(path), real, depth)
        return JSONResponse({"entries": await metadata.annotate(sandbox_id, listed)})
    if method == "MakeDir":
        path = where.path(message.get("path", ""))
        try:
            await _edge(request, where, lambda e: e.stat(sandbox_id, path))
        except NotFound:
            await _run_as_user(request, where, ["mkdir", "-p", "--", path], f"make_dir {path}")
            return JSONResponse({"entry": entry(await _edge(request, where, lambda e: e.stat(sandbox_id, path)))})
        raise Conflict(f"directory {path} already exists")
    if method == "Move":
        source, destination = where.path(message.get("source", "")), where.path(message.get("destination", ""))
        await _edge(request, where, lambda e: e.stat(sandbox_id, source))
        await _run_as_user(request, where, ["mv", "-T", "--", source, destination], f"rename {source}")
        resolver = _resolver(request, where)
        return JSONResponse({"entry": await _entry(resolver, await resolver.stat(destination))})
    if method == "Remove":
        path = where.path(message.get("path", ""))
        try:
            await services(request).operations.remove(sandbox_id, path, True, None)
        except NotFound:
            pass  # envd's Remove is os.RemoveAll: a path that is not there is already removed
        return JSONResponse({})
    watchers: Watchers = facade(request).watchers
    include_entry = bool(message.get("includeEntry", message.get("include_entry")))  # envd 0.6.3
    if method == "CreateWatcher":
        path, recursive = where.path(message.get("path", "")), bool(message.get("recursive"))
        watcher_id = await watchers.create(where, path, recursive, include_entry)
        return JSONResponse({"watcherId": watcher_id})
    if method == "GetWatcherEvents":
        events = await watchers.events(sandbox_id, str(message.get("watcherId", "")))
        return JSONResponse({"events": events})
    if method == "RemoveWatcher":
        watchers.remove(sandbox_id, str(message.get("watcherId", "")))
        return JSONResponse({})
    if method == "WatchDir":
        path, recursive = where.path(message.get("path", "")), bool(message.get("recursive"))
        watcher_id = await watchers.create(where, path, recursive, include_entry)
        return _stream(watchers.stream(sandbox_id, watcher_id, _deadline_s(request), _keepalive_s(request)))
    raise NotFound(f"filesystem.Filesystem/{method} is not supported by Corral's E2B facade")


@router.post("/filesystem.Filesystem/{method}")
async def filesystem_rpc(method: str, request: Request) -> Response:
    try:
        where = await target(request, basic_user(request))
        return await _filesystem(request, method, where, await _message(request))
    except E2BError as exc:
        return exc.response()
    except CorralError as exc:
        if method == "WatchDir":
            return _stream(_single(end_frame(exc)))
        return _connect_error(exc)


# -- plain HTTP: /files, /health ------------------------------------------------


@router.get("/files")
async def read_file(request: Request, path: str, username: str | None = None) -> Response:
    try:
        where = await files_target(request, "read", path, username)
        full = where.path(path)
        data = await _edge(request, where, lambda e: e.read_file(where.sandbox_id, full))
    except E2BError as exc:
        return exc.response()
    except CorralError as exc:
        return from_corral(exc).response()
    if "gzip" in request.headers.get("accept-encoding", "") and len(data) > 0:
        return Response(
            gzip.compress(data, 1), media_type="application/octet-stream", headers={"Content-Encoding": "gzip"}
        )
    return Response(data, media_type="application/octet-stream")


async def _upload_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"upload is over the limit of {limit} bytes (CORRAL_MAX_FILE_BYTES)")
        chunks.append(chunk)
    data = b"".join(chunks)
    if request.headers.get("content-encoding", "").lower() == "gzip":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise InvalidRequest(f"the body says Content-Encoding: gzip but is not gzip: {exc}") from None
        if len(data) > limit:
            raise PayloadTooLarge(f"upload is over the limit of {limit} bytes (CORRAL_MAX_FILE_BYTES)")
    return data


@router.post("/files")
async def write_files(request: Request, path: str | None = None, username: str | None = None) -> Response:
    try:
        where = await files_target(request, "write", path, username)
        limit = facade(request).max_file_bytes
        files: list[tuple[str, bytes]] = []
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            async with request.form(max_files=1000, max_part_size=limit) as form:
                uploads = [value for _, value in form.multi_items() if isinstance(value, UploadFile)]
                for upload in uploads:
                    # One file: the ``path`` query names it; several: each part's filename is its path.
                    named = path if path and len(uploads) == 1 else upload.filename
                    files.append((where.path(named or ""), await upload.read()))
        else:
            if not path:
                raise InvalidRequest("path is required for an octet-stream upload")
            files.append((where.path(path), await _upload_body(request, limit)))
        if not files:
            raise InvalidRequest("no file in the upload")
        written = []
        operations = services(request).operations
        for file_path, data in files:
            info = await operations.write_file(where.sandbox_id, file_path, data, 0o644, None)
            written.append({"name": info.name, "type": "file", "path": info.path})
        metadata = FileMetadata.from_headers(request.headers)  # envd 0.6.2: X-Metadata-<key> as xattrs
        await facade(request).metadata.write(where.sandbox_id, [item["path"] for item in written], metadata)
        return JSONResponse(written)
    except E2BError as exc:
        return exc.response()
    except CorralError as exc:
        return from_corral(exc).response()


@router.get("/health")
async def health(request: Request) -> Response:
    """204 while the sandbox runs; 502 once it ended and while it is paused, as envd behind E2B's proxy answers
    (asking does not resume a paused sandbox, unlike every other request)."""
    try:
        where = await target(request)
    except E2BError as exc:
        return exc.response()
    if where.info.state == SandboxState.PAUSED:
        return E2BError(502, f"The sandbox {where.sandbox_id} is paused").response()
    if facade(request).killing(where.sandbox_id):
        return gone(where.sandbox_id).response()
    return Response(status_code=204)
