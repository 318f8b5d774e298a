"""Gymnasium environments over Corral sandboxes: one episode, one sandbox; one step, one logged command.

``SandboxEnv`` is a ``gymnasium.Env``. ``reset()`` creates the episode's sandbox from a ``TaskSpec`` (or
forks it from a prepared one) and runs the task's setup; ``step(action)`` runs the action, a shell command,
and observes its output; the task's ``submit`` action ends the episode with the reward its ``reward_cmd``
prints; ``close()`` kills the sandbox. Every command goes with a step id made of the episode id and the step
number, so a trainer that was preempted and resets with ``options={"episode_id": ...}`` finds its sandbox
again and gets the steps it already ran answered from the trajectory log, not run twice.

``gymnasium.make("corral/Sandbox-v0", task=...)`` gives it with gymnasium's own wrappers (the passive checker
of spaces and return values, order enforcing). Vectorize with gymnasium itself: ``SyncVectorEnv`` or
``AsyncVectorEnv`` (which pickles the env into worker processes: a ``SandboxEnv`` pickles as its task,
connection settings and current sandbox id, and reconnects on the other side, so it also travels to Ray
actors). ``AsyncSandboxEnv`` is the same environment for asyncio trainers (its methods are awaited).

Observations are text: the command's stdout and stderr (decoded, characters outside ``string.printable``
shown as "?") in ``Text`` spaces, with its exit code; the untouched result is ``info["result"]``.
"""

from __future__ import annotations

import string
import uuid
from dataclasses import dataclass, field
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

from corral.sdk import AsyncClient, AsyncSandbox, Client, ExecResult, Sandbox

__all__ = ["AsyncSandboxEnv", "ENV_ID", "EPISODE_LABEL", "SandboxEnv", "TaskSpec"]

ENV_ID = "corral/Sandbox-v0"  # gymnasium.make(ENV_ID, task=..., url=..., api_key=...)
EPISODE_LABEL = "corral.rl.episode"
_PRINTABLE = frozenset(string.printable)


@dataclass(frozen=True)
class TaskSpec:
    """What an episode is: where it runs, how it starts, how it ends and how it is scored."""

    image: str = "busybox"
    setup: tuple[str, ...] = ()  # commands run at reset, in order (also step-id logged)
    prompt: str = ""  # the observation reset returns (with the last setup command's output)
    reward_cmd: str | None = None  # run at submit; the last line it prints is the reward (a float)
    submit_action: str = "submit"  # the action that ends the episode
    max_steps: int = 50  # then the episode is truncated
    step_timeout_s: float = 60.0
    output_chars: int = 4096  # observation text per stream; longer output is cut (info has it whole)
    cpu: float = 1.0
    memory_mb: int = 512
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    fork_from: str | None = None  # a prepared sandbox's id: episodes start as forks of it instead of creates


def _text(value: str, limit: int) -> str:
    return "".join(c if c in _PRINTABLE else "?" for c in value[:limit])


def _observation(task: TaskSpec, stdout: str, stderr: str, exit_code: int) -> dict[str, Any]:
    return {
        "stdout": _text(stdout, task.output_chars),
        "stderr": _text(stderr, task.output_chars),
        "exit_code": np.array(exit_code, dtype=np.int64),
    }


def _spaces(task: TaskSpec) -> tuple[spaces.Space[Any], spaces.Space[Any]]:
    text = spaces.Text(max_length=max(task.output_chars, len(task.prompt)), min_length=0, charset=string.printable)
    observation = spaces.Dict(
        {"stdout": text, "stderr": text, "exit_code": spaces.Box(low=-1024, high=1024, shape=(), dtype=np.int64)}
    )
    return observation, spaces.Text(max_length=65536, min_length=1, charset=string.printable)


def _reward(result: ExecResult) -> float:
    lines = result.stdout.strip().splitlines()
    try:
        return float(lines[-1]) if result.exit_code == 0 and lines else 0.0
    except ValueError:
        return 0.0


class _Episode:
    """The bookkeeping both env kinds share: episode id, step count, and what a step means."""

    def __init__(self, task: TaskSpec) -> None:
        self.task = task
        self.episode_id = ""
        self.steps = 0
        self.sandbox_id: str | None = None

    def start(self, options: dict[str, Any] | None) -> None:
        self.episode_id = str((options or {}).get("episode_id") or uuid.uuid4().hex)
        self.steps = 0

    def step_id(self, what: str) -> str:
        return f"{self.episode_id}-{what}"

    def labels(self) -> dict[str, str]:
        return {**self.task.labels, EPISODE_LABEL: self.episode_id}

    def create_args(self) -> dict[str, Any]:
        return {"cpu": self.task.cpu, "memory_mb": self.task.memory_mb, "env": self.task.env, "labels": self.labels()}

    def after_reset(self, last_setup: ExecResult | None) -> tuple[dict[str, Any], dict[str, Any]]:
        stdout = self.task.prompt + (last_setup.stdout if last_setup is not None else "")
        observation = _observation(self.task, stdout, last_setup.stderr if last_setup else "", 0)
        return observation, {"sandbox_id": self.sandbox_id, "episode_id": self.episode_id, "result": last_setup}

    def after_step(
        self, result: ExecResult, submitted: bool
    ) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        self.steps += 1
        reward = _reward(result) if submitted else 0.0
        truncated = not submitted and self.steps >= self.task.max_steps
        assert result.exit_code is not None  # a finished command's status
        observation = _observation(self.task, result.stdout, result.stderr, result.exit_code)
        info = {"sandbox_id": self.sandbox_id, "episode_id": self.episode_id, "result": result,
                "replayed": result.replayed}  # fmt: skip
        return observation, reward, submitted, truncated, info

    def command_for(self, action: str) -> tuple[str, bool]:
        """The command an action runs, and whether it is the submit (the reward command, or a no-op)."""
        if action.strip() == self.task.submit_action:
            return self.task.reward_cmd or "echo 0", True
        return action, False


