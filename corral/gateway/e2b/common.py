"""What the E2B facade's modules share: keys, the sandbox a request is for, E2B's error shapes.

Keys: the E2B API key (``e2b_<40 hex>``) and each sandbox's envd access token
are HMACs of the server's own API key, so nothing new is stored and both stop
working when the server key changes. The E2B key has the server key's rights.

Errors: E2B's control plane answers ``{"code": <status>, "message"}``; its
proxy answers a data-plane request for a sandbox that is gone with a 502
whose message says "was not found", which the SDK turns into
``SandboxNotRunningException``. Corral's errors are mapped to those shapes.
A stream whose sandbox goes away is dropped, as E2B's proxy drops it: the
SDK then asks ``/health`` and reports the sandbox killed (``ConnectStream``).
"""

from __future__ import annotations

import base64
import binascii
import contextvars
import datetime as dt
import hashlib
import hmac
import json
import logging
import struct
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import Receive, Scope, Send

from corral.api.errors import AuthenticationError, CorralError, InvalidRequest, NotFound, SandboxGone
from corral.api.models import ExecRequest, SandboxInfo, SandboxState
from corral.gateway.http_protocol import RESET_CONNECTION

if TYPE_CHECKING:
    from corral.gateway.services import Services

__all__ = [
    "END_STREAM",
    "ConnectStream",
    "E2BError",
    "E2BRoute",
    "ENVD_VERSION",
    "ENVD_PORT",
    "INTERPRETER_PORT",
    "StreamAborted",
    "ON_TIMEOUT_LABEL",
    "TEMPLATE_LABEL",
    "TIMEOUT_LABEL",
    "Target",
    "access_token",
    "e2b_api_key",
    "facade",
    "frame",
    "gone",
    "drop_processes",
    "home_of",
    "page",
    "quiet_aborted_streams",
    "refuse",
    "rfc3339",
    "services",
    "signed_token",
    "target",
]

# The envd features implemented, up to 0.6.4: stdin, close_stdin, octet-stream and gzip uploads (0.5.7), file
# metadata (0.6.2, metadata.py), entries in watch events (0.6.3) and watches on network mounts (0.6.4, watch.py).
ENVD_VERSION = "0.6.4"
ENVD_PORT = 49983
INTERPRETER_PORT = 49999
TEMPLATE_LABEL = "corral.e2b.template"
ON_TIMEOUT_LABEL = "corral.e2b.on_timeout"  # "pause" or "pause-filesystem" (autoPause); absent: killed
TIMEOUT_LABEL = "corral.e2b.timeout_s"  # the timeout it was created with: each running period after a pause
SANDBOX_USER = "user"


END_STREAM = 0x02  # the flag of a Connect stream's last frame


def rfc3339(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).isoformat().replace("+00:00", "Z")


def frame(message: dict[str, Any], flags: int = 0) -> bytes:
    """One Connect stream frame: ``[flags:1][length:4 big-endian][json]``."""
    body = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(body)) + body


_UNFINISHED = "ASGI callable returned without completing response."  # what uvicorn logs as it drops one
_aborted = contextvars.ContextVar("e2b_stream_aborted", default=False)


class StreamAborted(Exception):
    """Raised by a stream's body: end it by dropping the connection, with no end-of-stream frame."""


class ConnectStream(StreamingResponse):
    """A Connect server stream whose body may end it by raising ``StreamAborted``.

    ASGI has no "abort": a response left unfinished is what makes the server
    (uvicorn) close the connection, without the last chunk, so the client reads
    a broken stream; with ``corral serve``'s protocol the close is a reset.
    uvicorn logs that as an error; ``quiet_aborted_streams`` drops the line for
    responses that ended so on purpose (marked in the request's context, which
    the server's log call runs in)."""

    media_type = "application/connect+json"
    aborted = False
    _reset: Callable[[], None] | None = None

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except StreamAborted:
            self.aborted = True
            if self._reset is not None:
                self._reset()  # a RST rather than a FIN: see corral/gateway/http_protocol.py
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._reset = scope.get("extensions", {}).get(RESET_CONNECTION)
        await super().__call__(scope, receive, send)  # streams in a task of its own, beside a disconnect listener
        if self.aborted:
            _aborted.set(True)


class _QuietAborted(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _UNFINISHED and _aborted.get())


_QUIET = _QuietAborted()


def quiet_aborted_streams() -> None:
    """Keep uvicorn from logging an error for each stream ``ConnectStream`` dropped on purpose."""
    logger = logging.getLogger("uvicorn.error")
    if _QUIET not in logger.filters:
        logger.addFilter(_QUIET)


class E2BError(Exception):
    """An answer in E2B's own error shape: ``{"code": status, "message": ...}``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    def response(self) -> JSONResponse:
        # The SDK retries 429/502/503/504 unless told not to; a refusal will not change on retry.
        headers = {"Should-Retry": "false"} if self.status in (429, 503) else None
        return JSONResponse({"code": self.status, "message": self.message}, status_code=self.status, headers=headers)


class E2BRoute(APIRoute):
    """Routes that answer in E2B's error shape: Corral's errors become ``{"code": status, "message"}``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except E2BError as exc:
                return exc.response()
            except CorralError as exc:
                return from_corral(exc).response()

        return answer


def refuse(option: str, why: str) -> E2BError:
    """An option Corral cannot honour: refused, never silently ignored."""
    return E2BError(400, f"{option} is not supported by Corral's E2B facade: {why} (see docs/e2b.md)")


