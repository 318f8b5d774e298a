"""Time every HTTP request into the gateway's metrics, by route template (never the raw path).

A plain ASGI wrapper rather than Starlette's BaseHTTPMiddleware: that one runs each request through
an extra task and memory stream, which the exec hot path would pay for. The route template is known
only after routing (``scope["route"]``, set by the router in the scope it passes down), so the
response's start is where the request is counted. Requests before the service exists (startup) and
paths no route matched are counted under their own names, so an unknown path cannot grow the label set.
"""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["RequestTiming"]


class RequestTiming:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_s = time.perf_counter()
        state = scope["app"].state

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                service = getattr(state, "service", None)
                if service is not None:
                    route = scope.get("route")
                    template = getattr(route, "path", None) or "unmatched"
                    service.sandboxes.metrics.observe_request(scope["method"], template, message["status"], started_s)
            await send(message)

        await self.app(scope, receive, timed_send)
