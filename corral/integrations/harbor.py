"""Harbor environment on a Corral sandbox: ``harbor run --env corral.integrations.harbor:CorralEnvironment``.

Harbor (terminal-bench, SWE-bench and other task suites) runs each trial in an environment class it builds
from ``--env`` (a built-in name, or ``module:Class`` for a third-party one, as here) with ``--ek key=value``
options. This class is one sandbox per trial, reached over the SDK's ``AsyncClient``:

- **image**: the ``image`` option (any Corral image: a local name or a registry reference), else the task's
  ``[environment].docker_image``, else the task's ``environment/Dockerfile`` built by the server and tagged
  ``harbor-<task>:<content hash>`` (rebuilt only when the directory changes, or with ``--force-build``). The
  server reads the Dockerfile and its context from its own disk, so that last form needs the task directory
  at the same path on the server's machine (a local server, or a shared filesystem).
- **exec** runs ``bash -c`` as Harbor's Docker environment does, with ``cwd`` (default: the task's workdir,
  else the image's), ``env`` (Harbor's persistent and scoped variables merged), ``user`` and ``timeout_sec``
  enforced inside the sandbox; a timeout raises ``RuntimeError`` as Docker's does. Output streams to Harbor's
  callbacks when a phase asks for them.
- **files**: single files through the file API (modes kept), directories as one tar archive each way.
- **network**: ``no-network`` is Corral's loopback-only sandbox; ``allowlist`` becomes an egress allowlist
  (host names, IPv4 addresses and CIDRs); ``public`` is what Corral's E2B facade grants as internet: public
  addresses only, never private, loopback, link-local or metadata ranges. Policies switch while it runs
  (Harbor opens or closes the network between the agent and verifier phases).

Resources come from the task (``cpus``, ``memory_mb``, ``storage_mb`` as ``disk_mb``). ``stop(delete=True)``
kills the sandbox; ``--no-delete`` leaves it for inspection until its TTL (``ttl_s``, default 4 hours).

This module imports Harbor (Python 3.12 and later), so only Harbor imports it; ``import corral`` does not.
"""

from __future__ import annotations

import asyncio
import io
import re
import shutil
import stat
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal

from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
from harbor.environments.capabilities import EnvironmentCapabilities, EnvironmentResourceCapabilities
from harbor.environments.definition import (
    COMPOSE_FILE_NAME,
    DOCKERFILE_NAME,
    SNAPSHOT_HASH_LEN,
    require_agent_environment_definition,
    should_use_prebuilt_docker_image,
)
from harbor.environments.options import EnvironmentOptions
from harbor.environments.tar_transfer import pack_dir_to_bytes
from harbor.models.task.config import (
    NetworkAllowlistEntryType,
    NetworkMode,
    NetworkPolicy,
    classify_network_allowlist_entry,
)
from pydantic import Field

from corral.backends.common.network import NON_PUBLIC_NETWORKS
from corral.sdk import AsyncClient, AsyncSandbox, NetworkRule, NotFound, SandboxGone
from corral.sdk import ExecResult as CorralExecResult

__all__ = ["CorralEnvironment", "CorralEnvironmentOptions", "ENVIRONMENT_TYPE"]

ENVIRONMENT_TYPE = "corral"
UNBOUNDED_EXEC_S = 86400  # Harbor's timeout_sec=None; Corral's longest exec bound
REQUEST_TIMEOUT_S = 600.0  # a request's bound besides exec's own: a task directory's tar goes up in one
OUTPUT_CAP_BYTES = 16 << 20  # per stream; Docker's exec returns all of it, Corral's default keeps 1 MiB
_IMAGE_NAME_LEN = 100  # of Corral's 128-character names, leaving room for the prefix


class CorralEnvironmentOptions(EnvironmentOptions):
    """What ``--ek key=value`` may set. The API key is not one (Harbor writes options into its job files):
    set ``CORRAL_API_KEY``, or let ``corral serve`` on the same machine write the client config file."""

    url: str | None = Field(None, description="The Corral server; default CORRAL_URL, then the client config.")
    image: str | None = Field(None, description="A Corral image for every task, instead of the task's own.")
    backend: Literal["container", "microvm", "vm"] = "container"
    runtime: Literal["crun", "runc", "runsc"] | None = Field(None, description="Default: the server's.")
    ttl_s: float = Field(4 * 3600.0, gt=0, description="The sandbox's bound if Harbor dies or --no-delete.")
    labels: dict[str, str] = Field(default_factory=dict, description="Added to harbor.session and harbor.task.")
    build_timeout_s: float = Field(1800.0, gt=0, description="Each RUN step of a Dockerfile build.")


