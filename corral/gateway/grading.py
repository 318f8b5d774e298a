"""Grading a rollout without trusting the agent's sandbox.

The agent's final filesystem becomes a diff layer; a separate grader sandbox
stacks it with the hidden layers (tests, answers: never mounted while the
agent acted) and, on top, trusted layers (shell, test runner, interpreter), so
a binary the agent replaced is shadowed by the trusted one. Whatever the agent
left at the reward path is deleted before the grader runs; only what the
grader writes there counts. The grader sandbox has no network and is
destroyed afterwards; the agent's sandbox keeps running untouched.
"""

from __future__ import annotations

import contextlib

from corral.api.errors import CorralError, NotFound
from corral.api.models import CreateSandboxRequest, ExecRequest, GradeRequest, GradeResult
from corral.gateway.images import ImageService
from corral.gateway.service import SandboxService

__all__ = ["Grader"]

_TRUSTED_ALIAS = "trusted"
_MAX_REWARD_BYTES = 1 << 20


class Grader:
    def __init__(self, images: ImageService, sandboxes: SandboxService) -> None:
        self._images = images
        self._sandboxes = sandboxes

    def _grader_stack(self, agent_layers: list[str], request: GradeRequest) -> list[str]:
        stack = self._sandboxes.stack([*agent_layers, *request.hidden])
        for digest in self._sandboxes.stack(request.trusted):
            # A trusted layer that is also lower in the stack (the base, say) is mounted a second time on top.
            stack.append(f"{digest}#{_TRUSTED_ALIAS}" if digest in stack else digest)
        return stack

    async def grade(self, sandbox_id: str, request: GradeRequest) -> GradeResult:
        agent = await self._sandboxes.record(sandbox_id)
        snapshot = await self._images.snapshot(sandbox_id, None)
        stack = self._grader_stack(snapshot.layers, request)
        grader = await self._sandboxes.create(
            CreateSandboxRequest(
                layers=stack,
                cpu=agent.cpu,
                memory_mb=agent.memory_mb,
                pids_max=agent.pids_max,
                env={**agent.env, **request.env},
                cwd=agent.cwd,
                labels={"corral.grader_of": sandbox_id},
                ttl_s=request.timeout_s + 600,
            )  # fmt: skip
        )
        try:
            if request.reward_path:
                with contextlib.suppress(NotFound):
                    path = request.reward_path
                    await self._sandboxes.call(grader.id, lambda edge: edge.remove(grader.id, path, False))
            command = ExecRequest(cmd=request.cmd, env=request.env, cwd=request.cwd, timeout_s=request.timeout_s)
            result = await self._sandboxes.call(grader.id, lambda edge: edge.exec(grader.id, command))
            reward = None
            if request.reward_path:
                path = request.reward_path
                with contextlib.suppress(NotFound):
                    data = await self._sandboxes.call(grader.id, lambda edge: edge.read_file(grader.id, path))
                    reward = data[:_MAX_REWARD_BYTES].decode(errors="replace")
        finally:
            with contextlib.suppress(CorralError):
                await self._sandboxes.kill(grader.id)
        return GradeResult(
            exit_code=result.exit_code, stdout=result.stdout, stderr=result.stderr, timed_out=result.timed_out,
            reward=reward, grader_layers=stack,
        )  # fmt: skip
