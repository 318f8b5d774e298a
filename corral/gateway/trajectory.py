"""Commands and file writes go through the trajectory log on their way to the edge.

Every exec, streamed exec, background start and file write is appended to
the sandbox's log before its answer leaves the server. With a client step id
(``step_id``), a step sent again (a trainer restarted after preemption) is
answered from the log instead of running twice, a different request under the
same id is refused as a divergence, and the files the step changed are
recorded (provenance). Without one, the step gets an ``auto-`` id: logged,
exported, replayable, but never matched against a resend.
"""

from __future__ import annotations

import base64
import hashlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from corral.gateway.service import SandboxService
from corral.sdk._exceptions import CorralError, InvalidRequest, error_from_response
from corral.sdk._models import (
    CommandInfo,
    CreateSandboxRequest,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ReplayMismatch,
    ReplayRequest,
    ReplayResult,
    TrajectoryStep,
)
from corral.trajectory import LOG_CAP_KEY, Replay, Step, TrajectoryLog

__all__ = ["Trajectories"]

_AUTO_PREFIX = "auto-"
_REPLAY_COMPARED = ("exit_code", "stdout", "stderr")


def _to_model(step: Step) -> TrajectoryStep:
    return TrajectoryStep(
        seq=step.seq,
        step_id=step.step_id,
        kind=step.kind,
        request=step.request,
        state=step.state,  # type: ignore[arg-type]
        result=step.result,
        result_truncated=step.result_truncated,
        started_at=step.started_at,
        finished_at=step.finished_at,
        files=step.files,
    )