class CorralEnvironment(BaseEnvironment):
    """Harbor's ``BaseEnvironment`` on one Corral sandbox (see the module docstring)."""

    options_model: ClassVar[type[EnvironmentOptions]] = CorralEnvironmentOptions
    _build_locks: ClassVar[dict[str, asyncio.Lock]] = {}  # one build per image name at a time

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._client: AsyncClient | None = None
        self._sandbox: AsyncSandbox | None = None
        super().__init__(*args, **kwargs)

    @staticmethod
    def type() -> str:
        return ENVIRONMENT_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(
            disable_internet=True,
            network_allowlist=True,
            network_allowlist_hostnames=True,
            network_allowlist_ipv4_addresses=True,
            network_allowlist_ipv4_cidrs=True,
            dynamic_network_policy=True,
        )

    @classmethod
    def resource_capabilities(cls) -> EnvironmentResourceCapabilities:
        return EnvironmentResourceCapabilities(cpu_limit=True, memory_limit=True, fractional_cpus=True)

    @property
    def _options(self) -> CorralEnvironmentOptions:
        assert isinstance(self.options, CorralEnvironmentOptions)
        return self.options

    def _validate_definition(self) -> None:
        if self._options.image is not None:
            return
        compose = Path(self.environment_dir, COMPOSE_FILE_NAME)
        if compose.exists():
            raise ValueError(
                f"{compose}: Corral runs one sandbox per trial, not Docker Compose services; "
                "pass --ek image=<a Corral image with what the task needs>"
            )
        require_agent_environment_definition(self.environment_dir, docker_image=self.task_env_config.docker_image)

    @property
    def _dockerfile(self) -> Path:
        return Path(self.environment_dir, DOCKERFILE_NAME)

    @property
    def sandbox(self) -> AsyncSandbox:
        """The running sandbox (after ``start``)."""
        if self._sandbox is None:
            raise RuntimeError("the Corral environment is not started (or already stopped): call start() first")
        return self._sandbox

    async def start(self, force_build: bool) -> None:
        client = self._client = AsyncClient(self._options.url, timeout_s=REQUEST_TIMEOUT_S)
        image = await self._image(client, force_build)
        policy = self._network_policy
        self._sandbox = await client.create(
            image,
            backend=self._options.backend,
            runtime=self._options.runtime,
            cwd=self.task_env_config.workdir,
            env=self._startup_env(),
            labels={"harbor.session": self.session_id, "harbor.task": self.environment_name, **self._options.labels},
            ttl_s=self._options.ttl_s,
            network=None if policy.network_mode == NetworkMode.NO_NETWORK else {"allow": _rules(policy)},
            **self._resources(),
        )
        self.logger.debug(f"Corral sandbox {self._sandbox.id} ({image}) for {self.session_id}")
        await self.ensure_dirs(self._mount_targets(writable_only=True))  # /logs/agent, /logs/verifier ...
        await self._upload_environment_dir_after_start()

    def _resources(self) -> dict[str, Any]:
        wanted = {"cpu": self._effective_cpus, "memory_mb": self._effective_memory_mb,
                  "disk_mb": self._effective_storage_mb}  # fmt: skip
        return {name: value for name, value in wanted.items() if value is not None}

    async def _image(self, client: AsyncClient, force_build: bool) -> str:
        """The image to create from: the option, the task's image, or its Dockerfile built on the server."""
        if self._options.image is not None:
            return self._options.image
        docker_image = self.task_env_config.docker_image
        if should_use_prebuilt_docker_image(self.environment_dir, docker_image=docker_image, force_build=force_build):
            return str(docker_image)
        name = f"harbor-{_image_name(self.environment_name)}:{self.environment_id[:SNAPSHOT_HASH_LEN]}"
        async with self._build_locks.setdefault(name, asyncio.Lock()):
            if not force_build:
                try:
                    await client.images.inspect(name)
                    return name
                except NotFound:
                    pass
            self.logger.debug(f"Building {self._dockerfile} on the Corral server as {name}")
            await client.images.build_dockerfile(
                name, self._dockerfile.resolve(), context=self.environment_dir.resolve(), no_cache=force_build,
                timeout_s=self._options.build_timeout_s, on_progress=self.logger.debug,
            )  # fmt: skip
        return name

    async def stop(self, delete: bool) -> None:
        sandbox, self._sandbox = self._sandbox, None
        try:
            if sandbox is not None and delete:
                await sandbox.kill()
            elif sandbox is not None:
                self.logger.info(f"Corral sandbox {sandbox.id} left running (--no-delete); its TTL ends it")
        except (NotFound, SandboxGone):
            pass
        finally:
            if self._client is not None:
                await self._client.aclose()
                self._client = None

    async def exec(
        self,
        command: str,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_sec: int | None = None,
        user: str | int | None = None,
    ) -> ExecResult:
        resolved_user = self._resolve_user(user)
        options: dict[str, Any] = {
            "cwd": cwd or self.task_env_config.workdir,
            "env": self._merge_env(env),
            "user": None if resolved_user is None else str(resolved_user),
            "timeout_s": timeout_sec or UNBOUNDED_EXEC_S,
            "output_cap_bytes": OUTPUT_CAP_BYTES,
        }
        argv = ["bash", "-c", command]
        callback = self._output_callback()
        result: CorralExecResult | None = None
        if callback is None:
            result = await self.sandbox.exec(argv, **options)
        else:
            async for event in self.sandbox.exec_stream(argv, **options):
                if event.type in ("stdout", "stderr") and event.data:
                    await callback(event.data, event.type)
                elif event.type == "exit":
                    result = event.result
        if result is None:
            raise RuntimeError(f"the exec stream of sandbox {self.sandbox.id} ended without the command's result")
        if result.timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        if result.stdout_truncated or result.stderr_truncated:
            self.logger.warning(f"Output past {OUTPUT_CAP_BYTES} bytes per stream was dropped: {command[:200]!r}")
        return ExecResult(stdout=result.stdout, stderr=result.stderr, return_code=result.exit_code or 0)

    async def _apply_network_policy(self, network_policy: NetworkPolicy) -> None:
        await self.sandbox.set_network(_rules(network_policy))

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        source = Path(source_path)
        await self.sandbox.files.write(target_path, source.read_bytes(), mode=stat.S_IMODE(source.stat().st_mode))

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        source = Path(source_dir)
        if not source.is_dir():
            raise FileNotFoundError(f"Source directory {source_dir} does not exist")
        archive = await asyncio.to_thread(pack_dir_to_bytes, source, compress=True, include_root=False)
        await self.sandbox.files.upload_tar(target_dir, archive.getvalue())

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        target = Path(target_path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(await self.sandbox.files.read(source_path))

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        archive = await self.sandbox.files.download_tar(source_dir)
        await asyncio.to_thread(_extract_contents, archive, PurePosixPath(source_dir), Path(target_dir))


def _extract_contents(archive: bytes, source_dir: PurePosixPath, target: Path) -> None:
    """Corral's tar of ``/a/b`` holds ``b/...`` (of ``/``, the entries themselves): put what is inside ``b`` into
    ``target``, overwriting, as Harbor's environments do."""
    with tempfile.TemporaryDirectory() as scratch:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:*") as tar:
            tar.extractall(scratch, filter=transfer_tar_filter)
        inside = Path(scratch) / source_dir.name if source_dir.name else Path(scratch)
        shutil.copytree(inside, target, symlinks=True, dirs_exist_ok=True)


def _rules(policy: NetworkPolicy) -> list[NetworkRule]:
    """A Harbor network policy as Corral's egress allowlist (empty: plugged in, nothing allowed out)."""
    if policy.network_mode == NetworkMode.NO_NETWORK:
        return []
    if policy.network_mode == NetworkMode.PUBLIC:
        denied = [NetworkRule(cidr=cidr, protocol="any", action="deny") for cidr in NON_PUBLIC_NETWORKS]
        return [*denied, NetworkRule(cidr="0.0.0.0/0", protocol="any"), NetworkRule(cidr="::/0", protocol="any")]
    rules = []
    for entry in policy.allowed_hosts:
        if classify_network_allowlist_entry(entry) == NetworkAllowlistEntryType.HOSTNAME:
            rules.append(NetworkRule(host=entry, protocol="any"))
        else:  # an IPv4 address or CIDR: the capabilities refuse the rest before start
            rules.append(NetworkRule(cidr=entry, protocol="any"))
    return rules


def _image_name(task_name: str) -> str:
    """A task name as a Corral image name: lower case, other characters as '-'."""
    return re.sub(r"[^a-z0-9._-]+", "-", task_name.lower()).strip(".-")[:_IMAGE_NAME_LEN] or "task"
