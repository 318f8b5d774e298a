"""mini-swe-agent environment on a Corral sandbox: its configs name ``CorralEnvironment`` as environment_class.

mini-swe-agent resolves an environment class from its config by dotted path, builds it with the config's
``environment`` keys, and calls ``execute({"command": ...}, cwd=..., timeout=...)`` for each action. This
class answers that call the way its own Docker environment does, so agents, templates and run scripts work
unchanged:

- the command runs under ``interpreter`` (``bash -lc``) in ``cwd`` with ``env`` and the host's ``forward_env``,
  stderr merged into stdout in order (as Docker's ``stderr=STDOUT``), and comes back as
  ``{"output", "returncode", "exception_info"}``;
- a timeout comes back as returncode -1 with the output so far and the exception text the agent's
  observation template shows, and does not end the run;
- an output whose first line is ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (exit 0) raises mini-swe-agent's
  ``Submitted`` with the rest as the submission;
- ``get_template_vars`` reports the sandbox's own ``uname`` (the ``{{system}}``, ``{{release}}`` ... of its
  prompts), read once at start.

The sandbox is created in the constructor and killed by ``cleanup()`` (or when the object is collected, as
mini-swe-agent's run scripts expect of an environment); its TTL (``ttl_s``) bounds it if the process dies.
"""

from __future__ import annotations

import os
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel, Field

from corral.sdk import Client, CorralError, NotFound, Sandbox, SandboxGone

__all__ = ["CorralEnvironment", "CorralEnvironmentConfig", "SUBMIT_MARKER"]

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's submit line (its prompts say so)
_MERGE_STDERR = 'exec 2>&1; exec "$@"'  # /bin/sh: the interpreter's stderr joins its stdout, in order
_UNAME_FIELDS = ("system", "node", "release", "version", "machine")


class CorralEnvironmentConfig(BaseModel):
    """The ``environment`` section of a mini-swe-agent config (besides ``environment_class``)."""

    image: str = "debian-12"
    cwd: str = ""  # where commands run; default: the image's working directory
    env: dict[str, str] = Field(default_factory=dict)
    forward_env: list[str] = Field(default_factory=list)  # host variables passed on when set (env wins)
    timeout: int = 30  # seconds per command, unless execute() is given one
    interpreter: list[str] = Field(default_factory=lambda: ["bash", "-lc"])  # the command is its last argument
    cpu: float = 1.0
    memory_mb: int = 2048
    labels: dict[str, str] = Field(default_factory=dict)
    ttl_s: float = 7200.0  # like Docker's container_timeout: the sandbox's bound if the process dies
    url: str | None = None  # default: CORRAL_URL, then the client config file
    api_key: str | None = None  # default: CORRAL_API_KEY, then the client config file


class CorralEnvironment:
    """mini-swe-agent's ``Environment`` protocol on one Corral sandbox (see the module docstring)."""

    def __init__(self, *, config_class: type[CorralEnvironmentConfig] = CorralEnvironmentConfig, **kwargs: Any):
        self.config = config_class(**kwargs)
        self.client = Client(self.config.url, self.config.api_key)
        self.sandbox: Sandbox | None = None
        try:
            sandbox = self.sandbox = self.client.create(
                self.config.image, cpu=self.config.cpu, memory_mb=self.config.memory_mb,
                labels={**self.config.labels, "mini-swe-agent": "1"}, ttl_s=self.config.ttl_s,
            )  # fmt: skip
            uname = sandbox.exec(["sh", "-c", "uname -s; uname -n; uname -r; uname -v; uname -m"])
        except BaseException:
            self.cleanup()
            raise
        self.uname = dict(zip(_UNAME_FIELDS, uname.stdout.splitlines(), strict=False))

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``; the result as mini-swe-agent's environments give it."""
        command = action.get("command", "")
        if self.sandbox is None:
            return _failure("", "The environment was cleaned up: its sandbox is gone", RuntimeError("cleaned up"))
        timeout_s = timeout or self.config.timeout
        forwarded = {key: os.environ[key] for key in self.config.forward_env if key in os.environ}
        try:
            result = self.sandbox.exec(
                ["/bin/sh", "-c", _MERGE_STDERR, "sh", *self.config.interpreter, command],
                cwd=cwd or self.config.cwd or None, env={**forwarded, **self.config.env}, timeout_s=timeout_s,
            )  # fmt: skip
        except CorralError as exc:
            return _failure("", f"An error occurred while executing the command: {exc}", exc)
        if result.timed_out:
            error = TimeoutError(f"Command '{command}' timed out after {timeout_s} seconds")
            return _failure(result.stdout, f"An error occurred while executing the command: {error}", error)
        output = {"output": result.stdout, "returncode": result.exit_code, "exception_info": ""}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output["output"].lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        merged: dict[str, Any] = recursive_merge(self.config.model_dump(), self.uname, kwargs)
        return merged

    def serialize(self) -> dict[str, Any]:
        environment = self.config.model_dump(mode="json", exclude={"api_key"})
        return {
            "info": {
                "config": {"environment": environment, "environment_type": f"{__name__}.{type(self).__name__}"},
                "corral_sandbox_id": self.sandbox.id if self.sandbox is not None else None,
            }
        }

    def cleanup(self) -> None:
        """Kill the sandbox and close the connection (idempotent)."""
        sandbox, self.sandbox = self.sandbox, None
        try:
            if sandbox is not None:
                sandbox.kill()
        except (NotFound, SandboxGone):
            pass
        finally:
            self.client.close()

    def __del__(self) -> None:
        # mini-swe-agent's run scripts never call cleanup(): like its Docker environment, end with the object.
        try:
            self.cleanup()
        except Exception:  # at interpreter exit the connection may already be gone; the TTL ends it then
            pass


def _failure(output: str, message: str, exc: BaseException) -> dict[str, Any]:
    return {"output": output, "returncode": -1, "exception_info": message,
            "extra": {"exception_type": type(exc).__name__, "exception": str(exc)}}  # fmt: skip
