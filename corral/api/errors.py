"""Corral's one exception hierarchy, shared by the server and the SDK.

Every class maps to exactly one HTTP status, so a server error raised in the
edge reaches the user as the same class on the client side::

    CorralError                       (500, also the base)
    ├── InvalidRequest                400  bad arguments: fix the call
    ├── AuthenticationError           401  missing or wrong API key
    ├── PermissionDenied              403  the key may not do this
    ├── NotFound                      404  unknown sandbox, image, path, command
    ├── Conflict                      409  wrong state (sandbox not running, path exists)
    ├── SandboxGone                   410  the sandbox ended (killed, TTL, OOM, lost)
    ├── PayloadTooLarge               413  upload or file over the configured limit
    ├── CapacityExhausted             503  no node can admit the sandbox now: retry later
    ├── ServerUnavailable             502  the server or an edge could not be reached
    └── InternalError                 500  a Corral bug: report it

``ServerUnavailable`` is also what the SDK raises for connection failures.
The JSON error body is ``{"error": {"code": str, "message": str}}``; ``code``
is the class's ``code`` so both sides can map without the status.
"""

from __future__ import annotations

__all__ = [
    "CorralError",
    "InvalidRequest",
    "AuthenticationError",
    "PermissionDenied",
    "NotFound",
    "Conflict",
    "SandboxGone",
    "PayloadTooLarge",
    "CapacityExhausted",
    "ServerUnavailable",
    "InternalError",
    "error_from_response",
]


class CorralError(Exception):
    """Base of every Corral error; ``status`` and ``code`` travel over HTTP."""

    status: int = 500
    code: str = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


class InvalidRequest(CorralError):
    status = 400
    code = "invalid_request"


class AuthenticationError(CorralError):
    status = 401
    code = "unauthenticated"


class PermissionDenied(CorralError):
    status = 403
    code = "permission_denied"


class NotFound(CorralError):
    status = 404
    code = "not_found"


class Conflict(CorralError):
    status = 409
    code = "conflict"


class SandboxGone(CorralError):
    status = 410
    code = "sandbox_gone"


class PayloadTooLarge(CorralError):
    status = 413
    code = "payload_too_large"


class CapacityExhausted(CorralError):
    status = 503
    code = "capacity_exhausted"


class ServerUnavailable(CorralError):
    status = 502
    code = "server_unavailable"


class InternalError(CorralError):
    status = 500
    code = "internal"


_BY_CODE: dict[str, type[CorralError]] = {
    cls.code: cls
    for cls in (
        InvalidRequest,
        AuthenticationError,
        PermissionDenied,
        NotFound,
        Conflict,
        SandboxGone,
        PayloadTooLarge,
        CapacityExhausted,
        ServerUnavailable,
        InternalError,
    )
}
_BY_STATUS: dict[int, type[CorralError]] = {cls.status: cls for cls in _BY_CODE.values()}


def error_from_response(status: int, body: object) -> CorralError:
    """Rebuild the server's exception from an HTTP error response."""
    code, message = None, f"HTTP {status}"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        code = body["error"].get("code")
        message = str(body["error"].get("message", message))
    elif isinstance(body, dict) and "detail" in body:
        message = str(body["detail"])
    cls = _BY_CODE.get(code or "") or _BY_STATUS.get(status) or CorralError
    return cls(message)
