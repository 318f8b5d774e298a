"""Signed ``/files`` URLs (``download_url`` / ``upload_url``): a URL that works without any header.

The SDK signs ``path:operation:user:access_token[:expiration]`` with SHA-256
(envd's v1 signature, ``e2b/sandbox/signature.py``) and puts ``signature`` and
``signature_expiration`` (Unix seconds) in the query. Such a URL carries no
``E2b-Sandbox-Id``, so the sandbox is the one whose access token makes the
signature (each live sandbox is tried; with the header, only that one). An
expired URL, or one whose path, user, operation or expiration was changed, is
a 401.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from typing import Literal

from fastapi import Request

from corral.api.errors import NotFound
from corral.api.models import SandboxInfo, SandboxState
from corral.gateway.e2b.common import (
    ENVD_PORT,
    E2BError,
    Target,
    access_token,
    basic_user,
    facade,
    services,
    target,
)

__all__ = ["files_target", "signature"]

Operation = Literal["read", "write"]
_LIVE = [SandboxState.CREATING.value, SandboxState.RUNNING.value, SandboxState.PAUSED.value]


def signature(path: str, operation: Operation, user: str, token: str, expiration_s: int | None) -> str:
    """envd's v1 signature of a file URL; ``user`` is empty for the sandbox's default user."""
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration_s is None else f":{expiration_s}")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def _expiration(request: Request) -> int | None:
    text = request.query_params.get("signature_expiration")
    if text is None:
        return None
    try:
        expiration_s = int(text)
    except ValueError:
        raise E2BError(401, f"signature_expiration {text!r} is not a Unix time in seconds") from None
    if expiration_s < time.time():
        raise E2BError(401, f"the signed URL expired at {expiration_s} (Unix seconds): ask for a new one")
    return expiration_s


async def files_target(request: Request, operation: Operation, path: str | None, username: str | None) -> Target:
    """The sandbox a ``/files`` request is for: by its signature when it has one, else by headers and token."""
    given = request.query_params.get("signature")
    if given is None:
        return await target(request, username or basic_user(request))
    expiration_s = _expiration(request)
    server_key = facade(request).server_key
    wanted = request.headers.get("e2b-sandbox-id")
    try:
        infos: list[SandboxInfo] = (
            [await services(request).sandboxes.get(wanted)]
            if wanted
            else await services(request).sandboxes.list(states=_LIVE, labels={})
        )
    except NotFound:
        infos = []
    for info in infos:
        expected = signature(path or "", operation, username or "", access_token(server_key, info.id), expiration_s)
        if hmac.compare_digest(given.encode(), expected.encode()) and info.state.value in _LIVE:
            return Target(info.id, ENVD_PORT, username or info.user, info)
    raise E2BError(401, f"the {operation} signature matches no sandbox: the URL's path, user or expiration was changed")
