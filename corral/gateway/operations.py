"""Every request that changes a sandbox passes through here on its way to the edge: one place where it is
logged in the sandbox's trajectory, answered from the log when it is resent, and audited.

That is commands (exec, streamed exec, background starts and their stdin, signals and window size), file
changes (write, mkdir, remove, rename, tar upload), checkpoints and restores, and the sandbox's life (kill,
shutdown, pause, resume, TTL, network policy, snapshot, fork, bulk actions), from the HTTP API and from the
E2B facade alike. With a client step id (``step_id``), a step sent again (a trainer restarted after
preemption) is answered from the log instead of running twice, a different request under the same id is
refused as a divergence, and for a step that can change files the paths it changed are recorded
(provenance). Without one, the step gets an ``auto-`` id and is written within a few milliseconds after its
answer, in one transaction with the others of that moment (off the request path; a crash in that window can
lose it): logged, exported, replayable, but never matched against a resend.

Who may ask is decided before: a job token reaches only its job's sandboxes (the ``Auth`` dependency of every
route with a sandbox in its path, gateway/routes/deps.py; ``check_labels`` for creates and bulk actions).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlalchemy.exc import DBAPIError

from corral import tracing
from corral.api.errors import CorralError, InvalidRequest, NotFound, SandboxGone, error_from_response
from corral.api.models import (
    BulkRequest,
    BulkResult,
    CheckpointInfo,
    CommandInfo,
    ExecEvent,
    ExecRequest,
    ExecResult,
    FileInfo,
    ForkRequest,
    MkdirRequest,
    NetworkPolicy,
    NetworkStatus,
    PauseResult,
    RemoveResult,
    RenameRequest,
    SandboxInfo,
    SnapshotInfo,
    UploadResult,
)
from corral.edge.protocol import AuditedExec, edge_of
from corral.gateway.images import ImageService
from corral.gateway.service import SandboxService
from corral.guard.audit import detect_in_command
from corral.state.thread import DatabaseThread
from corral.trajectory import LOG_CAP_KEY, Replay, Step, TrajectoryLog

__all__ = ["AUTO_PREFIX", "Forked", "Operations", "replayed_result"]

log = logging.getLogger(__name__)

AUTO_PREFIX = "auto-"
# Steps without a client id wait this long to be written together: one transaction per flush is most of
# their cost (flushed every 5 ms, a sequential loop of execs spent 12-20% of the server's time, two cProfile runs,
# writing batches of one or two).
_FLUSH_DELAY_S = 0.05
_FLUSH_AT = 500  # pending steps that are written at once, without waiting (one append_many chunk)
M = TypeVar("M", bound=BaseModel)

Findings = list[tuple[str, str, dict[str, Any]]]  # (kind, severity, detail), as edges report them


@dataclass
class _EdgeReport:
    """What an operation's edge call brought back beside its result (``Operations._perform``): the audit's
    findings, and for a step with a client's id the files it changed (the edge took the clock and looked them
    up in the same call)."""

    findings: Findings = field(default_factory=list)
    files: list[str] | None = None


_Pending = tuple[str, str, str, dict[str, Any], dict[str, Any]]  # sandbox id, step id, kind, request, result
T = TypeVar("T")
# A queued write of the log: the call, the same in two halves or None, its writer's future (None: nobody waits).
_Queued = tuple[Callable[[], Any], Callable[[], Callable[[], Any]] | None, "asyncio.Future[Any] | None"]
_Outcome = tuple[Any, BaseException | None]
_THREAD_ROUNDS = 8  # transactions of step writes the database thread makes before other calls queued there run


class _StepWrites:
    """The trajectory log's writes of concurrent steps, committed together: the writes asked for in one turn of
    the event loop join one transaction (``TrajectoryLog.together``), in the order asked, as the state store's
    group commit does for creates (gateway/service.py). On SQLite (no database thread) the turn's writes are
    committed by a callback right after it; on PostgreSQL by a task on the database thread, and those asked for
    while it runs join the next transaction (one commit, and one WAL flush, for all of them). Each caller still
    awaits its own write's result before it goes on; a write's own error reaches only its caller. A database
    error rolls the shared transaction back, and each write is made again in one of its own, so that error too
    reaches the writes it belongs to. On PostgreSQL the thread takes what was asked for during a transaction
    itself, as it ends (up to ``_THREAD_ROUNDS`` transactions a turn on the thread): handing each round back to the
    event loop first left the thread idle ~40% of the time while the writes waited (16 sandboxes stepping)."""

    def __init__(self, log: TrajectoryLog, db: DatabaseThread) -> None:
        self._log = log
        self._db = db
        self._queued: list[_Queued] = []
        self._queue_lock = threading.Lock()  # PostgreSQL: the loop adds, the database thread takes
        self._flush_handle: asyncio.Handle | None = None  # SQLite: the callback that commits this turn's writes
        self._flushing: asyncio.Task[None] | None = None  # PostgreSQL: the task committing on the thread

    async def write(self, call: Callable[[], T], sent: Callable[[], Callable[[], T]] | None = None) -> T:
        """``call``'s value once its transaction is committed; ``sent``: the same write in two halves (it sends
        its statement and returns what reads the answer), for the pipeline on PostgreSQL."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._queue_lock:
            self._queued.append((call, sent, future))
        self._schedule()
        return await future

    @property
    def busy(self) -> bool:
        """Writes are queued or being committed: a write now must join them to keep its place after them."""
        return bool(self._queued) or self._flushing is not None

    def later(self, call: Callable[[], object]) -> None:
        """A write nobody waits for (steps without a client id), in its place among the others; its failure is
        logged."""
        with self._queue_lock:
            self._queued.append((call, None, None))
        self._schedule()

    def _schedule(self) -> None:
        if self._db.inline:
            if self._flush_handle is None:  # after the callbacks ready now: the writes of this turn join the first
                self._flush_handle = asyncio.get_running_loop().call_soon(self._flush)
        elif self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._flush_on_thread())

    def _flush(self) -> None:
        self._flush_handle = None
        queued, self._queued = self._queued, []
        _settle(queued, self._commit(queued))

    async def _flush_on_thread(self) -> None:
        try:
            await asyncio.sleep(0)  # the writes of this event-loop turn join the first transaction
            while self._queued:
                await self._db.run(self._commit_rounds, asyncio.get_running_loop())
        except Exception as exc:  # noqa: BLE001 - the thread could not run them: every writer learns it
            with self._queue_lock:
                queued, self._queued = self._queued, []
            _settle(queued, [(None, exc)] * len(queued))
        finally:
            self._flushing = None

    def _commit_rounds(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the database thread: what is queued in one transaction, then what was queued meanwhile in the next,
        each round's outcomes handed to the loop as soon as it is committed."""
        for _ in range(_THREAD_ROUNDS):
            with self._queue_lock:
                queued, self._queued = self._queued, []
            if not queued:
                return
            loop.call_soon_threadsafe(_settle, queued, self._commit(queued))

    def _commit(self, writes: list[_Queued]) -> list[_Outcome]:
        """Each write's value or error, the writes made in one transaction (on the database's thread, if any)."""
        try:
            try:
                with self._log.together():
                    if self._log.pipelines:
                        return self._pipelined(writes)
                    return [_outcome(call, database_errors=False) for call, _, _ in writes]
            except DBAPIError:  # rolled back: each again on its own, and its error to its own caller
                return [_outcome(call, database_errors=True) for call, _, _ in writes]
        except Exception as exc:  # noqa: BLE001 - no write's own: every writer learns it, none waits forever
            return [(None, exc)] * len(writes)

    def _pipelined(self, writes: list[_Queued]) -> list[_Outcome]:
        """The writes in their order, each run of those that come in two halves (a step's begin and result) sent
        in one pipeline and answered after it: on PostgreSQL one round trip for them all where each waited for its
        own (16 sandboxes stepping at once, docs/spec.md). A database error leaves the pipeline and the block."""
        outcomes: list[_Outcome] = []
        index = 0
        while index < len(writes):
            call, sent, _ = writes[index]
            if sent is None:
                outcomes.append(_outcome(call, database_errors=False))
                index += 1
                continue
            answers: list[Callable[[], Any] | BaseException] = []
            with self._log.pipeline():
                while index < len(writes) and (sent := writes[index][1]) is not None:
                    answers.append(_send(sent))
                    index += 1
            outcomes += [(None, answer) if isinstance(answer, BaseException) else
                         _outcome(answer, database_errors=False) for answer in answers]  # fmt: skip
        return outcomes


def _settle(queued: list[_Queued], outcomes: list[_Outcome]) -> None:
    """Hand each queued write its outcome: its writer's future, or the log for a write nobody waits for."""
    for (_, _, future), (value, error) in zip(queued, outcomes, strict=True):
        if future is None:
            if error is not None:
                log.error("a trajectory write failed", exc_info=error)
        elif not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)