class Trajectories:
    def __init__(self, log: TrajectoryLog, sandboxes: SandboxService, *, max_logged_file_bytes: int) -> None:
        self._log = log
        self._sandboxes = sandboxes
        self._max_logged_file_bytes = max_logged_file_bytes

    def mark_lost(self) -> int:
        """At start: steps that were running when the server died have no known outcome."""
        return self._log.mark_lost()

    def _begin(self, sandbox_id: str, step_id: str | None, kind: str, request: dict[str, Any]) -> Step | Replay:
        if step_id is not None and step_id.startswith(_AUTO_PREFIX):
            raise InvalidRequest(f"step ids starting with {_AUTO_PREFIX!r} are Corral's own: choose another")
        self._sandboxes.get(sandbox_id)  # unknown sandboxes get no log entries
        return self._log.begin(sandbox_id, step_id or f"{_AUTO_PREFIX}{uuid.uuid4().hex[:16]}", kind, request)

    async def _since(self, sandbox_id: str, step_id: str | None) -> float | None:
        if step_id is None:
            return None  # provenance is recorded for the client's own steps
        return await self._sandboxes.call(sandbox_id, lambda edge: edge.fs_clock(sandbox_id))

    async def _changed(self, sandbox_id: str, since: float | None) -> list[str] | None:
        if since is None:
            return None
        return await self._sandboxes.call(sandbox_id, lambda edge: edge.changed_paths(sandbox_id, since))

    @staticmethod
    def _replayed(step: Step) -> dict[str, Any]:
        result = dict(step.result or {})
        if "error" in result:
            raise error_from_response(0, {"error": result["error"]})
        result.pop(LOG_CAP_KEY, None)
        return result

    # -- the logged operations ------------------------------------------

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        step = self._begin(sandbox_id, request.step_id, "exec", request.model_dump(mode="json", exclude={"step_id"}))
        if isinstance(step, Replay):
            return ExecResult.model_validate({**self._replayed(step.step), "replayed": True})
        try:
            since = await self._since(sandbox_id, request.step_id)
            result = await self._sandboxes.call(sandbox_id, lambda edge: edge.exec(sandbox_id, request))
            files = await self._changed(sandbox_id, since)
        except CorralError as exc:
            self._log.fail(step, {"code": exc.code, "message": exc.message})
            raise
        self._log.finish(step, result.model_dump(mode="json"), files=files)
        return result

    async def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        body = request.model_dump(mode="json", exclude={"step_id"})
        step = self._begin(sandbox_id, request.step_id, "exec_stream", body)
        if isinstance(step, Replay):
            result = ExecResult.model_validate({**self._replayed(step.step), "replayed": True})
            for stream in ("stdout", "stderr"):
                text = getattr(result, stream)
                if text:
                    yield ExecEvent(type=stream, data=text)  # type: ignore[arg-type]
            yield ExecEvent(type="exit", command_id=result.command_id, result=result)
            return
        stdout: list[str] = []
        stderr: list[str] = []
        recorded = False
        try:
            since = await self._since(sandbox_id, request.step_id)
            async for event in self._sandboxes.stream(sandbox_id, lambda edge: edge.exec_stream(sandbox_id, request)):
                if event.type == "exit" and event.result is not None:
                    full = event.result.model_copy(update={"stdout": "".join(stdout), "stderr": "".join(stderr)})
                    self._log.finish(step, full.model_dump(mode="json"), files=await self._changed(sandbox_id, since))
                    recorded = True
                elif event.type in ("stdout", "stderr"):
                    (stdout if event.type == "stdout" else stderr).append(event.data or "")
                yield event
        except CorralError as exc:
            if not recorded:
                self._log.fail(step, {"code": exc.code, "message": exc.message})
                recorded = True
            raise
        finally:
            if not recorded:  # the client went away mid-stream; the edge killed the command
                self._log.fail(step, {"code": "conflict", "message": "the client went away; the command was killed"})

    async def start(self, sandbox_id: str, request: ExecRequest) -> CommandInfo:
        """A background command: logged when it starts (its output is read through /commands)."""
        step = self._begin(sandbox_id, request.step_id, "start", request.model_dump(mode="json", exclude={"step_id"}))
        if isinstance(step, Replay):
            return CommandInfo.model_validate(self._replayed(step.step))
        try:
            info = await self._sandboxes.call(sandbox_id, lambda edge: edge.start_command(sandbox_id, request))
        except CorralError as exc:
            self._log.fail(step, {"code": exc.code, "message": exc.message})
            raise
        self._log.finish(step, info.model_dump(mode="json"))
        return info

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int, step_id: str | None) -> FileInfo:
        request: dict[str, Any] = {"path": path, "mode": mode, "size": len(data)}
        if len(data) <= self._max_logged_file_bytes:
            request["data_b64"] = base64.b64encode(data).decode()  # so a replay can write it again
        else:
            request["sha256"] = hashlib.sha256(data).hexdigest()
        step = self._begin(sandbox_id, step_id, "write_file", request)
        if isinstance(step, Replay):
            return FileInfo.model_validate(self._replayed(step.step))
        try:
            info = await self._sandboxes.call(sandbox_id, lambda edge: edge.write_file(sandbox_id, path, data, mode))
        except CorralError as exc:
            self._log.fail(step, {"code": exc.code, "message": exc.message})
            raise
        self._log.finish(step, info.model_dump(mode="json"), files=[info.path] if step_id else None)
        return info

    # -- reading the log ------------------------------------------------

    def steps(self, sandbox_id: str, *, after_seq: int, limit: int | None) -> list[TrajectoryStep]:
        self._sandboxes.get(sandbox_id)
        return [_to_model(step) for step in self._log.steps(sandbox_id, after_seq=after_seq, limit=limit)]

    def export_jsonl(self, sandbox_id: str) -> Iterator[str]:
        self._sandboxes.get(sandbox_id)
        return self._log.export_jsonl(sandbox_id)

    def provenance(self, sandbox_id: str, path: str) -> list[TrajectoryStep]:
        self._sandboxes.get(sandbox_id)
        return [_to_model(step) for step in self._log.provenance(sandbox_id, path)]

    # -- replay ---------------------------------------------------------

    async def replay(self, sandbox_id: str, request: ReplayRequest) -> ReplayResult:
        """Re-run a sandbox's logged steps, in order, in a fresh sandbox from the same layers and settings."""
        original = self._sandboxes.record(sandbox_id)
        steps = [s for s in self._log.steps(sandbox_id) if s.state == "done" and "error" not in (s.result or {})]
        fresh = await self._sandboxes.create(
            CreateSandboxRequest(
                layers=original["layers"],
                runtime=original["runtime"],
                cpu=original["cpu"],
                memory_mb=original["memory_mb"],
                pids_max=original["pids_max"],
                env=original["env"],
                cwd=original["cwd"],
                user=original["user"],
                ttl_s=request.ttl_s,
                labels={**original["labels"], **request.labels, "corral.replay_of": sandbox_id},
            )  # fmt: skip
        )
        skipped: list[str] = []
        mismatches: list[ReplayMismatch] = []
        for step in steps:
            differences = await self._replay_step(fresh.id, step)
            if differences is None:
                skipped.append(step.step_id)
            else:
                mismatches += differences
        return ReplayResult(
            sandbox=self._sandboxes.get(fresh.id),
            steps=len(steps) - len(skipped),
            skipped=skipped,
            mismatches=mismatches,
        )

    async def _replay_step(self, sandbox_id: str, step: Step) -> list[ReplayMismatch] | None:
        """Run one logged step again; None when it cannot be re-run faithfully."""
        if step.kind in ("exec", "exec_stream"):
            request = ExecRequest.model_validate(step.request)
            result = await self._sandboxes.call(sandbox_id, lambda edge: edge.exec(sandbox_id, request))
            logged = self._replayed(step)
            return [
                ReplayMismatch(
                    seq=step.seq, step_id=step.step_id, field=name, logged=logged[name], replayed=getattr(result, name)
                )
                for name in _REPLAY_COMPARED
                if name in logged and logged[name] != getattr(result, name)
            ]
        if step.kind == "write_file" and "data_b64" in step.request:
            data = base64.b64decode(step.request["data_b64"])
            path, mode = step.request["path"], step.request["mode"]
            await self._sandboxes.call(sandbox_id, lambda edge: edge.write_file(sandbox_id, path, data, mode))
            return []
        return None  # background starts, and writes too large to have been logged whole
