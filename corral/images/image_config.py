"""Image config: what an image says about the processes started from it.

One representation for every way an image arrives (an OCI or ``docker save``
archive, a Dockerfile build, a registry pull): ``ImageConfig`` from the SDK
models, since the API shows it too. It is stored with the image's tag and
applied when a sandbox is created from the image: its environment under the
request's, its working directory and user unless the request names its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from corral.api.errors import InvalidRequest
from corral.api.models import ImageConfig

__all__ = ["ImageConfig", "from_oci", "merge", "sandbox_defaults"]

_ROOT_DIR = "/"
_ROOT_USER = "root"


def from_oci(image_config: dict[str, Any]) -> ImageConfig:
    """The ``config`` object of an OCI / docker image config JSON (Env, WorkingDir, User, ...)."""
    raw = image_config.get("config") or {}
    if not isinstance(raw, dict):
        raise InvalidRequest("the image config's `config` is not a JSON object")
    env: dict[str, str] = {}
    for entry in raw.get("Env") or []:
        key, sep, value = str(entry).partition("=")
        if sep and key:
            env[key] = value
    return ImageConfig(
        env=env,
        working_dir=raw.get("WorkingDir") or None,
        user=raw.get("User") or None,
        entrypoint=_argv(raw.get("Entrypoint")),
        cmd=_argv(raw.get("Cmd")),
        labels={str(k): str(v) for k, v in (raw.get("Labels") or {}).items()},
        exposed_ports=sorted(str(port) for port in (raw.get("ExposedPorts") or {})),
    )


def merge(configs: Iterable[ImageConfig]) -> ImageConfig:
    """Several images stacked as one environment (base, workspace, tools): later ones win, env and labels merge."""
    merged = ImageConfig()
    for config in configs:
        merged = ImageConfig(
            env={**merged.env, **config.env},
            working_dir=config.working_dir or merged.working_dir,
            user=config.user or merged.user,
            entrypoint=config.entrypoint if config.entrypoint is not None else merged.entrypoint,
            cmd=config.cmd if config.cmd is not None else merged.cmd,
            labels={**merged.labels, **config.labels},
            exposed_ports=sorted({*merged.exposed_ports, *config.exposed_ports}),
        )
    return merged


def sandbox_defaults(
    config: ImageConfig, *, env: dict[str, str], cwd: str | None, user: str | None
) -> tuple[dict[str, str], str, str]:
    """A sandbox's env, cwd and user: the request's where it set them, else the image's, else / and root."""
    return {**config.env, **env}, cwd or config.working_dir or _ROOT_DIR, user or config.user or _ROOT_USER


def _argv(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):  # docker accepts a string and means a shell command
        return ["/bin/sh", "-c", value]
    return [str(arg) for arg in value]
