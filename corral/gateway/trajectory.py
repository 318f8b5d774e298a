"""A sandbox's trajectory log as clients read it (steps, the JSONL export, provenance) and replay: its logged
steps run again in a fresh sandbox. What goes into the log is gateway/operations.py's work."""

from __future__ import annotations

import base64
from collections.abc import Awaitable, Callable, Iterator

from corral.api.errors import CorralError
from corral.api.models import (
    ExecRequest,
    MkdirRequest,
    NetworkPolicy,
    ReplayMismatch,
    ReplayRequest,
    ReplayResult,
    TrajectoryStep,
)
from corral.gateway.operations import replayed_result
from corral.gateway.service import SandboxService
from corral.trajectory import Step, TrajectoryLog

__all__ = ["Trajectories"]

_REPLAY_COMPARED = ("exit_code", "stdout", "stderr")
# Steps of the sandbox's life, not of what is in it: a replay has no use for them (its sandbox is its own).
_LIFE_KINDS = frozenset({"pause", "resume", "set_ttl", "snapshot", "fork", "kill", "shutdown"})


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
        if step.state != "done" or "error" in (step.result or {}) or step.kind in _LIFE_KINDS:
            continue
        if step.kind == "checkpoint":
            marks[str((step.result or {}).get("checkpoint"))] = tuple(kept)
        elif step.kind == "restore":
            kept = list(marks.get(str(step.request.get("checkpoint")), kept))
        else:
            kept.append(step)
    return kept


class Trajectories:
    def __init__(self, log: TrajectoryLog, sandboxes: SandboxService, settled: Callable[[], Awaitable[None]]) -> None:
        """``settled``: returns once every step answered so far is written or queued on the database thread
        (``Operations.settled``); awaited before each read, which that thread then runs after them."""
        self._log = log
        self._sandboxes = sandboxes
        self.settled = settled
        self._db = sandboxes.database

    def mark_lost(self) -> int:
        """At start: steps that were running when the server died have no known outcome."""
        return self._log.mark_lost()

    # -- reading the log ------------------------------------------------

    async def steps(self, sandbox_id: str, *, after_seq: int, limit: int | None) -> list[TrajectoryStep]:
        await self._sandboxes.check_exists(sandbox_id)
        await self.settled()
        found = await self._db.run(self._log.steps, sandbox_id, after_seq=after_seq, limit=limit)
        return [_to_model(step) for step in found]

    async def export_jsonl(self, sandbox_id: str) -> Iterator[str]:
        """The lines, read as they are sent (a StreamingResponse iterates a plain iterator on a worker thread),
        after the steps queued so far are written."""
        await self._sandboxes.check_exists(sandbox_id)
        await self.settled()
        await self._db.run(lambda: None)
        return self._log.export_jsonl(sandbox_id)

    async def provenance(self, sandbox_id: str, path: str) -> list[TrajectoryStep]:
        await self._sandboxes.check_exists(sandbox_id)
        await self.settled()
        return [_to_model(step) for step in await self._db.run(self._log.provenance, sandbox_id, path)]

    # -- replay ---------------------------------------------------------

    async def replay(self, sandbox_id: str, request: ReplayRequest) -> ReplayResult:
        """Re-run a sandbox's logged steps, in order, in a fresh sandbox from the same layers and settings."""
        await self.settled()
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
            logged = replayed_result(step)
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
                                   replayed=exc.to_body()["error"])]  # fmt: skip
        return []

    def _file_operation(self, sandbox_id: str, step: Step) -> Callable[[], Awaitable[object]] | None:
        """A logged file or network step as the call that does it again; None for what cannot be redone:
        background starts and what was sent to them (their output went on after the log entry), uploads too
        large to have been logged whole."""
        request, call = step.request, self._sandboxes.call
        if step.kind == "set_network":
            policy = NetworkPolicy.model_validate(request)
            return lambda: self._sandboxes.set_network(sandbox_id, policy)
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
