"""E2B's process model over Corral commands: start, stream, re-attach, signal, stdin.

An E2B process is a Corral streamed command (through the trajectory log and
the audit, like /v1 exec/stream) that this table runs in a task of its own,
so it outlives the HTTP stream that started it: a client that disconnects or
ran it in the background can re-attach with ``Connect(pid)``. Every
subscriber gets the events from when it subscribed. The pid is this table's
number for the command (unique per sandbox), not the in-sandbox pid.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

from corral.api.errors import Conflict, CorralError, InternalError, NotFound, SandboxGone
from corral.api.models import ExecRequest, ExecResult
from corral.gateway.operations import Operations

__all__ = ["ProcessTable", "Process", "Event", "OUTPUT_CAP_BYTES", "NO_TIMEOUT_S"]

log = logging.getLogger(__name__)
OUTPUT_CAP_BYTES = 64 << 20  # per stream; E2B has no cap, Corral needs one
NO_TIMEOUT_S = 86400.0  # E2B's timeout=0 ("no limit"): Corral's longest command
_FIRST_PID = 1000


@dataclass(frozen=True)
class Event:
    """One thing a process did: output (``stream`` and ``data``), or its end (``result`` or ``error``)."""

    stream: str | None = None
    data: bytes = b""
    result: ExecResult | None = None
    error: CorralError | None = None

    @property
    def is_end(self) -> bool:
        return self.stream is None


@dataclass
class Process:
    sandbox_id: str
    pid: int
    tag: str | None
    config: dict[str, Any]  # the proto3-JSON ProcessConfig it was started with (List shows it)
    command_id: str | None = None
    subscribers: set[asyncio.Queue[Event]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    stopped_by: CorralError | None = None  # why this table stopped following it, if it did
    pty_marker: str | None = None  # a PTY session (pty.py): its output is terminal data
    user: str | None = None  # who it runs as

    @property
    def ended(self) -> bool:
        return self.task is not None and self.task.done()

    def subscribe(self) -> asyncio.Queue[Event]:
        queue: asyncio.Queue[Event] = asyncio.Queue()
        self.subscribers.add(queue)
        return queue

    def publish(self, event: Event) -> None:
        for queue in self.subscribers:
            queue.put_nowait(event)


class ProcessTable:
    def __init__(self, operations: Operations) -> None:
        self._operations = operations
        self._processes: dict[tuple[str, int], Process] = {}
        self._pids = itertools.count(_FIRST_PID)

    def list(self, sandbox_id: str) -> list[Process]:
        return [p for (sid, _), p in self._processes.items() if sid == sandbox_id]

    def find(self, sandbox_id: str, pid: int | None = None, tag: str | None = None) -> Process:
        for process in self.list(sandbox_id):
            if (pid is not None and process.pid == pid) or (tag is not None and process.tag == tag):
                return process
        raise NotFound(f"process with {'pid ' + str(pid) if pid is not None else 'tag ' + repr(tag)} not found")

    async def start(
        self,
        sandbox_id: str,
        request: ExecRequest,
        *,
        tag: str | None,
        config: dict[str, Any],
        pty_marker: str | None = None,
    ) -> tuple[Process, asyncio.Queue[Event]]:
        """Start it and subscribe the caller; returns once it runs (errors before that are raised)."""
        if tag is not None and any(p.tag == tag for p in self.list(sandbox_id)):
            raise Conflict(f"a process with tag {tag!r} is already running")
        process = Process(sandbox_id, next(self._pids), tag, config, pty_marker=pty_marker, user=request.user)
        queue = process.subscribe()
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._processes[(sandbox_id, process.pid)] = process
        process.task = asyncio.get_running_loop().create_task(self._run(process, request, started))
        try:
            await started
        except BaseException:
            self._processes.pop((sandbox_id, process.pid), None)
            raise
        return process, queue

    async def _run(self, process: Process, request: ExecRequest, started: asyncio.Future[None]) -> None:
        ended = False
        try:
            async for event in self._operations.exec_stream(process.sandbox_id, request):
                if event.type == "started":
                    process.command_id = event.command_id
                    if not started.done():
                        started.set_result(None)
                elif event.type in ("stdout", "stderr"):
                    process.publish(Event(stream=event.type, data=(event.data or "").encode()))
                elif event.type == "exit":
                    ended = True
                    killed = process.stopped_by  # the kill's doing, however the command reported its end
                    process.publish(Event(error=killed) if killed else Event(result=event.result))
        except CorralError as exc:
            if not started.done():
                started.set_exception(exc)
            elif not ended:
                ended = True
                process.publish(Event(error=process.stopped_by or exc))
        except Exception as exc:
            log.exception("e2b process %s in %s failed", process.pid, process.sandbox_id)
            if not started.done():
                started.set_exception(exc)
            elif not ended:
                ended = True
                process.publish(Event(error=InternalError(f"the command failed: {exc}")))
        finally:
            if not started.done():
                started.set_exception(InternalError("the command ended before it started"))
            if not ended:
                process.publish(Event(error=process.stopped_by or InternalError("the server is shutting down")))
            self._processes.pop((process.sandbox_id, process.pid), None)

    def stopping(self, sandbox_id: str) -> None:
        """The sandbox is being killed: however its processes' commands end now, they end by the kill."""
        for process in self.list(sandbox_id):
            process.stopped_by = SandboxGone(f"sandbox {sandbox_id} was killed")

    async def forget(self, sandbox_id: str) -> None:
        """The sandbox was killed: stop following its processes."""
        self.stopping(sandbox_id)
        await self._cancel(self.list(sandbox_id))

    async def close(self) -> None:
        await self._cancel(list(self._processes.values()))

    @staticmethod
    async def _cancel(processes: builtins.list[Process]) -> None:
        tasks = [p.task for p in processes if p.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
