"""Commands and file writes go through the trajectory log on their way to the edge.

Every exec, streamed exec, background start and file write is appended to
the sandbox's log before its answer leaves the server. With a client step id
(``step_id``), a step sent again (a trainer restarted after preemption) is
answered from the log instead of running twice, a different request under the
same id is refused as a divergence, and the files the step changed are
recorded (provenance). Without one, the step gets an ``auto-`` id and is written
within a few milliseconds after its answer (off the request path; a crash in
that window can lose it): logged, exported, replayable, but never matched
against a resend.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

from pydantic import BaseModel

from corral import tracing
from corral.api.errors import CorralError, InvalidRequest, NotFound, SandboxGone, error_from_response
from corral.api.models import (
    CheckpointInfo,
    CommandInfo,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    MkdirRequest,
    RemoveResult,
    RenameRequest,
    ReplayMismatch,
    ReplayRequest,
    ReplayResult,
    SandboxInfo,
    TrajectoryStep,
    UploadResult,
)
from corral.edge.protocol import edge_of
from corral.gateway.service import SandboxService
from corral.guard.audit import detect_in_command
from corral.trajectory import LOG_CAP_KEY, Replay, Step, TrajectoryLog

__all__ = ["Trajectories"]

_AUTO_PREFIX = "auto-"
_FLUSH_DELAY_S = 0.005
M = TypeVar("M", bound=BaseModel)
_REPLAY_COMPARED = ("exit_code", "stdout", "stderr")

Findings = list[tuple[str, str, dict[str, Any]]]  # (kind, severity, detail), as edges report them


def _command_text(request: dict[str, Any]) -> str | None:
    cmd = request.get("cmd")
    if cmd is None:
        return None
    return cmd if isinstance(cmd, str) else " ".join(cmd)


def _auto_id() -> str:
    return f"{_AUTO_PREFIX}{uuid.uuid4().hex[:16]}"


def _error(exc: CorralError) -> dict[str, Any]:
    return {"error": {"code": exc.code, "message": exc.message}}


def _to_model(step: Step) -> TrajectoryStep:
    return TrajectoryStep(
        seq=step.seq,
        step_id=step.step_id,
        kind=step.kind,
        request=step.request,
        state=step.state,
        result=step.result,
        result_truncated=step.result_truncated,
        started_at=step.started_at,
        finished_at=step.finished_at,
        files=step.files,
    )


def _effective_steps(steps: list[Step]) -> list[Step]:
    """The done steps whose effects the sandbox still has: a restore drops what came after its checkpoint."""
    kept: list[Step] = []
    marks: dict[str, tuple[Step, ...]] = {}  # checkpoint id -> the steps in effect when it was taken
    for step in steps:
        if step.state != "done" or "error" in (step.result or {}):
            continue
        if step.kind == "checkpoint":
            marks[str((step.result or {}).get("checkpoint"))] = tuple(kept)
        elif step.kind == "restore":
            kept = list(marks.get(str(step.request.get("checkpoint")), kept))
        else:
            kept.append(step)
    return kept


class Trajectories:
    def __init__(self, log: TrajectoryLog, sandboxes: SandboxService, *, max_logged_file_bytes: int) -> None:
        self._log = log
        self._sandboxes = sandboxes
        self._db = sandboxes.database  # the log is written and read on the state's thread, in order
        self._max_logged_file_bytes = max_logged_file_bytes
        # Steps without a client id are written just after their answer leaves (within _FLUSH_DELAY_S),
        # off the request path: there is no resend to match, so they need not be durable before it.
        self._pending: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = []
        self._flush_handle: asyncio.TimerHandle | None = None

    def _append_auto(self, sandbox_id: str, kind: str, request: dict[str, Any], result: dict[str, Any]) -> None:
        self._pending.append((sandbox_id, kind, request, result))
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(_FLUSH_DELAY_S, self.flush)

    def flush(self) -> None:
        """Write the pending steps, in the order they finished (queued on the database thread: whatever is
        asked of it later sees them)."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        pending, self._pending = self._pending, []
        if pending:
            self._db.submit(self._append_all, pending)

    def _append_all(self, pending: list[tuple[str, str, dict[str, Any], dict[str, Any]]]) -> None:
        for sandbox_id, kind, request, result in pending:
            self._log.append(sandbox_id, _auto_id(), kind, request, result)

    async def checkpoint(self, sandbox_id: str) -> CheckpointInfo:
        """A VM checkpoint, marked in the log: a later restore rewinds the log's meaning to this point."""
        self.flush()
        info = await self._sandboxes.save_checkpoint(sandbox_id)
        await self._db.run(self._log.append, sandbox_id, _auto_id(), "checkpoint", {}, {"checkpoint": info.id})
        return info

    async def restore(self, sandbox_id: str, checkpoint_id: str) -> SandboxInfo:
        """Rewind to a checkpoint; the log records it, so replay skips what the rewind undid."""
        self.flush()
        info = await self._sandboxes.restore_checkpoint(sandbox_id, checkpoint_id)
        await self._db.run(self._log.append, sandbox_id, _auto_id(), "restore", {"checkpoint": checkpoint_id},
                           {"state": info.state.value})  # fmt: skip
        return info

    def mark_lost(self) -> int:
        """At start: steps that were running when the server died have no known outcome."""
        return self._log.mark_lost()

    async def _begin(self, sandbox_id: str, step_id: str, kind: str, request: dict[str, Any]) -> Step | Replay:
        if step_id.startswith(_AUTO_PREFIX):
            raise InvalidRequest(f"step ids starting with {_AUTO_PREFIX!r} are Corral's own: choose another")
        await self._sandboxes.get(sandbox_id)  # unknown sandboxes get no log entries
        self.flush()  # earlier steps first: the log's order is the order steps finished or began
        return await self._db.run(self._log.begin, sandbox_id, step_id, kind, request)

    @staticmethod
    def _replayed(step: Step) -> dict[str, Any]:
        result = dict(step.result or {})
        if "error" in result:
            raise error_from_response(0, {"error": result["error"]})
        result.pop(LOG_CAP_KEY, None)
        return result

    async def _audit(
        self, sandbox_id: str, command: str | None, result: ExecResult | None, edge_findings: Findings | None = None
    ) -> None:
        """Audit events for one step: detector hits on the command, quota hits in the result, protected
        paths it changed (the edge remembers what it reported already; ``edge_findings``: what it reported
        with the result, so it is not asked again)."""
        audit = self._sandboxes.audit_log
        if audit is None:
            return
        found: list[tuple[str, str, dict[str, Any]]] = []
        if command:
            found += [(kind, severity, {"cmd": command[:500]}) for kind, severity in detect_in_command(command)]
        if result is not None:
            if result.oom_killed:
                found.append(("oom_kill", "warning", {"command_id": result.command_id}))
            if result.timed_out:
                found.append(("timeout", "info", {"command_id": result.command_id}))
            if result.stdout_truncated or result.stderr_truncated:
                found.append(("output_capped", "info", {"stdout": result.stdout_truncated,
                                                        "stderr": result.stderr_truncated}))  # fmt: skip
        if edge_findings is not None:
            found += edge_findings
        else:
            with contextlib.suppress(NotFound, SandboxGone):
                found += await self._sandboxes.call(sandbox_id, lambda edge: edge.audit_after_command(sandbox_id))
        for kind, severity, detail in found:
            self._db.submit(audit.record, sandbox_id, kind, severity, detail)

    async def _logged(
        self,
        sandbox_id: str,
        step_id: str | None,
        kind: str,
        request: dict[str, Any],
        operation: Callable[[], Awaitable[M]],
        model: type[M],
        edge_findings: Findings | None = None,
    ) -> M:
        """Run an operation with its log entry: replayed, refused or recorded per the step id rules.
        ``edge_findings``: filled by ``operation`` with the edge's audit findings (see ``_audit``)."""
        if step_id is None:  # logged after it ran, in one write: nothing to match a resend against
            try:
                result = await operation()
            except (NotFound, SandboxGone):
                raise  # no such sandbox (any more): nothing to log against
            except CorralError as exc:
                self._append_auto(sandbox_id, kind, request, _error(exc))
                raise
            self._append_auto(sandbox_id, kind, request, result.model_dump(mode="json"))
            await self._audit(sandbox_id, _command_text(request), result if isinstance(result, ExecResult) else None,
                              edge_findings)  # fmt: skip
            return result
        step = await self._begin(sandbox_id, step_id, kind, request)
        if isinstance(step, Replay):
            replayed = self._replayed(step.step)
            return model.model_validate(
                {**replayed, "replayed": True} if "replayed" in model.model_fields else replayed
            )
        try:
            since = await self._sandboxes.call(sandbox_id, lambda edge: edge.fs_clock(sandbox_id))
            result = await operation()
            files = await self._sandboxes.call(sandbox_id, lambda edge: edge.changed_paths(sandbox_id, since))
        except CorralError as exc:
            await self._db.run(self._log.fail, step, _error(exc)["error"])
            raise
        await self._db.run(self._log.finish, step, result.model_dump(mode="json"), files=files)  # before the answer
        await self._audit(sandbox_id, _command_text(request), result if isinstance(result, ExecResult) else None,
                          edge_findings)  # fmt: skip
        return result

    # -- the logged operations ------------------------------------------

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        body = request.model_dump(mode="json", exclude={"step_id"})
        edge_findings: Findings = []

        async def run() -> ExecResult:  # the edge's findings come with the result: one call, not two
            result, found = await self._sandboxes.call(sandbox_id, lambda edge: edge.exec_audited(sandbox_id, request))
            edge_findings.extend(found)
            return result

        with tracing.span("corral.sandbox.exec", sandbox_id=sandbox_id, edge_id=edge_of(sandbox_id)) as span:
            if tracing.enabled():  # a read of the record, paid only while tracing
                span.set("backend", (await self._sandboxes.record(sandbox_id)).backend)
            return await self._logged(sandbox_id, request.step_id, "exec", body, run, ExecResult, edge_findings)

    async def start(self, sandbox_id: str, request: ExecRequest) -> CommandInfo:
        """A background command: logged when it starts (its output is read through /commands)."""
        body = request.model_dump(mode="json", exclude={"step_id"})
        run = functools.partial(self._sandboxes.call, sandbox_id, lambda edge: edge.start_command(sandbox_id, request))
        return await self._logged(sandbox_id, request.step_id, "start", body, run, CommandInfo)

    def _content(self, data: bytes) -> dict[str, Any]:
        """How uploaded bytes are logged: whole (so a replay can send them again) up to the logged-file limit,
        else by size and digest."""
        if len(data) <= self._max_logged_file_bytes:
            return {"size": len(data), "data_b64": base64.b64encode(data).decode()}
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    async def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int, step_id: str | None) -> FileInfo:
        request: dict[str, Any] = {"path": path, "mode": mode, **self._content(data)}
        run = functools.partial(
            self._sandboxes.call, sandbox_id, lambda edge: edge.write_file(sandbox_id, path, data, mode)
        )
        return await self._logged(sandbox_id, step_id, "write_file", request, run, FileInfo)

    async def mkdir(self, sandbox_id: str, body: MkdirRequest, step_id: str | None) -> FileInfo:
        run = functools.partial(
            self._sandboxes.call, sandbox_id, lambda edge: edge.mkdir(sandbox_id, body.path, body.parents, body.mode)
        )
        return await self._logged(sandbox_id, step_id, "mkdir", body.model_dump(mode="json"), run, FileInfo)

    async def remove(self, sandbox_id: str, path: str, recursive: bool, step_id: str | None) -> RemoveResult:
        async def run() -> RemoveResult:
            await self._sandboxes.call(sandbox_id, lambda edge: edge.remove(sandbox_id, path, recursive))
            return RemoveResult(path=path)

        request = {"path": path, "recursive": recursive}
        return await self._logged(sandbox_id, step_id, "remove", request, run, RemoveResult)

    async def rename(self, sandbox_id: str, body: RenameRequest, step_id: str | None) -> FileInfo:
        run = functools.partial(
            self._sandboxes.call, sandbox_id, lambda edge: edge.rename(sandbox_id, body.source, body.dest)
        )
        return await self._logged(sandbox_id, step_id, "rename", body.model_dump(mode="json"), run, FileInfo)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, step_id: str | None) -> UploadResult:
        async def run() -> UploadResult:
            members = await self._sandboxes.call(sandbox_id, lambda edge: edge.upload_tar(sandbox_id, path, data))
            return UploadResult(members=members)

        request = {"path": path, **self._content(data)}
        return await self._logged(sandbox_id, step_id, "upload_tar", request, run, UploadResult)

    async def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Streamed output, logged like exec once the command ends (the whole output, capped)."""
        body = request.model_dump(mode="json", exclude={"step_id"})
        step = await self._begin(sandbox_id, request.step_id, "exec_stream", body) if request.step_id else None
        if isinstance(step, Replay):
            result = ExecResult.model_validate({**self._replayed(step.step), "replayed": True})
            for stream in ("stdout", "stderr"):
                text = getattr(result, stream)
                if text:
                    yield ExecEvent(type=stream, data=text)
            yield ExecEvent(type="exit", command_id=result.command_id, result=result)
            return
        output: dict[str, list[str]] = {"stdout": [], "stderr": []}
        outcome: dict[str, Any] | None = None
        try:
            since = await self._sandboxes.call(sandbox_id, lambda edge: edge.fs_clock(sandbox_id)) if step else None
            async for event in self._sandboxes.stream(sandbox_id, lambda edge: edge.exec_stream(sandbox_id, request)):
                if event.type == "exit" and event.result is not None:
                    joined = {name: "".join(parts) for name, parts in output.items()}
                    outcome = event.result.model_copy(update=joined).model_dump(mode="json")
                    files = None
                    if step is not None and since is not None:
                        files = await self._sandboxes.call(sandbox_id, lambda e: e.changed_paths(sandbox_id, since))
                    await self._db.run(self._record, sandbox_id, step, "exec_stream", body, outcome, files)
                    await self._audit(sandbox_id, _command_text(body), event.result)
                elif event.type in output:
                    output[event.type].append(event.data or "")
                yield event
        except (NotFound, SandboxGone):
            if step is not None and outcome is None:
                gone = {"code": "sandbox_gone", "message": "the sandbox ended during the command"}
                self._db.submit(self._log.fail, step, gone)
                outcome = {}
            raise
        except CorralError as exc:
            if outcome is None:
                self._db.submit(self._record, sandbox_id, step, "exec_stream", body, _error(exc), None)
                outcome = {}
            raise
        finally:
            if outcome is None:  # the client went away mid-stream; the edge killed the command
                error = {"error": {"code": "conflict", "message": "the client went away; the command was killed"}}
                self._db.submit(self._record, sandbox_id, step, "exec_stream", body, error, None)

    def _record(
        self,
        sandbox_id: str,
        step: Step | None,
        kind: str,
        request: dict[str, Any],
        result: dict[str, Any],
        files: list[str] | None,
    ) -> None:
        """On the database thread (``_append_all`` for a step without a client id)."""
        if step is None:
            self._append_all([(sandbox_id, kind, request, result)])
        elif "error" in result:
            self._log.fail(step, result["error"])
        else:
            self._log.finish(step, result, files=files)

    # -- reading the log ------------------------------------------------

    async def steps(self, sandbox_id: str, *, after_seq: int, limit: int | None) -> list[TrajectoryStep]:
        await self._sandboxes.get(sandbox_id)
        self.flush()
        found = await self._db.run(self._log.steps, sandbox_id, after_seq=after_seq, limit=limit)
        return [_to_model(step) for step in found]

    async def export_jsonl(self, sandbox_id: str) -> Iterator[str]:
        """The lines, read as they are sent (a StreamingResponse iterates a plain iterator on a worker thread),
        after the steps queued so far are written."""
        await self._sandboxes.get(sandbox_id)
        self.flush()
        await self._db.run(lambda: None)
        return self._log.export_jsonl(sandbox_id)

    async def provenance(self, sandbox_id: str, path: str) -> list[TrajectoryStep]:
        await self._sandboxes.get(sandbox_id)
        self.flush()
        return [_to_model(step) for step in await self._db.run(self._log.provenance, sandbox_id, path)]

    # -- replay ---------------------------------------------------------

    async def replay(self, sandbox_id: str, request: ReplayRequest) -> ReplayResult:
        """Re-run a sandbox's logged steps, in order, in a fresh sandbox from the same layers and settings."""
        self.flush()
        original = await self._sandboxes.record(sandbox_id)
        steps = _effective_steps(await self._db.run(self._log.steps, sandbox_id))
        fresh = await self._sandboxes.create(
            original.to_request(labels={**request.labels, "corral.replay_of": sandbox_id}, ttl_s=request.ttl_s)
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
            sandbox=await self._sandboxes.get(fresh.id),
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
        operation = self._file_operation(sandbox_id, step)
        if operation is None:
            return None
        try:
            await operation()
        except CorralError as exc:  # it worked then (failed steps are not replayed): a difference to report
            return [ReplayMismatch(seq=step.seq, step_id=step.step_id, field="error", logged=None,
                                   replayed=_error(exc)["error"])]  # fmt: skip
        return []

    def _file_operation(self, sandbox_id: str, step: Step) -> Callable[[], Awaitable[object]] | None:
        """A logged file step as the edge call that does it again; None for what cannot be redone: background
        starts (their output went on after the log entry), uploads too large to have been logged whole."""
        request, call = step.request, self._sandboxes.call
        if step.kind in ("write_file", "upload_tar") and "data_b64" not in request:
            return None
        data = base64.b64decode(request.get("data_b64", ""))
        if step.kind == "write_file":
            return lambda: call(sandbox_id, lambda e: e.write_file(sandbox_id, request["path"], data, request["mode"]))
        if step.kind == "upload_tar":
            return lambda: call(sandbox_id, lambda e: e.upload_tar(sandbox_id, request["path"], data))
        if step.kind == "mkdir":
            body = MkdirRequest.model_validate(request)
            return lambda: call(sandbox_id, lambda e: e.mkdir(sandbox_id, body.path, body.parents, body.mode))
        if step.kind == "remove":
            return lambda: call(sandbox_id, lambda e: e.remove(sandbox_id, request["path"], request["recursive"]))
        if step.kind == "rename":
            return lambda: call(sandbox_id, lambda e: e.rename(sandbox_id, request["source"], request["dest"]))
        return None