def _send(sent: Callable[[], Callable[[], Any]]) -> Callable[[], Any] | BaseException:
    """A two-half write's first half: what reads its answer, or the error it raised before sending (its own; a
    database error is raised)."""
    try:
        return sent()
    except DBAPIError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the caller that asked for this write
        return exc


def _outcome(call: Callable[[], Any], *, database_errors: bool) -> _Outcome:
    """``call``'s value or the error it raised; a database error is raised unless ``database_errors``."""
    try:
        return call(), None
    except DBAPIError as exc:
        if not database_errors:
            raise
        return None, exc
    except Exception as exc:  # noqa: BLE001 - handed to the caller that asked for this write
        return None, exc


class Forked(BaseModel):
    """A fork's children, as its log entry holds them (a step's result is an object)."""

    sandboxes: list[SandboxInfo]


class Done(BaseModel):
    """The result of a step that answers nothing (stdin, a signal, a window size): logged as ``{}``."""


def _command_text(request: dict[str, Any]) -> str | None:
    cmd = request.get("cmd")
    if cmd is None:
        return None
    return cmd if isinstance(cmd, str) else " ".join(cmd)


def _auto_id() -> str:
    return f"{AUTO_PREFIX}{uuid.uuid4().hex[:16]}"


def replayed_result(step: Step) -> dict[str, Any]:
    """A logged step's result as it was answered; its error raised again."""
    result = dict(step.result or {})
    if "error" in result:
        raise error_from_response(0, {"error": result["error"]})
    result.pop(LOG_CAP_KEY, None)
    return result