def from_corral(exc: CorralError) -> E2BError:
    status = 404 if isinstance(exc, SandboxGone) else exc.status
    return E2BError(status, exc.message)


def _hmac(server_key: str, purpose: str) -> str:
    return hmac.new(server_key.encode(), purpose.encode(), hashlib.sha256).hexdigest()


def e2b_api_key(server_key: str) -> str:
    """The E2B-style API key (``e2b_`` + 40 hex) that goes with a Corral server key."""
    return "e2b_" + _hmac(server_key, "e2b-api-key")[:40]


def signed_token(server_key: str, purpose: str) -> str:
    """A token only this server makes, for one ``purpose`` (e.g. one template file upload URL)."""
    return _hmac(server_key, purpose)[:40]


def access_token(server_key: str, sandbox_id: str) -> str:
    """The sandbox's envd access token (``X-Access-Token``), returned on create, connect and get_info."""
    return "ea_" + _hmac(server_key, f"envd:{sandbox_id}")[:40]


def services(request: Request) -> Services:
    return request.app.state.service  # type: ignore[no-any-return]


def facade(request: Request) -> Any:
    return request.app.state.e2b


def check_api_key(request: Request) -> None:
    """The control plane's ``X-API-KEY``: the E2B key or the server key itself."""
    given = request.headers.get("x-api-key")
    server_key = facade(request).server_key
    if given is None:
        raise E2BError(401, "missing X-API-KEY: set E2B_API_KEY to the key `corral e2b-env` prints")
    if not any(hmac.compare_digest(given.encode(), k.encode()) for k in (e2b_api_key(server_key), server_key)):
        raise E2BError(401, "wrong API key: set E2B_API_KEY to the key `corral e2b-env` prints")


def page(request: Request, items: list[Any]) -> tuple[list[Any], dict[str, str]]:
    """One page of a listing (``limit``, ``nextToken``) and the header that points at the next one."""
    limit_text = request.query_params.get("limit")
    token = request.query_params.get("nextToken")
    start = 0
    if token:
        try:
            start = int(base64.urlsafe_b64decode(token.encode()).decode())
        except ValueError:
            raise E2BError(400, f"nextToken {token!r} is not one this server gave") from None
    end = len(items) if not limit_text else start + max(1, int(limit_text))
    headers = {}
    if end < len(items):
        headers["x-next-token"] = base64.urlsafe_b64encode(str(end).encode()).decode()
    return items[start:end], headers


async def drop_processes(operations: Any, sandbox_id: str) -> None:
    """What a cold boot leaves of a sandbox, its files: every process but the sandbox's init is killed (a command,
    so a step of its trajectory: a replay drops them too)."""
    drop = ExecRequest(cmd=["/bin/sh", "-c", "kill -9 -1 || true"], user="root", cwd="/", timeout_s=30)
    await operations.exec(sandbox_id, drop)


def home_of(user: str) -> str:
    return "/root" if user in ("root", "0") else f"/home/{user}"


@dataclass(frozen=True)
class Target:
    """The sandbox (and port) a data-plane request is for, and the user it acts as."""

    sandbox_id: str
    port: int
    user: str
    info: SandboxInfo

    @property
    def home(self) -> str:
        return home_of(self.user)

    def path(self, path: str) -> str:
        """Relative paths resolve against the user's home, as envd does."""
        if not path:
            raise InvalidRequest("path is empty")
        return path if path.startswith("/") else f"{self.home}/{path}"


def gone(sandbox_id: str) -> E2BError:
    return E2BError(502, f"The sandbox {sandbox_id} was not found")


async def target(request: Request, user: str | None = None) -> Target:
    """Route a data-plane request by its ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers and check its token."""
    sandbox_id = request.headers.get("e2b-sandbox-id")
    if not sandbox_id:
        raise E2BError(400, "missing E2b-Sandbox-Id header: set E2B_SANDBOX_URL to this server's URL (see docs/e2b.md)")
    port_text = request.headers.get("e2b-sandbox-port", str(ENVD_PORT))
    if not port_text.isdigit() or int(port_text) not in (ENVD_PORT, INTERPRETER_PORT):
        raise E2BError(
            502,
            f"port {port_text} is not open: Corral's E2B facade serves envd ({ENVD_PORT}) and the code "
            f"interpreter ({INTERPRETER_PORT}) only; sandboxes have no network beyond loopback",
        )
    state = facade(request)
    token = request.headers.get("x-access-token")
    if token is None and int(port_text) == INTERPRETER_PORT:
        # The code interpreter sends its context calls with the traffic token only (control.py sets it).
        token = request.headers.get("e2b-traffic-access-token")
    if token is None or not hmac.compare_digest(token.encode(), access_token(state.server_key, sandbox_id).encode()):
        raise E2BError(401, f"missing or wrong X-Access-Token for sandbox {sandbox_id}")
    try:
        info = await services(request).sandboxes.get(sandbox_id)
    except NotFound:
        raise gone(sandbox_id) from None
    if info.state not in (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.CREATING):
        raise gone(sandbox_id)
    return Target(sandbox_id, int(port_text), user or info.user, info)


def basic_user(request: Request) -> str | None:
    """envd's ``Authorization: Basic base64("<user>:")`` (the SDK's ``user=``); None for the default user."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user = base64.b64decode(value).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise AuthenticationError("malformed Authorization header: expected Basic base64('<user>:')") from None
    return user or None