class SandboxEnv(gymnasium.Env[dict[str, Any], str]):
    """A gymnasium environment whose state is a Corral sandbox (see the module docstring)."""

    metadata = {"render_modes": []}

    def __init__(self, task: TaskSpec, url: str | None = None, api_key: str | None = None) -> None:
        self.task = task
        self._url, self._api_key = url, api_key
        self._episode = _Episode(task)
        self._client: Client | None = None
        self._sandbox: Sandbox | None = None
        self.observation_space, self.action_space = _spaces(task)

    @property
    def client(self) -> Client:
        if self._client is None:
            self._client = Client(self._url, self._api_key)
        return self._client

    @property
    def sandbox(self) -> Sandbox:
        """The episode's sandbox (for file actions, grading, snapshots); reset() first."""
        if self._sandbox is None:
            if self._episode.sandbox_id is None:
                raise RuntimeError("no episode yet: call reset() first")
            self._sandbox = self.client.get(self._episode.sandbox_id)
        return self._sandbox

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        super().reset(seed=seed)
        previous = self._episode.episode_id
        self._episode.start(options)
        if self._episode.sandbox_id is not None and self._episode.episode_id != previous:
            self._end_sandbox()
        if self._episode.sandbox_id is None:
            self._sandbox = self._attach_or_create()
            self._episode.sandbox_id = self._sandbox.id
        last = None
        for index, command in enumerate(self.task.setup):
            last = self.sandbox.exec(command, timeout_s=self.task.step_timeout_s,
                                     step_id=self._episode.step_id(f"setup{index}"))  # fmt: skip
        return self._episode.after_reset(last)

    def _attach_or_create(self) -> Sandbox:
        found = self.client.list(labels={EPISODE_LABEL: self._episode.episode_id})
        if found:  # the same episode after a restart: its sandbox and its log are still there
            return self.client.get(found[0].id)
        if self.task.fork_from is not None:
            return self.client.get(self.task.fork_from).fork(1, labels=self._episode.labels())[0]
        return self.client.create(self.task.image, **self._episode.create_args())

    def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        command, submitted = self._episode.command_for(action)
        result = self.sandbox.exec(command, timeout_s=self.task.step_timeout_s,
                                   step_id=self._episode.step_id(str(self._episode.steps)))  # fmt: skip
        return self._episode.after_step(result, submitted)

    def _end_sandbox(self) -> None:
        if self._episode.sandbox_id is not None:
            self.client.kill(self._episode.sandbox_id)
        self._episode.sandbox_id, self._sandbox = None, None

    def close(self) -> None:
        if self._episode.sandbox_id is not None:
            self._end_sandbox()
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled as task, connection settings and episode (gymnasium's AsyncVectorEnv, Ray): no sockets."""
        return {"task": self.task, "url": self._url, "api_key": self._api_key, "episode": self._episode}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["task"], state["url"], state["api_key"])  # type: ignore[misc]
        self._episode = state["episode"]


class AsyncSandboxEnv:
    """``SandboxEnv`` for asyncio trainers: the same reset, step and close, awaited."""

    def __init__(self, task: TaskSpec, url: str | None = None, api_key: str | None = None) -> None:
        self.task = task
        self._client = AsyncClient(url, api_key)
        self._episode = _Episode(task)
        self._sandbox: AsyncSandbox | None = None
        self.observation_space, self.action_space = _spaces(task)

    @property
    def sandbox(self) -> AsyncSandbox:
        if self._sandbox is None:
            raise RuntimeError("no episode yet: await reset() first")
        return self._sandbox

    async def reset(self, *, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        previous = self._episode.episode_id
        self._episode.start(options)
        if self._sandbox is not None and self._episode.episode_id != previous:
            await self._sandbox.kill()
            self._sandbox = None
        if self._sandbox is None:
            found = await self._client.list(labels={EPISODE_LABEL: self._episode.episode_id})
            if found:
                self._sandbox = await self._client.get(found[0].id)
            elif self.task.fork_from is not None:
                parent = await self._client.get(self.task.fork_from)
                self._sandbox = (await parent.fork(1, labels=self._episode.labels()))[0]
            else:
                self._sandbox = await self._client.create(self.task.image, **self._episode.create_args())
            self._episode.sandbox_id = self._sandbox.id
        last = None
        for index, command in enumerate(self.task.setup):
            last = await self._sandbox.exec(command, timeout_s=self.task.step_timeout_s,
                                            step_id=self._episode.step_id(f"setup{index}"))  # fmt: skip
        return self._episode.after_reset(last)

    async def step(self, action: str) -> tuple[dict[str, Any], float, bool, bool, dict[str, Any]]:
        command, submitted = self._episode.command_for(action)
        result = await self.sandbox.exec(command, timeout_s=self.task.step_timeout_s,
                                         step_id=self._episode.step_id(str(self._episode.steps)))  # fmt: skip
        return self._episode.after_step(result, submitted)

    async def close(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.kill()
            self._sandbox = None
        await self._client.aclose()


if ENV_ID not in gymnasium.registry:
    gymnasium.register(id=ENV_ID, entry_point="corral.rl:SandboxEnv")