class Operations:
    def __init__(
        self,
        log: TrajectoryLog,
        sandboxes: SandboxService,
        images: ImageService,
        *,
        max_logged_file_bytes: int,
    ) -> None:
        self._log = log
        self._sandboxes = sandboxes
        self._images = images
        self._db = sandboxes.database  # the log is written and read on the state's thread, in order
        self._steps = _StepWrites(log, self._db)  # concurrent steps' writes committed together
        self._open_steps = 0  # steps with a client's id between their begin and their result (``_perform``)
        self._max_logged_file_bytes = max_logged_file_bytes
        # Steps without a client id are written just after their answer leaves (within _FLUSH_DELAY_S),
        # off the request path: there is no resend to match, so they need not be durable before it.
        self._pending: list[_Pending] = []
        self._flush_handle: asyncio.Handle | None = None

    # -- the log's order ------------------------------------------------

    def _append_auto(self, sandbox_id: str, kind: str, request: dict[str, Any], result: dict[str, Any]) -> None:
        self._pending.append((sandbox_id, _auto_id(), kind, request, result))
        if len(self._pending) >= _FLUSH_AT:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._flush_handle = asyncio.get_running_loop().call_soon(self.flush)  # after this answer, not before
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(_FLUSH_DELAY_S, self.flush)

    def flush(self, *, join: bool = False) -> None:
        """Write the pending steps, in the order they finished, in one transaction (queued on the database
        thread: whatever is asked of it later sees them). ``join``: with the step writes of this moment instead,
        in their transaction."""
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        pending, self._pending = self._pending, []
        if not pending:
            return
        if join:
            self._steps.later(functools.partial(self._log.append_many, pending))
        else:
            self._db.submit(self._log.append_many, pending)

    async def settled(self) -> None:
        """Every step answered so far is in the log: the pending ones queued, and the step writes being
        committed together done (what a read of the log waits for)."""
        self.flush()
        if self._steps.busy:
            await self._steps.write(lambda: None)  # settles after every write queued before it

    def _together(self) -> bool:
        """Whether a step's write joins the others of this moment (another step open, or writes queued or being
        committed): one step at a time writes at once, as waiting a turn for nobody costs it ~0.1 ms a write."""
        return self._open_steps > 1 or self._steps.busy

    async def _write(
        self,
        call: Callable[..., T],
        *args: Any,  # noqa: ANN401 - call's own
        sent: Callable[..., Callable[[], T]] | None = None,
        **kwargs: Any,  # noqa: ANN401 - call's own
    ) -> T:
        """A write of the log that the caller awaits: with the other steps' of this moment. ``sent``: the same write
        in two halves (``TrajectoryLog.begin_sent`` for ``begin``, ...), taking the same arguments."""
        if not self._together():
            return await self._db.run(call, *args, **kwargs)
        halves = functools.partial(sent, *args, **kwargs) if sent is not None else None
        return await self._steps.write(functools.partial(call, *args, **kwargs), halves)

    async def _begin(self, sandbox_id: str, step_id: str, kind: str, request: dict[str, Any]) -> Step | Replay:
        if step_id.startswith(AUTO_PREFIX):
            raise InvalidRequest(f"step ids starting with {AUTO_PREFIX!r} are Corral's own: choose another")
        await self._sandboxes.check_exists(sandbox_id)  # unknown sandboxes get no log entries
        # Earlier steps first: the log's order is the order steps finished or began.
        self.flush(join=self._together())  # in the begin's own transaction when it joins others
        return await self._write(self._log.begin, sandbox_id, step_id, kind, request, sent=self._log.begin_sent)

    # -- audit ------------------------------------------------------------

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

    # -- the one path -----------------------------------------------------

    async def _perform(
        self,
        sandbox_id: str,
        step_id: str | None,
        kind: str,
        request: dict[str, Any],
        operation: Callable[[], Awaitable[M]],
        model: type[M],
        *,
        changes_files: bool = True,
        edge_report: _EdgeReport | None = None,
    ) -> M:
        """Run an operation with its log entry: replayed, refused or recorded per the step id rules, then
        audited. ``changes_files``: it can change the sandbox's files, so with a step id the paths it changed
        are recorded, and the edge is asked what it saw change (protected paths); a step of the sandbox's life
        (pause, TTL, kill) is logged and nothing more. ``edge_report``: filled by ``operation`` with what its
        edge call brought back beside the result (the audit's findings; with a step id, the files changed)."""
        if step_id is None:  # logged after it ran, in one write: nothing to match a resend against
            edge_findings = edge_report.findings if edge_report is not None else None
            try:
                result = await operation()
            except (NotFound, SandboxGone):
                raise  # no such sandbox (any more): nothing to log against
            except CorralError as exc:
                self._append_auto(sandbox_id, kind, request, exc.to_body())
                raise
            self._append_auto(sandbox_id, kind, request, result.model_dump(mode="json"))
            if changes_files:
                await self._audit(sandbox_id, _command_text(request),
                                  result if isinstance(result, ExecResult) else None, edge_findings)  # fmt: skip
            return result
        self._open_steps += 1
        try:
            return await self._perform_step(sandbox_id, step_id, kind, request, operation, model,
                                            changes_files=changes_files, edge_report=edge_report)  # fmt: skip
        finally:
            self._open_steps -= 1

    async def _perform_step(
        self,
        sandbox_id: str,
        step_id: str,
        kind: str,
        request: dict[str, Any],
        operation: Callable[[], Awaitable[M]],
        model: type[M],
        *,
        changes_files: bool,
        edge_report: _EdgeReport | None,
    ) -> M:
        """``_perform`` of a step with a client's id: begun in the log before it runs, its result after."""
        edge_findings = edge_report.findings if edge_report is not None else None
        step = await self._begin(sandbox_id, step_id, kind, request)
        if isinstance(step, Replay):
            replayed = replayed_result(step.step)
            return model.model_validate(
                {**replayed, "replayed": True} if "replayed" in model.model_fields else replayed
            )
        try:  # with an edge report, the operation's own call takes the clock and looks the files up
            since = (
                await self._sandboxes.call(sandbox_id, lambda edge: edge.fs_clock(sandbox_id))
                if changes_files and edge_report is None
                else 0
            )
            result = await operation()
            files = None
            if changes_files:
                files = (
                    edge_report.files
                    if edge_report is not None
                    else await self._sandboxes.call(sandbox_id, lambda edge: edge.changed_paths(sandbox_id, since))
                )
        except CorralError as exc:
            await self._write(self._log.fail, step, exc.to_body()["error"], sent=self._log.fail_sent)
            raise
        await self._write(self._log.finish, step, result.model_dump(mode="json"), files=files,
                          sent=self._log.finish_sent)  # before the answer  # fmt: skip
        if changes_files:
            await self._audit(sandbox_id, _command_text(request), result if isinstance(result, ExecResult) else None,
                              edge_findings)  # fmt: skip
        return result

    # -- commands -------------------------------------------------------

    async def exec(self, sandbox_id: str, request: ExecRequest) -> ExecResult:
        body = request.model_dump(mode="json", exclude={"step_id"})
        step_files = request.step_id is not None
        report = _EdgeReport()

        async def run() -> ExecResult:  # the findings (and a step's files) come with the result: one call
            audited = await self._sandboxes.call(
                sandbox_id, lambda edge: edge.exec_audited(sandbox_id, request, step_files=step_files)
            )
            report.findings.extend(audited.findings)
            report.files = audited.files
            return audited.result

        with tracing.span("corral.sandbox.exec", sandbox_id=sandbox_id, edge_id=edge_of(sandbox_id)) as span:
            if tracing.enabled():  # a read of the record, paid only while tracing
                span.set("backend", (await self._sandboxes.record(sandbox_id)).backend)
            return await self._perform(sandbox_id, request.step_id, "exec", body, run, ExecResult, edge_report=report)

    async def start(self, sandbox_id: str, request: ExecRequest) -> CommandInfo:
        """A background command: logged when it starts (its output is read through /commands)."""
        body = request.model_dump(mode="json", exclude={"step_id"})
        run = functools.partial(self._sandboxes.call, sandbox_id, lambda edge: edge.start_command(sandbox_id, request))
        return await self._perform(sandbox_id, request.step_id, "start", body, run, CommandInfo)

    async def stdin(self, sandbox_id: str, command_id: str, data: bytes, step_id: str | None = None) -> None:
        """Bytes to a background command's stdin; empty closes it."""

        async def run() -> Done:
            await self._sandboxes.call(sandbox_id, lambda edge: edge.command_stdin(sandbox_id, command_id, data))
            return Done()

        request = {"command_id": command_id, **self._content(data)}
        await self._perform(sandbox_id, step_id, "stdin", request, run, Done, changes_files=False)

    async def signal(self, sandbox_id: str, command_id: str, signo: int, step_id: str | None = None) -> None:
        async def run() -> Done:
            await self._sandboxes.call(sandbox_id, lambda edge: edge.command_signal(sandbox_id, command_id, signo))
            return Done()

        request = {"command_id": command_id, "signal": signo}
        await self._perform(sandbox_id, step_id, "signal", request, run, Done, changes_files=False)

    async def resize(self, sandbox_id: str, command_id: str, rows: int, cols: int, step_id: str | None = None) -> None:
        async def run() -> Done:
            await self._sandboxes.call(sandbox_id, lambda edge: edge.command_resize(sandbox_id, command_id, rows, cols))
            return Done()

        request = {"command_id": command_id, "rows": rows, "cols": cols}
        await self._perform(sandbox_id, step_id, "resize", request, run, Done, changes_files=False)

    async def exec_stream(self, sandbox_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        """Streamed output, logged like exec once the command ends (the whole output, capped)."""
        body = request.model_dump(mode="json", exclude={"step_id"})
        step = await self._begin(sandbox_id, request.step_id, "exec_stream", body) if request.step_id else None
        if isinstance(step, Replay):
            result = ExecResult.model_validate({**replayed_result(step.step), "replayed": True})
            for stream in ("stdout", "stderr"):
                text = getattr(result, stream)
                if text:
                    yield ExecEvent(type=stream, data=text)
            yield ExecEvent(type="exit", command_id=result.command_id, result=result)
            return
        output: dict[str, list[str]] = {"stdout": [], "stderr": []}
        outcome: dict[str, Any] | None = None
        events = self._sandboxes.stream(  # the clock, the files and the findings come with it: one call
            sandbox_id, lambda edge: edge.exec_stream_audited(sandbox_id, request, step_files=step is not None)
        )
        try:
            async for item in events:
                if isinstance(item, AuditedExec):  # the command's exit
                    joined = {name: "".join(parts) for name, parts in output.items()}
                    outcome = item.result.model_copy(update=joined).model_dump(mode="json")
                    if step is None:  # with the other steps of the moment, after the exit has gone out
                        self._append_auto(sandbox_id, "exec_stream", body, outcome)
                    else:  # durable before the exit is sent: a resend is answered from it
                        await self._write(self._record, step, outcome, item.files, sent=self._record_sent)
                    await self._audit(sandbox_id, _command_text(body), item.result, item.findings)
                    yield ExecEvent(type="exit", command_id=item.result.command_id, result=item.result)
                    continue
                if item.type in output:
                    output[item.type].append(item.data or "")
                yield item
        except (NotFound, SandboxGone):
            if step is not None and outcome is None:
                gone = {"code": "sandbox_gone", "message": "the sandbox ended during the command"}
                self._db.submit(self._log.fail, step, gone)
                outcome = {}
            raise
        except CorralError as exc:
            if outcome is None:
                self._stream_failed(sandbox_id, step, body, exc.to_body())
                outcome = {}
            raise
        finally:
            if outcome is None:  # the client went away mid-stream; the edge killed the command
                error = {"error": {"code": "conflict", "message": "the client went away; the command was killed"}}
                self._stream_failed(sandbox_id, step, body, error)

    def _stream_failed(self, sandbox_id: str, step: Step | None, body: dict[str, Any], error: dict[str, Any]) -> None:
        if step is None:
            self._append_auto(sandbox_id, "exec_stream", body, error)
        else:
            self._db.submit(self._record, step, error, None)

    def _record(self, step: Step, result: dict[str, Any], files: list[str] | None) -> Step:
        """A streamed command's step with a client id, once it ended (on the database thread)."""
        if "error" in result:
            return self._log.fail(step, result["error"])
        return self._log.finish(step, result, files=files)

    def _record_sent(self, step: Step, result: dict[str, Any], files: list[str] | None) -> Callable[[], Step]:
        """``_record`` in two halves (``TrajectoryLog.finish_sent``)."""
        if "error" in result:
            return self._log.fail_sent(step, result["error"])
        return self._log.finish_sent(step, result, files=files)

    # -- files ------------------------------------------------------------

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
        return await self._perform(sandbox_id, step_id, "write_file", request, run, FileInfo)

    async def mkdir(self, sandbox_id: str, body: MkdirRequest, step_id: str | None) -> FileInfo:
        run = functools.partial(
            self._sandboxes.call, sandbox_id, lambda edge: edge.mkdir(sandbox_id, body.path, body.parents, body.mode)
        )
        return await self._perform(sandbox_id, step_id, "mkdir", body.model_dump(mode="json"), run, FileInfo)

    async def remove(self, sandbox_id: str, path: str, recursive: bool, step_id: str | None) -> RemoveResult:
        async def run() -> RemoveResult:
            await self._sandboxes.call(sandbox_id, lambda edge: edge.remove(sandbox_id, path, recursive))
            return RemoveResult(path=path)

        request = {"path": path, "recursive": recursive}
        return await self._perform(sandbox_id, step_id, "remove", request, run, RemoveResult)

    async def rename(self, sandbox_id: str, body: RenameRequest, step_id: str | None) -> FileInfo:
        run = functools.partial(
            self._sandboxes.call, sandbox_id, lambda edge: edge.rename(sandbox_id, body.source, body.dest)
        )
        return await self._perform(sandbox_id, step_id, "rename", body.model_dump(mode="json"), run, FileInfo)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes, step_id: str | None) -> UploadResult:
        async def run() -> UploadResult:
            members = await self._sandboxes.call(sandbox_id, lambda edge: edge.upload_tar(sandbox_id, path, data))
            return UploadResult(members=members)

        request = {"path": path, **self._content(data)}
        return await self._perform(sandbox_id, step_id, "upload_tar", request, run, UploadResult)

    # -- checkpoints ------------------------------------------------------

    async def checkpoint(self, sandbox_id: str) -> CheckpointInfo:
        """A VM checkpoint, marked in the log (before the answer): a later restore rewinds the log's meaning to
        this point."""
        self.flush()
        info = await self._sandboxes.save_checkpoint(sandbox_id)
        await self._db.run(self._log.append, sandbox_id, _auto_id(), "checkpoint", {}, {"checkpoint": info.id})
        return info

    async def restore(self, sandbox_id: str, checkpoint_id: str) -> SandboxInfo:
        """Rewind to a checkpoint; the log records it (before the answer), so replay skips what the rewind
        undid."""
        self.flush()
        info = await self._sandboxes.restore_checkpoint(sandbox_id, checkpoint_id)
        await self._db.run(self._log.append, sandbox_id, _auto_id(), "restore", {"checkpoint": checkpoint_id},
                           {"state": info.state.value})  # fmt: skip
        return info

    # -- the sandbox's life -----------------------------------------------

    async def kill(self, sandbox_id: str, step_id: str | None = None) -> SandboxInfo:
        run = functools.partial(self._sandboxes.kill, sandbox_id)
        return await self._perform(sandbox_id, step_id, "kill", {}, run, SandboxInfo, changes_files=False)

    async def shutdown(self, sandbox_id: str, timeout_s: float, step_id: str | None = None) -> SandboxInfo:
        run = functools.partial(self._sandboxes.shutdown, sandbox_id, timeout_s)
        request = {"timeout_s": timeout_s}
        return await self._perform(sandbox_id, step_id, "shutdown", request, run, SandboxInfo, changes_files=False)

    async def pause(self, sandbox_id: str, wait_reclaim: bool = False, step_id: str | None = None) -> PauseResult:
        run = functools.partial(self._sandboxes.pause, sandbox_id, wait_reclaim)
        request = {"wait_reclaim": wait_reclaim}
        return await self._perform(sandbox_id, step_id, "pause", request, run, PauseResult, changes_files=False)

    async def resume(self, sandbox_id: str, step_id: str | None = None) -> SandboxInfo:
        run = functools.partial(self._sandboxes.resume, sandbox_id)
        return await self._perform(sandbox_id, step_id, "resume", {}, run, SandboxInfo, changes_files=False)

    async def set_ttl(self, sandbox_id: str, ttl_s: float | None, step_id: str | None = None) -> SandboxInfo:
        run = functools.partial(self._sandboxes.set_ttl, sandbox_id, ttl_s)
        request = {"ttl_s": ttl_s}
        return await self._perform(sandbox_id, step_id, "set_ttl", request, run, SandboxInfo, changes_files=False)

    async def set_network(self, sandbox_id: str, policy: NetworkPolicy, step_id: str | None = None) -> NetworkStatus:
        """A new egress policy while it runs; replayed, so later steps of a replay see the same network."""
        run = functools.partial(self._sandboxes.set_network, sandbox_id, policy)
        request = policy.model_dump(mode="json")
        return await self._perform(sandbox_id, step_id, "set_network", request, run, NetworkStatus, changes_files=False)

    async def snapshot(self, sandbox_id: str, name: str | None, step_id: str | None = None) -> SnapshotInfo:
        run = functools.partial(self._images.snapshot, sandbox_id, name)
        request = {"name": name}
        return await self._perform(sandbox_id, step_id, "snapshot", request, run, SnapshotInfo, changes_files=False)

    async def fork(self, sandbox_id: str, request: ForkRequest, step_id: str | None = None) -> list[SandboxInfo]:
        """New sandboxes from this one; with a step id, a resend answers the same children instead of making more."""

        async def run() -> Forked:
            return Forked(sandboxes=await self._images.fork(sandbox_id, request))

        body = request.model_dump(mode="json")
        forked = await self._perform(sandbox_id, step_id, "fork", body, run, Forked, changes_files=False)
        return forked.sandboxes

    async def bulk(self, request: BulkRequest) -> BulkResult:
        """One action on every live sandbox whose labels match, each logged as its own step; failures are
        reported per sandbox."""
        if not request.labels:
            raise InvalidRequest("a bulk action needs a label selector (e.g. {'job': 'j1'}): refusing to act on all")
        if request.action == "set_ttl" and request.ttl_s is None and not request.clear_ttl:
            raise InvalidRequest("set_ttl needs ttl_s (or clear_ttl=true)")
        targets = [info.id for info in await self._sandboxes.list(states=None, labels=request.labels)]
        actions: dict[str, Callable[[str], Awaitable[object]]] = {
            "pause": self.pause,
            "resume": self.resume,
            "kill": self.kill,
            "set_ttl": lambda sandbox_id: self.set_ttl(sandbox_id, request.ttl_s),
        }
        results = await asyncio.gather(*(actions[request.action](t) for t in targets), return_exceptions=True)
        failed = {t: str(r) for t, r in zip(targets, results, strict=True) if isinstance(r, BaseException)}
        return BulkResult(matched=len(targets), done=[t for t in targets if t not in failed], failed=failed)
