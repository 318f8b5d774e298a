"""E2B's code interpreter (port 49999): ``run_code`` and contexts, for Python.

A context is a kernel process in the sandbox (kernel_main.py, written into
the sandbox when first needed) started through the process table, so it is a
logged, audited command like any other, listed by ``commands.list``. A cell
goes to the kernel's stdin as one JSON line; the kernel's messages come back
on its stdout as NDJSON and are passed through as they arrive. One cell runs
at a time per context. A cell runs to its end even when its client stopped
waiting (the server is not told when a client goes away while nothing is
sent); if its response is closed early, the cell is interrupted (SIGINT).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from corral.api.errors import CorralError, InvalidRequest, NotFound
from corral.api.models import ExecRequest
from corral.gateway.e2b.common import INTERPRETER_PORT, E2BError, Target, facade, from_corral, target
from corral.gateway.e2b.processes import NO_TIMEOUT_S, OUTPUT_CAP_BYTES, Event, Process, ProcessTable
from corral.gateway.operations import Operations

__all__ = ["router", "Kernels", "KERNEL_PATH"]

KERNEL_PATH = "/tmp/.corral-e2b-kernel.py"
_KERNEL_SOURCE = (Path(__file__).parent / "kernel_main.py").read_bytes()
_DEFAULT_CONTEXT = "default"
_DRAIN_TIMEOUT_S = 10.0
_LANGUAGES = (None, "", "python", "python3")

router = APIRouter(include_in_schema=False)


@dataclass
class _Kernel:
    context_id: str
    cwd: str
    process: Process
    queue: asyncio.Queue[Event]
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    partial: bytes = b""
    unfinished_cells: int = 0  # interrupted cells whose end_of_execution is still to come
    dead: bool = False

    def describe(self) -> dict[str, str]:
        return {"id": self.context_id, "language": "python", "cwd": self.cwd}


class Kernels:
    def __init__(self, processes: ProcessTable, operations: Operations) -> None:
        self._processes = processes
        self._operations = operations  # the kernel's file, its cells (stdin) and interrupts are logged steps
        self._kernels: dict[tuple[str, str], _Kernel] = {}

    def list(self, sandbox_id: str) -> list[_Kernel]:
        return [k for (sid, _), k in self._kernels.items() if sid == sandbox_id and not k.dead]

    async def create(self, where: Target, cwd: str | None, context_id: str | None = None) -> _Kernel:
        self._kernels = {key: k for key, k in self._kernels.items() if not k.dead and not k.process.ended}
        context_id = context_id or secrets.token_hex(8)
        cwd = where.path(cwd) if cwd else where.home
        sandbox_id = where.sandbox_id
        await self._operations.write_file(sandbox_id, KERNEL_PATH, _KERNEL_SOURCE, 0o644, None)
        request = ExecRequest(
            cmd=["python3", "-u", KERNEL_PATH],
            env={"HOME": where.home, "USER": where.user},
            cwd=cwd,
            user=where.user,
            timeout_s=NO_TIMEOUT_S,
            stdin="",
            output_cap_bytes=OUTPUT_CAP_BYTES,
        )
        config = {"cmd": "python3", "args": ["-u", KERNEL_PATH], "cwd": cwd}
        process, queue = await self._processes.start(sandbox_id, request, tag=f"e2b-kernel-{context_id}", config=config)
        kernel = _Kernel(context_id, cwd, process, queue)
        self._kernels[(sandbox_id, context_id)] = kernel
        return kernel

    async def get(self, where: Target, context_id: str | None) -> _Kernel:
        kernel = self._kernels.get((where.sandbox_id, context_id or _DEFAULT_CONTEXT))
        if kernel is not None and not kernel.dead:
            return kernel
        if context_id and context_id != _DEFAULT_CONTEXT:
            raise NotFound(f"context {context_id} not found (it was removed, or its kernel exited)")
        return await self.create(where, None, _DEFAULT_CONTEXT)

    async def _signal(self, kernel: _Kernel, signo: int) -> None:
        command_id = kernel.process.command_id
        sandbox_id = kernel.process.sandbox_id
        if command_id is not None:
            with contextlib.suppress(CorralError):
                await self._operations.signal(sandbox_id, command_id, signo)

    async def remove(self, sandbox_id: str, context_id: str) -> None:
        kernel = self._kernels.pop((sandbox_id, context_id), None)
        if kernel is None or kernel.dead:
            raise NotFound(f"context {context_id} not found")
        kernel.dead = True
        await self._signal(kernel, 9)
        if kernel.process.task is not None:  # gone from the process table before a restart reuses its tag
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(kernel.process.task), _DRAIN_TIMEOUT_S)

    async def restart(self, where: Target, context_id: str) -> _Kernel:
        kernel = self._kernels.get((where.sandbox_id, context_id))
        if kernel is None:
            raise NotFound(f"context {context_id} not found")
        await self.remove(where.sandbox_id, context_id)
        return await self.create(where, kernel.cwd, context_id)

    def forget(self, sandbox_id: str) -> None:
        for key in [key for key in self._kernels if key[0] == sandbox_id]:
            self._kernels.pop(key).dead = True

    async def _next(self, kernel: _Kernel, timeout_s: float | None = None) -> AsyncIterator[dict[str, Any]]:
        """The kernel's messages (its stdout lines; its stderr as stderr messages) as they come."""
        while True:
            event = await asyncio.wait_for(kernel.queue.get(), timeout=timeout_s)
            if event.is_end:
                kernel.dead = True
                code = event.result.exit_code if event.result is not None else None
                reason = event.error.message if event.error is not None else f"exit code {code}"
                yield {
                    "type": "error",
                    "name": "KernelDied",
                    "value": f"the Python kernel exited ({reason})",
                    "traceback": "",
                }
                yield {"type": "end_of_execution"}
                return
            if event.stream == "stderr":
                text = event.data.decode(errors="replace")
                yield {"type": "stderr", "text": text, "timestamp": time.time_ns() // 1000}
                continue
            kernel.partial += event.data
            *lines, kernel.partial = kernel.partial.split(b"\n")
            for line in lines:
                if line.strip():
                    yield json.loads(line)

    async def _drain(self, kernel: _Kernel) -> None:
        """Skip what is left of interrupted cells before the next one starts."""
        while kernel.unfinished_cells and not kernel.dead:
            async for message in self._next(kernel, _DRAIN_TIMEOUT_S):
                if message["type"] == "end_of_execution":
                    kernel.unfinished_cells -= 1
                    break

    async def execute(self, kernel: _Kernel, code: str, env: dict[str, str]) -> AsyncIterator[bytes]:
        sandbox_id = kernel.process.sandbox_id
        async with kernel.lock:
            try:
                await self._drain(kernel)
            except TimeoutError:
                raise CorralError("the context's kernel did not stop its interrupted cell; restart it") from None
            if kernel.dead:
                raise NotFound(f"context {kernel.context_id} not found: its kernel exited; create a new one")
            line = json.dumps({"code": code, "env": env}).encode() + b"\n"
            command_id = kernel.process.command_id
            assert command_id is not None
            await self._operations.stdin(sandbox_id, command_id, line)
            kernel.unfinished_cells += 1
            finished = False
            try:
                async for message in self._next(kernel):
                    yield json.dumps(message).encode() + b"\n"
                    if message["type"] == "end_of_execution":
                        kernel.unfinished_cells -= 1
                        finished = True
                        return
            finally:
                if not finished and not kernel.dead:
                    with anyio.CancelScope(shield=True):  # the response was cancelled: still reach the kernel
                        await self.interrupt(kernel)

    async def interrupt(self, kernel: _Kernel) -> None:
        """SIGINT: the running cell ends with KeyboardInterrupt, the context keeps its state."""
        await self._signal(kernel, 2)


async def _interpreter_target(request: Request) -> Target:
    where = await target(request)
    if where.port != INTERPRETER_PORT:
        raise E2BError(404, f"{request.url.path} is served on the code interpreter's port {INTERPRETER_PORT}")
    return where


def _plain_error(exc: CorralError | E2BError) -> Response:
    return (exc if isinstance(exc, E2BError) else from_corral(exc)).response()


@router.post("/execute")
async def execute(request: Request) -> Response:
    try:
        where = await _interpreter_target(request)
        body = await request.json()
        if body.get("language") not in _LANGUAGES:
            raise InvalidRequest(
                f"language {body.get('language')!r} is not supported by Corral's code interpreter: "
                "Python only (run other languages with commands.run)"
            )
        env = body.get("env_vars") or {}
        kernel = await facade(request).kernels.get(where, body.get("context_id"))
        stream = facade(request).kernels.execute(kernel, str(body.get("code", "")), env)
        first = await anext(stream)  # errors before the cell runs still get a proper status
    except (CorralError, E2BError) as exc:
        return _plain_error(exc)

    async def lines() -> AsyncIterator[bytes]:
        yield first
        async for chunk in stream:
            yield chunk

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@router.post("/contexts")
async def create_context(request: Request) -> Response:
    try:
        where = await _interpreter_target(request)
        body = await request.json() if (await request.body()).strip() else {}
        if body.get("language") not in _LANGUAGES:
            raise InvalidRequest(f"language {body.get('language')!r} is not supported: Python only")
        kernel = await facade(request).kernels.create(where, body.get("cwd"))
    except (CorralError, E2BError) as exc:
        return _plain_error(exc)
    return JSONResponse(kernel.describe())


@router.get("/contexts")
async def list_contexts(request: Request) -> Response:
    try:
        where = await _interpreter_target(request)
    except E2BError as exc:
        return exc.response()
    return JSONResponse([k.describe() for k in facade(request).kernels.list(where.sandbox_id)])


@router.delete("/contexts/{context_id}")
async def remove_context(context_id: str, request: Request) -> Response:
    try:
        where = await _interpreter_target(request)
        await facade(request).kernels.remove(where.sandbox_id, context_id)
    except (CorralError, E2BError) as exc:
        return _plain_error(exc)
    return Response(status_code=204)


@router.post("/contexts/{context_id}/restart")
async def restart_context(context_id: str, request: Request) -> Response:
    try:
        where = await _interpreter_target(request)
        await facade(request).kernels.restart(where, context_id)
    except (CorralError, E2BError) as exc:
        return _plain_error(exc)
    return Response(status_code=204)
