"""Inspect (inspect-ai) sandbox environment ``corral``: each sample's tools run in a Corral sandbox.

Inspect finds this provider through the ``inspect_ai`` entry point in Corral's package metadata, so a task
needs only ``sandbox="corral"`` (or ``("corral", CorralSandboxConfig(...))``, or the path of a YAML file of its
fields) and ``CORRAL_URL``/``CORRAL_API_KEY``. Every sample gets a fresh sandbox at sample init, killed at
sample cleanup; each also carries a TTL, so an eval process that dies leaves nothing running for long.

How Inspect's contract maps onto Corral:

- ``exec``: the argv runs as given (Corral resolves ``cmd[0]`` through the sandbox's PATH, with ``env``
  applied through the exec API, never through a wrapper). The timeout is enforced inside the sandbox, so a
  timeout is the command's and raises ``TimeoutError`` at once (``timeout_retry`` has no daemon hang to retry).
  Text ``input`` is the command's stdin; bytes that are not UTF-8 go through a file the command reads.
  Output past Inspect's limit (``INSPECT_SANDBOX_MAX_EXEC_OUTPUT_SIZE``) raises ``OutputLimitExceededError``.
  An unknown ``user`` raises ``SandboxUserUnsupportedError``; an ended sandbox or an unreachable server
  ``SandboxUnavailableError``.
- ``read_file``/``write_file``: Corral's file API (parents are created, writes are atomic); relative paths
  resolve against the sample's working directory (the config's ``cwd``, else the image's).
- ``connection``: ``corral shell ID --cwd WORKDIR [--user USER]`` (an interactive terminal in the sample's
  sandbox), prefixed with ``CORRAL_URL=...`` (never the API key) so it reaches the same server; the
  ``container`` field is the sandbox id. The sandbox is labelled with the task name (``inspect.task``), so
  ``corral ls`` and ``corral exec`` find it too.
"""

from __future__ import annotations

import posixpath
import shlex
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, overload

import yaml  # type: ignore[import-untyped]  # inspect-ai depends on PyYAML; its stubs are not installed
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    SandboxUnavailableError,
    SandboxUserUnsupportedError,
    sandboxenv,
)
from pydantic import BaseModel, Field
from typing_extensions import override

from corral.api.models import is_registry_reference
from corral.sdk import AsyncClient, AsyncSandbox, InvalidRequest, NotFound, SandboxGone, ServerUnavailable

__all__ = ["CorralSandboxConfig", "CorralSandboxEnvironment", "EVAL_LABEL", "TASK_LABEL"]

TASK_LABEL = "inspect.task"  # the Inspect task's name
EVAL_LABEL = "inspect.eval"  # one id per Python process running evals: task cleanup kills what is left of it
_EVAL_ID = uuid.uuid4().hex[:16]
_NO_TIMEOUT_S = 86400.0  # Corral's longest exec: Inspect's "no timeout"
_EXEC_OUTPUT_MAX_BYTES = 1 << 30  # Corral's largest per-stream output cap
_AGENT_FAILED = 126  # the exit status of an exec Corral's agent could not start (the message says why)
_LIVE = ["creating", "running", "paused"]  # the states a cleanup still has to end


class CorralSandboxConfig(BaseModel, frozen=True):
    """Per-task (or per-sample) sandbox settings: ``sandbox=("corral", CorralSandboxConfig(...))``."""

    image: str = "debian-12"  # Inspect's bash and python tools need bash (busybox has none)
    cpu: float = 1.0
    memory_mb: int = 1024
    disk_mb: int | None = None
    env: dict[str, str] = Field(default_factory=dict)
    cwd: str | None = None  # the sample's working directory (created); default: the image's
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_s: float = 3600.0  # a sandbox outlives a dead eval process by at most this
    url: str | None = None  # default: CORRAL_URL, then the client config file
    api_key: str | None = None  # default: CORRAL_API_KEY, then the client config file


def _config(config: SandboxEnvironmentConfigType | None) -> CorralSandboxConfig:
    if config is None:
        return CorralSandboxConfig()
    if isinstance(config, CorralSandboxConfig):
        return config
    if isinstance(config, str):  # sandbox=("corral", "corral.yaml"): Inspect resolves it against the task's dir
        return CorralSandboxConfig.model_validate(yaml.safe_load(Path(config).read_text()) or {})
    return CorralSandboxConfig.model_validate(config.model_dump())


