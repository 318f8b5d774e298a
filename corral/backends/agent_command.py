"""A command running through a corral-agent (container or VM guest), as the backend-neutral RunningCommand."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from corral.backends.base import CommandEvent, CommandExit, CommandOutput, CommandSpec, CommandStarted
from corral.backends.common.agent_protocol import (
    AgentConnection,
    AgentExit,
    AgentOutput,
    AgentStarted,
    ExecOrder,
    TreeWalk,
)

__all__ = ["AgentCommand"]


class AgentCommand:
    """``oom_kills``: the sandbox's OOM-kill counter, read before and after, so a command killed by the
    memory limit is told apart from one killed by a signal (None where the host cannot see it, e.g. VMs).
    ``walk_after``: a tree the agent walks once the command exited (the audit's look, without a round trip of its
    own), handed to ``on_walked`` with this command's job id, before its exit event."""

    def __init__(
        self,
        agent: AgentConnection,
        command: CommandSpec,
        oom_kills: Callable[[], int] | None = None,
        *,
        walk_after: TreeWalk | None = None,
        on_walked: Callable[[int, list[str], bool], None] | None = None,
    ) -> None:
        self._agent = agent
        self._command = command
        self._oom_kills = oom_kills
        self._walk_after = walk_after
        self._on_walked = on_walked
        self._job_id = agent.new_job_id()

    async def events(self) -> AsyncIterator[CommandEvent]:
        cmd = self._command
        order = ExecOrder(
            argv=cmd.argv,
            env=cmd.env,
            cwd=cmd.cwd,
            user=cmd.user,
            timeout_ms=max(1, int(cmd.timeout_s * 1000)),
            output_cap_bytes=cmd.output_cap_bytes,
            has_stdin=cmd.stdin is not None,
            terminal=cmd.terminal,
            walk_after=self._walk_after,
            announce_start=cmd.announce_start,
            ipc_after=self._agent.ipc_at_exit,
        )
        ooms_before = self._oom_kills() if self._oom_kills is not None else 0
        async for event in self._agent.run(self._job_id, order, cmd.stdin if cmd.stdin else None):
            if isinstance(event, AgentStarted):
                yield CommandStarted(pid=event.pid)
            elif isinstance(event, AgentOutput):
                yield CommandOutput(event.stream, event.data)
            elif isinstance(event, AgentExit):
                if event.walked is not None and self._on_walked is not None:
                    self._on_walked(self._job_id, *event.walked)
                killed = event.exit_code == -9 and not event.timed_out
                oom = killed and self._oom_kills is not None and self._oom_kills() > ooms_before
                yield CommandExit(event.exit_code, event.timed_out, oom, event.stdout_truncated, event.stderr_truncated)

    def write_stdin(self, data: bytes) -> None:
        self._agent.write_stdin(self._job_id, data)

    def signal(self, signo: int) -> None:
        self._agent.signal(self._job_id, signo)

    def resize(self, rows: int, cols: int) -> None:
        if self._command.terminal:
            self._agent.resize(self._job_id, rows, cols)