@sandboxenv(name="corral")
class CorralSandboxEnvironment(SandboxEnvironment):
    """One sample's Corral sandbox (see the module docstring for how Inspect's contract maps onto it)."""

    def __init__(self, client: AsyncClient, sandbox: AsyncSandbox, workdir: str) -> None:
        super().__init__()
        self.client = client
        self.sandbox = sandbox
        self.workdir = workdir

    @classmethod
    def config_deserialize(cls, config: dict[str, Any]) -> BaseModel:
        return CorralSandboxConfig.model_validate(config)

    @override
    @classmethod
    async def task_init(cls, task_name: str, config: SandboxEnvironmentConfigType | None) -> None:
        """Fail before any sample starts if the server cannot be reached or does not have the image (a registry
        reference is pulled by the first create instead)."""
        settings = _config(config)
        async with AsyncClient(settings.url, settings.api_key) as client:
            if is_registry_reference(settings.image):
                await client.list(labels={TASK_LABEL: task_name})
            else:
                await client.images.inspect(settings.image)

    @override
    @classmethod
    async def sample_init(
        cls, task_name: str, config: SandboxEnvironmentConfigType | None, metadata: dict[str, str]
    ) -> dict[str, SandboxEnvironment]:
        settings = _config(config)
        client = AsyncClient(settings.url, settings.api_key)
        try:
            sandbox = await client.create(
                settings.image, cpu=settings.cpu, memory_mb=settings.memory_mb, disk_mb=settings.disk_mb,
                env=settings.env, labels={**settings.labels, TASK_LABEL: task_name, EVAL_LABEL: _EVAL_ID},
                ttl_s=settings.ttl_s,
            )  # fmt: skip
            if settings.cwd is not None:
                await sandbox.files.mkdir(settings.cwd)
        except BaseException:
            await client.aclose()
            raise
        return {"default": cls(client, sandbox, settings.cwd or sandbox.info.cwd)}

    @override
    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: SandboxEnvironmentConfigType | None,
        environments: dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        for environment in environments.values():
            corral = environment.as_type(CorralSandboxEnvironment)
            try:
                await corral.sandbox.kill()
            except (NotFound, SandboxGone):
                pass  # its TTL ended it, or someone else did
            finally:
                await corral.client.aclose()

    @override
    @classmethod
    async def task_cleanup(cls, task_name: str, config: SandboxEnvironmentConfigType | None, cleanup: bool) -> None:
        """Kill this process's sandboxes of the task that sample cleanup did not (a sample init cancelled
        mid-create); with ``--no-sandbox-cleanup`` they are left for the user, and their TTL."""
        if not cleanup:
            return
        settings = _config(config)
        async with AsyncClient(settings.url, settings.api_key) as client:
            for info in await client.list(state=_LIVE, labels={TASK_LABEL: task_name, EVAL_LABEL: _EVAL_ID}):
                await client.kill(info.id)

    @override
    @classmethod
    async def cli_cleanup(cls, id: str | None) -> None:
        """``inspect sandbox cleanup corral <sandbox id>`` kills that sandbox."""
        if id is not None:
            async with AsyncClient() as client:
                await client.kill(id)

    def _path(self, path: str) -> str:
        return posixpath.join(self.workdir, path)  # an absolute path stays as it is

    @override
    async def exec(
        self,
        cmd: list[str],
        input: str | bytes | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        timeout: int | None = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        argv, stdin = list(cmd), input if not isinstance(input, bytes) else None
        if isinstance(input, bytes):
            try:
                stdin = input.decode()
            except UnicodeDecodeError:
                argv = await self._stdin_from_file(argv, input)
        cap_bytes = min(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE, _EXEC_OUTPUT_MAX_BYTES)
        try:
            result = await self.sandbox.exec(
                argv, env=env, cwd=self._path(cwd) if cwd else self.workdir, user=user, stdin=stdin,
                timeout_s=float(timeout) if timeout is not None else _NO_TIMEOUT_S, output_cap_bytes=cap_bytes,
            )  # fmt: skip
        except (SandboxGone, ServerUnavailable) as exc:
            raise SandboxUnavailableError(f"Corral sandbox {self.sandbox.id} cannot run commands: {exc}") from exc
        if result.timed_out:
            error = TimeoutError(f"Command timed out after {timeout} seconds")
            error.truncated_output = result.stdout + result.stderr  # type: ignore[attr-defined]
            raise error
        if result.stdout_truncated or result.stderr_truncated:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR, result.stdout)
        if result.exit_code == _AGENT_FAILED and user is not None and "unknown user" in result.stderr:
            raise SandboxUserUnsupportedError(result.stderr.strip())
        exit_code = result.exit_code if result.exit_code is not None else -1
        return ExecResult(success=exit_code == 0, returncode=exit_code, stdout=result.stdout, stderr=result.stderr)

    async def _stdin_from_file(self, argv: list[str], data: bytes) -> list[str]:
        """An argv that feeds ``data`` to ``argv`` on stdin: written to a file the shell opens, then removes."""
        path = f"/tmp/.corral-inspect-stdin-{uuid.uuid4().hex}"
        await self.sandbox.files.write(path, data)  # readable by the exec's user
        return ["/bin/sh", "-c", 'exec <"$0" || exit 126; rm -f "$0" 2>/dev/null; exec "$@"', path, *argv]

    @override
    async def connection(self, *, user: str | None = None) -> SandboxConnection:
        try:
            state = (await self.client.get(self.sandbox.id)).info.state.value
        except (NotFound, ServerUnavailable) as exc:
            raise ConnectionError(f"Corral sandbox {self.sandbox.id} cannot be reached: {exc}") from exc
        if state not in ("running", "paused"):  # a paused one resumes on the shell's first request
            raise ConnectionError(f"Corral sandbox {self.sandbox.id} is {state}")
        argv = ["corral", "shell", self.sandbox.id, "--cwd", self.workdir, *(["--user", user] if user else [])]
        command = f"CORRAL_URL={shlex.quote(self.client.url)} {shlex.join(argv)}"
        return SandboxConnection(type="corral", command=command, container=self.sandbox.id)

    @override
    async def write_file(self, file: str, contents: str | bytes) -> None:
        with _file_errors():
            await self.sandbox.files.write(self._path(file), contents)

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    @override
    async def read_file(self, file: str, text: bool = True) -> str | bytes:
        with _file_errors():
            data = await self.sandbox.files.read(self._path(file))
        if len(data) > SandboxEnvironmentLimits.MAX_READ_FILE_SIZE:
            raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        return data.decode() if text else data


@contextmanager
def _file_errors() -> Iterator[None]:
    """Corral's file errors as the built-in ones Inspect's tools expect (a missing file, a directory)."""
    try:
        yield
    except NotFound as exc:
        raise FileNotFoundError(exc.message) from exc
    except InvalidRequest as exc:
        if "is a directory" not in exc.message:
            raise
        raise IsADirectoryError(exc.message) from exc
